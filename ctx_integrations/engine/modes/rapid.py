"""RAPID mode: retrieval-augmented speculative decoding (the RAPID paper; docs/methods.md#rapid where it agrees).

The target is the model over the long context (prefix + every document + question, sequential
positions); its long-context KV comes from the store, so a second question on the same documents
reuses it. The drafter is the same engine (default) or another engine with the same tokenizer, over
a short context retrieved as in the paper's RAG setup (Sec. 4.1): the long context is cut into
512-token chunks, ranked by the cosine similarity of their dense embeddings to the question's
(``ranking="dense"``, the embedded MiniLM by default; BM25 and the documents' own retrieval scores
are options), chunks below similarity 0.3 are dropped, and the best ones are kept in their original
order within a budget bounded between 4096 tokens and 1/24 of the input length
(:func:`draft_budget`). Each round the drafter proposes ``gamma`` tokens from its own cache, the
target scores them all in one forward pass, :func:`~ctx_integrations.engine.modes.speculative.verify`
accepts a prefix, and both drop the rejected tokens. Target and drafter are rows of the shared batch
(``speculative_rows.py``), so RAPID requests decode beside every other request.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ctx_integrations.engine.core.decoding import DecodeResult, StopCriteria, single_stream
from ctx_integrations.engine.core.disk import CacheStats
from ctx_integrations.engine.core.jobs import FusedJob, Stream
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.registry import DecodeContext, EngineParts, register_mode
from ctx_integrations.engine.core.rows import Piece
from ctx_integrations.engine.core.scheduler import Request
from ctx_integrations.engine.modes.specs import RAPID
from ctx_integrations.engine.modes.speculative_rows import DraftChannel, DraftJob, DraftRow, RapidJob, SequenceRow
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.retrieval.scores import normalize_sparse

# The paper's RAG setup (Sec. 4.1): the retrieval context is bounded between 4096 tokens and 1/24 of the input.
DRAFT_MIN_TOKENS = 4096
DRAFT_CONTEXT_RATIO = 1 / 24


@dataclass(frozen=True)
class Chunk:
    """A slice of the long context: where it starts (in tokens), its document, tokens and relevance r."""

    start: int
    document: int
    token_ids: tuple[int, ...]
    score: float = 0.0


def split_chunks(context_ids: list[list[int]], chunk_tokens: int) -> list[Chunk]:
    """Cut each document's tokens into chunks of at most ``chunk_tokens`` (chunks never cross documents)."""
    chunks, offset = [], 0
    for doc, ids in enumerate(context_ids):
        for begin in range(0, len(ids), chunk_tokens):
            chunks.append(Chunk(offset + begin, doc, tuple(ids[begin:begin + chunk_tokens])))
        offset += len(ids)
    return chunks


def bm25_scores(texts: list[str], query: str) -> list[float]:
    """BM25 of each text against the query, normalised to [0, 1) like every lexical score (arctan)."""
    import bm25s

    query_tokens = bm25s.tokenize(query, stopwords="en", show_progress=False, return_ids=False)[0]
    if not query_tokens:
        return [0.0] * len(texts)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    known = [t for t in query_tokens if t in retriever.vocab_dict]
    if not known:
        return [0.0] * len(texts)
    return [normalize_sparse(float(s)) for s in retriever.get_scores(known)]


def dense_scores(texts: list[str], query: str, embedder: object) -> list[float]:
    """Cosine similarity of each text's embedding to the query's (the paper's dense retrieval).

    ``embedder``: anything with ``embed_documents(texts)`` and ``embed_query(text)`` (the project's
    ``retrieval.embedders.Embedder``, a LangChain ``Embeddings``); vectors are normalised here, so
    embedders that do not return unit vectors work too.
    """
    documents = np.asarray(embedder.embed_documents(list(texts)), dtype=np.float64).reshape(len(texts), -1)
    query_vector = np.asarray(embedder.embed_query(query), dtype=np.float64).reshape(-1)
    norms = np.linalg.norm(documents, axis=1) * np.linalg.norm(query_vector)
    return [float(s) for s in (documents @ query_vector) / np.maximum(norms, 1e-12)]


def resolve_embedder(embedder: object) -> object:
    """The drafter's embedder: the embedded MiniLM by default (imported here, lazily, so the engine core
    never imports retrieval), or any object with ``embed_documents`` / ``embed_query``."""
    if embedder is None:
        from ctx_integrations.retrieval.embedders import default_embedder

        return default_embedder()
    check_embedder(embedder)
    return embedder


