"""Where answers are computed: one engine in this process (:class:`LocalBackend`), or Ray Serve replicas.

The HTTP layer (:mod:`ctx_integrations.serve.app`) validates, retrieves and counts; it hands a backend
plain-dict *jobs* (documents already inline, so a router can see them) and gets plain dicts back
(``Answer.to_dict()``). Plain dicts cross a process boundary unchanged, which is what lets the same
app front a Ray Serve deployment (:mod:`ctx_integrations.serve.ray_app`).

A job: ``{"query", "documents": [{"text", "id", "score", "scores", "metadata"}], "mode", "options",
"sampling": {max_tokens, temperature, top_p, seed, stop, ...}, "timeout"}`` (``"sampling"``: the fields of
:class:`~ctx_integrations.SamplingParams`, ``structured`` as StructuredOutput's fields); a chat job has
``"messages"`` instead of query/documents/mode, and ``"tools"`` / ``"tool_choice"`` / ``"parallel_tool_calls"``
when it offers tools; a batch job has ``"queries"`` and ``"documents"`` (shared list, or one list per query).
An answer asked for logprobs carries OpenAI's ``"logprobs"`` content (token texts need the tokenizer, which
only the engine's side has).

A whole answer is awaited from the engine (``agenerate`` / ``achat``: one wake-up of the event loop
when it is done), a streamed one read from its async stream (``astream`` / ``astream_chat``: one
event per token). Either way cancelling the awaiting task cancels the request inside the engine's
scheduler (its rows are freed). Timeouts are the engine's own (``timeout=``, ``RequestTimeoutError``).
A conversation is validated and tokenised on a worker thread (opening a stream, and inside
``achat``), so the event loop keeps answering (``/healthz``, other streams) while a long one is
tokenised; a documents request is only checked on the loop (its documents are tokenised on the
scheduler's loader thread). A structured-output format (``response_format``, or the call format ``tools`` ask
for) compiles in a worker process, never on the loop, while the request is admitted (in flight, inside
``max_in_flight``); cancelling the request kills its compile (:mod:`~ctx_integrations.engine.core.compile_pool`).
Every answer carries its prompt's token count (``prompt_tokens``, also in
``timings``: ``prefix + documents + suffix`` as one concatenation, counted once when the request was
prepared), so the server's ``usage`` is right on every path without tokenising again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ctx_integrations import SamplingParams, StructuredOutput, ToolCallFilter


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
    fields = dict(job["sampling"])
    if "structured" in fields:
        fields["structured"] = StructuredOutput(**fields["structured"])
    return SamplingParams(**fields)


def _tools(job: dict[str, Any]) -> dict[str, Any]:
    """A chat job's tool arguments for ``achat`` / ``astream_chat`` (``{}`` without tools)."""
    return {name: job[name] for name in ("tools", "tool_choice", "parallel_tool_calls") if name in job}


class LocalBackend:
    """One :class:`~ctx_integrations.Engine` in this process, shared by every request (its scheduler batches them)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def _open(self, job: dict[str, Any]) -> Any:
        if "messages" in job:
            return self.engine.astream_chat(job["messages"], sampling=_sampling(job), timeout=job.get("timeout"),
                                            **_tools(job))
        return self.engine.astream(job["query"], job["documents"], mode=job["mode"], sampling=_sampling(job),
                                   timeout=job.get("timeout"), **job["options"])

    def _dict(self, answer: Any, job: dict[str, Any]) -> dict[str, Any]:
        """``Answer.to_dict()``, with OpenAI's ``logprobs`` content (token texts) when the job asked for them."""
        result = answer.to_dict()
        if job["sampling"].get("logprobs") is not None:
            result["logprobs"] = answer.token_logprobs(self.engine.loaded.tokenizer)
        return result

    async def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Token events; with tools, only the text before the first call (the calls come with the answer)."""
        pieces = await asyncio.to_thread(self._open, job)
        calls = ToolCallFilter.for_engine(self.engine) if "tools" in job else None
        try:
            async for piece in pieces:
                text = piece if calls is None else calls.push(piece)
                if text:
                    yield {"token": text}
        finally:
            await pieces.aclose()  # cancels the request in the engine if it is still running
        if calls is not None and (rest := calls.rest(pieces.answer.text)):
            yield {"token": rest}
        yield {"answer": self._dict(pieces.answer, job)}

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        if "messages" in job:
            result = await self.engine.achat(job["messages"], sampling=_sampling(job), timeout=job.get("timeout"),
                                             **_tools(job))
        else:
            result = await self.engine.agenerate(job["query"], job["documents"], mode=job["mode"],
                                                 sampling=_sampling(job), timeout=job.get("timeout"), **job["options"])
        return self._dict(result, job)

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        answers = await self.engine.agenerate_many(job["queries"], job["documents"], mode=job["mode"],
                                                   sampling=_sampling(job), timeout=job.get("timeout"),
                                                   **job["options"])
        return [self._dict(answer, job) for answer in answers]

    def stats(self) -> dict[str, Any]:
        """``engine.stats()``: queue depth, active requests and rows, cache hits and bytes per tier."""
        return dict(self.engine.stats())

    async def close(self) -> None:
        """Refuse new work and wait for the engine's requests in flight (off the event loop)."""
        await asyncio.to_thread(self.engine.close)
