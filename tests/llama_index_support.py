"""Shared pieces of the LlamaIndex tests: a few tiny nodes, real indexes over them, a model-free reranker.

Everything is a real llama-index-core class: ``TextNode``, ``VectorStoreIndex`` over the default
``SimpleVectorStore`` or a real on-disk ``ChromaVectorStore``, and a ``BaseNodePostprocessor`` subclass
that reranks by keyword overlap (a reranker needs no model to overwrite ``node.score``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ctx_integrations.llama_index import default_embedding

TEXTS = {
    "vault": "The secret code of the vault is 4721.",
    "paris": "Paris is the capital of France.",
    "fuji": "Mount Fuji is the highest mountain in Japan.",
}
QUESTION = "What is the secret code of the vault?"


def make_nodes(texts: dict[str, str] = TEXTS) -> list[TextNode]:
    return [TextNode(id_=node_id, text=text, metadata={"source": f"{node_id}.txt"}) for node_id, text in texts.items()]


def memory_index(nodes: list[TextNode] | None = None) -> VectorStoreIndex:
    """A ``VectorStoreIndex`` over the default in-memory store, embedded with the embedded MiniLM."""
    return VectorStoreIndex(nodes if nodes is not None else make_nodes(), embed_model=default_embedding())


def chroma_index(folder: Path, nodes: list[TextNode] | None = None, space: str | None = None,
                 name: str = "nodes") -> VectorStoreIndex:
    """A ``VectorStoreIndex`` over a real on-disk Chroma collection (no Chroma embedding function)."""
    import chromadb
    from llama_index.vector_stores.chroma import ChromaVectorStore

    client = chromadb.PersistentClient(path=str(folder))
    configuration = {"hnsw": {"space": space}} if space else None
    collection = client.get_or_create_collection(name, embedding_function=None, configuration=configuration)
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    return VectorStoreIndex(nodes if nodes is not None else make_nodes(), storage_context=storage,
                            embed_model=default_embedding())


class KeywordReranker(BaseNodePostprocessor):
    """Rerank like a cross-encoder would: overwrite ``node.score`` in place with a logit (a numpy scalar, as
    SentenceTransformerRerank does), here ``2 * (shared words) - 3``, and sort by it."""

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        words = set(query_bundle.query_str.lower().strip("?").split())
        for item in nodes:
            shared = len(words & set(item.node.get_content().lower().strip(".").split()))
            item.score = np.float32(2 * shared - 3)
        return sorted(nodes, key=lambda item: -item.score)


def keyword_logit(question: str, text: str) -> float:
    """What :class:`KeywordReranker` gives ``text`` (for expected values computed by hand)."""
    return float(2 * len(set(question.lower().strip("?").split()) & set(text.lower().strip(".").split())) - 3)
