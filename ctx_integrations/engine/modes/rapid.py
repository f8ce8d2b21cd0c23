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
accepts a prefix, and both caches are rewound to the accepted sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch

from ctx_integrations.engine.core.cache import CachedKV, StreamBatch, batch_streams
from ctx_integrations.engine.core.jobs import ExclusiveJob, single_result
from ctx_integrations.engine.core.registry import DecodeContext, EngineParts, register_mode
from ctx_integrations.engine.core.streams import (
    DecodeResult,
    Emitter,
    StopCriteria,
    TokenSampler,
    TraceStep,
    decode_fused,
    forward_streams,
    forward_streams_keep,
    single_stream,
)
from ctx_integrations.engine.core.validation import choice, real_number, whole_number
from ctx_integrations.engine.modes.speculative import check_tail_rule, scaled_logits, verify
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.retrieval.scores import normalize_sparse

RANKINGS = ("dense", "bm25", "scores", "auto")
# The paper's RAG setup (Sec. 4.1): the retrieval context is bounded between 4096 tokens and 1/24 of the input.
DRAFT_MIN_TOKENS = 4096
DRAFT_CONTEXT_RATIO = 1 / 24
# Largest eta: eta (q - p) overflows float32 near 1e38, and p^ = softmax(z / T + eta (q - p)) becomes NaN (greedy
# decoding then emits token id 0); the paper uses 5-50.
MAX_ETA = 1000.0


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


class _Side:
    """One model in the speculative loop: its cache, and which tokens of its sequence are already in it."""

    def __init__(self, model: torch.nn.Module, streams: StreamBatch, width: int):
        self.model, self.streams, self.width, self.fed = model, streams, width, []

    def forward(self, sequence: list[int], keep: int) -> torch.Tensor:
        """Make the cache hold ``sequence``; return the logits of its last ``keep`` positions ([keep, V])."""
        self.rewind(sequence)
        if len(self.fed) > len(sequence) - keep:  # the last ``keep`` tokens must go through this pass
            self.rewind(sequence[: len(sequence) - keep])
        new = sequence[len(self.fed):]
        ids = torch.tensor([new], device=self.streams.positions.device)
        logits = forward_streams_keep(self.model, self.streams, ids, keep)[0, :, : self.width]
        self.fed = list(sequence)
        return logits

    def rewind(self, sequence: list[int]) -> None:
        """Drop cached tokens after the longest common prefix of what was fed and ``sequence``."""
        common = 0
        for fed, wanted in zip(self.fed, sequence):
            if fed != wanted:
                break
            common += 1
        drop = len(self.fed) - common
        if drop:
            self.streams.cache.crop(-drop)
            self.streams.attention_mask = self.streams.attention_mask[:, :-drop]
            self.streams.positions = self.streams.positions - drop
            self.fed = self.fed[:common]


@dataclass
class _Stats:
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    draft_passes: int = 0


def _draft(drafter: _Side, sequence: list[int], gamma: int, sampler: TokenSampler,
           eos: frozenset[int], stats: _Stats) -> Generator[None, None, tuple[list[int], torch.Tensor | None]]:
    """Propose up to ``gamma`` tokens (stopping after an EOS); return them and the distributions they came from.

    Yields after each of the drafter's forward passes (the scheduler runs other requests in between).
    """
    drafts, dists = [], []
    for _ in range(gamma):
        q = torch.softmax(scaled_logits(drafter.forward(sequence + drafts, 1)[0], sampler.temperature, sampler.top_p),
                          dim=-1)
        stats.draft_passes += 1
        yield
        token = int(q.argmax()) if sampler.temperature == 0 else int(
            torch.multinomial(q.cpu(), 1, generator=sampler.generator))
        drafts.append(token)
        dists.append(q)
        if token in eos:
            break
    return drafts, torch.stack(dists) if dists else None


