"""KV-cache store: bit-exact round trips, content-addressed misses, corruption handling, batching."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from ctx_integrations.engine.core.cache import KVCacheStore, SequenceBatch, batch_sequences
from ctx_integrations.engine.core.decoding import forward_sequences
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.prepared import PreparedTexts
from ctx_integrations.errors import CorruptCacheWarning
from tests.helpers import tiny_loaded

DOC = "Marrowgate has three bridges over the river Ast; the oldest was built in 1621."
QUESTION = "How many bridges does Marrowgate have?"


def cached_logits(loaded, layout, store, documents):
    prefix = store.prefix(layout)
    streams = batch_sequences(prefix, [store.document(layout, d) for d in documents])
    suffix = torch.tensor([layout.suffix_ids(QUESTION)]).expand(len(documents), -1)
    return forward_sequences(loaded.model, streams, suffix)


def fresh_logits(loaded, layout, document):
    ids = layout.prefix_ids + layout.context_ids(document) + layout.suffix_ids(QUESTION)
    streams = SequenceBatch(DynamicCache(), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return forward_sequences(loaded.model, streams, torch.tensor([ids]))


def entry_files(directory):
    return sorted(p for p in directory.rglob("*.safetensors") if not p.name.startswith(".tmp"))


def test_disk_round_trip_is_bit_identical(loaded, layout, tmp_path):
    first = KVCacheStore(loaded, tmp_path)
    computed = first.document(layout, DOC)
    logits_computed = cached_logits(loaded, layout, first, [DOC])
    second = KVCacheStore(loaded, tmp_path)  # new process-like store: must read the file
    loaded_entry = second.document(layout, DOC)
    assert second.stats.hits == 1 and second.stats.misses == 0
    assert torch.equal(loaded_entry.kv, computed.kv)
    assert torch.equal(cached_logits(loaded, layout, second, [DOC]), logits_computed)


def test_cached_prefill_matches_one_pass_prefill(loaded, layout):
    store = KVCacheStore(loaded)
    torch.testing.assert_close(cached_logits(loaded, layout, store, [DOC]), fresh_logits(loaded, layout, DOC),
                               rtol=1e-5, atol=1e-5)


def test_writes_are_atomic_and_shared_prefix_is_stored_once(loaded, layout, tmp_path):
    store = KVCacheStore(loaded, tmp_path)
    store.documents(layout, [DOC, DOC + " Another sentence.", "A third document."])
    assert len(entry_files(tmp_path)) == 4  # one prefix + three documents
    assert not list(tmp_path.rglob(".tmp-*"))


@pytest.mark.parametrize("change", ["model", "template", "text", "dtype"])
def test_any_change_of_identity_is_a_miss(loaded, layout, tmp_path, change):
    KVCacheStore(loaded, tmp_path).document(layout, DOC)
    other_loaded, other_layout, text = loaded, layout, DOC
    if change == "model":
        other_loaded = tiny_loaded("llama", seed=1)
    elif change == "template":
        other_layout = PromptLayout(loaded.tokenizer, system_prompt="Answer from the documents.")
    elif change == "text":
        text = DOC.replace("1621", "1622")
    else:
        other_loaded = tiny_loaded("llama", seed=0, dtype=torch.float64)
    store = KVCacheStore(other_loaded, tmp_path)
    store.document(other_layout, text)
    assert (store.stats.hits, store.stats.misses) == (0, 1)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_entry_is_detected_and_recomputed(loaded, layout, tmp_path, damage):
    original = KVCacheStore(loaded, tmp_path).document(layout, DOC)
    path = next(p for p in entry_files(tmp_path) if original.key in p.name)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    else:
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))
    store = KVCacheStore(loaded, tmp_path)
    with pytest.warns(CorruptCacheWarning, match="corrupt"):
        entry = store.document(layout, DOC)
    assert store.stats.corrupt == 1 and store.stats.misses == 1
    assert torch.equal(entry.kv, original.kv)
    with warnings.catch_warnings():  # the rewritten entry is sound again
        warnings.simplefilter("error")
        assert torch.equal(KVCacheStore(loaded, tmp_path).document(layout, DOC).kv, original.kv)


def test_memory_tier_evicts_least_recently_used_beyond_its_byte_budget(loaded, layout):
    docs = ["first document", "second document", "third document"]
    sizes = [e.kv.numel() * e.kv.element_size() for e in KVCacheStore(loaded).documents(layout, docs)]
    store = KVCacheStore(loaded, memory_bytes=sizes[1] + sizes[2])  # room for two of the three (not the prefix)
    store.documents(layout, docs)
    assert not store.contains(layout, docs[0]) and store.contains(layout, docs[1]) and store.contains(layout, docs[2])
    assert store.memory_used == sizes[1] + sizes[2] <= store.memory_bytes
    store.document(layout, docs[0])
    assert store.stats.misses == 4
    assert not store.contains(layout, docs[1]) and store.contains(layout, docs[2])  # the least recently used left


def test_hits_are_counted_per_tier_and_per_request(loaded, layout, tmp_path):
    from ctx_integrations.engine.core.disk import CacheStats

    KVCacheStore(loaded, tmp_path).documents(layout, ["on disk"])
    store = KVCacheStore(loaded, tmp_path)
    store.documents(layout, ["in memory"])
    request = CacheStats()
    store.documents(layout, ["on disk", "in memory", "new one"], stats=request)
    assert (request.disk_hits, request.memory_hits, request.misses) == (1, 1, 1)
    assert (store.stats.disk_hits, store.stats.memory_hits, store.stats.misses) == (1, 1, 2)
    prefetched = KVCacheStore(loaded, tmp_path)
    prefetched.prefetch(PreparedTexts(layout, prefetched).prepare_all(["on disk"]))  # read ahead: still a disk hit
    request = CacheStats()
    prefetched.documents(layout, ["on disk", "on disk"], stats=request)
    assert (request.disk_hits, request.memory_hits, request.misses) == (1, 1, 0)


def test_query_time_entries_stay_off_the_disk(loaded, layout, tmp_path):
    store = KVCacheStore(loaded, tmp_path)
    store.prefix(layout)
    with_prefix, in_memory = store.disk_used(), store.memory_used
    store.document_tokens(layout, layout.context_ids("a concatenation of several documents"), persist=False)
    assert store.disk_used() == with_prefix and store.memory_used > in_memory
    store.document(layout, "an ingested document")  # document entries do go to disk
    assert store.disk_used() > with_prefix


def test_clear_memory_keeps_disk_entries(loaded, layout, tmp_path):
    on_disk, in_memory = KVCacheStore(loaded, tmp_path / "kv"), KVCacheStore(loaded)
    for store in (on_disk, in_memory):
        store.document(layout, DOC)
        store.clear_memory()
    assert on_disk.contains(layout, DOC) and not in_memory.contains(layout, DOC)
    on_disk.document(layout, DOC)
    in_memory.document(layout, DOC)
    assert (on_disk.stats.hits, on_disk.stats.misses) == (1, 1)
    assert (in_memory.stats.hits, in_memory.stats.misses) == (0, 2)


def test_half_precision_on_disk(loaded, layout, tmp_path):
    exact = KVCacheStore(loaded, tmp_path / "full").document(layout, DOC)
    KVCacheStore(loaded, tmp_path / "half", half_on_disk=True).document(layout, DOC)
    reloaded = KVCacheStore(loaded, tmp_path / "half", half_on_disk=True).document(layout, DOC)
    assert reloaded.kv.dtype == torch.float32
    torch.testing.assert_close(reloaded.kv, exact.kv, rtol=1e-3, atol=1e-3)
    assert entry_files(tmp_path / "half")[0].stat().st_size < entry_files(tmp_path / "full")[0].stat().st_size


def test_forget_invalidates_an_entry(loaded, layout, tmp_path):
    store = KVCacheStore(loaded, tmp_path)
    store.document(layout, DOC)
    store.forget(layout, DOC)
    assert not store.contains(layout, DOC)


def test_batched_streams_of_different_lengths_match_single_streams(loaded, layout):
    store = KVCacheStore(loaded)
    documents = ["short.", DOC, DOC + " " + DOC]
    batched = cached_logits(loaded, layout, store, documents)
    for i, document in enumerate(documents):
        torch.testing.assert_close(batched[i], fresh_logits(loaded, layout, document)[0], rtol=1e-5, atol=1e-5)


def test_batch_streams_positions_and_mask(loaded, layout):
    store = KVCacheStore(loaded)
    prefix = store.prefix(layout)
    docs = [store.document(layout, "a b c"), store.document(layout, DOC)]
    streams = batch_sequences(prefix, [None] + docs)
    expected = [prefix.length, prefix.length + docs[0].length, prefix.length + docs[1].length]
    assert streams.positions.tolist() == expected
    assert streams.attention_mask.sum(1).tolist() == expected
    assert streams.cache.get_seq_length() == prefix.length + docs[1].length


def test_batched_miss_computation_matches_one_by_one(loaded, layout, tmp_path):
    documents = ["short.", DOC, DOC + " " + DOC, DOC]  # different lengths and a duplicate
    batched_store = KVCacheStore(loaded, tmp_path)
    batched = batched_store.documents(layout, documents)
    assert (batched_store.stats.misses, batched_store.stats.hits) == (3, 1)
    single_store = KVCacheStore(loaded)
    for entry, document in zip(batched, documents):
        single = single_store.document(layout, document)
        assert entry.token_ids == single.token_ids
        torch.testing.assert_close(entry.kv, single.kv, rtol=1e-5, atol=1e-5)
    reloaded = KVCacheStore(loaded, tmp_path).documents(layout, documents)
    assert all(torch.equal(a.kv, b.kv) for a, b in zip(reloaded, batched))


def test_batched_misses_respect_the_token_budget(loaded, layout):
    store = KVCacheStore(loaded, batch_tokens=40)
    documents = [f"document number {i} " * 4 for i in range(5)]
    entries = store.documents(layout, documents)
    reference = KVCacheStore(loaded)
    for entry, document in zip(entries, documents):
        torch.testing.assert_close(entry.kv, reference.document(layout, document).kv, rtol=1e-5, atol=1e-5)


def test_a_memory_hit_refreshes_recency(loaded, layout):
    """Issue 28 item 10: the entry hit between two inserts must outlive the one that was not hit."""
    docs = ["alpha river town", "beta river town", "gamma river town"]
    assert len({len(layout.context_ids(d)) for d in docs}) == 1  # equal sizes: eviction goes by recency only
    probe = KVCacheStore(loaded)
    size = probe.document(layout, docs[0]).kv.nbytes
    store = KVCacheStore(loaded, memory_bytes=probe.prefix(layout).kv.nbytes + 2 * size)  # prefix + two documents
    store.document(layout, docs[0])
    store.document(layout, docs[1])
    store.document(layout, docs[0])  # a memory hit: docs[0] is now more recent than docs[1]
    assert store.stats.memory_hits == 1
    store.document(layout, docs[2])
    assert store.contains(layout, docs[0]) and not store.contains(layout, docs[1])


class HashEmbedder:
    """Fixed vectors from a text's hash: a store needs some embedder, these tests need no model."""

    name, identity, dimension, spec = "hash", "hash:1", 8, None

    def embed_documents(self, texts):
        import hashlib

        import numpy as np

        vectors = [np.frombuffer(hashlib.sha256(t.encode()).digest()[:32], np.uint8)[:8].astype(np.float32) + 1
                   for t in texts]
        return np.stack([v / np.linalg.norm(v) for v in vectors])

    def embed_query(self, text):
        return self.embed_documents([text])[0]


