"""The host tier between the memory tier and the disk (``KVCacheStore(host_bytes=...)``).

On a GPU it holds page-locked copies of the entries the device tier evicts and of entries read ahead
from disk; here (CPU) it is switched on explicitly and its copies are plain, which checks the
bookkeeping: which tier holds what within its budget, which tier each hit is counted to, what a
prefetch brings in, and that answers do not change. The pinned, asynchronous copies themselves are
checked on CUDA by ``tests/test_cuda.py::test_the_host_tier_pins_evicted_entries_and_returns_them_intact``.
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.cache import KVCacheStore
from ctx_integrations.engine.core.disk import CacheStats
from ctx_integrations.engine.core.prepared import PreparedTexts
from ctx_integrations.errors import InvalidOptionError

DOCS = ["Marrowgate is the capital of Veloria.", "The mayor of Marrowgate is Ilsa Brenn.",
        "The Lantern Fair is held every October in the harbour district.", "The vault code is 4721."]


@pytest.fixture(scope="module")
def originals(loaded, layout) -> list[torch.Tensor]:
    return [e.kv for e in KVCacheStore(loaded).documents(layout, DOCS)]


def size(kv: torch.Tensor) -> int:
    return kv.numel() * kv.element_size()


def test_no_host_tier_on_cpu_by_default_and_a_bad_budget_is_named(loaded):
    assert KVCacheStore(loaded).host_bytes == 0
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(InvalidOptionError, match="host_bytes"):
            KVCacheStore(loaded, host_bytes=bad)


def test_evicted_entries_wait_in_the_host_tier_and_come_back_as_host_hits(loaded, layout, originals):
    # memory room for the largest document only: every other entry (and the prefix) is evicted to the host tier
    store = KVCacheStore(loaded, memory_bytes=max(map(size, originals)), host_bytes=1 << 30)
    store.documents(layout, DOCS)
    assert store.memory_used <= store.memory_bytes and store.host_used > 0
    request = CacheStats()
    again = store.documents(layout, DOCS, stats=request)
    assert (request.misses, request.disk_hits) == (0, 0)
    assert request.host_hits >= len(DOCS) - 1 and request.hits == len(DOCS)
    assert all(torch.equal(entry.kv, kv) for entry, kv in zip(again, originals))
    assert store.stats.host_hits == request.host_hits
    # without a host tier the same evictions are lost: every document is computed again
    plain = KVCacheStore(loaded, memory_bytes=max(map(size, originals)))
    plain.documents(layout, DOCS)
    request = CacheStats()
    plain.documents(layout, DOCS, stats=request)
    assert request.misses >= len(DOCS) - 1 and request.host_hits == 0 and plain.host_used == 0


def test_the_host_tier_keeps_the_most_recently_used_entries_within_its_budget(loaded, layout, originals):
    # no memory tier at all: entries go straight to the host tier, which has room for the prefix (used by every
    # call) and the two last documents
    budget = size(KVCacheStore(loaded).prefix(layout).kv) + size(originals[2]) + size(originals[3])
    store = KVCacheStore(loaded, memory_bytes=0, host_bytes=budget)
    for document in DOCS:
        store.document(layout, document)
    assert store.host_used == budget and store.memory_used == 0
    assert store.contains(layout, DOCS[3]) and store.contains(layout, DOCS[2]) and not store.contains(layout, DOCS[0])
    request = CacheStats()
    store.documents(layout, DOCS[2:], stats=request)
    assert (request.host_hits, request.misses) == (2, 0)
    store.forget(layout, DOCS[3])
    assert not store.contains(layout, DOCS[3]) and store.host_used == budget - size(originals[3])


def test_prefetch_reads_disk_entries_through_the_host_tier(loaded, layout, originals, tmp_path):
    KVCacheStore(loaded, tmp_path).documents(layout, DOCS)
    store = KVCacheStore(loaded, tmp_path, host_bytes=1 << 30)
    store.prefetch(PreparedTexts(layout, store).prepare_all(DOCS[:2]))
    assert store.host_used == size(originals[0]) + size(originals[1])  # read into the host tier ...
    request = CacheStats()
    entries = store.documents(layout, DOCS[:2] * 2, stats=request)  # ... and on to the memory tier
    assert (request.disk_hits, request.memory_hits, request.misses) == (2, 2, 0)  # first use: from the disk
    assert all(torch.equal(e.kv, kv) for e, kv in zip(entries, originals[:2] * 2))
    # an entry evicted from memory but still on the host is prefetched from there: a host hit at first use
    store.clear_memory()
    assert store.memory_used == store.host_used == 0
    small = KVCacheStore(loaded, tmp_path, memory_bytes=max(map(size, originals)), host_bytes=1 << 30)
    small.documents(layout, DOCS)  # from disk; the memory tier keeps one, the host tier the others
    key = small.entry_key(layout, layout.context_ids(DOCS[0]))
    assert key not in small._memory and key in small._host
    small.prefetch(PreparedTexts(layout, small).prepare_all([DOCS[0]]))  # from the host tier, not the disk
    assert key in small._memory
    request = CacheStats()
    small.documents(layout, DOCS[:1], stats=request)
    assert (request.host_hits, request.disk_hits, request.misses) == (1, 0, 0)


def test_an_engine_with_a_small_memory_tier_answers_the_same_from_its_host_tier(loaded):
    reference = Engine(loaded).generate("Who is the mayor?", DOCS, max_new_tokens=8)
    engine = Engine(loaded, memory_bytes=1, host_bytes=1 << 30)
    first = engine.generate("Who is the mayor?", DOCS, max_new_tokens=8)
    second = engine.generate("Who is the mayor?", DOCS, max_new_tokens=8)
    assert first.token_ids == second.token_ids == reference.token_ids
    assert first.cache_hits_by_tier == {"memory": 0, "host": 0, "disk": 0, "remote": 0}
    assert first.cache_misses == len(DOCS)
    assert second.cache_hits_by_tier == {"memory": 0, "host": len(DOCS), "disk": 0, "remote": 0}
    assert second.cache_misses == 0
    stats = engine.stats()
    assert stats["bytes"]["host"] == engine.store.host_used > 0 and stats["budgets"]["host"] == 1 << 30
    assert stats["cache"]["hits_by_tier"]["host"] == len(DOCS)
