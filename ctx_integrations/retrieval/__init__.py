"""Retrieval that keeps every score: embedders, rerankers, normalisation and the document store.

Names are imported lazily so that ``retrieval.scores`` stays cheap (no chromadb, no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DocumentStore": "store", "StoreMismatchError": "store", "AddReport": "store",
    "ScoredRetriever": "retriever", "Scorer": "retriever", "Reranker": "retriever",
    "Embedder": "embedders", "TransformerEmbedder": "embedders", "default_embedder": "embedders",
    "BGEM3Embedder": "flag", "FlagRerankerModel": "flag",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
