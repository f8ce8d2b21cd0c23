"""The baselines every comparison runs against (METHODS.md "Baselines"), on the same templates.

``concat``: all documents in one prompt, prefilled sequentially (no cache reuse: that is the point
of the baseline). ``truncated``: the same prompt cut to the last context tokens that fit the window
(the Soft-NBCE paper's Truncated baseline). ``single``: the top-1 document by score, from its cache.
``map_reduce``: a batched
map step summarises every document, then one prompt answers from the concatenated summaries; a
document whose summary prompt would not fit the model's window is cut into token pieces that do
(:func:`map_inputs`), each summarised on its own, so the map step never runs past the window.
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
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError


def _decode_concatenated(ctx: DecodeContext, texts: list[str]) -> DecodeResult:
    layout = ctx.engine.layout
    ids = layout.prefix_ids + [t for text in texts for t in layout.context_ids(text)] + layout.suffix_ids(ctx.query)
    ctx.check_window(len(ids), f"the concatenation of {len(texts)} documents")
    return _decode_prompt(ctx, ids)


def _decode_prompt(ctx: DecodeContext, ids: list[int]) -> DecodeResult:
    """Greedy/sampled decoding of one prompt, prefilled sequentially (no cache reuse)."""
    loaded = ctx.engine.loaded
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


@register_mode("truncated")
def run_truncated(ctx: DecodeContext, *, context_tokens: int | None = None) -> DecodeResult:
    """Truncated (the Soft-NBCE paper's baseline): the concatenated documents cut to their last tokens.

    Keeps the last ``context_tokens`` tokens of the concatenated context (None: as many as fit the
    model's window with the prompt and ``max_new_tokens``), so the answer never runs past the window
    and what is lost is the start of the context. ``extra["dropped_tokens"]`` says how many were cut.
    """
    if context_tokens is not None and (isinstance(context_tokens, bool) or not isinstance(context_tokens, int)
                                       or context_tokens < 1):
        raise InvalidOptionError(f"context_tokens must be None or an int >= 1, got {context_tokens!r}")
    layout = ctx.engine.layout
    prefix, suffix = layout.prefix_ids, layout.suffix_ids(ctx.query)
    context = [t for d in ctx.documents for t in layout.context_ids(d.text)]
    room = ctx.engine.loaded.max_positions - len(prefix) - len(suffix) - ctx.stop.max_new_tokens
    ctx.check_window(len(prefix) + len(suffix) + 1, "the prompt without context")
    keep = min(room, context_tokens or room, len(context))
    result = _decode_prompt(ctx, prefix + context[len(context) - keep:] + suffix)
    result.extra.update(context_tokens=keep, dropped_tokens=len(context) - keep)
    return result


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
    streams = batch_streams(engine.store.prefix(layout), [engine.store.document_tokens(layout, context_ids)])
    first_logits = forward_streams(engine.loaded.model, streams, torch.tensor([suffix], device=engine.loaded.device))
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    result = decode_fused(engine.loaded.model, engine.loaded.tokenizer, streams, first_logits, single_stream,
                          ctx.sampler, ctx.stop, ctx.on_token, ctx.started)
    result.trace = [TraceStep(step.token_id, top, step.score) for step in result.trace]
    return result


def map_inputs(layout: PromptLayout, texts: list[str], summary_tokens: int, window: int) -> list[tuple[int, list[int]]]:
    """(document index, context token ids) of every map-step input, in order.

    A document whose summary prompt (prefix + document + suffix + ``summary_tokens``) fits ``window``
    is one input (its cache is the document's own); a longer one is cut into consecutive token pieces
    of the largest size that fits, each summarised on its own.
    """
    room = window - len(layout.prefix_ids) - len(layout.suffix_ids("")) - summary_tokens
    if room < 1:
        raise DocumentTooLongError(
            f"map_reduce's summary prompt with summary_tokens={summary_tokens} already needs "
            f"{window - room + 1} of the model's {window} positions before any document: lower summary_tokens")
    inputs = []
    for index, text in enumerate(texts):
        ids = layout.context_ids(text)
        inputs.extend((index, ids[start:start + room]) for start in range(0, len(ids), room))
    return inputs


@register_mode("map_reduce")
def run_map_reduce(ctx: DecodeContext, *, summary_tokens: int = 96) -> DecodeResult:
    """MapReduce: summarise each document (one batch, from cached KV), then answer from the summaries.

    Documents too long for the summary prompt are summarised piece by piece (:func:`map_inputs`); the
    reduce prompt joins each document's piece summaries in order. If the summaries together do not fit
    the window the reduce step raises ``DocumentTooLongError`` (lower ``summary_tokens``).
    """
    engine = ctx.engine
    summary_layout = PromptLayout(engine.loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    suffix = summary_layout.suffix_ids("")
    inputs = map_inputs(summary_layout, [d.text for d in ctx.documents], summary_tokens,
                        engine.loaded.max_positions)
    context_ids = [ids for _, ids in inputs]
    prefix = engine.store.prefix(summary_layout)
    streams = batch_streams(prefix, [engine.store.document_tokens(summary_layout, ids) for ids in context_ids])
    suffix_batch = torch.tensor([suffix], device=engine.loaded.device).expand(len(context_ids), -1)
    first_logits = forward_streams(engine.loaded.model, streams, suffix_batch)
    map_stop = StopCriteria(ctx.stop.eos_token_ids, summary_tokens)
    summaries = decode_independent(engine.loaded.model, engine.loaded.tokenizer, streams, first_logits, ctx.sampler,
                                   map_stop)
    ctx.timings["map_s"] = time.perf_counter() - ctx.started
    result = _decode_concatenated(ctx, reduce_texts(ctx.documents, [i for i, _ in inputs], [s.text for s in summaries]))
    result.extra.update(summaries=[s.text for s in summaries], summary_documents=[i for i, _ in inputs],
                        map_input_tokens=[len(ids) for ids in context_ids])
    return result


def reduce_texts(documents: list[Document], sources: list[int], summaries: list[str]) -> list[str]:
    """One reduce context per document: its pieces' summaries joined in order; a document whose every
    summary is empty falls back to its own text (a model that ends the summary at once)."""
    texts = []
    for index, document in enumerate(documents):
        joined = " ".join(s.strip() for s, source in zip(summaries, sources) if source == index and s.strip())
        texts.append(joined or document.text)
    return texts
