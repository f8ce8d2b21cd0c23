"""Leaving an adapter's async stream early closes the engine's ``AnswerStream``, which cancels the request.

The engine is a real :class:`Engine` (tiny random Llama) whose ``astream`` / ``astream_chat`` streams are
wrapped to record when they are closed and whether their answer was complete by then (``None``: closed
early). A missing ``aclose`` in an adapter would leave the request decoding to ``max_tokens`` for nobody.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from llama_index.core.llms import ChatMessage

from ctx_integrations import Engine
from ctx_integrations.langchain import ChatContextOfExperts
from ctx_integrations.llama_index import ExpertDecoderLLM
from tests.helpers import tiny_loaded

LONG = 400  # far more tokens than the test reads


class RecordedStream:
    """An engine stream that logs its answer (``None`` until complete) when it is closed."""

    def __init__(self, stream, log: list):
        self.stream, self.log = stream, log

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.stream.__anext__()

    async def aclose(self):
        self.log.append(self.stream.answer)
        await self.stream.aclose()

    @property
    def answer(self):
        return self.stream.answer


class RecordingEngine(Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.closed: list = []

    def astream(self, *args, **kwargs):
        return RecordedStream(super().astream(*args, **kwargs), self.closed)

    def astream_chat(self, *args, **kwargs):
        return RecordedStream(super().astream_chat(*args, **kwargs), self.closed)


@pytest.fixture(scope="module")
def engine() -> RecordingEngine:
    return RecordingEngine(tiny_loaded("llama"))


@pytest.mark.parametrize("documents", [None, ["The vault code is 4721.", "Paris is in France."]])
def test_closing_a_langchain_stream_early_cancels_the_request(engine, documents):
    chat = ChatContextOfExperts(engine=engine, max_tokens=LONG)

    async def read_one_then_close() -> None:
        stream = chat.astream("What is the code?", documents=documents) if documents else chat.astream("Hello")
        await stream.__anext__()
        await stream.aclose()

    engine.closed.clear()
    asyncio.run(read_one_then_close())
    assert engine.closed and engine.closed[0] is None  # closed before the answer was complete


def test_dropping_a_llama_index_stream_cancels_the_request(engine):
    llm = ExpertDecoderLLM(engine=engine, max_new_tokens=LONG)

    async def read_one_then_drop() -> None:
        stream = await llm.astream_chat([ChatMessage(role="user", content="Hello")])
        await stream.__anext__()
        await stream.aclose()
        del stream  # LlamaIndex's callback wrapper holds our generator until it is collected
        gc.collect()
        for _ in range(20):
            if engine.closed:
                break
            await asyncio.sleep(0.05)  # asyncio's async-generator finalizer closes it on the loop

    engine.closed.clear()
    asyncio.run(read_one_then_drop())
    assert engine.closed == [None]