def check_embedder(embedder: object) -> None:
    """Refuse a ``draft_embedder`` that cannot embed (``None`` is the default MiniLM)."""
    if embedder is not None and not all(callable(getattr(embedder, name, None))
                                        for name in ("embed_documents", "embed_query")):
        raise InvalidOptionError(f"draft_embedder must have embed_documents(texts) and embed_query(text) "
                                 f"(e.g. ctx_integrations.retrieval.embedders.default_embedder()), "
                                 f"got {type(embedder).__name__}")


def draft_budget(long_tokens: int, draft_context_tokens: int | None) -> tuple[int, int]:
    """(lower, upper) token bounds of the drafter's context for a long context of ``long_tokens``.

    ``None`` (the paper's, Sec. 4.1): at least ``DRAFT_MIN_TOKENS`` (4096, or the whole context when
    shorter), at most 1/24 of the input or that lower bound when 1/24 is less. The lower bound wins
    over the similarity threshold. An int: at most that many tokens, no lower bound (the best chunk
    is always kept).
    """
    if draft_context_tokens is not None:
        return 0, draft_context_tokens
    lower = min(DRAFT_MIN_TOKENS, long_tokens)
    return lower, max(lower, math.ceil(long_tokens * DRAFT_CONTEXT_RATIO))


def select_chunks(chunks: list[Chunk], budget: int, min_similarity: float, min_tokens: int = 0) -> list[Chunk]:
    """Best chunks first while they fit ``budget`` tokens and score >= ``min_similarity``, then in original order.

    The best chunk is always kept (the drafter needs some context) even below the threshold, and so is
    every next-best chunk until ``min_tokens`` are kept (the paper's lower bound).
    """
    kept, used = [], 0
    for chunk in sorted(chunks, key=lambda c: (-c.score, c.start)):
        if kept and chunk.score < min_similarity and used >= min_tokens:
            break
        if used + len(chunk.token_ids) <= budget:
            kept.append(chunk)
            used += len(chunk.token_ids)
    return sorted(kept, key=lambda c: c.start)


def rank_chunks(ctx: DecodeContext, chunks: list[Chunk], ranking: str,
                embedder: object = None) -> tuple[list[Chunk], str]:
    """Score chunks by dense cosine similarity to the question (the paper's), BM25, or their documents'
    retrieval scores.

    ``auto`` uses the documents' scores when they carry information (not all equal, i.e. the input
    was already retrieved and scored), and BM25 otherwise. ``embedder`` is for ``dense`` (None: MiniLM).
    """
    if ranking == "auto":
        ranking = "scores" if len({d.score for d in ctx.documents}) > 1 else "bm25"
    if ranking == "scores":
        scores = [ctx.documents[c.document].score for c in chunks]
    else:
        tokenizer = ctx.engine.loaded.tokenizer
        texts = [tokenizer.decode(list(c.token_ids)) for c in chunks]
        if ranking == "dense":
            scores = dense_scores(texts, ctx.query, resolve_embedder(embedder))
        else:
            scores = bm25_scores(texts, ctx.query)
    return [Chunk(c.start, c.document, c.token_ids, float(s)) for c, s in zip(chunks, scores)], ranking


def draft_chunks(ctx: DecodeContext, context_ids: list[list[int]], chunk_tokens: int, ranking: str, embedder: object,
                 draft_context_tokens: int | None, min_similarity: float) -> tuple[list[Chunk], str, tuple[int, int]]:
    """The drafter's chunks (original order), the ranking used and the (lower, upper) budget.

    When the lower bound already covers the whole long context every chunk is kept, so nothing is
    ranked (no embedding computed; ranking ``"none"``).
    """
    check_embedder(embedder)
    chunks = split_chunks(context_ids, chunk_tokens)
    bounds = draft_budget(sum(len(ids) for ids in context_ids), draft_context_tokens)
    if bounds[0] >= sum(len(c.token_ids) for c in chunks):
        return chunks, "none", bounds
    ranked, used = rank_chunks(ctx, chunks, ranking, embedder)
    return select_chunks(ranked, bounds[1], min_similarity, bounds[0]), used, bounds


