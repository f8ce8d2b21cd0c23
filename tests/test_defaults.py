"""One answer-length default everywhere: every entry point's default equals ``DEFAULT_MAX_NEW_TOKENS``.

Catches an entry point that hard-codes its own budget (as the LlamaIndex LLM's 256, the CLI's 64 and
the server's 128 once did), so the same question gets a different answer length depending on the door.
"""

from __future__ import annotations

import inspect
import re

import pytest

from ctx_integrations.engine.core.decoding import StopCriteria
from ctx_integrations.engine.core.defaults import DEFAULT_MAX_NEW_TOKENS
from ctx_integrations.engine.core.engine import Engine


def test_the_default_is_llama_index_s_num_output():
    from llama_index.core.constants import DEFAULT_NUM_OUTPUTS

    assert DEFAULT_MAX_NEW_TOKENS == DEFAULT_NUM_OUTPUTS


@pytest.mark.parametrize("method", ["submit", "submit_chat", "generate_many", "agenerate_many"])
def test_engine_methods_default_to_the_constant(method):
    assert inspect.signature(getattr(Engine, method)).parameters["max_new_tokens"].default == DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("method", ["generate", "agenerate", "stream", "astream", "chat", "achat", "stream_chat",
                                    "astream_chat"])
def test_the_request_methods_take_their_defaults_from_submit(method):
    """They are uses of ``submit`` / ``submit_chat``: a default of their own could drift from the constant."""
    parameters = inspect.signature(getattr(Engine, method)).parameters
    assert "max_new_tokens" not in parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def test_the_stop_criteria_default_to_the_constant():
    assert StopCriteria(frozenset({0})).max_new_tokens == DEFAULT_MAX_NEW_TOKENS


def test_the_cli_ask_defaults_to_the_constant():
    from ctx_integrations.cli import build_parser

    args = build_parser().parse_args(["ask", "What is the code?"])
    assert args.max_new_tokens == DEFAULT_MAX_NEW_TOKENS


def test_the_server_defaults_to_the_constant():
    from ctx_integrations.serve.schemas import AnswerRequest, ChatCompletionRequest, Sampling

    assert Sampling.model_fields["max_new_tokens"].default == DEFAULT_MAX_NEW_TOKENS
    assert AnswerRequest(query="q").max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling().max_new_tokens == DEFAULT_MAX_NEW_TOKENS


def test_langchain_defaults_to_the_constant():
    from ctx_integrations.langchain import ChatContextOfExperts, ContextOfExpertsRunnable

    assert ContextOfExpertsRunnable.model_fields["max_tokens"].default == DEFAULT_MAX_NEW_TOKENS
    chat = ChatContextOfExperts()  # engine=None: nothing is loaded until a call
    assert chat._get_ls_params()["ls_max_tokens"] == DEFAULT_MAX_NEW_TOKENS


def test_llama_index_defaults_to_the_constant():
    from ctx_integrations.llama_index import ExpertDecoderLLM

    assert ExpertDecoderLLM.model_fields["max_new_tokens"].default == DEFAULT_MAX_NEW_TOKENS


# -- one default mode everywhere ------------------------------------------------------------------------------------


def test_every_entry_point_defaults_to_the_one_mode():
    """A door that names its own default mode would answer the same question with another method."""
    from ctx_integrations import DEFAULT_BATCH_MODE, DEFAULT_MODE
    from ctx_integrations.cli import build_parser
    from ctx_integrations.langchain import ChatContextOfExperts, ContextOfExpertsRunnable
    from ctx_integrations.llama_index import (
        ContextOfExpertsChatEngine,
        ContextOfExpertsQueryEngine,
        ContextOfExpertsSynthesizer,
        ExpertDecoderLLM,
    )
    from ctx_integrations.serve.schemas import AnswerRequest, RetrievalOptions

    def default(function):
        return inspect.signature(function).parameters["mode"].default

    defaults = {
        **{f"Engine.{m}": default(getattr(Engine, m)) for m in ("submit", "generate", "agenerate", "stream",
                                                                 "astream")},
        **{f"ExpertDecoderLLM.{m}": default(getattr(ExpertDecoderLLM, m))
           for m in ("decode", "adecode", "stream_decode", "astream_decode")},
        "QueryEngine": default(ContextOfExpertsQueryEngine.__init__),
        "QueryEngine.from_index": default(ContextOfExpertsQueryEngine.from_index),
        "ChatEngine.from_index": default(ContextOfExpertsChatEngine.from_index),
        "Synthesizer": default(ContextOfExpertsSynthesizer.__init__),
        "Runnable": ContextOfExpertsRunnable.model_fields["mode"].default,
        "ChatModel": ChatContextOfExperts.model_fields["mode"].default,
        "server answer": AnswerRequest(query="q").mode,
        "server chat": RetrievalOptions().mode,
        "cli ask": build_parser().parse_args(["ask", "What is the code?"]).mode,
    }
    assert {name: mode for name, mode in defaults.items() if mode != DEFAULT_MODE} == {}
    batches = {"Engine.generate_many": default(Engine.generate_many),
               "Engine.agenerate_many": default(Engine.agenerate_many),
               "ExpertDecoderLLM.decode_many": default(ExpertDecoderLLM.decode_many),
               "ExpertDecoderLLM.adecode_many": default(ExpertDecoderLLM.adecode_many)}
    assert {name: mode for name, mode in batches.items() if mode != DEFAULT_BATCH_MODE} == {}


def test_no_module_names_a_default_mode_of_its_own():
    """The signatures above are the doors known today; this catches a new one that hard-codes a mode name."""
    from pathlib import Path

    import ctx_integrations

    root = Path(ctx_integrations.__file__).parent
    literal = re.compile(r"""\bmode(?:: str(?: \| None)?)? = ["'](\w+)["']|["']--mode["'], default=["'](\w+)""")
    found = {str(path.relative_to(root)): hit.group(0) for path in root.rglob("*.py")
             for hit in literal.finditer(path.read_text()) if path.name != "defaults.py"}
    assert found == {}
