"""The baselines every comparison runs against (docs/methods.md#baselines), on the same templates.

``concat``: all documents in one prompt, prefilled sequentially (no cache reuse: that is the point
of the baseline). ``truncated``: the same prompt cut to the last context tokens that fit the window
(the Soft-NBCE paper's Truncated baseline). ``single``: the top-1 document by score, from its cache.
These three are one-stream pooled jobs. ``map_reduce``: a batched map step summarises every
document, then one prompt answers from the concatenated summaries; a document whose summary prompt
would not fit the model's window is cut into token pieces that do (:func:`map_inputs`), each
summarised on its own, so the map step never runs past the window (an exclusive job: two phases with
their own streams).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

import torch
from transformers import DynamicCache

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.cache import StreamBatch, batch_streams
from ctx_integrations.engine.core.jobs import ExclusiveJob, FusedJob, Stream, single_result
from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.rows import Piece
from ctx_integrations.engine.core.static_decode import StaticStreams, check_compile_mode
from ctx_integrations.engine.core.streams import (
    DecodeResult,
    StopCriteria,
    TraceStep,
    forward_streams,
    fused_steps,
    independent_steps,
    single_stream,
)
from ctx_integrations.engine.core.validation import optional_whole_number, whole_number
from ctx_integrations.errors import DocumentTooLongError


def prompt_job(ctx: DecodeContext, ids: list[int],
               finish: Callable[[DecodeResult], DecodeResult] | None = None) -> FusedJob:
    """One stream holding a whole prompt, prefilled sequentially (no cache reuse)."""
    ctx.check_streams(1, len(ids) + ctx.stop.max_new_tokens, "the concatenated prompt")
    return FusedJob(ctx, [Stream((), tuple(ids), 0)], single_stream, finish)


def concatenated_ids(ctx: DecodeContext, texts: list[str], what: str | None = None) -> list[int]:
    """``prefix + texts + question`` as one prompt, refused when it does not fit the window."""
    layout = ctx.engine.layout
    ids = layout.prefix_ids + [t for text in texts for t in layout.context_ids(text)] + layout.suffix_ids(ctx.query)
    ctx.check_window(len(ids), what or f"the concatenation of {len(texts)} documents")
    return ids


@register_mode("concat")
def run_concat(ctx: DecodeContext) -> FusedJob:
    """Corpus in context ("All"): every document in one prompt, in the given order."""
    return prompt_job(ctx, concatenated_ids(ctx, [d.text for d in ctx.documents]))


@register_mode("truncated")
def run_truncated(ctx: DecodeContext, *, context_tokens: int | None = None) -> FusedJob:
    """Truncated (the Soft-NBCE paper's baseline): the concatenated documents cut to their last tokens.

    Keeps the last ``context_tokens`` tokens of the concatenated context (None: as many as fit the
    model's window with the prompt and ``max_new_tokens``), so the answer never runs past the window
    and what is lost is the start of the context. ``extra["dropped_tokens"]`` says how many were cut.
    """
    context_tokens = optional_whole_number("context_tokens", context_tokens, minimum=1)
    layout = ctx.engine.layout
    prefix, suffix = layout.prefix_ids, layout.suffix_ids(ctx.query)
    context = [t for d in ctx.documents for t in layout.context_ids(d.text)]
    room = ctx.engine.loaded.max_positions - len(prefix) - len(suffix) - ctx.stop.max_new_tokens
    ctx.check_window(len(prefix) + len(suffix) + 1, "the prompt without context")
    keep = min(room, context_tokens or room, len(context))

    def finish(result: DecodeResult) -> DecodeResult:
        result.extra.update(context_tokens=keep, dropped_tokens=len(context) - keep)
        return result

    return prompt_job(ctx, prefix + context[len(context) - keep:] + suffix, finish)


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


def reduce_texts(documents: list[Document], sources: list[int], summaries: list[str]) -> list[str]:
    """One reduce context per document: its pieces' summaries joined in order; a document whose every
    summary is empty falls back to its own text (a model that ends the summary at once)."""
    texts = []
    for index, document in enumerate(documents):
        joined = " ".join(s.strip() for s, source in zip(summaries, sources) if source == index and s.strip())
        texts.append(joined or document.text)
    return texts


def _map_reduce_steps(ctx: DecodeContext, summary_tokens: int,
                      compile_mode: str | None) -> Generator[None, None, DecodeResult]:
    engine, loaded = ctx.engine, ctx.engine.loaded
    summary_layout = PromptLayout(loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    suffix = summary_layout.suffix_ids("")
    inputs = map_inputs(summary_layout, [d.text for d in ctx.documents], summary_tokens, loaded.max_positions)
    context_ids = [ids for _, ids in inputs]
    longest = len(summary_layout.prefix_ids) + max(map(len, context_ids)) + len(suffix)
    ctx.check_streams(len(context_ids), longest + summary_tokens, "map_reduce's map step (one stream per input)")
    prefix = engine.store.prefix(summary_layout)
    # the summary prompt's caches serve MapReduce only: memory tier, not the disk
    caches = engine.store.documents_tokens(summary_layout, context_ids, stats=ctx.cache, persist=False)
    streams = batch_streams(prefix, caches)
    suffix_batch = torch.tensor([suffix], device=loaded.device).expand(len(context_ids), -1)
    first_logits = forward_streams(loaded.model, streams, suffix_batch)
    mapping = StaticStreams(loaded.model, streams, summary_tokens, compile_mode)  # one token per stream per step
    yield
    map_stop = StopCriteria(ctx.stop.eos_token_ids, summary_tokens)
    summaries = yield from independent_steps(mapping.step, loaded.tokenizer, first_logits, ctx.sampler, map_stop)
    ctx.timings["map_s"] = time.perf_counter() - ctx.started
    ids = concatenated_ids(ctx, reduce_texts(ctx.documents, [i for i, _ in inputs], [s.text for s in summaries]),
                           f"map_reduce's reduce step (the summaries of {len(ctx.documents)} documents: lower "
                           "summary_tokens)")
    reduce = StreamBatch(DynamicCache(), torch.zeros(1, 0, dtype=torch.long, device=loaded.device),
                         torch.zeros(1, dtype=torch.long, device=loaded.device))
    first_logits = forward_streams(loaded.model, reduce, torch.tensor([ids], device=loaded.device))
    reducing = StaticStreams(loaded.model, reduce, ctx.stop.max_new_tokens, compile_mode)
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    yield
    result = yield from fused_steps(reducing.step, loaded.tokenizer, first_logits, single_stream, ctx.sampler, ctx.stop,
                                    ctx.on_token, ctx.started)
    result.extra.update(summaries=[s.text for s in summaries], summary_documents=[i for i, _ in inputs],
                        map_input_tokens=[len(ids) for ids in context_ids])
    return result


@register_mode("map_reduce")
def run_map_reduce(ctx: DecodeContext, *, summary_tokens: int = 96, compile_mode: str | None = None) -> ExclusiveJob:
    """MapReduce: summarise each document (one batch, from cached KV), then answer from the summaries.

    Documents too long for the summary prompt are summarised piece by piece (:func:`map_inputs`); the
    reduce prompt joins each document's piece summaries in order. If the summaries together do not fit
    the window the reduce step raises ``DocumentTooLongError`` (lower ``summary_tokens``). Runs as an
    exclusive job (two phases with their own streams), one forward per scheduler step. Both phases decode
    one token per stream per step from a fixed-size cache written in place (``static_decode.py``);
    ``compile_mode``: ``None`` (eager, the default) or a ``torch.compile`` mode for that step, e.g.
    ``"reduce-overhead"`` (CUDA graphs on a GPU: the first request of each shape pays the compile).
    """
    summary_tokens = whole_number("summary_tokens", summary_tokens, minimum=1)
    check_compile_mode(compile_mode)
    return ExclusiveJob([ctx], single_result(_map_reduce_steps(ctx, summary_tokens, compile_mode)))
