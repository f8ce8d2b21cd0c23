"""What :meth:`Engine.submit <ctx_integrations.Engine.submit>` returns: one answer to wait for, stream or cancel.

Every request method of the engine is this handle used one way: ``generate`` is ``submit(...).result()``,
``agenerate`` awaits it, ``stream`` / ``astream`` read its pieces (vLLM's ``AsyncLLM.generate`` and SGLang's
``Engine.generate`` hand back the same kind of object). The pieces of text reach the handle from the scheduler's
thread through :class:`Pieces`, a buffer any number of readers follow at their own pace: a sync reader waits on a
condition, an async reader on an event the scheduler's thread sets through the reader's loop. So no thread is held
per stream, a reader that starts late misses nothing, and a handle nobody streams costs one list append per piece.
Written by hand: the scheduler's ``concurrent.futures.Future`` carries the result, not the pieces before it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Generator
from concurrent import futures
from concurrent.futures import Future
from typing import Any

from ctx_integrations.engine.core.scheduler import RequestCancelledError, RequestHandle

Waker = Callable[[], None]


class Pieces:
    """The text pieces of one answer as they are decoded, kept for every reader; closed when the request is over.

    :meth:`push` runs on the scheduler's thread (it is the request's ``on_token``) and never raises into it;
    pieces pushed after :meth:`close` (a request that timed out while its last step ran) are dropped.
    """

    def __init__(self) -> None:
        self._items: list[str] = []
        self._closed = False
        self._cond = threading.Condition()
        self._wakers: list[Waker] = []

    def push(self, piece: str) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(piece)
            self._cond.notify_all()
            wakers = tuple(self._wakers)
        for wake in wakers:
            wake()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            wakers = tuple(self._wakers)
        for wake in wakers:
            wake()

    def after(self, seen: int) -> tuple[list[str], bool]:
        """The pieces after the first ``seen``, and whether no more will come."""
        with self._cond:
            return self._items[seen:], self._closed

    def wait_after(self, seen: int) -> tuple[list[str], bool]:
        """:meth:`after`, blocking until there is something new or the answer is over."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._items) > seen)
            return self._items[seen:], self._closed

    def listen(self, wake: Waker) -> None:
        with self._cond:
            self._wakers.append(wake)

    def unlisten(self, wake: Waker) -> None:
        with self._cond:
            if wake in self._wakers:
                self._wakers.remove(wake)


async def compiled_off_loop(compiling: Future, cancel: Callable[[], None] | None = None) -> None:
    """Wait until ``compiling`` (a format's compile) is done, without blocking the event loop and without raising
    its error; the awaiting task cancelled, ``cancel`` (default: the future's own) stops the compile."""
    if compiling.done():
        return
    waiter = asyncio.wrap_future(compiling)
    try:
        await asyncio.wait({waiter})
    except BaseException:
        (cancel or compiling.cancel)()
        raise
    if not waiter.cancelled():
        waiter.exception()  # taken here (asyncio would log it as never retrieved); the reader raises it from compiling


