"""Turn the engine's blocking, callback-based decoding into sync and async iterators of text pieces.

Every mode reports each new piece of text through ``on_token`` from inside one blocking call. These
helpers run that call on a worker thread and hand the pieces to a generator (sync) or to the event
loop (async), so streaming is real token streaming and async callers never block their loop. They
are framework-free: ``Engine.stream`` and every framework adapter (LangChain, LlamaIndex) use them.

A consumer that stops early (closes the generator, or cancels the async iteration) cancels the call:
the next ``on_token`` raises inside the worker, decoding stops and the engine is free again, instead
of decoding to ``max_new_tokens`` for nobody while holding the engine's lock.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any, TypeVar

Result = TypeVar("Result")
TokenCall = Callable[[Callable[[str], None]], Result]
_DONE = object()


class StreamCancelled(Exception):
    """Raised inside the decoding call when its consumer stopped listening; never reaches the consumer."""


def _cancellable(deliver: Callable[[str], None], cancelled: threading.Event) -> Callable[[str], None]:
    def on_token(piece: str) -> None:
        if cancelled.is_set():
            raise StreamCancelled("the stream's consumer stopped reading")
        deliver(piece)

    return on_token


def iter_tokens(call: TokenCall[Result]) -> Generator[str, None, Result]:
    """Yield the pieces ``call(on_token)`` reports as they come; return its result (errors re-raised here)."""
    pieces: queue.Queue = queue.Queue()
    cancelled = threading.Event()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = call(_cancellable(pieces.put, cancelled))
        except BaseException as error:  # re-raised in the consumer's thread
            outcome["error"] = error
        finally:
            pieces.put(_DONE)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while (piece := pieces.get()) is not _DONE:
            yield piece
    finally:
        cancelled.set()  # a no-op when the call finished; stops it when the consumer left early
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


async def aiter_tokens(call: TokenCall[Result], sink: dict[str, Result]) -> AsyncIterator[str]:
    """Async version of :func:`iter_tokens`: the call runs in asyncio's default executor.

    An async generator cannot return a value, so the call's result is stored in ``sink["answer"]``.
    The call runs in a copy of the caller's context (``asyncio.to_thread``), so tracing context set by
    a framework (spans, callback managers) is visible inside it.
    """
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def deliver(piece: str) -> None:
        loop.call_soon_threadsafe(pieces.put_nowait, piece)

    def work() -> Result:
        try:
            return call(_cancellable(deliver, cancelled))
        finally:
            loop.call_soon_threadsafe(pieces.put_nowait, _DONE)

    future = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        while (piece := await pieces.get()) is not _DONE:
            yield piece
    except BaseException:  # the consumer left early (aclose, cancellation): stop decoding, drop its outcome
        cancelled.set()
        await asyncio.gather(future, return_exceptions=True)
        raise
    sink["answer"] = await future  # also re-raises the call's error


class AnswerStream:
    """An async stream of one answer: ``async for piece in stream`` yields text pieces; then ``stream.answer``.

    ``start(on_token)`` queues the request (when iteration begins) and returns its handle (anything with
    ``future``, ``cancel()``); ``on_token`` is called on the scheduler's thread and hands each piece to
    the event loop, so no thread is held per stream. ``pick`` turns the request's result into the
    answer. Leaving the loop early (``break``, ``aclose()``, task cancellation) cancels the request,
    so its decoding stops at the next step instead of running to ``max_new_tokens`` for nobody.
    """

    def __init__(self, start: Callable[[Callable[[str], None]], Any], pick: Callable[[Any], Any]):
        self._start, self._pick = start, pick
        self._handle: Any = None
        self._queue: asyncio.Queue | None = None
        self.answer: Any = None

    def __aiter__(self) -> AnswerStream:
        return self

    async def __anext__(self) -> str:
        if self._handle is None:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            self._queue = queue
            self._handle = self._start(lambda piece: loop.call_soon_threadsafe(queue.put_nowait, piece))
            self._handle.future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _DONE))
        assert self._queue is not None
        try:
            piece = await self._queue.get()
        except BaseException:
            self._handle.cancel()
            raise
        if piece is _DONE:
            self.answer = self._pick(self._handle.future.result())  # re-raises the request's error
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        """Stop listening; a request still running is cancelled."""
        if self._handle is not None and not self._handle.future.done():
            self._handle.cancel()
