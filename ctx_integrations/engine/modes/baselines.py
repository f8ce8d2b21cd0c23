"""The baselines every comparison runs against (docs/methods.md#baselines), on the same templates.

``concat``: all documents in one prompt, prefilled sequentially (no cache reuse: that is the point
of the baseline). ``truncated``: the same prompt cut to the last context tokens that fit the window
(the Soft-NBCE paper's Truncated baseline). ``single``: the top-1 document by score, from its cache.
These three are one-stream pooled jobs. ``map_reduce``: a batched map step summarises every
document, then one prompt answers from the concatenated summaries; a document whose summary prompt
would not fit the model's window is cut into token pieces that do (:func:`map_inputs`), each
summarised on its own, so the map step never runs past the window (a pooled job whose follow-up job is
the reduce step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.decoding import (
    DecodeResult,
    Emitter,
    StopCriteria,
    TraceStep,
    single_stream,
)
from ctx_integrations.engine.core.jobs import FusedJob, Job, PooledJob, Stream
from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.rows import Piece, Run
from ctx_integrations.engine.core.validation import optional_whole_number, whole_number
from ctx_integrations.engine.modes.specs import CONCAT, MAP_REDUCE, SINGLE, TRUNCATED
from ctx_integrations.errors import DocumentTooLongError


def prompt_job(ctx: DecodeContext, ids: list[int],
               finish: Callable[[DecodeResult], DecodeResult] | None = None) -> FusedJob:
    """One stream holding a whole prompt, prefilled sequentially (no cache reuse)."""
    ctx.check_streams(1, len(ids) + ctx.stop.max_new_tokens, "the concatenated prompt")
    return FusedJob(ctx, [Stream((), tuple(ids), 0)], single_stream, finish)


def concatenated_ids(ctx: DecodeContext, contexts: Sequence[Sequence[int]], what: str | None = None) -> list[int]:
    """``prefix + contexts + question`` as one prompt (each context's tokens given), refused when it does not fit."""
    ids = ctx.engine.layout.prefix_ids + [t for context in contexts for t in context] + list(ctx.suffix_ids)
    ctx.check_window(len(ids), what or f"the concatenation of {len(contexts)} documents")
    return ids


@register_mode(CONCAT)
def run_concat(ctx: DecodeContext) -> FusedJob:
    """Corpus in context ("All"): every document in one prompt, in the given order."""
    return prompt_job(ctx, concatenated_ids(ctx, [prepared.ids for prepared in ctx.prepared]))


@register_mode(TRUNCATED)
def run_truncated(ctx: DecodeContext, *, context_tokens: int | None = None) -> FusedJob:
    """Truncated (the Soft-NBCE paper's baseline): the concatenated documents cut to their last tokens.

    Keeps the last ``context_tokens`` tokens of the concatenated context (None: as many as fit the
    model's window with the prompt and ``max_new_tokens``), so the answer never runs past the window
    and what is lost is the start of the context. ``extra["dropped_tokens"]`` says how many were cut.
    """
    context_tokens = optional_whole_number("context_tokens", context_tokens, minimum=1)
    prefix, suffix = ctx.engine.layout.prefix_ids, list(ctx.suffix_ids)
    context = [t for prepared in ctx.prepared for t in prepared.ids]
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


@register_mode(SINGLE)
def run_single(ctx: DecodeContext) -> FusedJob:
    """Corpus in context ("Single"): only the top-1 document by score, decoded from its cached KV."""
    engine, layout = ctx.engine, ctx.engine.layout
    top = top_document(ctx.documents)
    chosen, suffix = ctx.prepared[top], ctx.suffix_ids
    prefix_len = len(layout.prefix_ids)
    ctx.check_window(prefix_len + chosen.tokens + len(suffix), f"document {top}")
    ctx.check_streams(1, prefix_len + chosen.tokens + len(suffix) + ctx.stop.max_new_tokens, "single")
    prefix = engine.store.prefix(layout)
    (document,) = engine.store.documents_prepared(layout, [chosen], stats=ctx.cache)
    stream = Stream((Piece(prefix.kv, 0), Piece(document.kv, prefix_len)), tuple(suffix), prefix_len + document.length)

    def finish(result: DecodeResult) -> DecodeResult:
        result.trace = [replace(step, document=top) for step in result.trace]
        return result

    return FusedJob(ctx, [stream], single_stream, finish)


def map_inputs(layout: PromptLayout, contexts: Sequence[Sequence[int]], summary_tokens: int,
               window: int) -> list[tuple[int, list[int]]]:
    """(document index, context token ids) of every map-step input, in order (``contexts``: each document's tokens).

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
    for index, ids in enumerate(contexts):
        ids = list(ids)
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


def _map_plan(ctx: DecodeContext, summary_tokens: int) -> tuple[PromptLayout, list[tuple[int, list[int]]], list[int]]:
    """The map step's summary layout, its inputs (:func:`map_inputs`) and suffix, checked against the budgets."""
    loaded = ctx.engine.loaded
    summary_layout = PromptLayout(loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    suffix = summary_layout.suffix_ids("")
    if summary_layout.context_template == ctx.engine.layout.context_template:  # the same tokens: prepared already
        contexts = [prepared.ids for prepared in ctx.prepared]
    else:
        contexts = [summary_layout.context_ids(d.text) for d in ctx.documents]
    inputs = map_inputs(summary_layout, contexts, summary_tokens, loaded.max_positions)
    longest = len(summary_layout.prefix_ids) + max(len(ids) for _, ids in inputs) + len(suffix)
    ctx.check_streams(len(inputs), longest + summary_tokens, "map_reduce's map step (one stream per input)")
    return summary_layout, inputs, suffix


def _reduce_job(ctx: DecodeContext, inputs: list[tuple[int, list[int]]], summaries: list[DecodeResult]) -> FusedJob:
    """The reduce step: the QA prompt over each document's summaries, one stream."""
    ctx.timings["map_s"] = time.perf_counter() - ctx.started
    layout = ctx.engine.layout
    texts = reduce_texts(ctx.documents, [i for i, _ in inputs], [s.text for s in summaries])
    ids = concatenated_ids(ctx, [layout.context_ids(text) for text in texts],
                           f"map_reduce's reduce step (the summaries of {len(ctx.documents)} documents: lower "
                           "summary_tokens)")

    def finish(result: DecodeResult) -> DecodeResult:
        result.extra.update(summaries=[s.text for s in summaries], summary_documents=[i for i, _ in inputs],
                            map_input_tokens=[len(ids) for _, ids in inputs])
        return result

    return prompt_job(ctx, ids, finish)


class MapJob(PooledJob):
    """MapReduce's map step as rows of the scheduler's batch: one row per input (the summary prompt's prefix,
    the input's cached piece, then the summary suffix), each decoding its own summary with the request's
    sampler; a row leaves the batch when its summary ends. When all have ended, the reduce step follows as
    a new job of the same request (:meth:`follow_up`)."""

    def __init__(self, ctx: DecodeContext, prefix_kv: torch.Tensor, caches: list, suffix: list[int],
                 summary_tokens: int, follow: Callable[[list[DecodeResult]], Job]):
        super().__init__([ctx])
        self.ctx, self.follow = ctx, follow
        prefix_len = prefix_kv.shape[3]
        self.pieces = [[Piece(prefix_kv, 0), Piece(cache.kv, prefix_len)] for cache in caches]
        stop = StopCriteria(ctx.stop.eos_token_ids, summary_tokens)
        self.emitters = [Emitter(ctx.engine.loaded.tokenizer, stop) for _ in caches]
        self.samplers = [ctx.sampler.unconstrained() for _ in caches]  # summaries: never held to the answer's format
        self._next = [[Run(tuple(suffix), prefix_len + cache.length)] for cache in caches]
        self._tokens = sum(prefix_len + cache.length + len(suffix) + summary_tokens for cache in caches)
        self._live = list(range(len(caches)))  # the inputs whose rows are still in the batch, in row order

    @property
    def done(self) -> bool:
        return all(emitter.done for emitter in self.emitters)

    def rows(self) -> list[list[Piece]]:
        return self.pieces

    def runs(self) -> list[list[Run]]:
        return [self._next[row] for row in self._live]

    def kv_tokens(self) -> int:
        return self._tokens

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.stack([token.double(), checked.double()])
                          for token, checked in (self.samplers[row].pick(scores[-1])
                                                 for row, scores in zip(self._live, logits))])

    def accept(self, values: list[float]) -> None:
        for row, token, checked in zip(self._live, values[0::2], values[1::2]):
            self.samplers[row].check(checked)
            self.samplers[row].accept(int(token))
            run = self._next[row][-1]
            if not self.emitters[row].push(TraceStep(int(token), None, 0.0)):
                self._next[row] = [Run((int(token),), run.first_position + len(run.ids))]

    def take_finished_rows(self) -> list[int]:
        finished = [index for index, row in enumerate(self._live) if self.emitters[row].done]
        if finished and not self.done:
            self._live = [row for row in self._live if not self.emitters[row].done]
            return finished
        return []

    def follow_up(self) -> Job:
        return self.follow([emitter.result() for emitter in self.emitters])

    def results(self) -> list[DecodeResult]:
        raise AssertionError("a map step has no answer of its own: its follow-up (the reduce step) has")


