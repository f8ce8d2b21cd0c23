"""Where answers are computed: one engine in this process (:class:`LocalBackend`), or Ray Serve replicas.

The HTTP layer (:mod:`ctx_integrations.serve.app`) validates, retrieves and counts; it hands a backend
plain-dict *jobs* (documents already inline, so a router can see them) and gets plain dicts back
(``Answer.to_dict()``). Plain dicts cross a process boundary unchanged, which is what lets the same
app front a Ray Serve deployment (:mod:`ctx_integrations.serve.ray_app`).

A job: ``{"query", "documents": [{"text", "id", "score", "scores", "metadata"}], "mode", "options",
"sampling": {max_new_tokens, temperature, top_p, seed, stop}, "timeout"}``; a chat job has
``"messages"`` instead of query/documents/mode; a batch job has ``"queries"`` and ``"documents"``
(shared list, or one list per query).

Every answer is produced through the engine's async stream, even when the caller wants it whole:
cancelling the awaiting task closes the stream, which cancels the request inside the engine (its
rows are freed), whichever engine implementation is underneath.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ctx_integrations.errors import RequestTimeoutError


class Backend(Protocol):
    """What the HTTP layer needs from whatever computes answers."""

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Events ``{"token": piece}`` as they are decoded, then one ``{"answer": Answer.to_dict()}``."""
        ...

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def answer_dict(answer: Any) -> dict[str, Any]:
    """``Answer.to_dict()`` plus cache hits per tier when the engine reports them."""
    payload = answer.to_dict()
    by_tier = getattr(answer, "cache_hits_by_tier", None)
    if by_tier is not None:
        payload["cache"]["hits_by_tier"] = dict(by_tier)
    return payload


def _deadline(job: dict[str, Any]) -> float | None:
    timeout = job.get("timeout")
    return None if timeout is None else asyncio.get_running_loop().time() + float(timeout)


class LocalBackend:
    """One :class:`~ctx_integrations.Engine` in this process, shared by every request."""

    def __init__(self, engine: Any):
        self.engine = engine

    def _open(self, job: dict[str, Any]) -> Any:
        if "messages" in job:
            return self.engine.astream_chat(job["messages"], **job["sampling"])
        return self.engine.astream(job["query"], job["documents"], mode=job["mode"], **job["sampling"],
                                   **job["options"])

    async def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        deadline = _deadline(job)
        pieces = self._open(job)
        try:
            iterator = pieces.__aiter__()
            while True:
                remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if remaining is not None and remaining <= 0:
                    raise RequestTimeoutError(f"the request ran past its timeout of {job['timeout']} s and was "
                                              "cancelled: raise timeout or lower max_new_tokens")
                try:
                    piece = await asyncio.wait_for(iterator.__anext__(), remaining)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    continue  # the check above raises the typed error
                yield {"token": piece}
        finally:
            with contextlib.suppress(Exception):
                await pieces.aclose()  # cancels the request in the engine if it is still running
        yield {"answer": answer_dict(pieces.answer)}

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        events = self.stream(job)
        try:
            async for event in events:
                if "answer" in event:
                    return event["answer"]
        finally:
            await events.aclose()
        raise RuntimeError("the engine's stream ended without an answer")  # pragma: no cover (engine contract)

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        work = self.engine.agenerate_many(job["queries"], job["documents"], mode=job["mode"], **job["sampling"],
                                          **job["options"])
        try:
            answers = await (work if job.get("timeout") is None else asyncio.wait_for(work, job["timeout"]))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"the batch ran past its timeout of {job['timeout']} s and was cancelled: "
                                      "raise timeout, send fewer queries or lower max_new_tokens") from None
        return [answer_dict(a) for a in answers]

    def stats(self) -> dict[str, Any]:
        """``engine.stats()`` when the engine has it; else the KV store's counters (older engines)."""
        stats = getattr(self.engine, "stats", None)
        if callable(stats):
            return dict(stats())
        return {"cache": self.engine.store.stats.as_dict()}

    async def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if callable(close):
            result = close()
            if asyncio.iscoroutine(result):
                await result
