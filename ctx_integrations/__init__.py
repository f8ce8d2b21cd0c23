"""ctx-integrations: a local decoder for RAG apps with per-document KV caches and five decoding methods.

The public names are imported on first use (module ``__getattr__``, PEP 562): ``import ctx_integrations``
and the command line's ``--help`` stay fast because torch and transformers load only when ``Engine``
(or a module that needs them) is first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ctx_integrations.documents import Document
    from ctx_integrations.engine.core.answer import Answer
    from ctx_integrations.engine.core.config import EngineConfig
    from ctx_integrations.engine.core.engine import Engine
    from ctx_integrations.engine.core.sampling import SamplingParams

__all__ = ["Answer", "Document", "Engine", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {
    "Answer": "ctx_integrations.engine.core.answer",
    "Document": "ctx_integrations.documents",
    "Engine": "ctx_integrations.engine.core.engine",
    "EngineConfig": "ctx_integrations.engine.core.config",
    "SamplingParams": "ctx_integrations.engine.core.sampling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ctx_integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
