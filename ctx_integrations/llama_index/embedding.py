"""The project's embedder (embedded all-MiniLM-L6-v2 by default) as a LlamaIndex ``BaseEmbedding``.

An index built with it retrieves offline, with no hub access, and shares the very model the project's
own store and the LangChain adapter use. Vectors are unit-length, so a store's cosine (or Chroma's
distance) can be turned into the relevance prior exactly (see ``scores``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from ctx_integrations.retrieval.embedders import Embedder, default_embedder


class EmbedderEmbedding(BaseEmbedding):
    """Wrap a ``ctx_integrations.retrieval.embedders.Embedder`` (``embedder=None``: the shared embedded MiniLM).

    The async methods run the encoder on a worker thread, so ``aquery`` / ``aretrieve`` do not block
    the event loop while a query is embedded.
    """

    embedder: Any = Field(default=None, exclude=True, description="the project's Embedder; None: embedded MiniLM")
    _resolved: Embedder | None = PrivateAttr(default=None)

    def __init__(self, embedder: Embedder | None = None, **data: Any):
        resolved = default_embedder() if embedder is None else embedder
        data.setdefault("model_name", resolved.name)
        super().__init__(embedder=embedder, **data)
        self._resolved = resolved

    @classmethod
    def class_name(cls) -> str:
        return "EmbedderEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._resolved.embed_query(query).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._resolved.embed_documents([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._resolved.embed_documents(list(texts)).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return await asyncio.to_thread(self._get_text_embedding, text)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)


def default_embedding(**options: Any) -> EmbedderEmbedding:
    """The embedded all-MiniLM-L6-v2 as a LlamaIndex embedding, e.g. ``Settings.embed_model = default_embedding()``.

    ``options`` go to ``BaseEmbedding`` (e.g. ``embed_batch_size``).
    """
    return EmbedderEmbedding(**options)
