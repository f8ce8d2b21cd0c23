"""The baselines every comparison runs against (METHODS.md "Baselines"), on the same templates.

``concat``: all documents in one prompt, prefilled sequentially (no cache reuse: that is the point
of the baseline). ``single``: the top-1 document by score, from its cache. Both are one-stream pooled
jobs. ``map_reduce``: a batched map step summarises every document, then one prompt answers from the
concatenated summaries (an exclusive job: two phases with their own streams).
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch
from transformers import DynamicCache

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.cache import StreamBatch, batch_streams
from ctx_integrations.engine.core.jobs import ExclusiveJob, FusedJob, Stream, single_result
from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.rows import Piece
from ctx_integrations.engine.core.streams import (
    DecodeResult,
    StopCriteria,
    TraceStep,
    forward_streams,
    fused_steps,
    independent_steps,
    single_stream,
)
from ctx_integrations.engine.core.validation import whole_number


def concatenated_job(ctx: DecodeContext, texts: list[str]) -> FusedJob:
    """One stream holding the whole prompt ``prefix + texts + question``, prefilled sequentially (no cache reuse)."""
    layout = ctx.engine.layout
    ids = layout.prefix_ids + [t for text in texts for t in layout.context_ids(text)] + layout.suffix_ids(ctx.query)
    ctx.check_window(len(ids), f"the concatenation of {len(texts)} documents")
    ctx.check_streams(1, len(ids) + ctx.stop.max_new_tokens, "the concatenated prompt")
    return FusedJob(ctx, [Stream((), tuple(ids), 0)], single_stream)


@register_mode("concat")
def run_concat(ctx: DecodeContext) -> FusedJob:
    """Corpus in context ("All"): every document in one prompt, in the given order."""
    return concatenated_job(ctx, [d.text for d in ctx.documents])


def top_document(documents: list[Document]) -> int:
    """Index of the highest-scored document (the first on ties)."""
    return max(range(len(documents)), key=lambda i: (documents[i].score, -i))


@register_mode("single")
def run_single(ctx: DecodeContext) -> FusedJob:
    """Corpus in context ("Single"): only the top-1 document by score, decoded from its cached KV."""
    engine, layout = ctx.engine, ctx.engine.layout
    top = top_document(ctx.documents)
    context_ids, suffix = layout.context_ids(ctx.documents[top].text), layout.suffix_ids(ctx.query)
    prefix_len = len(layout.prefix_ids)
    ctx.check_window(prefix_len + len(context_ids) + len(suffix), f"document {top}")
    ctx.check_streams(1, prefix_len + len(context_ids) + len(suffix) + ctx.stop.max_new_tokens, "single")
    prefix = engine.store.prefix(layout)
    document = engine.store.document_tokens(layout, context_ids, stats=ctx.cache)
    stream = Stream((Piece(prefix.kv, 0), Piece(document.kv, prefix_len)), tuple(suffix), prefix_len + document.length)

    def finish(result: DecodeResult) -> DecodeResult:
        result.trace = [TraceStep(step.token_id, top, step.score) for step in result.trace]
        return result

    return FusedJob(ctx, [stream], single_stream, finish)


def _map_reduce_steps(ctx: DecodeContext, summary_tokens: int) -> Generator[None, None, DecodeResult]:
    engine, loaded = ctx.engine, ctx.engine.loaded
    summary_layout = PromptLayout(loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    suffix = summary_layout.suffix_ids("")
    context_ids = [summary_layout.context_ids(d.text) for d in ctx.documents]
    longest = len(summary_layout.prefix_ids) + max(map(len, context_ids)) + len(suffix)
    ctx.check_window(longest, "map_reduce's map step (the longest document)", summary_tokens, "summary_tokens")
    ctx.check_streams(len(context_ids), longest + summary_tokens, "map_reduce's map step (one stream per document)")
    prefix = engine.store.prefix(summary_layout)
    # the summary prompt's caches serve MapReduce only: memory tier, not the disk
    caches = engine.store.documents_tokens(summary_layout, context_ids, stats=ctx.cache, persist=False)
    streams = batch_streams(prefix, caches)
    suffix_batch = torch.tensor([suffix], device=loaded.device).expand(len(context_ids), -1)
    first_logits = forward_streams(loaded.model, streams, suffix_batch)
    yield
    map_stop = StopCriteria(ctx.stop.eos_token_ids, summary_tokens)
    summaries = yield from independent_steps(lambda ids: forward_streams(loaded.model, streams, ids), loaded.tokenizer,
                                             first_logits, ctx.sampler, map_stop)
    ctx.timings["map_s"] = time.perf_counter() - ctx.started
    layout = engine.layout
    texts = [s.text.strip() or d.text for s, d in zip(summaries, ctx.documents)]
    ids = layout.prefix_ids + [t for text in texts for t in layout.context_ids(text)] + layout.suffix_ids(ctx.query)
    ctx.check_window(len(ids), f"the concatenation of {len(texts)} summaries")
    reduce = StreamBatch(DynamicCache(), torch.zeros(1, 0, dtype=torch.long, device=loaded.device),
                         torch.zeros(1, dtype=torch.long, device=loaded.device))
    first_logits = forward_streams(loaded.model, reduce, torch.tensor([ids], device=loaded.device))
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    yield
    result = yield from fused_steps(lambda step_ids: forward_streams(loaded.model, reduce, step_ids), loaded.tokenizer,
                                    first_logits, single_stream, ctx.sampler, ctx.stop, ctx.on_token, ctx.started)
    result.extra["summaries"] = [s.text for s in summaries]
    return result


@register_mode("map_reduce")
def run_map_reduce(ctx: DecodeContext, *, summary_tokens: int = 96) -> ExclusiveJob:
    """MapReduce: summarise each document (one batch, from cached KV), then answer from the summaries.

    Runs as an exclusive job (two phases with their own streams), one forward per scheduler step.
    """
    summary_tokens = whole_number("summary_tokens", summary_tokens, minimum=1)
    return ExclusiveJob([ctx], single_result(_map_reduce_steps(ctx, summary_tokens)))
