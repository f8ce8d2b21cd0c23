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

from ctx_integrations import Engine
from ctx_integrations.errors import InvalidOptionError, InvalidScoresError
from ctx_integrations.llama_index import (
    ContextOfExpertsSynthesizer,
    RerankerScoreFusion,
    ScoreKeepingRetriever,
    default_embedding,
    infer_score_kind,
)
from ctx_integrations.llama_index.score_keeping import keep_retrieval_score
from ctx_integrations.llama_index.scores import score_parts
from ctx_integrations.retrieval.scores import UPPER
from tests.helpers import tiny_loaded
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


@pytest.mark.parametrize("space", ["l2", "cosine"])
def test_a_stock_engine_over_chroma_reads_the_collection_space_from_the_index(tmp_path, space):
    """``index.as_query_engine(response_synthesizer=...)`` gives the synthesizer bare nodes; the kind read from the
    index (its Chroma collection's space) turns exp(-distance) back into the cosine, not read as one."""
    index = chroma_index(tmp_path, space=space)
    kind = infer_score_kind(index)
    assert kind == infer_score_kind(index.vector_store) == f"chroma_{space}"
    synthesizer = ContextOfExpertsSynthesizer(engine=Engine(tiny_loaded("llama")), retrieval_score_kind=kind,
                                              max_new_tokens=2)
    response = index.as_query_engine(llm=synthesizer.llm, similarity_top_k=3,
                                     response_synthesizer=synthesizer).query(QUESTION)
    expected = cosines(QUESTION)
    assert len(response.source_nodes) == 3
    for item in response.source_nodes:
        node_id, scores = item.node.node_id, item.node.metadata["scores"]
        assert scores["dense"] == pytest.approx(expected[node_id], abs=1e-4)
        assert item.score == pytest.approx((expected[node_id] + 1) / 2, abs=1e-4)
        assert scores[kind] != pytest.approx(expected[node_id], abs=1e-3)  # Chroma's number is not the cosine


@pytest.mark.parametrize(("space", "distance"), [("l2", lambda cos: 2 - 2 * cos), ("cosine", lambda cos: 1 - cos),
                                                 ("ip", lambda cos: 1 - cos)])
def test_a_collection_made_with_hnsw_space_metadata_is_read_too(tmp_path, space, distance):
    """LlamaIndex's Chroma examples set the space as collection metadata (``hnsw:space``): same kinds, and
    the documented formulas hold against Chroma's own distances (unit-length MiniLM vectors)."""
    import chromadb
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.vector_stores.chroma import ChromaVectorStore

    collection = chromadb.PersistentClient(path=str(tmp_path)).get_or_create_collection(
        "nodes", embedding_function=None, metadata={"hnsw:space": space})
    store = ChromaVectorStore(chroma_collection=collection)
    index = VectorStoreIndex(make_nodes(), storage_context=StorageContext.from_defaults(vector_store=store),
                             embed_model=default_embedding())
    assert infer_score_kind(store) == infer_score_kind(index) == f"chroma_{space}"
    expected = cosines(QUESTION)
    for item in index.as_retriever(similarity_top_k=3).retrieve(QUESTION):
        cos = expected[item.node.node_id]
        assert item.score == pytest.approx(math.exp(-distance(cos)), abs=1e-4)  # what Chroma's store returns
        parts, r = score_parts(f"chroma_{space}", item.score)
        assert parts["dense"] == pytest.approx(cos, abs=1e-4) and r == pytest.approx((cos + 1) / 2, abs=1e-4)


def test_a_chroma_space_this_library_does_not_know_is_refused_not_read_as_cosine(tmp_path):
    index = chroma_index(tmp_path, space="cosine")
    collection = index.vector_store.client
    configuration = dict(collection._model.configuration_json)  # a space a future Chroma might add
    configuration["hnsw"] = {**configuration["hnsw"], "space": "hamming"}
    collection._model.configuration_json = configuration
    for source in (index, index.vector_store, index.as_retriever()):
        with pytest.raises(InvalidOptionError, match="space 'hamming' is not one of l2, cosine, ip"):
            infer_score_kind(source)
    collection._model.configuration_json = {**configuration, "hnsw": None, "spann": None}
    with pytest.raises(InvalidOptionError, match="cannot read the Chroma collection's distance space"):
        infer_score_kind(index)


def test_what_is_not_a_known_index_or_store_needs_an_explicit_kind():
    with pytest.raises(InvalidOptionError, match="cannot tell what node.score str returns"):
        infer_score_kind("chroma")
    assert infer_score_kind(memory_index()) == infer_score_kind(memory_index().vector_store) == "dense"


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
