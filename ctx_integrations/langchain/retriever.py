"""Retrievers that keep every score: the project's store as a LangChain retriever, and an adapter for any
LangChain vector store that can return relevance scores.

LangChain retrievers return bare documents and drop scores. Decoding uses the relevance r of each
document as a prior (``gamma * log r``), so both retrievers put r in ``metadata["score"]`` and every
raw and normalised part in ``metadata["scores"]``, and give each document an ``id`` for citations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore
from pydantic import ConfigDict, Field

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.langchain.convert import SCORE_KEY, SCORES_KEY, content_id, to_langchain_document
from ctx_integrations.retrieval.scores import UPPER, normalize_dense


def _check_k(k: int) -> int:
    if not isinstance(k, int) or k < 1:
        raise InvalidOptionError(f"k must be a positive integer, got {k!r}")
    return k


class ScoredRetriever(BaseRetriever):
    """The project's retriever (``ctx_integrations.retrieval``) as a LangChain ``BaseRetriever``.

    ``retriever`` is anything with ``retrieve(query, top_k, rerank_top_n=None) -> list[Document]``
    (the project's ``ScoredRetriever``); its fused r lands in ``metadata["score"]`` and its parts
    (dense, sparse, reranker, raw and normalised) in ``metadata["scores"]``. ``k`` can be overridden
    per call: ``retriever.invoke(question, k=2)``.
    """

    retriever: Any = Field(exclude=True)
    k: int = 4
    rerank_top_n: int | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def __init__(self, **data: Any):
        super().__init__(**data)
        self._check()

    def _check(self) -> None:
        if not callable(getattr(self.retriever, "retrieve", None)):
            raise InvalidOptionError("retriever must have retrieve(query, top_k, rerank_top_n=None), like "
                                     f"ctx_integrations.retrieval.ScoredRetriever; got {type(self.retriever).__name__}")
        _check_k(self.k)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[LCDocument]:
        found = self.retriever.retrieve(query, _check_k(k or self.k), rerank_top_n=self.rerank_top_n)
        return [to_langchain_document(doc) for doc in found]


def clip_relevance(relevance: float) -> float:
    """LangChain relevance scores are meant to lie in [0, 1] but some stores overshoot: clip to [0, 1 - eps]."""
    return min(max(float(relevance), 0.0), UPPER)


_DEFAULT_NORMALIZE = {"relevance": clip_relevance, "similarity": normalize_dense}


class VectorStoreScoredRetriever(BaseRetriever):
    """Any LangChain ``VectorStore`` that returns scores, as a retriever that keeps them.

    ``search="relevance"`` calls ``similarity_search_with_relevance_scores`` (scores the store maps into
    [0, 1]; clipped to [0, 1 - eps]); ``search="similarity"`` calls ``similarity_search_with_score`` for
    stores without a relevance function (e.g. ``InMemoryVectorStore``, whose score is a cosine in
    [-1, 1], normalised with ``normalize_dense`` as in the PCED paper). ``search="auto"`` (default) picks
    ``relevance`` when the store has a relevance function, ``similarity`` for ``InMemoryVectorStore``
    (whose score is known to be a cosine), and otherwise refuses at construction, naming the choice to
    make: guessing what an unknown store's raw score means would skew every prior silently.
    ``metadata["scores"]`` gets ``<search>`` (what the store returned) and ``<search>_norm`` (normalised),
    the project's naming; ``metadata["score"]`` is the normalised r. ``normalize`` replaces the default
    normalisation (e.g. for a store whose ``similarity_search_with_score`` returns a distance).
    """

    vectorstore: VectorStore = Field(exclude=True)
    k: int = 4
    search: Literal["auto", "relevance", "similarity"] = "auto"
    score_threshold: float | None = None
    normalize: Callable[[float], float] | None = Field(default=None, exclude=True)

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def __init__(self, **data: Any):
        super().__init__(**data)
        self._check()

    def _check(self) -> None:
        _check_k(self.k)
        if self.search == "auto":
            self.search = _auto_search(self.vectorstore, explicit_normalize=self.normalize is not None)
        if self.score_threshold is not None and self.search != "relevance":
            raise InvalidOptionError("score_threshold filters relevance scores: use it with search='relevance'")

    def _search_kwargs(self, k: int | None) -> dict[str, Any]:
        extra = {} if self.score_threshold is None else {"score_threshold": self.score_threshold}
        return {"k": _check_k(k or self.k), **extra}

    def _scored(self, pairs: list[tuple[LCDocument, float]]) -> list[LCDocument]:
        normalize = self.normalize or _DEFAULT_NORMALIZE[self.search]
        out = []
        for document, raw in pairs:
            r = normalize(raw)
            scores = {**(document.metadata.get(SCORES_KEY) or {}), self.search: float(raw), f"{self.search}_norm": r}
            out.append(LCDocument(page_content=document.page_content, metadata={**document.metadata, SCORE_KEY: r,
                                                                                 SCORES_KEY: scores},
                                  id=document.id or content_id(document.page_content)))
        return out

    def _unsupported(self) -> InvalidOptionError:
        return InvalidOptionError(f"{type(self.vectorstore).__name__} has no relevance-score function: build the "
                                  "retriever with search='similarity' (and a normalize= that fits its score)")

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[LCDocument]:
        if self.search == "similarity":
            return self._scored(self.vectorstore.similarity_search_with_score(query, k=_check_k(k or self.k)))
        try:
            return self._scored(self.vectorstore.similarity_search_with_relevance_scores(query,
                                                                                          **self._search_kwargs(k)))
        except NotImplementedError as error:
            raise self._unsupported() from error

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None) -> list[LCDocument]:
        if self.search == "similarity":
            pairs = await self.vectorstore.asimilarity_search_with_score(query, k=_check_k(k or self.k))
            return self._scored(pairs)
        try:
            pairs = await self.vectorstore.asimilarity_search_with_relevance_scores(query, **self._search_kwargs(k))
        except NotImplementedError as error:
            raise self._unsupported() from error
        return self._scored(pairs)


def _auto_search(store: VectorStore, *, explicit_normalize: bool) -> Literal["relevance", "similarity"]:
    """``relevance`` when the store maps its scores into [0, 1]; ``similarity`` where the raw score is known."""
    try:
        store._select_relevance_score_fn()  # the hook LangChain's relevance search calls; no public accessor
    except NotImplementedError:
        pass
    else:
        return "relevance"
    if isinstance(store, InMemoryVectorStore) or explicit_normalize:
        return "similarity"  # InMemoryVectorStore: a cosine in [-1, 1]; else the caller's normalize says what it is
    raise InvalidOptionError(f"{type(store).__name__} has no relevance-score function and its raw score is unknown "
                             "here: pass search='similarity' with a normalize= that maps its score into [0, 1]")
