"""ctx-integrations: a local decoder for RAG apps with per-document KV caches and five decoding methods.

The package root is the public facade: what an application or a front end (the LangChain and LlamaIndex
adapters, the HTTP server, the command line) needs from the engine, under names that mean one thing. Nothing
outside ``ctx_integrations.engine`` needs to import from inside it (``tests/test_import_graph.py`` holds the
adapters and the server to that).

The names are imported on first use (module ``__getattr__``, PEP 562): ``import ctx_integrations`` and the
command line's ``--help`` stay fast because torch and transformers load only when ``Engine`` (or another name
whose module needs them) is first touched; ``DEFAULT_MAX_NEW_TOKENS``, ``DEFAULT_MODE``, ``EMBEDDED_MODEL_NAME``,
``Document`` and the modes' declarations (``available_modes``, ``unavailable_modes``, ``mode_spec``,
``mode_options``, ``check_mode``) never load them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ctx_integrations.documents import Document
    from ctx_integrations.engine.core.answer import Answer
    from ctx_integrations.engine.core.config import EngineConfig
    from ctx_integrations.engine.core.defaults import (
        DEFAULT_BATCH_MODE,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_MODE,
        EMBEDDED_MODEL_NAME,
    )
    from ctx_integrations.engine.core.engine import Engine
    from ctx_integrations.engine.core.handle import AnswerHandle, AnswerStream
    from ctx_integrations.engine.core.mode_catalog import (
        available_modes,
        check_mode,
        describe_modes,
        mode_options,
        mode_spec,
        unavailable_modes,
    )
    from ctx_integrations.engine.core.model import LoadedModel, load_model, local_model_name
    from ctx_integrations.engine.core.sampling import SamplingParams
    from ctx_integrations.engine.core.structured import StructuredOutput
    from ctx_integrations.engine.core.tools import ToolCallFilter

__all__ = ["DEFAULT_BATCH_MODE", "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_MODE", "EMBEDDED_MODEL_NAME", "Answer",
           "AnswerHandle", "AnswerStream", "Document", "Engine", "EngineConfig", "LoadedModel", "SamplingParams",
           "StructuredOutput", "ToolCallFilter", "available_modes", "check_mode", "describe_modes", "load_model",
           "local_model_name", "mode_options", "mode_spec", "unavailable_modes"]
__version__ = "0.1.0"

_LAZY = {
    "Answer": "ctx_integrations.engine.core.answer",  # what a request returns: text, trace, citations, timings
    "AnswerHandle": "ctx_integrations.engine.core.handle",  # what Engine.submit / submit_chat return
    "AnswerStream": "ctx_integrations.engine.core.handle",  # Engine.astream / astream_chat's async stream
    "DEFAULT_MAX_NEW_TOKENS": "ctx_integrations.engine.core.defaults",  # the answer-length default (no torch)
    "DEFAULT_BATCH_MODE": "ctx_integrations.engine.core.defaults",  # the mode of many questions over one set (no torch)
    "DEFAULT_MODE": "ctx_integrations.engine.core.defaults",  # the decoding mode when none is named (no torch)
    "Document": "ctx_integrations.documents",
    "EMBEDDED_MODEL_NAME": "ctx_integrations.engine.core.defaults",  # the default model's name (no torch)
    "Engine": "ctx_integrations.engine.core.engine",
    "EngineConfig": "ctx_integrations.engine.core.config",  # every Engine setting but cache_dir, checked (no torch)
    "LoadedModel": "ctx_integrations.engine.core.model",  # one loaded model, shared by engines over it
    "SamplingParams": "ctx_integrations.engine.core.sampling",
    "StructuredOutput": "ctx_integrations.engine.core.structured",  # incl. StructuredOutput.from_response_format
    "ToolCallFilter": "ctx_integrations.engine.core.tools",  # a stream's text with its tool calls held back
    # the modes' declarations (no torch): their names, a mode's {option: default} and its ModeSpec, and the check of a
    # mode and its options as a typed error, early (before a model loads)
    "available_modes": "ctx_integrations.engine.core.mode_catalog",
    "check_mode": "ctx_integrations.engine.core.mode_catalog",
    "describe_modes": "ctx_integrations.engine.core.mode_catalog",  # GET /v1/modes's listing, unavailable ones too
    "mode_options": "ctx_integrations.engine.core.mode_catalog",
    "mode_spec": "ctx_integrations.engine.core.mode_catalog",
    "unavailable_modes": "ctx_integrations.engine.core.mode_catalog",  # {name: why} of modes that failed to load
    "load_model": "ctx_integrations.engine.core.model",
    "local_model_name": "ctx_integrations.engine.core.model",  # a model name checked against this machine
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ctx_integrations' has no attribute {name!r}")
    # not cached here: each lookup reads the defining module's attribute (a dict lookup once it is imported), so the
    # facade never holds a stale copy of a name that module rebinds (a test's monkeypatch of load_model included)
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