def test_the_same_text_in_two_stores_and_collections_is_computed_and_stored_once(loaded, tmp_path, monkeypatch):
    """Issue 27 item 4: the bug was one KV folder per store folder (and per Chroma URL and collection), so the
    same passage ingested from two folders into two stores was computed twice and stored twice."""
    from ctx_integrations import Engine
    from ctx_integrations.retrieval import DocumentStore
    from ctx_integrations.retrieval.ingest import ingest, token_counter

    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    for folder in ("one", "two"):  # the same licence text under two folders (two absolute paths)
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "LICENSE.txt").write_text(DOC)
    reports = []
    for folder, collection in (("one", "ctx_documents"), ("two", "other_collection")):
        store = DocumentStore(tmp_path / f"store-{folder}", embedder=HashEmbedder(), collection=collection)
        store.engine = Engine(loaded, cache_dir=store.kv_dir)  # a fresh engine: nothing in memory
        reports.append(ingest(store, [tmp_path / folder], token_counter(loaded.tokenizer), progress=False))
    assert [r.cache_misses for r in reports] == [1, 0]  # one miss, then a hit on disk
    files = entry_files(tmp_path)
    assert len(files) == 2 and all(f.is_relative_to(tmp_path / "cache" / "kv") for f in files)  # prefix + DOC
    assert len({f.parent.parent for f in files}) == 1  # one folder per model


def test_entries_of_the_layout_before_per_model_folders_are_still_found(loaded, layout, tmp_path):
    """Migration: an entry at ``<root>/<key[:2]>/<key>.safetensors`` (the old layout) is a disk hit, moved in."""
    old = KVCacheStore(loaded, tmp_path)
    entry = old.document(layout, DOC)
    legacy = tmp_path / entry.key[:2] / f"{entry.key}.safetensors"
    old.disk.path(entry.key).rename(legacy.parent.mkdir(parents=True, exist_ok=True) or legacy)
    store = KVCacheStore(loaded, tmp_path)
    assert store.contains(layout, DOC)
    assert torch.equal(store.document(layout, DOC).kv, entry.kv) and store.stats.disk_hits == 1
    assert store.disk.path(entry.key).is_file() and not legacy.exists()
    legacy.write_bytes(store.disk.path(entry.key).read_bytes())  # a second copy left in the old layout ...
    store.forget(layout, DOC)
    assert not store.contains(layout, DOC) and not legacy.exists()  # ... is forgotten with the entry
