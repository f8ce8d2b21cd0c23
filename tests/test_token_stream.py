"""The framework-free token bridge under Engine.stream and every adapter: order, result, errors, cancellation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core.token_stream import StreamCancelled, aiter_tokens, iter_tokens
from tests.helpers import tiny_loaded


def counting_call(limit: int | None, stopped: threading.Event | None = None):
    """A blocking call that reports "0 ", "1 ", ... through on_token and returns how many it sent."""

    def call(on_token):
        sent = 0
        try:
            while limit is None or sent < limit:
                on_token(f"{sent} ")
                sent += 1
            return sent
        finally:
            if stopped is not None:
                stopped.set()

    return call


def test_iter_tokens_yields_in_order_and_returns_the_result():
    pieces = iter_tokens(counting_call(5))
    seen = []
    while True:
        try:
            seen.append(next(pieces))
        except StopIteration as finished:
            assert finished.value == 5
            break
    assert seen == ["0 ", "1 ", "2 ", "3 ", "4 "]


def test_iter_tokens_reraises_the_call_error_in_the_consumer():
    def failing(on_token):
        on_token("a")
        raise ValueError("boom")

    pieces = iter_tokens(failing)
    assert next(pieces) == "a"
    with pytest.raises(ValueError, match="boom"):
        next(pieces)


def test_closing_early_stops_the_call():
    stopped = threading.Event()
    pieces = iter_tokens(counting_call(None, stopped))  # would run forever
    assert next(pieces) == "0 "
    pieces.close()
    assert stopped.is_set()  # close() joined the worker, which stopped at its next token


def test_aiter_tokens_streams_through_the_loop_and_fills_the_sink():
    async def main():
        sink: dict = {}
        seen = [piece async for piece in aiter_tokens(counting_call(4), sink)]
        return seen, sink

    seen, sink = asyncio.run(main())
    assert seen == ["0 ", "1 ", "2 ", "3 "] and sink == {"answer": 4}


def test_aiter_tokens_reraises_and_cancels():
    def failing(on_token):
        on_token("a")
        raise ValueError("boom")

    async def consume(call, sink):
        return [piece async for piece in aiter_tokens(call, sink)]

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(consume(failing, {}))

    stopped = threading.Event()

    async def leave_early():
        sink: dict = {}
        stream = aiter_tokens(counting_call(None, stopped), sink)
        assert await stream.__anext__() == "0 "
        await stream.aclose()
        return sink

    assert asyncio.run(leave_early()) == {}  # no result for a consumer that left
    assert stopped.is_set()


def test_stream_cancelled_is_what_the_call_sees():
    errors = []

    def call(on_token):
        try:
            while True:
                on_token("x")
        except StreamCancelled as error:
            errors.append(error)
            raise

    pieces = iter_tokens(call)
    next(pieces)
    pieces.close()
    assert len(errors) == 1


def test_engine_stream_closed_early_frees_the_engine():
    engine = Engine(tiny_loaded("llama"))
    question, docs = "What is the code?", ["The code is 4721.", "Paris is in France."]
    assert len(engine.generate(question, docs, max_new_tokens=64).token_ids) > 32  # a long decode to interrupt
    forwards = engine.scheduler.stats.forwards
    stream = engine.stream(question, docs, max_new_tokens=64)
    next(stream)
    stream.close()
    assert engine.stats()["active_requests"] == 0  # its rows left the batch at once
    assert engine.scheduler.stats.forwards - forwards < 8  # decoding stopped instead of running 64 tokens for nobody