def check_drafter(engine: EngineParts, drafter: object) -> EngineParts:
    """The drafter engine: the target itself by default; another one must share the target's tokenizer."""
    if drafter is None or drafter is engine:
        return engine
    if not isinstance(drafter, EngineParts):
        raise InvalidOptionError(
            f"drafter must be an Engine (or None to draft with the target model), got {type(drafter).__name__}")
    mine, theirs = engine.loaded.tokenizer, drafter.loaded.tokenizer
    if theirs is not mine and theirs.get_vocab() != mine.get_vocab():
        raise InvalidOptionError(
            f"the drafter {drafter.loaded.name!r} uses a different tokenizer than the target {engine.loaded.name!r}: "
            "speculative decoding compares the two models token by token, so they must share one vocabulary. "
            "Pick a drafter of the same model family (or drafter=None to draft with the target model itself).")
    return drafter


def _report_drafter_failure(channel: DraftChannel) -> Callable[[Future], None]:
    """Hand a failure of the drafter's request (on its own scheduler) to the RAPID request waiting for it."""

    def done(future: Future) -> None:
        if future.cancelled():
            channel.fail(InvalidOptionError("the drafter's request was cancelled before it drafted"))
        elif future.exception() is not None:
            channel.fail(future.exception())

    return done


@register_mode(RAPID)
def run_rapid(ctx: DecodeContext, *, gamma: int = 10, eta: float = 10.0, drafter: EngineParts | None = None,
              draft_context_tokens: int | None = None, chunk_tokens: int = 512, min_similarity: float = 0.3,
              ranking: str = "dense", draft_embedder: object = None, tail_rule: str = "paper",
              compare_target: bool = False) -> RapidJob:
    """Retrieval-augmented speculative decoding.

    gamma: tokens drafted per round (10, the paper's). eta: how strongly the drafter's distribution
    shifts the target's (0 = plain speculative decoding, output distributed as the long-context target;
    5-20 self-speculation, 40-50 with a larger drafter). drafter: an Engine with the same tokenizer
    (default: the target model). tail_rule: "paper" (Eq. 9) or the "draft_head" variant (see
    ``speculative.py``). The drafter's short context: chunks of ``chunk_tokens`` (512) ranked by
    "dense" cosine similarity (the paper's; ``draft_embedder``, default the embedded MiniLM), "bm25",
    the documents' "scores", or "auto" (scores when they differ, else BM25); chunks below
    ``min_similarity`` (0.3) dropped, original order; ``draft_context_tokens`` None: the paper's
    bounds (:func:`draft_budget`), an int: at most that many tokens (the best chunk always kept).
    compare_target: then decode as many tokens with the target alone (batched like any request) and
    report the measured speedup (adds that run's time to ``total_s``). temperature / top_p / seed are
    the engine's; temperature 0 is the greedy variant. The target and drafter are rows of the shared
    batch (``speculative_rows.py``); a drafter model of its own drafts on that model's scheduler.
    """
    _check_budgets(draft_context_tokens, chunk_tokens)
    draft_engine = check_drafter(ctx.engine, drafter)
    engine, layout = ctx.engine, ctx.engine.layout
    context_ids = [list(p.ids) for p in ctx.prepared]
    long_ids = [t for ids in context_ids for t in ids]
    suffix, prefix_len = list(ctx.suffix_ids), len(layout.prefix_ids)
    ctx.check_window(prefix_len + len(long_ids) + len(suffix), "the long context (all documents)")
    ctx.check_streams(2, prefix_len + len(long_ids) + len(suffix) + ctx.stop.max_new_tokens + gamma,
                      "RAPID's target and drafter streams")
    kept, used_ranking, (min_tokens, budget) = draft_chunks(ctx, context_ids, chunk_tokens, ranking, draft_embedder,
                                                            draft_context_tokens, min_similarity)
    short_ids = [t for c in kept for t in c.token_ids]

    # the long context serves this request (and the next on the same documents): memory tier only
    prefix = engine.store.prefix(layout)
    long_kv = engine.store.document_tokens(layout, long_ids, stats=ctx.cache, persist=False)
    ctx.timings["long_context_s"] = time.perf_counter() - ctx.started
    width = min(engine.loaded.model.get_output_embeddings().weight.shape[0],
                draft_engine.loaded.model.get_output_embeddings().weight.shape[0])
    target_pieces = [Piece(prefix.kv, 0), Piece(long_kv.kv, prefix_len)]
    answer_room = ctx.stop.max_new_tokens + gamma
    target_tokens = prefix_len + long_kv.length + len(suffix) + answer_room
    draft_tokens = prefix_len + len(short_ids) + len(suffix) + answer_room
    draft = DraftRow(SequenceRow(prefix_len), short_ids + suffix, ctx.sampler, ctx.stop.eos_token_ids, width)

    def finish(result: DecodeResult) -> DecodeResult:
        result.extra.update(ranking=used_ranking, draft_context_tokens=len(short_ids),
                            long_context_tokens=len(long_ids), draft_budget=(min_tokens, budget), tail_rule=tail_rule,
                            drafter=draft_engine.loaded.name,
                            chunks=[{"start": c.start, "document": c.document, "tokens": len(c.token_ids),
                                     "score": round(c.score, 6)} for c in kept])
        return result

    settings = dict(gamma=gamma, eta=eta, tail_rule=tail_rule, width=width, finish=finish,
                    then=(lambda job: _target_alone(ctx, job, target_pieces, suffix)) if compare_target else None)
    if draft_engine.loaded.model is engine.loaded.model:  # self-speculation: both rows in this job
        drafter_prefix = draft_engine.store.prefix(layout)
        return RapidJob(ctx, target_pieces, SequenceRow(prefix_len + long_kv.length), suffix,
                        kv_tokens=target_tokens + draft_tokens, draft=([Piece(drafter_prefix.kv, 0)], draft),
                        **settings)
    channel = DraftChannel(engine.scheduler.wake, draft_engine.scheduler.wake)
    job = RapidJob(ctx, target_pieces, SequenceRow(prefix_len + long_kv.length), suffix, kv_tokens=target_tokens,
                   channel=channel, **settings)

    handle = draft_engine.scheduler.submit(DraftRequest(draft_engine, layout, draft, channel, draft_tokens))
    handle.future.add_done_callback(_report_drafter_failure(channel))
    return job


