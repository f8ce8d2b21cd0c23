"""One answer-length default everywhere: every entry point's default equals ``DEFAULT_MAX_NEW_TOKENS``.

Catches an entry point that hard-codes its own budget (as the LlamaIndex LLM's 256, the CLI's 64 and
the server's 128 once did), so the same question gets a different answer length depending on the door.
"""

from __future__ import annotations

import inspect

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