def speculate(ctx: DecodeContext, target: _Side, drafter: _Side, target_prompt: list[int], draft_prompt: list[int],
              gamma: int, eta: float, tail_rule: str = "paper") -> Generator[None, None, DecodeResult]:
    """The draft / verify loop: one target forward pass per round, both caches rewound to the accepted text.

    A generator that yields after every forward pass (drafter or target) and returns the result.
    """
    sampler, stats, generated, drafted_flags = ctx.sampler, _Stats(), [], []
    emitter = Emitter(ctx.engine.loaded.tokenizer, ctx.stop, ctx.on_token, ctx.started)
    while not emitter.done:
        g = min(gamma, ctx.stop.max_new_tokens - len(emitter.trace) - 1)
        drafts, dists = yield from _draft(drafter, draft_prompt + generated, g, sampler, ctx.stop.eos_token_ids,
                                          stats)
        logits = target.forward(target_prompt + generated + drafts, len(drafts) + 1)
        stats.target_passes += 1
        yield
        if dists is None:
            verdict_accepted, token = 0, sampler(logits[0])
        else:
            verdict = verify(logits, dists, drafts, eta=eta, temperature=sampler.temperature, top_p=sampler.top_p,
                             generator=sampler.generator, tail_rule=tail_rule)
            verdict_accepted, token = verdict.accepted, verdict.token
            stats.drafted += len(drafts)
            stats.accepted += verdict.accepted
        emitted = drafts[:verdict_accepted] + [token]
        log_p = torch.log_softmax(scaled_logits(logits[: len(emitted)], sampler.temperature), dim=-1)
        for i, t in enumerate(emitted):
            if not emitter.done:
                emitter.push(TraceStep(t, None, float(log_p[i, t])))
                generated.append(t)
                drafted_flags.append(i < verdict_accepted)
    result = emitter.result()
    result.extra.update(drafted_tokens=drafted_flags[: len(result.token_ids)], drafted=stats.drafted,
                        accepted=stats.accepted, target_passes=stats.target_passes,
                        draft_passes=stats.draft_passes,
                        acceptance_rate=stats.accepted / stats.drafted if stats.drafted else 0.0)
    return result


def _target_alone_rate(ctx: DecodeContext, prefix: CachedKV, long_kv: CachedKV, suffix: list[int],
                       max_new_tokens: int) -> float:
    """Tokens per second of the target alone, timed over the same window as RAPID's ``rapid_decode_s``.

    Both windows start from the cache of prefix + long context + all but the last suffix token.
    """
    loaded = ctx.engine.loaded
    streams = batch_streams(prefix, [long_kv])
    forward_streams(loaded.model, streams, torch.tensor([suffix[:-1]], device=loaded.device))
    start = time.perf_counter()
    first = forward_streams(loaded.model, streams, torch.tensor([suffix[-1:]], device=loaded.device))
    sampler = TokenSampler(ctx.sampler.temperature, ctx.sampler.top_p)
    stop = StopCriteria(frozenset(), max_new_tokens)  # same token count as RAPID, EOS or not
    result = decode_fused(loaded.model, loaded.tokenizer, streams, first, single_stream, sampler, stop)
    return len(result.token_ids) / (time.perf_counter() - start)


