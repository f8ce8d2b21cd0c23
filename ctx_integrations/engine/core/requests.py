"""The engine's requests: what each public call asks of the scheduler, known from the start.

A request carries its contexts (each with its documents prepared once: tokens, cache keys, the prompt's
token count; :class:`~ctx_integrations.engine.core.registry.DecodeContext`), its mode and options, its
sampling settings (in the contexts' sampler and stop criteria) and, from the scheduler's
:class:`~ctx_integrations.engine.core.scheduler.Request`, its id and status. The scheduler plans it
(:meth:`plan`), reads its documents ahead (:meth:`prefetch`) and hands its caller the answers
(:meth:`finish`) through these methods, never through closures, so what runs can be named and inspected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import torch

from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.chat import CHAT_MODE
from ctx_integrations.engine.core.decoding import DecodeResult, single_stream
from ctx_integrations.engine.core.jobs import ExclusiveJob, FusedJob, Job, Stream
from ctx_integrations.engine.core.registry import DecodeContext, answers_many, check_mode, resolve_mode
from ctx_integrations.engine.core.scheduler import Request
from ctx_integrations.engine.core.tools import ToolRequest

# Below this, the tokens after the first came out with it (a speculative round accepted the whole answer).
_BURST_S = 1e-3


def decode_rate(new_tokens: int, ttft_s: float, total_s: float) -> float:
    """Tokens per second after the first, or over the whole answer when they all arrived in one burst.

    ``(n - 1) / (total - ttft)`` measures decoding; a mode that emits several tokens per step (RAPID
    accepts a whole draft) can end the answer in the first step, where that ratio divides by ~0 and
    reports thousands of tokens per second: such an answer's rate is ``n / total``.
    """
    if new_tokens < 1 or total_s <= 0:
        return 0.0
    decode_s = total_s - ttft_s
    if new_tokens > 1 and decode_s >= _BURST_S:
        return (new_tokens - 1) / decode_s
    return new_tokens / total_s


def answer_of(ctx: DecodeContext, result: DecodeResult, mode: str, options: dict[str, Any],
              prompt_tokens: int) -> Answer:
    """The :class:`Answer` of one finished context: its result, timings, cache counts and prompt length."""
    total = time.perf_counter() - ctx.started
    decode_s = max(total - result.ttft_s, 1e-9)
    engine = ctx.engine
    timings = {"ttft_s": result.ttft_s, "total_s": total, "decode_s": decode_s,
               "tokens_per_s": decode_rate(len(result.token_ids), result.ttft_s, total),
               "new_tokens": float(len(result.token_ids)), "prompt_tokens": float(prompt_tokens), **ctx.timings,
               "threads": float(engine.scheduler.threads or torch.get_num_threads()),
               "dtype": str(engine.loaded.dtype).removeprefix("torch.")}
    return Answer(text=result.text, token_ids=result.token_ids, trace=result.trace, timings=timings,
                  documents=ctx.documents, mode=mode, cache_hits=ctx.cache.hits, cache_misses=ctx.cache.misses,
                  cache_hits_by_tier=ctx.cache.by_tier(), finish_reason=result.finish_reason,
                  options=dict(options), extra=result.extra, prompt_tokens=prompt_tokens)


class ModeRequest(Request):
    """A decoding mode's answer over prepared documents: one context, or every question of a ``many`` mode (IPPD)."""

    def __init__(self, engine: Any, contexts: list[DecodeContext], mode: str, options: dict[str, Any], *,
                 timeout: float | None = None):
        super().__init__(engine, timeout=timeout, started=min(ctx.started for ctx in contexts))
        # a mode is planned only with values its declaration accepts: its function leaves those checks to it
        check_mode(mode, options)
        self.contexts, self.mode, self.options = contexts, mode, dict(options)

    def prefetch(self) -> None:
        for ctx in self.contexts:  # an async caller's documents are tokenised here, on the loader thread
            ctx.prepare()
        unique = {p.key: p for ctx in self.contexts for p in ctx.prepared}
        self.owner.store.prefetch(list(unique.values()))

    def plan(self) -> Job:
        for ctx in self.contexts:  # done by prefetch, unless it failed (then the typed error is raised here)
            ctx.prepare()
        run = resolve_mode(self.mode)
        return run(self.contexts, **self.options) if answers_many(self.mode) else run(self.contexts[0], **self.options)

    def finish(self, job: Job) -> list[Answer]:
        return [answer_of(ctx, result, self.mode, self.options, ctx.prompt_tokens)
                for ctx, result in zip(self.contexts, job.results())]


class ChatRequest(Request):
    """A conversation without documents (mode ``"chat"``): one stream over the rendered conversation's tokens."""

    def __init__(self, engine: Any, ctx: DecodeContext, ids: list[int], *, timeout: float | None = None,
                 tools: ToolRequest | None = None):
        super().__init__(engine, timeout=timeout, started=ctx.started)
        self.ctx, self.ids, self.tools = ctx, tuple(ids), tools

    def plan(self) -> Job:
        return FusedJob(self.ctx, [Stream((), self.ids, 0)], single_stream)

    def finish(self, job: Job) -> list[Answer]:
        answer = answer_of(self.ctx, job.results()[0], CHAT_MODE, {}, len(self.ids))
        if self.tools is not None:  # the calls, read back from the text (the model's call format, or JSON)
            read = self.owner.layout.tool_format.read(answer.text, self.tools.tools, self.tools.choice,
                                                      self.tools.parallel, cut=answer.finish_reason != "eos")
            answer.text, answer.tool_calls, answer.cut_tool_call = read.text, read.calls, read.cut
        return [answer]


class WarmRequest(Request):
    """Compute (or load) the caches of prepared documents, one batched forward per step (``Engine.warm``)."""

    def __init__(self, engine: Any, ctx: DecodeContext, progress: Callable[[int, int], None] | None = None):
        super().__init__(engine)
        self.ctx, self.progress = ctx, progress

    def prefetch(self) -> None:
        self.owner.store.prefetch(self.ctx.prepared)

    def plan(self) -> Job:
        return ExclusiveJob([self.ctx], self._steps())

    def _steps(self) -> Generator[None, None, list[DecodeResult]]:
        # one step per batched forward of the store: other requests run (and time out) in between; after each,
        # progress(documents with their cache, all documents) on this thread, the scheduler's
        for ready in self.owner.store.documents_in_steps(self.owner.layout, self.ctx.prepared, stats=self.ctx.cache):
            if self.progress is not None:
                self.progress(ready, len(self.ctx.prepared))
            yield
        return []

    def finish(self, job: Job) -> dict[str, int]:
        counts = self.ctx.cache.as_dict()
        return {key: counts[key] for key in ("hits", "misses", "corrupt")}
