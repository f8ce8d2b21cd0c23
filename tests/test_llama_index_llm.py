"""ExpertDecoderLLM (a real LlamaIndex CustomLLM) and the MiniLM BaseEmbedding, on a tiny random Llama.

Every call is checked against the engine's own plain-chat decoding of the same conversation, so the
tests mean something with random weights; ``Settings.llm`` is exercised through a stock
``index.as_query_engine()``, whose LLM calls are captured with LlamaIndex's own debug handler.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from llama_index.core import Settings
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.callbacks.schema import EventPayload

from ctx_integrations import Engine
from ctx_integrations.engine.core.sampling import SamplingParams
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.llama_index import (
    EmbedderEmbedding,
    ExpertDecoderLLM,
    UndecodedContextWarning,
    default_embedding,
)
from ctx_integrations.retrieval.embedders import default_embedder
from tests.helpers import tiny_loaded
from tests.llama_index_support import QUESTION, memory_index

TOKENS = 8
PROMPT = "Name a colour."
MESSAGES = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."), ChatMessage(role=MessageRole.USER, content="Hi")]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture
def llm(engine) -> ExpertDecoderLLM:
    return ExpertDecoderLLM(engine=engine, max_new_tokens=TOKENS)


def reference(engine: Engine, messages: list[dict[str, str]]):
    return engine.chat(messages, max_new_tokens=TOKENS)


def test_metadata_is_truthful(llm, engine):
    meta = llm.metadata
    assert meta.context_window == engine.loaded.max_positions == 2048
    assert meta.num_output == TOKENS and meta.model_name == engine.loaded.name and meta.is_chat_model


def test_complete_and_stream_complete(llm, engine):
    expected = reference(engine, [{"role": "user", "content": PROMPT}])
    response = llm.complete(PROMPT)
    assert response.text == expected.text
    assert response.raw["usage"]["completion_tokens"] == len(expected.token_ids)
    chunks = list(llm.stream_complete(PROMPT))
    deltas = [c.delta for c in chunks if c.delta]
    assert len(deltas) > 1 and "".join(deltas) == expected.text and chunks[-1].text == expected.text
    assert chunks[-1].raw["usage"]["total_tokens"] == response.raw["usage"]["total_tokens"]


def test_chat_and_stream_chat_use_the_chat_template(llm, engine):
    expected = reference(engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    response = llm.chat(MESSAGES)
    assert response.message.role == MessageRole.ASSISTANT and response.message.content == expected.text
    chunks = list(llm.stream_chat(MESSAGES))
    assert len([c for c in chunks if c.delta]) > 1 and "".join(c.delta for c in chunks) == expected.text
    assert chunks[-1].message.content == expected.text


def test_async_versions_match(llm, engine):
    completion = reference(engine, [{"role": "user", "content": PROMPT}]).text
    chat = reference(engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]).text

    async def main():
        complete = await llm.acomplete(PROMPT)
        streamed = [c.delta async for c in await llm.astream_complete(PROMPT)]
        achat = await llm.achat(MESSAGES)
        chat_stream = [c.delta async for c in await llm.astream_chat(MESSAGES)]
        return complete.text, streamed, achat.message.content, chat_stream

    complete, streamed, achat, chat_stream = asyncio.run(main())
    assert complete == completion and "".join(streamed) == completion and len([d for d in streamed if d]) > 1
    assert achat == chat and "".join(chat_stream) == chat


def test_system_prompt_and_per_call_options(engine):
    llm = ExpertDecoderLLM(engine=engine, max_new_tokens=TOKENS, system_prompt="Answer in French.")
    system = {"role": "system", "content": "Answer in French."}
    assert llm.complete(PROMPT).text == reference(engine, [system, {"role": "user", "content": PROMPT}]).text
    assert llm.complete(PROMPT).text != llm.complete(PROMPT, max_new_tokens=2).text  # per call: 2 tokens, not 8
    assert llm.complete(PROMPT, max_new_tokens=2).raw["usage"]["completion_tokens"] <= 2
    with pytest.raises(InvalidOptionError, match="does not accept tools"):
        llm.complete(PROMPT, tools=[])
    with pytest.raises(InvalidOptionError, match="engine must be"):
        ExpertDecoderLLM(engine="SmolLM2")


def test_filters_and_penalties_reach_the_engine_as_fields_and_per_call(engine):
    # the 135M model loops without penalties: ExpertDecoderLLM must pass them (and top_k / min_p) to the engine
    knobs = dict(repetition_penalty=1.8, frequency_penalty=1.5, presence_penalty=1.0, top_k=3, min_p=0.2)
    messages = [{"role": "user", "content": PROMPT}]
    expected = engine.chat(messages, sampling=SamplingParams(max_tokens=24, temperature=0.9, seed=7, **knobs)).text
    plain = engine.chat(messages, sampling=SamplingParams(max_tokens=24, temperature=0.9, seed=7)).text
    assert expected != plain  # the knobs change this answer, so passing them is observable
    assert ExpertDecoderLLM(engine=engine, max_new_tokens=24, temperature=0.9, seed=7, **knobs).complete(
        PROMPT).text == expected
    llm = ExpertDecoderLLM(engine=engine, max_new_tokens=24, temperature=0.9, seed=7)
    assert llm.complete(PROMPT, **knobs).text == expected and llm.complete(PROMPT).text == plain
    assert llm.sampling_params({"top_k": 3}).top_k == 3  # what the synthesizer and query engine decode with
    with pytest.raises(InvalidOptionError, match="min_p"):
        ExpertDecoderLLM(engine=engine, min_p=1.5)
    with pytest.raises(InvalidOptionError, match="presence_penalty"):
        llm.complete(PROMPT, presence_penalty=3.0)


def test_settings_llm_serves_a_stock_query_engine(llm):
    """``Settings.llm = ExpertDecoderLLM(...)``: LlamaIndex's own RetrieverQueryEngine answers with it."""
    debug = LlamaDebugHandler()
    saved_llm, saved_callbacks = Settings._llm, Settings._callback_manager
    try:
        Settings.llm = llm
        Settings.callback_manager = CallbackManager([debug])
        with pytest.warns(UndecodedContextWarning):  # it works, and says what it cannot do that way
            response = memory_index().as_query_engine(similarity_top_k=2).query(QUESTION)
    finally:
        Settings._llm, Settings._callback_manager = saved_llm, saved_callbacks
    calls = debug.get_event_pairs(CBEventType.LLM)
    assert len(calls) == 1
    sent = calls[0][0].payload[EventPayload.MESSAGES]
    assert "4721" in sent[-1].content  # the stock synthesizer put the retrieved node into the chat prompt
    assert response.response == llm.chat(sent).message.content


def test_embedding_is_the_embedded_minilm():
    embedding = default_embedding()
    assert isinstance(embedding, EmbedderEmbedding) and embedding.model_name == "all-MiniLM-L6-v2"
    texts = ["The vault code is 4721.", "Paris is in France."]
    expected = default_embedder().embed_documents(texts)
    assert np.allclose(embedding.get_text_embedding_batch(texts), expected, atol=1e-6)
    assert np.allclose(embedding.get_query_embedding(QUESTION), default_embedder().embed_query(QUESTION), atol=1e-6)

    async def main():
        return await embedding.aget_query_embedding(QUESTION), await embedding.aget_text_embedding_batch(texts)

    query, batch = asyncio.run(main())
    assert np.allclose(query, embedding.get_query_embedding(QUESTION)) and np.allclose(batch, expected, atol=1e-6)
