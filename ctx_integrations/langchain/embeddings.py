"""The project's embedder (embedded all-MiniLM-L6-v2 by default) as LangChain ``Embeddings``.

Lets a LangChain vector store share the very model the project's own store uses, with no second
loader and no download.
"""

from __future__ import annotations

from typing import Any

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field

from ctx_integrations.retrieval.embedders import default_embedder


class EmbedderEmbeddings(BaseModel, Embeddings):
    """Wrap a ``ctx_integrations.retrieval.embedders.Embedder`` (``None``: the shared embedded MiniLM)."""

    embedder: Any = Field(default=None, exclude=True)

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def _resolved(self) -> Any:
        return default_embedder() if self.embedder is None else self.embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._resolved().embed_documents(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self._resolved().embed_query(text).tolist()
