"""Retrieval that keeps every score and hands the decoder a fused relevance r per document.

Pipeline (docs/methods.md#scores): a candidate pool from the dense index (plus the BM25 top hits when
ranking by the lexical score), every available raw score for each candidate (dense cosine, sparse,
ColBERT), each normalised into [0, 1 - eps]; the score chosen with ``score=`` is r_ret. With a
reranker, the best ``rerank_top_n`` candidates are reranked and r = harmonic mean(r_ret, r_rer);
otherwise r = r_ret. Documents come back ordered by r, with ``score = r`` and ``scores`` holding
every raw part (``dense``, ``sparse``, ``colbert``, ``reranker``), its normalised value (``*_norm``),
``retrieval`` (r_ret) and ``fused`` (r), so they can go straight into ``engine.generate``.

Sparse and ColBERT scores of BGE-M3 rescore the dense candidate pool (``candidates`` documents), as
BGE-M3's authors recommend for hybrid use; the embedded default's sparse signal is BM25 over the
whole store, so ranking by it also pulls in BM25's own top hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ctx_integrations.documents import Document, user_text
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError
from ctx_integrations.retrieval.scores import fuse_scores, normalize
from ctx_integrations.retrieval.store import DocumentStore

SCORE_KINDS = ("dense", "sparse", "colbert")


@runtime_checkable
class Scorer(Protocol):
    """Extra retrieval signals for candidate texts, computed at query time (e.g. BGE-M3 sparse / ColBERT)."""

    kinds: tuple[str, ...]

    def score(self, query: str, texts: Sequence[str]) -> dict[str, list[float]]: ...


@runtime_checkable
class Reranker(Protocol):
    """A cross-encoder: raw relevance logits of (query, text) pairs; we normalise them with a sigmoid."""

    name: str

    def rerank(self, query: str, texts: Sequence[str]) -> list[float]: ...


class ScoredRetriever:
    """Top-k retrieval from a :class:`DocumentStore` that keeps every raw and normalised score.

    ``score``: which retrieval score is r_ret (``dense``, ``sparse`` or ``colbert``: the paper's
    three PCED variants). ``scorer``: where sparse / ColBERT scores come from; by default the store's
    embedder if it is a :class:`Scorer` (BGE-M3), else BM25 over the store. ``reranker``: optional
    second stage. ``candidates``: size of the pool that is scored (default ``max(20, 4 * top_k)``).
    """

    def __init__(self, store: DocumentStore, *, score: str = "dense", scorer: Scorer | None = None,
                 reranker: Reranker | None = None, candidates: int | None = None):
        self.store = store
        self.scorer = scorer if scorer is not None else (
            store.embedder if isinstance(store.embedder, Scorer) else None)
        available = self.available_scores()
        if score not in SCORE_KINDS:
            raise InvalidOptionError(f"unknown score {score!r}: use one of {', '.join(SCORE_KINDS)}")
        if score not in available:
            raise InvalidOptionError(f"score {score!r} is not available with embedder {store.embedder.name!r} "
                                     f"(it gives {', '.join(available)}); ColBERT scores need a BGE-M3 "
                                     "store (--retriever bge-m3 / BGEM3Embedder)")
        if candidates is not None and candidates < 1:
            raise InvalidOptionError("candidates must be >= 1")
        self.score = score
        self.reranker = reranker
        self.candidates = candidates

    def available_scores(self) -> list[str]:
        kinds = {"dense"} | set(self.scorer.kinds if self.scorer is not None else ("sparse",))
        return [k for k in SCORE_KINDS if k in kinds]

    def retrieve(self, query: str, top_k: int = 4, rerank_top_n: int | None = None) -> list[Document]:
        """The ``top_k`` best documents by fused score r, each with ``score`` = r and every part in ``scores``.

        ``rerank_top_n``: how many of the best candidates by r_ret the reranker sees (default
        ``max(2 * top_k, 10)``); it needs a reranker and must be >= ``top_k``.
        """
        if not isinstance(query, str) or not query.strip():
            raise InvalidOptionError("query must be a non-empty string")
        user_text(query, "the query")  # e.g. a lone surrogate, which the embedder's tokenizer cannot encode
        if top_k < 1:
            raise InvalidOptionError("top_k must be >= 1")
        if rerank_top_n is not None and (self.reranker is None or rerank_top_n < top_k):
            raise InvalidOptionError("rerank_top_n needs a reranker and must be >= top_k")
        if self.store.count() == 0:
            raise EmptyDocumentsError(f"store {self.store.location} is empty: ingest documents first "
                                      "(ctx-experts ingest PATH --store DIR, or DocumentStore.add)")
        pool = max(self.candidates or 0, 20, 4 * top_k, rerank_top_n or 0)
        docs = self._score_pool(query, pool)
        docs.sort(key=lambda d: (-d.scores["retrieval"], d.id))
        if self.reranker is not None:
            docs = self._rerank(query, docs[: rerank_top_n or max(2 * top_k, 10)])
        for doc in docs:
            doc.scores.setdefault("fused", fuse_scores(doc.scores["retrieval"]))
            doc.score = doc.scores["fused"]
        docs.sort(key=lambda d: (-d.score, d.id))
        return docs[:top_k]

    def _score_pool(self, query: str, pool: int) -> list[Document]:
        query_vector = np.asarray(self.store.embedder.embed_query(query), np.float32)
        ids = [i for i, _ in self.store.query(query_vector, pool)]
        lexical = self.store.lexical_scores(query) if self.scorer is None else None
        if lexical is not None and self.score == "sparse":
            best = sorted((i for i, s in lexical.items() if s > 0), key=lambda i: -lexical[i])[:pool]
            ids += [i for i in best if i not in set(ids)]
        docs = self.store.get(ids)
        dense = self.store.embeddings([d.id for d in docs]) @ query_vector  # type: ignore[misc]
        parts: dict[str, list[float]] = {"dense": [float(s) for s in dense]}
        if lexical is not None:
            parts["sparse"] = [lexical.get(d.id, 0.0) for d in docs]  # type: ignore[arg-type]
        else:
            parts.update(self.scorer.score(query, [d.text for d in docs]))  # type: ignore[union-attr]
        for k, doc in enumerate(docs):
            for kind, values in parts.items():
                doc.scores[kind] = float(values[k])
                doc.scores[f"{kind}_norm"] = normalize(kind, values[k])
            doc.scores["retrieval"] = doc.scores[f"{self.score}_norm"]
        return docs

    def _rerank(self, query: str, docs: list[Document]) -> list[Document]:
        logits = self.reranker.rerank(query, [d.text for d in docs])  # type: ignore[union-attr]
        if len(logits) != len(docs):
            raise InvalidOptionError(f"reranker returned {len(logits)} scores for {len(docs)} documents")
        for doc, logit in zip(docs, logits):
            doc.scores["reranker"] = float(logit)
            doc.scores["reranker_norm"] = normalize("reranker", logit)
            doc.scores["fused"] = fuse_scores(doc.scores["retrieval"], doc.scores["reranker_norm"])
        return docs
