"""Cache-affinity routing without Ray: the consistent-hash ring and how a request's documents pick a replica."""

from __future__ import annotations

from collections import Counter

from ctx_integrations.serve.routing import HashRing, affinity_ranking, job_documents

KEYS = [f"document number {i} about the harbour" for i in range(400)]


def test_the_ring_spreads_documents_over_every_replica():
    """Bug caught: one point per replica (or a bad hash) sending most documents to one replica."""
    counts = Counter(HashRing(["a", "b"]).owner(k) for k in KEYS)
    assert set(counts) == {"a", "b"} and all(120 < n < 280 for n in counts.values())


def test_the_owner_is_the_same_whatever_the_order_of_replicas():
    """Bug caught: a ring built from the replicas' listing order, so two routers disagree."""
    assert [HashRing(["a", "b", "c"]).owner(k) for k in KEYS] == [HashRing(["c", "a", "b"]).owner(k) for k in KEYS]


def test_adding_a_replica_moves_only_documents_to_the_new_replica():
    """Bug caught: modulo hashing, which reshuffles (and so invalidates) most replicas' caches on scale-out."""
    before, after = HashRing(["a", "b"]), HashRing(["a", "b", "c"])
    moved = [k for k in KEYS if before.owner(k) != after.owner(k)]
    assert moved and all(after.owner(k) == "c" for k in moved)
    assert len(moved) < len(KEYS) / 2


def test_a_request_goes_to_the_replica_owning_most_of_its_text():
    ring = HashRing(["a", "b"])
    on_a = [k for k in KEYS if ring.owner(k) == "a"][:3]
    on_b = [k for k in KEYS if ring.owner(k) == "b"][:1]
    assert affinity_ranking(ring, on_a + on_b) == ["a", "b"]
    assert affinity_ranking(ring, on_b * 5) == ["b"]  # a repeated document counts once


def test_job_documents_reads_every_job_shape():
    shared = {"query": "q", "documents": [{"text": "x"}, {"text": "y"}]}
    per_question = {"queries": ["q1", "q2"], "documents": [[{"text": "x"}], [{"text": "z"}]]}
    assert job_documents(shared) == ["x", "y"] and job_documents(per_question) == ["x", "z"]
    assert job_documents({"messages": [{"role": "user", "content": "hi"}]}) == [] and job_documents(None) == []