class AnswerHandle:
    """One request's answer: :meth:`result` (blocking), ``await handle`` / :meth:`wait`, :meth:`stream` (a generator
    of text pieces that returns the :class:`~ctx_integrations.Answer`), :meth:`astream` (an async stream; then its
    ``.answer``), :meth:`cancel`.

    ``queue`` puts the request in the scheduler's queue and returns the scheduler's handle, once: at :meth:`start`
    (``Engine.submit``) or when the handle is first read (``Engine.astream``: when iteration starts, so a stream
    nobody reads never runs). ``pieces`` is the request's ``on_token`` sink; ``pick`` turns the request's result
    (its list of answers) into what the handle returns. ``request_id`` is the scheduler's id (``req-N``).

    ``compiling``: the request's structured-output format while it compiles off the caller's thread (a future,
    :meth:`GrammarCompiler.submit <ctx_integrations.engine.core.structured.GrammarCompiler.submit>`); the request
    is queued once it is done (``queue`` reads its result), awaited without blocking an event loop, and
    cancelling the handle (or the task awaiting it) meanwhile stops the compile.
    """

    def __init__(self, queue: Callable[[], RequestHandle], pieces: Pieces, request_id: str,
                 pick: Callable[[Any], Any] = lambda answers: answers[0], compiling: Future | None = None):
        self._queue, self._pieces, self._pick = queue, pieces, pick
        self._queued: RequestHandle | None = None
        self._compiling = compiling
        self._cancelled = False  # cancelled before it was queued: it never will be
        self._lock = threading.Lock()
        self.request_id = request_id

    def start(self) -> AnswerHandle:
        """Queue the request now, if it is not queued yet (``Engine.submit`` does, unless ``start=False``); a
        request whose format still compiles is queued when the compile is done."""
        if self._compiling is not None and not self._compiling.done():
            self._compiling.add_done_callback(self._start_compiled)
            return self
        self._scheduled()
        return self

    def _start_compiled(self, compiling: Future) -> None:
        """Queue the request once its format compiled (on the compile's thread); a failed or cancelled compile, or a
        refusal to queue, is raised to whoever reads the handle."""
        if not compiling.cancelled() and compiling.exception() is None:
            try:
                self._scheduled()
            except Exception:  # noqa: S110 (re-raised by the reader's own _scheduled: nothing queued)
                pass

    async def _compiled(self) -> None:
        """Wait for the request's format to compile without blocking the loop; cancelled: the compile stops."""
        if self._compiling is not None:
            await compiled_off_loop(self._compiling, self.cancel)

    def _scheduled(self) -> RequestHandle:
        if self._compiling is not None:
            futures.wait([self._compiling])  # a sync reader waits here, outside the lock (cancel() takes it)
        with self._lock:
            if self._queued is None and self._cancelled:
                raise RequestCancelledError(f"request {self.request_id} was cancelled before it was queued (while "
                                            "its structured-output format compiled)")
            if self._queued is None:
                self._queued = self._queue()
                self._queued.future.add_done_callback(lambda _: self._pieces.close())
            return self._queued

    def done(self) -> bool:
        """Whether the request is over (answered, failed or cancelled)."""
        return self._queued is not None and self._queued.future.done()

    def cancel(self) -> None:
        """Stop the request at the next step boundary and free its rows (a no-op once it is over); a request whose
        format is compiling is never queued, and its compile stops."""
        with self._lock:
            queued = self._queued
            if queued is None and self._compiling is not None:
                self._cancelled = True
                self._compiling.cancel()
        if queued is not None:
            queued.cancel()

    def result(self) -> Any:
        """Block until the answer is done and return it; re-raises the request's error."""
        return self._pick(self._scheduled().result())

    async def wait(self) -> Any:
        """Await the answer without blocking the event loop; cancelling the await cancels the request."""
        await self._compiled()
        return self._pick(await self._scheduled().wait())

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait().__await__()

    def stream(self) -> Generator[str, None, Any]:
        """Yield the answer's text pieces as they are decoded; the answer is the generator's return value.

        Closing the generator early cancels the request (decoding stops at the next step).
        """
        handle, seen = self._scheduled(), 0
        try:
            while True:
                new, closed = self._pieces.wait_after(seen)
                for piece in new:
                    seen += 1
                    yield piece
                if closed and not new:
                    break
        finally:
            if not handle.future.done():
                handle.cancel()
        return self._pick(handle.result())

    def astream(self) -> AnswerStream:
        """An async stream of the answer's pieces (``async for piece in handle.astream()``), then its ``.answer``."""
        return AnswerStream(self)


class AnswerStream(AsyncIterator[str]):
    """``async for piece in stream`` yields one answer's text pieces, then ``stream.answer`` holds the answer.

    The request is queued (if it was not yet) when iteration starts. Leaving the loop early (``break`` then
    :meth:`aclose`, task cancellation) cancels the request, so it stops at the next step instead of decoding to
    ``max_new_tokens`` for nobody. The scheduler's thread wakes the reader through its loop
    (``call_soon_threadsafe``), once per piece at most.
    """

    def __init__(self, handle: AnswerHandle):
        self._answer = handle
        self._seen = 0
        self._event: asyncio.Event | None = None
        self._wake: Waker | None = None
        self.answer: Any = None

    def __aiter__(self) -> AnswerStream:
        return self

    def _listen(self) -> asyncio.Event:
        if self._event is None:
            loop, event = asyncio.get_running_loop(), asyncio.Event()
            self._event, self._wake = event, lambda: loop.call_soon_threadsafe(event.set)
            self._answer._pieces.listen(self._wake)
            self._answer._scheduled()
        return self._event

    def _stop_listening(self) -> None:
        if self._wake is not None:
            self._answer._pieces.unlisten(self._wake)

    async def __anext__(self) -> str:
        if self._event is None:
            await self._answer._compiled()
        event = self._listen()
        while True:
            event.clear()  # before reading: a piece pushed after the read sets it again
            new, closed = self._answer._pieces.after(self._seen)
            if new:
                self._seen += 1
                return new[0]
            if closed:
                self._stop_listening()
                self.answer = self._answer._pick(self._answer._scheduled().future.result())  # re-raises its error
                raise StopAsyncIteration
            try:
                await event.wait()
            except BaseException:
                self._stop_listening()
                self._answer.cancel()
                raise

    async def aclose(self) -> None:
        """Stop listening; a request still running is cancelled."""
        self._stop_listening()
        if not self._answer.done():
            self._answer.cancel()
