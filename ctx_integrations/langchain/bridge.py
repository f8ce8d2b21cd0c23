"""Glue between the engine's blocking, callback-based decoding and LangChain's sync/async iterators.

The engine reports each new piece of text through ``on_token`` from inside a blocking call; these
helpers run that call on a worker thread and hand the pieces to a generator (sync) or to the event
loop (async), so streaming is real token streaming and ``astream`` never blocks the loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Generator
from functools import lru_cache
from typing import Any

from langchain_core.runnables.config import run_in_executor

from ctx_integrations.engine.answer import Answer
from ctx_integrations.engine.generate import Engine
from ctx_integrations.errors import InvalidOptionError

TokenCall = Callable[[Callable[[str], None]], Answer]
_DONE = object()


@lru_cache(maxsize=1)
def default_engine() -> Engine:
    """The embedded default engine, loaded once per process and shared by every adapter built without one."""
    return Engine.from_pretrained()


def resolve_engine(engine: Engine | None) -> Engine:
    return default_engine() if engine is None else engine


def check_engine(engine: object) -> None:
    """Adapters hold the engine as an opaque field; refuse anything else at construction."""
    if engine is not None and not isinstance(engine, Engine):
        raise InvalidOptionError(f"engine must be a ctx_integrations.Engine or None, got {type(engine).__name__}")


def prompt_tokens(engine: Engine, question: str, texts: list[str]) -> int:
    """Tokens of the prompt ``prefix + documents + suffix`` (what ``usage_metadata.input_tokens`` reports)."""
    layout = engine.layout
    return len(layout.prefix_ids) + sum(len(layout.context_ids(t)) for t in texts) + len(layout.suffix_ids(question))


def iter_tokens(call: TokenCall) -> Generator[str, None, Answer]:
    """Yield the pieces ``call(on_token)`` reports as they come; return its Answer (errors re-raised here)."""
    pieces: queue.Queue = queue.Queue()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["answer"] = call(pieces.put)
        except BaseException as error:  # re-raised in the consumer's thread
            outcome["error"] = error
        finally:
            pieces.put(_DONE)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    while (piece := pieces.get()) is not _DONE:
        yield piece
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["answer"]


async def aiter_tokens(call: TokenCall, sink: dict[str, Answer]) -> AsyncIterator[str]:
    """Async version of :func:`iter_tokens`: the call runs in an executor, pieces arrive through the loop.

    An async generator cannot return a value, so the final Answer is stored in ``sink["answer"]``.
    """
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()

    def work() -> Answer:
        try:
            return call(lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece))
        finally:
            loop.call_soon_threadsafe(pieces.put_nowait, _DONE)

    future = asyncio.ensure_future(run_in_executor(None, work))
    try:
        while (piece := await pieces.get()) is not _DONE:
            yield piece
    finally:
        sink["answer"] = await future  # also re-raises the call's error
