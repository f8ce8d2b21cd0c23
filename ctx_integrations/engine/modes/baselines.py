"""The baselines every comparison runs against (METHODS.md "Baselines"), on the same templates.

``concat``: all documents in one prompt, prefilled sequentially (no cache reuse: that is the point
of the baseline). ``single``: the top-1 document by score, from its cache. ``map_reduce``: a batched
map step summarises every document, then one prompt answers from the concatenated summaries.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.cache import StreamBatch, batch_streams
from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.streams import (
    DecodeResult,
    StopCriteria,
    TraceStep,
    decode_fused,
    decode_independent,
    forward_streams,
    single_stream,
)
from ctx_integrations.engine.core.validation import whole_number


def _decode_concatenated(ctx: DecodeContext, texts: list[str]) -> DecodeResult:
    layout, loaded = ctx.engine.layout, ctx.engine.loaded
    ids = layout.prefix_ids + [t for text in texts for t in layout.context_ids(text)] + layout.suffix_ids(ctx.query)
    ctx.check_window(len(ids), f"the concatenation of {len(texts)} documents")
    ctx.check_streams(1, len(ids) + ctx.stop.max_new_tokens, "the concatenated prompt")
    device = loaded.device
    streams = StreamBatch(DynamicCache(), torch.zeros(1, 0, dtype=torch.long, device=device),
                          torch.zeros(1, dtype=torch.long, device=device))
    first_logits = forward_streams(loaded.model, streams, torch.tensor([ids], device=device))
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    return decode_fused(loaded.model, loaded.tokenizer, streams, first_logits, single_stream, ctx.sampler, ctx.stop,
                        ctx.on_token, ctx.started)


@register_mode("concat")
def run_concat(ctx: DecodeContext) -> DecodeResult:
    """Corpus in context ("All"): every document in one prompt, in the given order."""
    return _decode_concatenated(ctx, [d.text for d in ctx.documents])


def top_document(documents: list[Document]) -> int:
    """Index of the highest-scored document (the first on ties)."""
    return max(range(len(documents)), key=lambda i: (documents[i].score, -i))


@register_mode("single")
def run_single(ctx: DecodeContext) -> DecodeResult:
    """Corpus in context ("Single"): only the top-1 document by score, decoded from its cached KV."""
    engine, layout = ctx.engine, ctx.engine.layout
    top = top_document(ctx.documents)
    context_ids, suffix = layout.context_ids(ctx.documents[top].text), layout.suffix_ids(ctx.query)
    ctx.check_window(len(layout.prefix_ids) + len(context_ids) + len(suffix), f"document {top}")
    ctx.check_streams(1, len(layout.prefix_ids) + len(context_ids) + len(suffix) + ctx.stop.max_new_tokens, "single")
    streams = batch_streams(engine.store.prefix(layout), [engine.store.document_tokens(layout, context_ids)])
    first_logits = forward_streams(engine.loaded.model, streams, torch.tensor([suffix], device=engine.loaded.device))
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    result = decode_fused(engine.loaded.model, engine.loaded.tokenizer, streams, first_logits, single_stream,
                          ctx.sampler, ctx.stop, ctx.on_token, ctx.started)
    result.trace = [TraceStep(step.token_id, top, step.score) for step in result.trace]
    return result


@register_mode("map_reduce")
def run_map_reduce(ctx: DecodeContext, *, summary_tokens: int = 96) -> DecodeResult:
    """MapReduce: summarise each document (one batch, from cached KV), then answer from the summaries."""
    summary_tokens = whole_number("summary_tokens", summary_tokens, minimum=1)
    engine = ctx.engine
    summary_layout = PromptLayout(engine.loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    suffix = summary_layout.suffix_ids("")
    context_ids = [summary_layout.context_ids(d.text) for d in ctx.documents]
    longest = len(summary_layout.prefix_ids) + max(map(len, context_ids)) + len(suffix)
    ctx.check_window(longest, "map_reduce's map step (the longest document)", summary_tokens, "summary_tokens")
    ctx.check_streams(len(context_ids), longest + summary_tokens, "map_reduce's map step (one stream per document)")
    prefix = engine.store.prefix(summary_layout)
    streams = batch_streams(prefix, [engine.store.document_tokens(summary_layout, ids) for ids in context_ids])
    suffix_batch = torch.tensor([suffix], device=engine.loaded.device).expand(len(context_ids), -1)
    first_logits = forward_streams(engine.loaded.model, streams, suffix_batch)
    map_stop = StopCriteria(ctx.stop.eos_token_ids, summary_tokens)
    summaries = decode_independent(engine.loaded.model, engine.loaded.tokenizer, streams, first_logits, ctx.sampler,
                                   map_stop)
    ctx.timings["map_s"] = time.perf_counter() - ctx.started
    result = _decode_concatenated(ctx, [s.text.strip() or d.text for s, d in zip(summaries, ctx.documents)])
    result.extra["summaries"] = [s.text for s in summaries]
    return result
