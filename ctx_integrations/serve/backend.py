"""Where answers are computed: one engine in this process (:class:`LocalBackend`), or Ray Serve replicas.

The HTTP layer (:mod:`ctx_integrations.serve.app`) validates, retrieves and counts; it hands a backend
plain-dict *jobs* (documents already inline, so a router can see them) and gets plain dicts back
(``Answer.to_dict()``). Plain dicts cross a process boundary unchanged, which is what lets the same
app front a Ray Serve deployment (:mod:`ctx_integrations.serve.ray_app`).

A job: ``{"query", "documents": [{"text", "id", "score", "scores", "metadata"}], "mode", "options",
"sampling": {max_tokens, temperature, top_p, seed, stop}, "timeout"}`` (``"sampling"``: the fields of
:class:`~ctx_integrations.SamplingParams`); a chat job has
``"messages"`` instead of query/documents/mode; a batch job has ``"queries"`` and ``"documents"``
(shared list, or one list per query).

A whole answer is awaited from the engine (``agenerate`` / ``achat``: one wake-up of the event loop
when it is done), a streamed one read from its async stream (``astream`` / ``astream_chat``: one
event per token). Either way cancelling the awaiting task cancels the request inside the engine's
scheduler (its rows are freed). Timeouts are the engine's own (``timeout=``, ``RequestTimeoutError``).
A conversation is validated and tokenised on a worker thread (opening a stream, and inside
``achat``), so the event loop keeps answering (``/healthz``, other streams) while a long one is
tokenised; a documents request is only checked on the loop (its documents are tokenised on the
scheduler's loader thread). Every answer carries its prompt's token count (``prompt_tokens``, also in
``timings``: ``prefix + documents + suffix`` as one concatenation, counted once when the request was
prepared), so the server's ``usage`` is right on every path without tokenising again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ctx_integrations.engine.core.sampling import SamplingParams


class Backend(Protocol):
    """What the HTTP layer needs from whatever computes answers."""

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Events ``{"token": piece}`` as they are decoded, then one ``{"answer": Answer.to_dict()}``."""
        ...

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def _sampling(job: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**job["sampling"])


class LocalBackend:
    """One :class:`~ctx_integrations.Engine` in this process, shared by every request (its scheduler batches them)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def _open(self, job: dict[str, Any]) -> Any:
        if "messages" in job:
            return self.engine.astream_chat(job["messages"], sampling=_sampling(job), timeout=job.get("timeout"))
        return self.engine.astream(job["query"], job["documents"], mode=job["mode"], sampling=_sampling(job),
                                   timeout=job.get("timeout"), **job["options"])

    async def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        pieces = await asyncio.to_thread(self._open, job)
        try:
            async for piece in pieces:
                yield {"token": piece}
        finally:
            await pieces.aclose()  # cancels the request in the engine if it is still running
        answer = pieces.answer.to_dict()
        yield {"answer": answer}

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        if "messages" in job:
            result = await self.engine.achat(job["messages"], sampling=_sampling(job), timeout=job.get("timeout"))
        else:
            result = await self.engine.agenerate(job["query"], job["documents"], mode=job["mode"],
                                                 sampling=_sampling(job), timeout=job.get("timeout"), **job["options"])
        return result.to_dict()

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        answers = await self.engine.agenerate_many(job["queries"], job["documents"], mode=job["mode"],
                                                   sampling=_sampling(job), timeout=job.get("timeout"),
                                                   **job["options"])
        return [answer.to_dict() for answer in answers]

    def stats(self) -> dict[str, Any]:
        """``engine.stats()``: queue depth, active requests and rows, cache hits and bytes per tier."""
        return dict(self.engine.stats())

    async def close(self) -> None:
        """Refuse new work and wait for the engine's requests in flight (off the event loop)."""
        await asyncio.to_thread(self.engine.close)
