"""Score normalisation and fusion (PCED paper, appendix B; docs/methods.md#scores).

Every retrieval signal is mapped into r in [0, 1 - eps] so it can enter decoding as gamma * log r:
dense / ColBERT cosine affinely, unbounded lexical scores through arctan, reranker logits through
a sigmoid; retrieval and reranker scores are fused by their harmonic mean.

A NaN score is refused here, where it appears, rather than silently becoming a prior of NaN.
"""

from __future__ import annotations

import math

from ctx_integrations.errors import InvalidOptionError, InvalidScoresError

EPS = 1e-8
UPPER = 1.0 - EPS


def _number(value: float, what: str) -> float:
    value = float(value)
    if math.isnan(value):
        raise InvalidScoresError(f"{what} score is NaN: check the embedder / reranker output")
    return value


def _clip(value: float) -> float:
    return min(max(value, 0.0), UPPER)


def normalize_dense(similarity: float) -> float:
    """Cosine-like similarity s in [-1, 1] -> clip((s + 1) / 2, 0, 1 - eps). Also for ColBERT scores."""
    return _clip((_number(similarity, "dense") + 1.0) / 2.0)


normalize_colbert = normalize_dense


def normalize_sparse(score: float) -> float:
    """Lexical score s >= 0 (BM25, BGE-M3 sparse) -> clip((2 / pi) * arctan(max(s, 0)), 0, 1 - eps)."""
    return _clip(2.0 / math.pi * math.atan(max(_number(score, "sparse"), 0.0)))


def normalize_reranker(logit: float) -> float:
    """Reranker logit z -> sigmoid(z), clipped to [0, 1 - eps] (FlagReranker's normalize=True)."""
    z = _number(logit, "reranker")
    value = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return _clip(value)


def fuse_scores(retrieval: float, reranker: float | None = None) -> float:
    """r = 2 r_ret r_rer / (r_ret + r_rer + eps); with no reranker r = r_ret."""
    retrieval = _number(retrieval, "retrieval")
    if reranker is None:
        return _clip(retrieval)
    reranker = _number(reranker, "reranker")
    return _clip(2.0 * retrieval * reranker / (retrieval + reranker + EPS))


NORMALIZERS = {"dense": normalize_dense, "colbert": normalize_colbert, "sparse": normalize_sparse,
               "reranker": normalize_reranker}


def normalize(kind: str, raw: float) -> float:
    """Normalise a raw score of ``kind`` (dense, colbert, sparse, reranker) into [0, 1 - eps]."""
    try:
        rule = NORMALIZERS[kind]
    except KeyError:
        raise InvalidOptionError(f"unknown score kind {kind!r}: use one of {', '.join(NORMALIZERS)}") from None
    return rule(raw)
