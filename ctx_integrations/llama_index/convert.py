"""Translate between LlamaIndex nodes and the engine's Document / Answer, keeping every score.

A node reaches the decoder as the text a stock LlamaIndex synthesizer would show the LLM
(``get_content(MetadataMode.LLM)``: the node text plus its LLM-visible metadata). The ingestion hook
uses the same function, so the KV cache computed at ingestion is the one a query looks up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.llama_index.score_keeping import HIDDEN_KEYS, node_scores


def node_text(node: BaseNode) -> str:
    """The text the decoder reads for ``node`` (and whose tokens key its KV cache)."""
    return node.get_content(metadata_mode=MetadataMode.LLM)


def to_document(item: NodeWithScore) -> Document:
    """A scored node -> the engine's Document (r from ``metadata["score"]``, parts from ``metadata["scores"]``)."""
    r, parts = node_scores(item)
    metadata = {k: v for k, v in item.node.metadata.items() if k not in HIDDEN_KEYS}
    return Document(node_text(item.node), item.node.node_id, r, parts, metadata)


def cited_node_ids(answer: Answer, nodes: Sequence[NodeWithScore]) -> list[str]:
    """Ids of the nodes that won tokens of ``answer``, most tokens first."""
    return [nodes[i].node.node_id for i, _ in answer.citation_counts().most_common()]


def response_metadata(answer: Answer, nodes: Sequence[NodeWithScore], model_name: str) -> dict[str, Any]:
    """Everything needed to cite and time an answer, as ``Response.metadata``.

    ``trace`` has one entry per generated token (``node_id`` of the node that won it, or ``None`` for
    modes without per-token attribution); ``cited_nodes`` lists the ids of nodes that won tokens, most
    first, and ``tokens_won`` how many each won.
    """
    ids = [item.node.node_id for item in nodes]
    counts = answer.citation_counts()
    return {
        "mode": answer.mode, "model_name": model_name,
        "trace": [{"token_id": step.token_id, "node_id": None if step.document is None else ids[step.document],
                   "score": step.score} for step in answer.trace],
        "cited_nodes": cited_node_ids(answer, nodes),
        "tokens_won": {ids[i]: n for i, n in counts.most_common()},
        "timings": dict(answer.timings),
        "cache": {"hits": answer.cache_hits, "misses": answer.cache_misses},
        "finish_reason": answer.finish_reason, "options": dict(answer.options), "extra": dict(answer.extra),
    }
