"""What ``node.score`` means for each LlamaIndex retriever / vector store, and how it becomes r in [0, 1].

LlamaIndex puts whatever the vector store returns into ``NodeWithScore.score``, and the stores do not
agree (checked in llama-index-core 0.14 and llama-index-vector-stores-chroma 0.6 source):

- ``SimpleVectorStore`` (the default in-memory store), default query mode: the cosine similarity in
  [-1, 1] -> kind ``dense``, r = (s + 1) / 2.
- ``ChromaVectorStore`` (default and MMR modes): ``exp(-distance)`` in the collection's space -> kind
  ``chroma_l2`` / ``chroma_cosine`` / ``chroma_ip``, turned back into the cosine, then r = (cos + 1) / 2.
- a reranker that writes a cross-encoder logit (e.g. FlagEmbeddingReranker) -> kind ``reranker``,
  r = sigmoid(z); one that writes a probability or relevance in [0, 1] (SentenceTransformerRerank,
  whose CrossEncoder applies a sigmoid; Cohere) -> kind ``relevance``, r = clip(s).
- a lexical retriever (BM25) -> kind ``sparse``, r = (2 / pi) * arctan(s).

Chroma's space decides the distance: ``l2`` (its default) is the *squared* Euclidean distance, which for
unit-length embeddings is ``2 - 2 cos``; ``cosine`` is ``1 - cos``; ``ip`` is ``1 - dot`` (``= 1 - cos``
for unit vectors). So ``exp(-d)`` is not a cosine: we undo it (``d = -ln(score)``), recover the cosine
and normalise it like any dense score (docs/methods.md#scores: ``r = (cos + 1) / 2``). This assumes
unit-length embeddings (MiniLM, BGE and OpenAI embeddings all are).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ctx_integrations.errors import InvalidOptionError, InvalidScoresError
from ctx_integrations.retrieval.scores import NORMALIZERS, UPPER, normalize_dense

# Chroma distance d (recovered from exp(-d)) -> cosine similarity, per collection space.
_CHROMA_COSINE: dict[str, Callable[[float], float]] = {
    "l2": lambda d: 1.0 - d / 2.0,
    "cosine": lambda d: 1.0 - d,
    "ip": lambda d: 1.0 - d,
}

SCORE_KINDS: dict[str, str] = {
    "dense": "cosine similarity in [-1, 1] (SimpleVectorStore): r = (s + 1) / 2",
    "colbert": "ColBERT late-interaction similarity in [-1, 1]: r = (s + 1) / 2",
    "sparse": "lexical score >= 0 (BM25): r = (2 / pi) * arctan(s)",
    "reranker": "cross-encoder logit: r = sigmoid(z)",
    "relevance": "a score already in [0, 1] (probability, relevance): r = clip(s)",
    **{f"chroma_{space}": f"ChromaVectorStore over a '{space}' collection: exp(-distance) -> cosine -> (cos + 1) / 2"
       for space in _CHROMA_COSINE},
}


def check_score_kind(kind: str, *, allow_auto: bool = False) -> str:
    """Refuse an unknown score kind with the list of known ones (at construction, not at the first query)."""
    if (allow_auto and kind == "auto") or kind in SCORE_KINDS:
        return kind
    known = (["auto"] if allow_auto else []) + list(SCORE_KINDS)
    raise InvalidOptionError(f"unknown score kind {kind!r}: use one of {', '.join(known)} "
                             "(see ctx_integrations.llama_index.scores for which store gives which)")


def as_float(score: Any, what: str = "node") -> float:
    """A plain float from a node score (stores hand back numpy scalars); NaN is refused where it appears."""
    try:
        value = float(score)
    except (TypeError, ValueError):
        raise InvalidScoresError(f"{what} score {score!r} is not a number") from None
    if math.isnan(value):
        raise InvalidScoresError(f"{what} score is NaN: check the embedder / reranker output")
    return value


def chroma_cosine(kind: str, score: float) -> float:
    """The cosine similarity behind a Chroma ``exp(-distance)`` score (unit-length embeddings)."""
    if score <= 0.0:
        raise InvalidScoresError(f"a Chroma score must be exp(-distance) > 0, got {score}: is this store's score "
                                 "really Chroma's? Pass the right retrieval_score_kind")
    return _CHROMA_COSINE[kind.removeprefix("chroma_")](-math.log(score))


def score_parts(kind: str, raw: Any) -> tuple[dict[str, float], float]:
    """Every raw and normalised part of one score of ``kind``, and its r in [0, 1 - eps].

    Parts use the project's naming: ``<kind>`` (raw) and ``<kind>_norm``; a Chroma score also keeps
    the cosine it stands for as ``dense`` / ``dense_norm``.
    """
    check_score_kind(kind)
    value = as_float(raw, kind)
    if kind.startswith("chroma_"):
        cosine = chroma_cosine(kind, value)
        r = normalize_dense(cosine)
        return {kind: value, "dense": cosine, "dense_norm": r}, r
    r = min(max(value, 0.0), UPPER) if kind == "relevance" else NORMALIZERS[kind](value)
    return {kind: value, f"{kind}_norm": r}, r


def infer_score_kind(source: Any) -> str:
    """The kind of ``node.score`` that ``source`` gives, for the stores whose score we know (see module doc).

    ``source``: a ``VectorStoreIndex`` retriever (its store and query mode), a ``VectorStoreIndex`` (its store,
    as ``index.as_retriever()`` queries it) or a vector store itself. For Chroma the kind follows the
    collection's distance space, read from the collection (``chroma_l2``, ``chroma_cosine``, ``chroma_ip``), so
    a stock engine's synthesizer gets it with ``ContextOfExpertsSynthesizer(retrieval_score_kind=
    infer_score_kind(index))``. Raises :class:`InvalidOptionError` for anything else: a wrong guess would
    silently skew every prior.
    """
    from llama_index.core.indices.vector_store.base import VectorStoreIndex
    from llama_index.core.indices.vector_store.retrievers import VectorIndexRetriever
    from llama_index.core.vector_stores.types import BasePydanticVectorStore, VectorStoreQueryMode

    name = type(source).__name__
    if isinstance(source, VectorIndexRetriever):
        store = source._vector_store  # no public accessor in llama-index-core 0.14
        mode = source._vector_store_query_mode
    elif isinstance(source, VectorStoreIndex):
        store, mode = source.vector_store, VectorStoreQueryMode.DEFAULT
    elif isinstance(source, BasePydanticVectorStore):
        store, mode = source, VectorStoreQueryMode.DEFAULT
    else:
        raise _unknown(name)
    kind = _store_kind(store, mode)
    if kind is None:
        raise _unknown(name if store is source else f"{name} over {type(store).__name__}")
    return kind


def _unknown(name: str) -> InvalidOptionError:
    return InvalidOptionError(
        f"cannot tell what node.score {name} returns: pass retrieval_score_kind= one of {', '.join(SCORE_KINDS)} "
        "(a cosine similarity is 'dense', a score already in [0, 1] is 'relevance')")


def _store_kind(store: Any, mode: Any) -> str | None:
    """The score kind of a vector store queried in ``mode``, or ``None`` for a store we do not know."""
    from llama_index.core.vector_stores.simple import SimpleVectorStore
    from llama_index.core.vector_stores.types import VectorStoreQueryMode

    if isinstance(store, SimpleVectorStore):
        if mode != VectorStoreQueryMode.DEFAULT:
            raise InvalidOptionError(
                f"SimpleVectorStore in query mode {mode.value!r} returns scores that are not cosine similarities "
                "(MMR mixes in redundancy): pass retrieval_score_kind= explicitly, e.g. 'dense' to treat them "
                "as similarities anyway")
        return "dense"
    space = _chroma_space(store)
    return None if space is None else f"chroma_{space}"


def _chroma_space(store: Any) -> str | None:
    """The distance space of a ``ChromaVectorStore``'s collection, or ``None`` for another store."""
    try:
        from llama_index.vector_stores.chroma import ChromaVectorStore
    except ImportError:  # the Chroma integration is not installed, so this cannot be a Chroma store
        return None
    if not isinstance(store, ChromaVectorStore):
        return None
    configuration = store.client.configuration or {}
    for index in ("hnsw", "spann"):
        space = (configuration.get(index) or {}).get("space")
        if space is not None:
            space = getattr(space, "value", space)
            if space not in _CHROMA_COSINE:
                raise InvalidOptionError(f"Chroma collection space {space!r} is not one of "
                                         f"{', '.join(_CHROMA_COSINE)}: pass retrieval_score_kind= explicitly")
            return str(space)
    raise InvalidOptionError("cannot read the Chroma collection's distance space: pass retrieval_score_kind= "
                             f"one of {', '.join('chroma_' + s for s in _CHROMA_COSINE)}")
