"""ChatContextOfExperts: LangChain's standard chat-model suites plus parity with the engine and with greedy decoding.

The standard suites run on a tiny random Llama with the embedded tokenizer (mechanics do not depend on
weights); plain chat is checked token for token against transformers' own greedy ``generate``.
"""

from __future__ import annotations

import asyncio
from functools import cache

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ctx_integrations import DEFAULT_MODE, Engine
from ctx_integrations.engine.core.chat import conversation_ids
from ctx_integrations.errors import InvalidOptionError, UnknownModeError
from ctx_integrations.langchain import ChatContextOfExperts
from tests.helpers import greedy_reference, tiny_loaded

# langchain-tests' async standard tests carry no asyncio mark; the project runs pytest-asyncio in strict mode.
pytestmark = [pytest.mark.asyncio, pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning")]

DOCS = ["The secret code of the vault is 4721.", "Paris is the capital of France."]


@cache
def shared_engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture
def chat() -> ChatContextOfExperts:
    return ChatContextOfExperts(engine=shared_engine(), max_tokens=8)


class TestChatContextOfExpertsUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatContextOfExperts]:
        return ChatContextOfExperts

    @property
    def chat_model_params(self) -> dict:
        return {"engine": shared_engine()}


class TestChatContextOfExpertsStandard(ChatModelIntegrationTests):
    """The standard behaviour suite (invoke, stream, batch, usage, stop, conversations) on the tiny engine.

    Turned off here: tool calling, structured output and JSON mode. They are offered (``bind_tools``,
    ``with_structured_output``), but the suite checks what a model chooses (``magic_function(3)`` called with
    ``{"input": 3}``, a joke's setup and punchline), which a random-weight model with an 8-token budget cannot;
    tests/test_langchain_structured.py checks them (every output valid against its schema) on this engine and
    the embedded model. Skipped by the suite itself: image/audio/PDF inputs (text-only model), per-call model
    override (one engine serves one model; a different ``model=`` is refused with a clear error), VCR (no network).
    """

    @property
    def chat_model_class(self) -> type[ChatContextOfExperts]:
        return ChatContextOfExperts

    @property
    def chat_model_params(self) -> dict:
        return {"engine": shared_engine(), "max_tokens": 8}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False


def test_plain_chat_is_greedy_decoding_of_the_chat_template(chat):
    messages = [SystemMessage("You are terse."), HumanMessage("hello"), AIMessage("hi"), HumanMessage("how are you?")]
    result = chat.invoke(messages)
    engine = shared_engine()
    ids = conversation_ids(engine.layout, [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                                    {"role": "user", "content": "how are you?"}])
    reference = greedy_reference(engine.loaded, ids, 8)
    assert result.response_metadata["token_ids"] == reference
    assert result.content == engine.loaded.tokenizer.decode(reference, skip_special_tokens=True)
    assert result.usage_metadata == {"input_tokens": len(ids), "output_tokens": len(reference),
                                     "total_tokens": len(ids) + len(reference)}
    assert result.response_metadata["mode"] == "chat" and result.response_metadata["documents"] == []


def test_chat_over_documents_matches_the_engine(chat):
    engine = shared_engine()
    answer = engine.generate("What is the code?", DOCS, max_new_tokens=8)
    result = chat.invoke([HumanMessage("What is the code?")], documents=DOCS)
    assert result.content == answer.text and result.response_metadata["mode"] == DEFAULT_MODE
    assert [s["token_id"] for s in result.response_metadata["trace"]] == answer.token_ids
    bound = chat.bind(documents=DOCS, mode="concat")
    assert bound.invoke("What is the code?").content == engine.generate("What is the code?", DOCS, mode="concat",
                                                                        max_new_tokens=8).text


def test_stream_and_astream_yield_tokens_that_join_to_invoke(chat):
    full = chat.invoke("hello")
    chunks = list(chat.stream("hello"))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == full.content
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.usage_metadata == full.usage_metadata
    assert merged.response_metadata["model_name"] == shared_engine().loaded.name

    async def collect():
        return [c async for c in chat.astream("What is the code?", documents=DOCS)]

    achunks = asyncio.run(collect())
    assert "".join(c.content for c in achunks) == chat.invoke("What is the code?", documents=DOCS).content


def test_streaming_flag_and_stop_sequences(chat):
    streamed = ChatContextOfExperts(engine=shared_engine(), max_tokens=8, streaming=True).invoke("hello")
    assert streamed.content == chat.invoke("hello").content
    text = chat.invoke("hello").content
    if len(text.strip()) > 1:  # a stop string that occurs is cut off with everything after it
        cut = text.strip()[1]
        assert cut not in chat.invoke("hello", stop=[cut]).content


def test_bad_calls_raise_clear_errors(chat):
    with pytest.raises(InvalidOptionError, match="does not accept functions"):
        chat.invoke("hello", functions=[])  # tools are honoured (tests/test_langchain_structured.py); this is not
    with pytest.raises(InvalidOptionError, match="serves"):
        chat.invoke("hello", model="gpt-4")
    with pytest.raises(UnknownModeError):
        chat.invoke("hello", documents=DOCS, mode="nope")
    with pytest.raises(UnknownModeError):
        ChatContextOfExperts(engine=shared_engine(), mode="nope")
    with pytest.raises(InvalidOptionError, match="user message"):
        chat.invoke([SystemMessage("only a system prompt")], documents=DOCS)


@pytest.mark.slow
def test_embedded_default_plain_chat(embedded_engine):
    """The real chat template of the embedded SmolLM2 through the plain-chat path (no documents)."""
    result = ChatContextOfExperts(engine=embedded_engine, max_tokens=6).invoke("Say hello.")
    assert result.content.strip() and result.usage_metadata["output_tokens"] == len(
        result.response_metadata["token_ids"]) <= 6