def _map_job(ctx: DecodeContext, summary_tokens: int) -> MapJob:
    engine = ctx.engine
    summary_layout, inputs, suffix = _map_plan(ctx, summary_tokens)
    prefix = engine.store.prefix(summary_layout)
    # the summary prompt's caches serve MapReduce only: memory tier, not the disk
    caches = engine.store.documents_tokens(summary_layout, [ids for _, ids in inputs], stats=ctx.cache, persist=False)
    return MapJob(ctx, prefix.kv, caches, suffix, summary_tokens,
                  lambda summaries: _reduce_job(ctx, inputs, summaries))


@register_mode(MAP_REDUCE)
def run_map_reduce(ctx: DecodeContext, *, summary_tokens: int = 96) -> Job:
    """MapReduce: summarise each document (from cached KV), then answer from the summaries.

    Documents too long for the summary prompt are summarised piece by piece (:func:`map_inputs`); the
    reduce prompt joins each document's piece summaries in order. If the summaries together do not fit
    the window the reduce step raises ``DocumentTooLongError`` (lower ``summary_tokens``). Both steps run
    as rows of the scheduler's shared batch, beside other requests: the map step one row per input
    (:class:`MapJob`), then the reduce step one row (its follow-up job); with the engine's compiled decode
    step (``Engine(compile_mode=...)``, e.g. CUDA graphs on CUDA) like every pooled request.
    """
    summary_tokens = whole_number("summary_tokens", summary_tokens, minimum=1)
    return _map_job(ctx, summary_tokens)