@register_mode("rapid")
def run_rapid(ctx: DecodeContext, *, gamma: int = 10, eta: float = 10.0, drafter: EngineParts | None = None,
              draft_context_tokens: int | None = None, chunk_tokens: int = 512, min_similarity: float = 0.3,
              ranking: str = "dense", draft_embedder: object = None, tail_rule: str = "paper",
              compare_target: bool = False) -> ExclusiveJob:
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
    compare_target: also decode with the target alone and report the measured speedup (adds that run's
    time to ``total_s``). temperature / top_p / seed are the engine's; temperature 0 is the greedy variant.
    Runs as an exclusive job (two caches rewound every round), one forward per scheduler step.
    """
    _check_options(gamma, eta, draft_context_tokens, chunk_tokens, min_similarity, ranking)
    check_tail_rule(tail_rule)
    draft_engine = check_drafter(ctx.engine, drafter)
    settings = dict(gamma=gamma, eta=eta, draft_context_tokens=draft_context_tokens, chunk_tokens=chunk_tokens,
                    min_similarity=min_similarity, ranking=ranking, draft_embedder=draft_embedder,
                    tail_rule=tail_rule, compare_target=compare_target)
    return ExclusiveJob([ctx], single_result(_rapid_steps(ctx, draft_engine, **settings)))


def _rapid_steps(ctx: DecodeContext, draft_engine: EngineParts, *, gamma: int, eta: float,
                 draft_context_tokens: int | None, chunk_tokens: int, min_similarity: float, ranking: str,
                 draft_embedder: object, tail_rule: str, compare_target: bool) -> Generator[None, None, DecodeResult]:
    engine, layout = ctx.engine, ctx.engine.layout
    context_ids = [layout.context_ids(d.text) for d in ctx.documents]
    long_ids = [t for ids in context_ids for t in ids]
    suffix = layout.suffix_ids(ctx.query)
    ctx.check_window(len(layout.prefix_ids) + len(long_ids) + len(suffix), "the long context (all documents)")
    ctx.check_streams(2, len(layout.prefix_ids) + len(long_ids) + len(suffix) + ctx.stop.max_new_tokens + gamma,
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
    target = _Side(engine.loaded.model, batch_streams(prefix, [long_kv]), width)
    drafter_side = _Side(draft_engine.loaded.model, batch_streams(draft_engine.store.prefix(layout), [None]), width)
    target.forward(suffix[:-1], 1)
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    yield
    decode_start = time.perf_counter()
    drafter_side.forward(short_ids + suffix[:-1], 1)
    ctx.timings["draft_prefill_s"] = time.perf_counter() - decode_start
    yield
    result = yield from speculate(ctx, target, drafter_side, suffix, short_ids + suffix, gamma, eta, tail_rule)
    rapid_s = time.perf_counter() - decode_start
    n = len(result.token_ids)
    ctx.timings.update(rapid_decode_s=rapid_s, rapid_tokens_per_s=n / rapid_s,
                       acceptance_rate=result.extra["acceptance_rate"], drafted=float(result.extra["drafted"]),
                       accepted=float(result.extra["accepted"]), target_passes=float(result.extra["target_passes"]),
                       tokens_per_target_pass=n / max(result.extra["target_passes"], 1))
    if compare_target and n:
        target_rate = _target_alone_rate(ctx, prefix, long_kv, suffix, n)
        ctx.timings.update(target_tokens_per_s=target_rate, speedup=(n / rapid_s) / target_rate)
    result.extra.update(ranking=used_ranking, draft_context_tokens=len(short_ids), long_context_tokens=len(long_ids),
                        draft_budget=(min_tokens, budget), tail_rule=tail_rule,
                        drafter=draft_engine.loaded.name,
                        chunks=[{"start": c.start, "document": c.document, "tokens": len(c.token_ids),
                                 "score": round(c.score, 6)} for c in kept])
    return result


def _check_options(gamma: int, eta: float, draft_context_tokens: int | None, chunk_tokens: int,
                   min_similarity: float, ranking: str) -> None:
    whole_number("gamma", gamma, minimum=1, hint=" (tokens drafted per round)")
    real_number("eta", eta, minimum=0.0, maximum=MAX_ETA, hint=" (0 = plain speculative decoding)")
    whole_number("chunk_tokens", chunk_tokens, minimum=1)
    if draft_context_tokens is not None:
        whole_number("draft_context_tokens", draft_context_tokens, minimum=1, hint=" (None: the paper's bounds)")
        if draft_context_tokens < chunk_tokens:
            raise InvalidOptionError(f"need chunk_tokens <= draft_context_tokens (None: the paper's bounds), got "
                                     f"chunk_tokens={chunk_tokens}, draft_context_tokens={draft_context_tokens}")
    real_number("min_similarity", min_similarity, minimum=-1.0, maximum=1.0,
                hint=" (a cosine similarity or normalised relevance)")
    choice("ranking", ranking, RANKINGS)
