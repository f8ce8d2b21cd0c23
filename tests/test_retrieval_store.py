"""DocumentStore and ScoredRetriever on real Chroma (on disk and a local ``chroma run`` server) with MiniLM.

The LangChain suite (tests/test_langchain_store.py) checks the adapter; this file checks the store
itself: persistence, upsert semantics, KV caches beside the store, batching, metadata, the
collection's configuration, embedder identity, the HTTP client, and the retriever's scores and errors.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import chromadb
import numpy as np
import pytest

from ctx_integrations import Engine
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError
from ctx_integrations.paths import kv_root
from ctx_integrations.retrieval import DocumentStore, ScoredRetriever, StoreMismatchError
from ctx_integrations.retrieval.embedders import TransformerEmbedder, default_embedder
from ctx_integrations.retrieval.scores import normalize_dense, normalize_sparse
from ctx_integrations.retrieval.store import clean_metadata, content_hash
from tests.helpers import tiny_loaded

TEXTS = {
    "eiffel": "The Eiffel Tower is in Paris, the capital of France.",
    "fuji": "Mount Fuji is the highest mountain in Japan.",
    "nile": "The Nile flows north through Egypt into the Mediterranean Sea.",
    "vault": "The secret code of the vault is 4721.",
}
VAULT_QUESTION = "What is the code of the vault?"


class CountingEmbedder:
    """The embedded MiniLM, recording the size of every embed_documents call."""

    def __init__(self, inner=None):
        self.inner = inner or default_embedder()
        self.name, self.batches = self.inner.name, []

    identity = property(lambda self: self.inner.identity)
    dimension = property(lambda self: self.inner.dimension)
    spec = property(lambda self: self.inner.spec)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(len(texts))
        return self.inner.embed_documents(texts)

    def embed_query(self, text: str) -> np.ndarray:
        return self.inner.embed_query(text)


class TableEmbedder:
    """Fixed unit vectors per text, so that a test can place a document exactly where it wants it."""

    name, identity, dimension = "table", "table:1", 3

    def __init__(self, vectors: dict[str, Sequence[float]]):
        self.vectors = {t: np.asarray(v, np.float32) / np.linalg.norm(v) for t, v in vectors.items()}

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])

    def embed_query(self, text: str) -> np.ndarray:
        return self.vectors[text]


def _records(**extra_metadata) -> list[dict]:
    return [{"id": key, "text": text, "metadata": {"topic": key, **extra_metadata}} for key, text in TEXTS.items()]


def _cache_files(folder: Path) -> set[Path]:
    return set(folder.rglob("*.safetensors"))


# -- persistence and upserts -------------------------------------------------------------------------------
def test_round_trip_add_reopen_retrieve(tmp_path):
    store = DocumentStore(tmp_path, embedder=CountingEmbedder())
    report = store.add(_records())
    assert (report.added, report.updated, report.unchanged) == (4, 0, 0)
    assert (tmp_path / "chroma").is_dir() and store.kv_dir == kv_root()  # one KV root for every store

    reopened = DocumentStore(tmp_path)  # a new client on the same folder; the embedder comes from the store
    assert reopened.embedder.identity == default_embedder().identity and len(reopened) == 4
    assert sorted(reopened.ids()) == sorted(TEXTS)
    stored = {d.id: d for d in reopened.all_documents()}
    assert {k: d.text for k, d in stored.items()} == TEXTS
    assert stored["nile"].metadata == {"topic": "nile", "content_hash": content_hash(TEXTS["nile"])}
    assert [d.id for d in reopened.get(["vault", "absent", "fuji"])] == ["vault", "fuji"]

    docs = ScoredRetriever(reopened).retrieve(VAULT_QUESTION, top_k=2)
    assert docs[0].id == "vault" and docs[0].text == TEXTS["vault"] and docs[0].metadata["topic"] == "vault"
    query = default_embedder().embed_query(VAULT_QUESTION)
    lexical = reopened.lexical_scores(VAULT_QUESTION)
    for doc in docs:
        assert set(doc.scores) == {"dense", "dense_norm", "sparse", "sparse_norm", "retrieval", "fused"}
        dense = float(default_embedder().embed_documents([doc.text])[0] @ query)
        assert doc.scores["dense"] == pytest.approx(dense, abs=1e-5)
        assert doc.scores["dense_norm"] == normalize_dense(doc.scores["dense"])
        assert doc.scores["sparse"] == lexical[doc.id]
        assert doc.scores["sparse_norm"] == normalize_sparse(lexical[doc.id])
        assert doc.score == doc.scores["fused"] == doc.scores["retrieval"] == doc.scores["dense_norm"]
    assert docs[0].score > docs[1].score
    assert lexical["vault"] > 0 and lexical["fuji"] == 0.0


def test_upserts_embed_only_what_changed(tmp_path):
    embedder = CountingEmbedder()
    store = DocumentStore(tmp_path, embedder=embedder)
    store.add(_records())
    assert embedder.batches == [4]

    again = store.add(_records())
    assert (again.added, again.updated, again.unchanged) == (0, 0, 4) and embedder.batches == [4]

    records = _records()
    records[0]["metadata"]["topic"] = "tower"  # metadata only
    records[1]["text"] = "Mount Fuji is a volcano in Japan."  # text
    records.append({"id": "new", "text": "A brand new document about oceans."})
    report = store.add(records)
    assert (report.added, report.updated, report.unchanged) == (1, 2, 2) and embedder.batches == [4, 3]
    assert store.get(["eiffel"])[0].metadata["topic"] == "tower"
    assert store.get(["fuji"])[0].text == "Mount Fuji is a volcano in Japan."
    assert store.lexical_scores("oceans")["new"] > 0  # the BM25 index was rebuilt after the write
    assert len(store) == 5


def test_add_refuses_empty_text_and_duplicate_ids(tmp_path):
    store = DocumentStore(tmp_path)
    with pytest.raises(EmptyDocumentsError, match="empty text"):
        store.add([{"id": "a", "text": "  "}])
    with pytest.raises(InvalidOptionError, match="appears twice"):
        store.add([{"id": "a", "text": "one"}, {"id": "a", "text": "two"}])
    with pytest.raises(EmptyDocumentsError, match="not a single string"):
        store.add("a single string")
    assert len(store) == 0
    store.add(["A text without an id."])  # the id defaults to the content hash
    assert store.ids() == [content_hash("A text without an id.")[:32]]


# -- KV caches beside the store -------------------------------------------------------------------------
@pytest.fixture
def engine(tmp_path) -> Engine:
    return Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")


def _on_disk(engine: Engine, text: str) -> bool:
    """Whether a cache file exists for ``text``, asked of a fresh engine (empty memory) on the same folder."""
    return Engine(engine.loaded, cache_dir=engine.store.directory).store.contains(engine.layout, text)


def test_caches_are_computed_at_ingestion_and_follow_changes(tmp_path, engine):
    store = DocumentStore(tmp_path, engine=engine)
    report = store.add(_records())
    assert report.cache_misses == 4 and all(_on_disk(engine, t) for t in TEXTS.values())
    files = _cache_files(tmp_path / "kv")
    assert len(files) == 5  # four documents and the shared prefix

    changed = "The secret code of the vault is 9903."
    report = store.add([{"id": "vault", "text": changed, "metadata": {"topic": "vault"}}])
    assert (report.updated, report.cache_misses) == (1, 1)
    assert not _on_disk(engine, TEXTS["vault"]) and _on_disk(engine, changed)
    after = _cache_files(tmp_path / "kv")
    assert len(after) == 5 and len(after - files) == 1 and len(files - after) == 1

    assert store.delete(["nile", "absent"]) == 1
    assert not _on_disk(engine, TEXTS["nile"]) and len(_cache_files(tmp_path / "kv")) == 4
    assert store.ids() and "nile" not in store.ids()


def test_a_cache_shared_by_two_documents_stays_until_both_are_gone(tmp_path, engine):
    text = "Two documents, one text."
    store = DocumentStore(tmp_path, engine=engine)
    store.add([{"id": "a", "text": text}, {"id": "b", "text": text}])
    store.delete(["a"])
    assert _on_disk(engine, text)
    store.add([{"id": "b", "text": "Now b says something else."}])
    assert not _on_disk(engine, text)


def test_warm_computes_the_caches_of_a_store_ingested_without_engine(tmp_path, engine):
    store = DocumentStore(tmp_path)
    assert store.add(_records()).cache_misses == 0
    with pytest.raises(InvalidOptionError, match="needs an engine"):
        store.warm()
    assert store.warm(engine).cache_misses == 4
    assert store.warm().cache_misses == 0 and all(_on_disk(engine, t) for t in TEXTS.values())


# -- batches, metadata, collection --------------------------------------------------------------------------
def test_writes_and_reads_respect_the_max_batch_size(tmp_path, monkeypatch):
    store = DocumentStore(tmp_path, embedder=CountingEmbedder())
    assert store.max_batch_size > 100  # the real client's limit
    monkeypatch.setattr(DocumentStore, "max_batch_size", property(lambda self: 3))
    records = [{"id": f"d{i}", "text": f"Document number {i} is about topic {i}."} for i in range(7)]
    upserts: list[int] = []
    store.add(records, progress=upserts.append)  # progress is called once per upsert
    assert upserts == [3, 3, 1] and store.embedder.batches == [3, 3, 1]
    assert sorted(store.ids()) == sorted(r["id"] for r in records)  # paged in 3s
    assert len(store.all_documents()) == 7
    order = ["d6", "d0", "d3", "d5", "d1", "d4", "d2"]
    assert [d.id for d in store.get(order)] == order
    assert store.embeddings(order).shape == (7, store.embedder.dimension)
    assert store.delete(order) == 7 and len(store) == 0


def test_metadata_without_none_and_non_scalars_as_json(tmp_path):
    raw = {"a": None, "tags": ["x", "y"], "nested": {"b": 1, "a": 2}, "n": 3, "f": 0.5, "flag": True, "s": "t"}
    assert clean_metadata(raw) == {"tags": '["x", "y"]', "nested": '{"a": 2, "b": 1}', "n": 3, "f": 0.5,
                                   "flag": True, "s": "t"}
    store = DocumentStore(tmp_path)
    store.add([{"id": "m", "text": "Metadata test.", "metadata": raw}])
    stored = store.get(["m"])[0].metadata
    assert stored == {**clean_metadata(raw), "content_hash": content_hash("Metadata test.")}
    assert store.add([{"id": "m", "text": "Metadata test.", "metadata": raw}]).unchanged == 1  # types round-trip
    assert [d.id for d in store.where({"n": 3, "flag": True})] == ["m"]


def test_collection_is_cosine_with_no_embedding_function(tmp_path):
    store = DocumentStore(tmp_path)
    store.add(_records())
    for opened in (store, DocumentStore(tmp_path)):
        collection = opened._collection
        assert collection.configuration["hnsw"]["space"] == "cosine"
        assert collection.configuration_json["embedding_function"] in (None, {"type": "legacy"})
        assert collection._embedding_function is None  # never Chroma's default (it downloads a model)
        assert collection.metadata == {"format": "ctx-store-1", "embedder": default_embedder().identity,
                                       "embedder_spec": "minilm", "dimension": 384}
    fuji, nile = default_embedder().embed_documents([TEXTS["fuji"], TEXTS["nile"]])
    hits = store.query(fuji, 10)
    assert len(hits) == 4 and hits[0][0] == "fuji" and hits[0][1] == pytest.approx(1.0, abs=1e-5)
    # 1 - distance is the cosine (an L2 space would give 2 cos - 1)
    assert dict(hits)["nile"] == pytest.approx(float(fuji @ nile), abs=1e-5)


def test_another_embedder_is_refused_before_anything_is_touched(tmp_path):
    store = DocumentStore(tmp_path)
    store.add(_records())
    other = TransformerEmbedder(max_length=128)  # same weights, other truncation: other vectors
    with pytest.raises(StoreMismatchError, match=r"not comparable.*spec 'minilm'"):
        DocumentStore(tmp_path, embedder=other)
    assert len(DocumentStore(tmp_path)) == 4
    with pytest.raises(InvalidOptionError, match="collection name"):
        DocumentStore(tmp_path, collection="x")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(InvalidOptionError, match="is a file"):
        DocumentStore(tmp_path / "file")


# -- a Chroma server --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


_RUN_CHROMA = ("import sys; from chromadb.cli.cli import app; "
               "sys.argv = ['chroma', 'run', '--path', sys.argv[1], '--port', sys.argv[2]]; app()")


@pytest.fixture(scope="module")
def chroma_url(tmp_path_factory):
    """A real ``chroma run`` server on a free localhost port, stopped after the module."""
    data, port = tmp_path_factory.mktemp("chroma-server"), _free_port()
    log = (data / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-c", _RUN_CHROMA, str(data / "db"), str(port)], stdout=log,
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            chromadb.HttpClient(host="localhost", port=port).heartbeat()
            break
        except Exception:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"chroma run did not start: {(data / 'server.log').read_text()[-2000:]}") from None
            time.sleep(0.2)
    yield f"http://localhost:{port}"
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


def test_a_url_location_talks_to_a_chroma_server(chroma_url, tmp_path, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path))
    port = int(chroma_url.rsplit(":", 1)[1])
    store = DocumentStore(chroma_url, collection="served")
    assert store.location == chroma_url and store.kv_dir == tmp_path / "kv"  # no folder per server or collection
    store.add(_records())
    independent = chromadb.HttpClient(host="localhost", port=port)
    assert independent.get_collection("served", embedding_function=None).count() == 4  # it is on the server
    reopened = DocumentStore(chroma_url, collection="served")
    assert len(reopened) == 4 and reopened._collection._embedding_function is None
    assert ScoredRetriever(reopened).retrieve(VAULT_QUESTION, top_k=1)[0].id == "vault"


# -- retriever ----------------------------------------------------------------------------------------------
def test_retrieve_errors_say_what_to_do(tmp_path):
    store = DocumentStore(tmp_path)
    with pytest.raises(EmptyDocumentsError, match="ctx-experts ingest"):
        ScoredRetriever(store).retrieve("anything")
    store.add(_records())
    retriever = ScoredRetriever(store)
    with pytest.raises(InvalidOptionError, match="top_k"):
        retriever.retrieve(VAULT_QUESTION, top_k=0)
    with pytest.raises(InvalidOptionError, match="rerank_top_n needs a reranker"):
        retriever.retrieve(VAULT_QUESTION, top_k=2, rerank_top_n=4)
    with pytest.raises(InvalidOptionError, match="non-empty"):
        retriever.retrieve("  ")
    with pytest.raises(InvalidOptionError, match="ColBERT scores need a BGE-M3 store"):
        ScoredRetriever(store, score="colbert")
    with pytest.raises(InvalidOptionError, match="unknown score"):
        ScoredRetriever(store, score="bm42")
    with pytest.raises(InvalidOptionError, match="candidates"):
        ScoredRetriever(store, candidates=0)
    assert ScoredRetriever(store).available_scores() == ["dense", "sparse"]


def test_sparse_ranking_pulls_bm25_hits_outside_the_dense_pool(tmp_path):
    query = "zanzibar spices"
    fillers = {f"filler {i}": [1.0, 0.05 * i, 0.0] for i in range(25)}
    needle = "The zanzibar spices market opens at dawn."
    embedder = TableEmbedder({query: [1.0, 0.0, 0.0], needle: [-1.0, 0.0, 0.1], **fillers})
    store = DocumentStore(tmp_path, embedder=embedder)
    store.add([{"id": "needle", "text": needle}] + [{"id": f"f{i:02d}", "text": t} for i, t in enumerate(fillers)])

    dense = ScoredRetriever(store, score="dense").retrieve(query, top_k=3)
    assert "needle" not in [d.id for d in dense]  # 26th of 26 by cosine: outside the 20-document dense pool
    docs = ScoredRetriever(store, score="sparse").retrieve(query, top_k=3)
    assert docs[0].id == "needle"
    assert docs[0].scores["sparse"] == store.lexical_scores(query)["needle"] > 0
    assert docs[0].scores["dense"] == pytest.approx(float(embedder.vectors[needle] @ embedder.vectors[query]))
    assert docs[0].score == docs[0].scores["sparse_norm"] and all(d.scores["sparse"] == 0.0 for d in docs[1:])
