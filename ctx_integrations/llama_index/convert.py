"""Translate between LlamaIndex nodes and the engine's Document / Answer, keeping every score.

A node reaches the decoder as the text a stock LlamaIndex synthesizer would show the LLM
(``get_content(MetadataMode.LLM)``: the node text plus its LLM-visible metadata), except that metadata which
is not content (:data:`NON_CONTENT_METADATA_KEYS`: file paths, names, sizes, dates, ids) is hidden as if it
were in the node's ``excluded_llm_metadata_keys``, LlamaIndex's own switch, which is respected as well.
Such values would be shown to the model (and quoted back in answers) and would make the tokens, hence the
KV cache key, depend on where a file lies: the same text in another folder would be computed again. Name
keys in ``show_metadata`` to show them anyway. The ingestion hook uses the same function, so the KV cache
computed at ingestion is the one a query looks up.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from ctx_integrations import Answer
from ctx_integrations.documents import Document
from ctx_integrations.llama_index.score_keeping import HIDDEN_KEYS, node_scores

# Metadata about a file or a record, not its content: SimpleDirectoryReader's file_* and dates (it already
# excludes all but file_path from the LLM), ids, and the source path / chunk index `ctx-experts ingest` records.
NON_CONTENT_METADATA_KEYS = frozenset({
    "file_path", "file_name", "file_type", "file_size", "creation_date", "last_modified_date", "last_accessed_date",
    "doc_id", "document_id", "ref_doc_id", "node_id", "id", "source", "chunk", "content_hash"})


def node_text(node: BaseNode, show_metadata: Collection[str] = ()) -> str:
    """The text the decoder reads for ``node`` (and whose tokens key its KV cache).

    LLM-visible metadata is shown as LlamaIndex shows it, minus :data:`NON_CONTENT_METADATA_KEYS` not named in
    ``show_metadata``. The node is not changed (a shallow copy carries the wider exclusion list).
    """
    hidden = [key for key in node.metadata if key in NON_CONTENT_METADATA_KEYS and key not in show_metadata
              and key not in node.excluded_llm_metadata_keys]
    if hidden:
        node = node.model_copy(update={"excluded_llm_metadata_keys": [*node.excluded_llm_metadata_keys, *hidden]})
    return node.get_content(metadata_mode=MetadataMode.LLM)


def to_document(item: NodeWithScore, show_metadata: Collection[str] = ()) -> Document:
    """A scored node -> the engine's Document (r from ``metadata["score"]``, parts from ``metadata["scores"]``).

    The document's text is :func:`node_text`; its ``metadata`` keeps every key (for citations, never shown
    to the model).
    """
    r, parts = node_scores(item)
    metadata = {k: v for k, v in item.node.metadata.items() if k not in HIDDEN_KEYS}
    return Document(node_text(item.node, show_metadata), item.node.node_id, r, parts, metadata)


def cited_node_ids(answer: Answer, nodes: Sequence[NodeWithScore]) -> list[str]:
    """Ids of the nodes that won tokens of ``answer``, most tokens first."""
    return [nodes[i].node.node_id for i, _ in answer.citation_counts().most_common()]


# where LlamaIndex's readers put a node's file (ctx-experts ingest: "source"; SimpleDirectoryReader: "file_path")
_SOURCE_KEYS = ("source", "file_path", "file_name", "url")


def node_source(node: Any) -> str | None:
    """The file or address a node came from, as its reader recorded it, or ``None``."""
    return next((str(node.metadata[key]) for key in _SOURCE_KEYS if node.metadata.get(key)), None)


def response_metadata(answer: Answer, nodes: Sequence[NodeWithScore], model_name: str) -> dict[str, Any]:
    """Everything needed to cite and time an answer, as ``Response.metadata``.

    ``trace`` has one entry per generated token (``node_id`` of the node that won it, or ``None`` for
    modes without per-token attribution); ``cited_nodes`` lists the ids of nodes that won tokens, most
    first, and ``tokens_won`` how many each won; ``citations`` the same nodes as LangChain's chain cites its
    documents: ``{"id", "index", "tokens_won", "score", "source"}`` (``source``: :func:`node_source`).
    """
    ids = [item.node.node_id for item in nodes]
    counts = answer.citation_counts()
    citations = [{"id": ids[i], "index": i, "tokens_won": n, "score": nodes[i].score,
                  "source": node_source(nodes[i].node)} for i, n in counts.most_common()]
    return {
        "mode": answer.mode, "model_name": model_name,
        "trace": [{"token_id": step.token_id, "node_id": None if step.document is None else ids[step.document],
                   "score": step.score} for step in answer.trace],
        "cited_nodes": cited_node_ids(answer, nodes),
        "tokens_won": {ids[i]: n for i, n in counts.most_common()}, "citations": citations,
        "timings": dict(answer.timings),
        "cache": {"hits": answer.cache_hits, "misses": answer.cache_misses},
        "finish_reason": answer.finish_reason, "options": dict(answer.options), "extra": dict(answer.extra),
    }
