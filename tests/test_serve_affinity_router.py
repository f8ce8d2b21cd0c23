"""The document-affinity router (``DocumentAffinityRouter.choose_replicas``) on stand-in replicas: no Ray cluster.

Replicas stand in as what the router reads of Ray Serve's ``RunningReplica``: ``replica_id.unique_id`` and, to
show the router ignores it, the node it runs on."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from ctx_integrations.serve.routing import HashRing, affinity_ranking

ray_app = pytest.importorskip("ctx_integrations.serve.ray_app")

NAMES = ["r0ab12cd", "r1ef34gh", "r2ij56kl"]


def _replica(name: str, node: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), node_id=node)


def _router(queue_lens: dict[str, int] | None = None):
    router = object.__new__(ray_app.DocumentAffinityRouter)  # Ray Serve builds it with its deployment's state
    router.initialize_state()
    lens = queue_lens or {}
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: lens.get(replica_id.unique_id))
    return router


def _choose(router, replicas, job):
    pending = SimpleNamespace(args=[job], kwargs={})
    return asyncio.run(router.choose_replicas(replicas, pending))


def _names(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_owner_is_the_rings_whatever_node_each_replica_runs_on():
    """Bug caught: a router keyed on a host, process or node (replicas on a second node never owning a document,
    or owners changing when a replica moves to another node)."""
    one_node = [_replica(name, "node-a") for name in NAMES]
    two_nodes = [_replica(name, node) for name, node in zip(NAMES, ["node-a", "node-b", "node-b"])]
    ring = HashRing(NAMES)
    owners = Counter()
    for i in range(30):
        job = {"query": "q", "documents": [{"text": f"document {i}"}, {"text": f"other {i}"}]}
        expected = affinity_ranking(ring, [d["text"] for d in job["documents"]])[0]
        for replicas in (one_node, two_nodes, list(reversed(two_nodes))):
            first, rest = _names(_choose(_router(), replicas, job))
            assert first == [expected] and sorted(rest) == sorted(set(NAMES) - {expected})
        owners[expected] += 1
    assert len(owners) == 3, f"30 document sets never reached a replica: {owners}"


def test_requests_without_documents_are_not_all_sent_to_the_first_idle_replica():
    """Bug caught: one rank in Ray's order (Ray takes the first of equally loaded replicas), so every chat
    without documents went to one replica while the others idled."""
    replicas = [_replica(name, "node-a") for name in NAMES]
    firsts = Counter(_names(_choose(_router(), replicas, {"messages": []}))[0][0] for _ in range(60))
    assert set(firsts) == set(NAMES), firsts


def test_a_busy_owner_is_ranked_after_the_others():
    """Bug caught: the ``imbalance`` rule lost (an owner with a long queue still ranked first)."""
    replicas = [_replica(name, f"node-{i}") for i, name in enumerate(NAMES)]
    job = {"query": "q", "documents": ["a document"]}
    owner = affinity_ranking(HashRing(NAMES), ["a document"])[0]
    busy = _names(_choose(_router({owner: 9, **{n: 0 for n in NAMES if n != owner}}), replicas, job))
    assert busy[1] == [owner] and owner not in busy[0]