class DraftRequest(Request):
    """RAPID's drafter row as a request of the drafter model's own scheduler (a drafter model of its own)."""

    def __init__(self, draft_engine: EngineParts, layout: PromptLayout, draft: DraftRow, channel: DraftChannel,
                 tokens: int):
        super().__init__(draft_engine)
        self.layout, self.draft, self.channel, self.tokens = layout, draft, channel, tokens

    def plan(self) -> DraftJob:  # on the drafter model's scheduler thread: its prefix cache may be computed
        prefix = self.owner.store.prefix(self.layout)
        return DraftJob([Piece(prefix.kv, 0)], self.draft, self.channel, self.tokens)

    def finish(self, job: DraftJob) -> None:
        return None


def _target_alone(ctx: DecodeContext, job: RapidJob, pieces: list[Piece], suffix: list[int]) -> FusedJob | None:
    """``compare_target``: the target alone decodes as many tokens over the same cached long context, as a
    follow-up job of the request (batched like any other); its finish reports the speedup, returns RAPID's answer.

    Its rate counts the tokens after the first over the time after the prefill (the question's tokens and
    the first token's forward), as RAPID's ``rapid_tokens_per_s`` counts from the target's prefill on.
    """
    rapid = job.results()[0]
    n = len(rapid.token_ids)
    if n == 0:
        return None
    alone = dataclasses.replace(ctx, on_token=None, stop=StopCriteria(frozenset(), n), timings={},
                                started=time.perf_counter(), cache=CacheStats())

    def finish(_: DecodeResult) -> DecodeResult:
        elapsed = time.perf_counter() - alone.started
        decoding = elapsed - alone.timings.get("prefill_s", 0.0)
        rate = (n - 1) / decoding if n > 1 and decoding > 0 else n / elapsed
        ctx.timings.update(target_tokens_per_s=rate, speedup=ctx.timings["rapid_tokens_per_s"] / rate)
        return rapid

    first = pieces[-1].first_position + pieces[-1].kv.shape[3]
    return FusedJob(alone, [Stream(tuple(pieces), tuple(suffix), first)], single_stream, finish)


def _check_budgets(draft_context_tokens: int | None, chunk_tokens: int) -> None:
    """The rule between two options (each one's type and range is its declaration's, checked before planning)."""
    if draft_context_tokens is not None and draft_context_tokens < chunk_tokens:
        raise InvalidOptionError(f"need chunk_tokens <= draft_context_tokens (None: the paper's bounds), got "
                                 f"chunk_tokens={chunk_tokens}, draft_context_tokens={draft_context_tokens}")
