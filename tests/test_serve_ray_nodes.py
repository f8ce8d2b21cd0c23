"""Ray Serve replicas on a two-node cluster of logical GPUs (``ray.cluster_utils.Cluster``: two raylets on this
machine), joined as ``serve --ray --ray-address`` joins one.

Each node has one GPU (Ray's GPU resources are logical: Ray sets ``CUDA_VISIBLE_DEVICES`` for a replica
reserving one even with no GPU in the machine, Ray 2.60), so with one GPU per replica and no replica count
the app has one replica per GPU of the cluster: two, one on each node, while the tiny engines stay on the
CPU. Two replicas on one node with distinct GPUs: tests/test_serve_ray.py. The document-affinity router keys
on Ray Serve's replica ids, not on a host or process, so every set of documents comes back to one replica
wherever it runs. Slow (two raylets, Serve, two replicas and a gateway start: about two minutes on a busy
2-core machine).
"""

from __future__ import annotations

import httpx
import pytest

from tests.serve_support import free_port, replica_stats, tiny_engine

pytestmark = pytest.mark.slow
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

WORDS = "harbour bridge market winter tower library garden railway museum festival island treaty".split()


def _doc_sets(count: int) -> list[list[dict]]:
    return [[{"text": f"In node {i} the {WORDS[i % 12]} opened in {1800 + i}.", "id": f"n{i}"},
             {"text": f"Set {i} of the {WORDS[(i + 7) % 12]} closes at noon.", "id": f"m{i}"}]
            for i in range(count)]


@pytest.fixture(scope="module")
def cluster_app(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from ctx_integrations.serve.gpu_placement import replica_count
    from ctx_integrations.serve.ray_app import build_app, cluster_node_gpus, connect, start, stop

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_raylet_start_wait_time_s", "120")  # as tests/test_serve_ray.py: a busy 2-core machine
        patch.setattr("ray.serve._private.api.HTTP_PROXY_TIMEOUT", 180)
        patch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")  # as tests/test_serve_ray.py, for the same load
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1,
                                                                "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1, num_gpus=1)
            cluster.wait_for_nodes()
            connect(address=cluster.address)
            replicas = replica_count(None, 1, cluster_node_gpus())
            port = free_port()
            # one HTTP proxy (on the head): both nodes are this machine, so a proxy per node would share the port
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            app = build_app(replicas=replicas, cache_dir=tmp_path_factory.mktemp("kv"), gpus_per_replica=1,
                            engine_factory="tests.serve_support:tiny_engine", engine_options={"device": "cuda"})
            start(app, port=port, address=cluster.address)
            yield f"http://127.0.0.1:{port}", replicas
        finally:
            if ray.is_initialized():
                stop()
            cluster.shutdown()


def test_one_replica_per_gpu_of_the_cluster_on_each_node_with_the_device_setting(cluster_app):
    """Bugs caught: replicas reserving no GPU (Ray does not set CUDA_VISIBLE_DEVICES, both could land on one node),
    the replica count taken from one node's GPUs, or ``--device cuda`` not reaching a replica on another node."""
    _, replicas = cluster_app
    assert replicas == 2
    placed = replica_stats(2)
    assert len(placed) == 2, f"not every replica answered: {placed}"
    assert {stats["device"] for stats in placed.values()} == {"cuda:0"}
    assert len({stats["placement"]["node"] for stats in placed.values()}) == 2, placed
    assert [stats["placement"]["cuda_visible_devices"] for stats in placed.values()] == ["0", "0"]


def test_the_affinity_router_keeps_each_document_set_on_one_replica_across_nodes(cluster_app):
    """Bugs caught: a router keyed on something one host or process owns (replicas on the second node never
    chosen, or a set of documents moving between replicas), or answers differing from one engine's."""
    url, _ = cluster_app
    placed = replica_stats(2)
    node_of = {name: stats["placement"]["node"] for name, stats in placed.items()}
    engine = tiny_engine()
    replica_of: dict[int, str] = {}
    for round_ in range(2):
        for i, docs in enumerate(_doc_sets(12)):
            body = {"query": f"When did {i} open?", "documents": docs, "max_new_tokens": 2}
            answer = httpx.post(f"{url}/v1/answer", json=body, timeout=120).json()
            if round_ == 0:
                assert answer["token_ids"] == engine.generate(body["query"], docs, max_new_tokens=2).token_ids
                replica_of[i] = answer["replica"]
            else:  # the replica that computed them holds them in memory
                assert answer["replica"] == replica_of[i]
                assert answer["cache"]["hits"] == 2 and answer["cache"]["misses"] == 0
    assert len({node_of[name] for name in replica_of.values()}) == 2, "no document set went to the second node"
