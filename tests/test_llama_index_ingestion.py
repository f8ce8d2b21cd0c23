"""KV caches at ingestion: KVCacheWarmer in a real IngestionPipeline makes the first query a cache hit,
and an edited node misses (its cache is keyed by its tokens, so a stale entry is never used)."""

from __future__ import annotations

import pytest
from llama_index.core import Document as LIDocument
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter

from ctx_integrations import Engine
from ctx_integrations.llama_index import ContextOfExpertsQueryEngine, KVCacheWarmer, default_embedding, node_text
from tests.helpers import tiny_loaded
from tests.llama_index_support import QUESTION, TEXTS, chroma_index, memory_index

TOKENS = 4


def documents(texts: dict[str, str] = TEXTS) -> list[LIDocument]:
    return [LIDocument(id_=doc_id, text=text, metadata={"source": f"{doc_id}.txt"}) for doc_id, text in texts.items()]


def pipeline(warmer: KVCacheWarmer) -> IngestionPipeline:
    return IngestionPipeline(transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0), default_embedding(),
                                              warmer])


def test_ingestion_warms_every_node_and_the_first_query_hits(tmp_path):
    engine = Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")
    warmer = KVCacheWarmer(engine)
    nodes = pipeline(warmer).run(documents=documents())
    assert len(nodes) == 3 and warmer.stats == {"hits": 0, "misses": 3, "corrupt": 0}
    assert all(engine.store.contains(engine.layout, node_text(node)) for node in nodes)
    assert all(node.embedding is not None for node in nodes)  # the nodes passed through unchanged otherwise

    query_engine = ContextOfExpertsQueryEngine.from_index(memory_index(nodes), engine=engine, similarity_top_k=3,
                                                          max_new_tokens=TOKENS)
    before = engine.store.stats.as_dict()
    response = query_engine.query(QUESTION)
    assert response.metadata["cache"] == {"hits": 3, "misses": 0}  # warm from the first query on
    assert engine.store.stats.misses == before["misses"]


def test_an_edited_node_misses_and_reingestion_recomputes_only_it(tmp_path):
    engine = Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")
    warmer = KVCacheWarmer(engine)
    pipeline(warmer).run(documents=documents())
    edited = {**TEXTS, "vault": "The secret code of the vault is 9350."}
    nodes = SentenceSplitter(chunk_size=64, chunk_overlap=0)(documents(edited))  # the edit, not yet ingested
    query_engine = ContextOfExpertsQueryEngine.from_index(memory_index(nodes), engine=engine, similarity_top_k=3,
                                                          max_new_tokens=TOKENS)
    assert query_engine.query(QUESTION).metadata["cache"] == {"hits": 2, "misses": 1}  # the stale entry is not used

    again = KVCacheWarmer(engine)
    pipeline(again).run(documents=documents({**TEXTS, "vault": "The secret code of the vault is 1111."}))
    assert again.stats == {"hits": 2, "misses": 1, "corrupt": 0}


def test_the_warmer_is_keyed_by_engine_in_the_pipeline_hash(tmp_path):
    """IngestionPipeline caches a step by its serialised form: another model must not reuse this one's run."""
    first = KVCacheWarmer(Engine(tiny_loaded("llama", seed=0)))
    second = KVCacheWarmer(Engine(tiny_loaded("llama", seed=1)))
    assert first.to_dict()["engine_key"] != second.to_dict()["engine_key"]
    assert "engine" not in first.to_dict()


@pytest.mark.slow
def test_chroma_ingestion_on_the_embedded_default(embedded_engine, tmp_path):
    """IngestionPipeline -> Chroma on disk with KVCacheWarmer: the first PCED query on SmolLM2 is all hits."""
    texts = {"keeper": "The lighthouse keeper of Varnholm is named Edda Lindqvist.",
             "ferry": "The ferry to Varnholm leaves the harbour at seven every morning.",
             "bakery": "The bakery on Varnholm sells rye bread with caraway seeds."}
    warmer = KVCacheWarmer(embedded_engine)
    nodes = pipeline(warmer).run(documents=documents(texts))
    assert warmer.stats["misses"] + warmer.stats["hits"] == 3
    query_engine = ContextOfExpertsQueryEngine.from_index(chroma_index(tmp_path / "chroma", nodes),
                                                          engine=embedded_engine, mode="pced", similarity_top_k=2,
                                                          max_new_tokens=12)
    response = query_engine.query("Who is the lighthouse keeper of Varnholm?")
    assert response.metadata["cache"] == {"hits": 2, "misses": 0}
    assert "Edda" in response.response
    assert response.source_nodes[0].node.ref_doc_id == "keeper"
