"""Score keeping for LlamaIndex: which node.score each store gives, how it becomes r, and that it survives.

Normalisation is checked against values computed by hand and, for the real stores (the default
in-memory store and an on-disk Chroma collection in each distance space), against the cosine computed
here from the embedded MiniLM's own vectors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import VectorStoreQueryMode

from ctx_integrations.errors import InvalidOptionError, InvalidScoresError
from ctx_integrations.llama_index import (
    RerankerScoreFusion,
    ScoreKeepingRetriever,
    default_embedding,
    infer_score_kind,
)
from ctx_integrations.llama_index.score_keeping import keep_retrieval_score
from ctx_integrations.llama_index.scores import score_parts
from ctx_integrations.retrieval.scores import UPPER
from tests.llama_index_support import (
    QUESTION,
    TEXTS,
    KeywordReranker,
    chroma_index,
    keyword_logit,
    make_nodes,
    memory_index,
)


def cosines(question: str) -> dict[str, float]:
    """The cosine of the question with every node (as the index embeds it), from the embedded MiniLM's vectors."""
    embedding = default_embedding()
    query = np.asarray(embedding.get_query_embedding(question))
    return {node.node_id: float(np.dot(query, embedding.get_text_embedding(node.get_content(MetadataMode.EMBED))))
            for node in make_nodes()}


@pytest.mark.parametrize(("kind", "raw", "parts", "r"), [
    ("dense", 0.6, {"dense": 0.6, "dense_norm": 0.8}, 0.8),
    ("dense", -1.5, {"dense": -1.5, "dense_norm": 0.0}, 0.0),
    ("sparse", 1.0, {"sparse": 1.0, "sparse_norm": 0.5}, 0.5),
    ("reranker", 0.0, {"reranker": 0.0, "reranker_norm": 0.5}, 0.5),
    ("relevance", 0.3, {"relevance": 0.3, "relevance_norm": 0.3}, 0.3),
    ("relevance", 1.2, {"relevance": 1.2, "relevance_norm": UPPER}, UPPER),
    ("chroma_l2", math.exp(-0.5), {"chroma_l2": math.exp(-0.5), "dense": 0.75, "dense_norm": 0.875}, 0.875),
    ("chroma_cosine", math.exp(-0.25), {"chroma_cosine": math.exp(-0.25), "dense": 0.75, "dense_norm": 0.875}, 0.875),
    ("chroma_ip", math.exp(-1.5), {"chroma_ip": math.exp(-1.5), "dense": -0.5, "dense_norm": 0.25}, 0.25),
])
def test_score_parts_by_hand(kind, raw, parts, r):
    got_parts, got_r = score_parts(kind, raw)
    assert got_parts == pytest.approx(parts) and got_r == pytest.approx(r)


def test_bad_scores_and_kinds_are_refused():
    with pytest.raises(InvalidScoresError, match="NaN"):
        score_parts("dense", float("nan"))
    with pytest.raises(InvalidScoresError, match="not a number"):
        score_parts("dense", "high")
    with pytest.raises(InvalidScoresError, match="exp\\(-distance\\) > 0"):
        score_parts("chroma_l2", 0.0)
    with pytest.raises(InvalidOptionError, match="unknown score kind 'cosine'"):
        score_parts("cosine", 0.5)
    with pytest.raises(InvalidOptionError, match="unknown score kind"):
        RerankerScoreFusion(score_kind="logits")


def test_numpy_scores_become_floats_and_nodes_are_copied():
    node = TextNode(id_="a", text="alpha", metadata={"source": "a.txt"}, excluded_llm_metadata_keys=["source"])
    kept = keep_retrieval_score(NodeWithScore(node=node, score=np.float32(0.5)), "dense")
    assert type(kept.score) is float and kept.score == 0.5  # node.score stays the raw value, as a float
    assert all(type(v) is float for v in kept.node.metadata["scores"].values())
    assert kept.node.metadata["score"] == pytest.approx(0.75)
    assert node.metadata == {"source": "a.txt"} and node.excluded_llm_metadata_keys == ["source"]  # untouched
    assert kept.node is not node and kept.node.node_id == "a"
    assert set(kept.node.excluded_llm_metadata_keys) == {"source", "score", "scores"}
    assert {"score", "scores"} <= set(kept.node.excluded_embed_metadata_keys)
    # the scores never reach the LLM text (which keys the KV cache) nor the embedding / reranker text
    assert kept.node.get_content(MetadataMode.LLM) == node.get_content(MetadataMode.LLM)
    assert kept.node.get_content(MetadataMode.EMBED) == node.get_content(MetadataMode.EMBED)


def test_default_in_memory_store_gives_cosines():
    index = memory_index()
    retriever = ScoreKeepingRetriever(index.as_retriever(similarity_top_k=3))
    assert retriever.score_kind == "dense"
    expected = cosines(QUESTION)
    found = retriever.retrieve(QUESTION)
    assert [item.node.node_id for item in found][0] == "vault"
    for item in found:
        scores = item.node.metadata["scores"]
        assert item.score == pytest.approx(expected[item.node.node_id], abs=1e-5)
        assert scores["dense"] == pytest.approx(expected[item.node.node_id], abs=1e-5)
        assert scores["dense_norm"] == scores["retrieval"] == item.node.metadata["score"]
        assert scores["dense_norm"] == pytest.approx((expected[item.node.node_id] + 1) / 2, abs=1e-5)
    stored = index.docstore.get_node("vault")
    assert "score" not in stored.metadata and "score" not in stored.excluded_llm_metadata_keys  # not mutated


@pytest.mark.parametrize("space", ["l2", "cosine", "ip"])
def test_chroma_exp_minus_distance_is_turned_back_into_the_cosine(tmp_path, space):
    retriever = chroma_index(tmp_path, space=space).as_retriever(similarity_top_k=3)
    assert infer_score_kind(retriever) == f"chroma_{space}"
    raw = {item.node.node_id: item.score for item in retriever.retrieve(QUESTION)}
    expected = cosines(QUESTION)
    for item in ScoreKeepingRetriever(retriever).retrieve(QUESTION):
        node_id, scores = item.node.node_id, item.node.metadata["scores"]
        assert scores[f"chroma_{space}"] == pytest.approx(raw[node_id])  # Chroma's own number, kept
        assert raw[node_id] != pytest.approx(expected[node_id], abs=1e-3)  # ... which is not the cosine
        assert scores["dense"] == pytest.approx(expected[node_id], abs=1e-4)
        assert item.node.metadata["score"] == pytest.approx((expected[node_id] + 1) / 2, abs=1e-4)


class FixedRetriever(BaseRetriever):
    """A retriever whose scores mean nothing we know of."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(id_="a", text="alpha"), score=3.0)]


def test_unknown_scores_need_an_explicit_kind():
    with pytest.raises(InvalidOptionError, match="cannot tell what node.score FixedRetriever returns"):
        ScoreKeepingRetriever(FixedRetriever())
    kept = ScoreKeepingRetriever(FixedRetriever(), score_kind="sparse").retrieve("q")
    assert kept[0].node.metadata["scores"] == pytest.approx({"sparse": 3.0, "sparse_norm": 2 / math.pi * math.atan(3),
                                                             "retrieval": 2 / math.pi * math.atan(3),
                                                             "fused": 2 / math.pi * math.atan(3)})
    mmr = memory_index().as_retriever(vector_store_query_mode=VectorStoreQueryMode.MMR)
    with pytest.raises(InvalidOptionError, match="'mmr' returns scores that are not cosine"):
        ScoreKeepingRetriever(mmr)
    with pytest.raises(InvalidOptionError, match="BaseRetriever"):
        ScoreKeepingRetriever("not a retriever")


def test_reranker_fusion_keeps_both_scores_in_a_plain_llama_index_pipeline():
    """ScoreKeepingRetriever -> a reranker overwriting node.score -> RerankerScoreFusion, chained by hand."""
    retriever = ScoreKeepingRetriever(memory_index().as_retriever(similarity_top_k=3))
    bundle = QueryBundle(QUESTION)
    nodes = retriever.retrieve(bundle)
    retrieval = {item.node.node_id: item.node.metadata["score"] for item in nodes}
    nodes = RerankerScoreFusion().postprocess_nodes(KeywordReranker().postprocess_nodes(nodes, bundle), bundle)
    for item in nodes:
        node_id, scores = item.node.node_id, item.node.metadata["scores"]
        logit = keyword_logit(QUESTION, TEXTS[node_id])
        r_rer = 1 / (1 + math.exp(-logit))
        fused = 2 * retrieval[node_id] * r_rer / (retrieval[node_id] + r_rer + 1e-8)
        assert type(scores["reranker"]) is float and scores["reranker"] == logit
        assert scores["reranker_norm"] == pytest.approx(r_rer)
        assert scores["retrieval"] == retrieval[node_id]  # the retrieval score survived the reranker
        assert scores["fused"] == pytest.approx(fused) and item.score == pytest.approx(fused)
        assert item.node.metadata["score"] == pytest.approx(fused)
