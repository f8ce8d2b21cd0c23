"""Engine replicas on Ray Serve, on one Ray cluster of this machine's nodes (127.0.0.1) that serves two apps in turn.

One cluster for the whole module (starting Ray is most of the module's time; the last test shuts it down),
started as ``serve --ray`` starts a local one (:func:`connect`: loopback only), with more raylets added on this
machine as nodes (``ray.cluster_utils``). Ray's GPUs are logical: Ray sets a replica's ``CUDA_VISIBLE_DEVICES``
even with no GPU in the machine, while the tiny engines stay on the CPU.

- Two nodes of one GPU each (the head and a second node): with one GPU per replica and no replica count, the
  app has one replica per GPU of the cluster, one on each node; the document-affinity router keys on Ray
  Serve's replica ids, not on a host or process, so every set of documents comes back to one replica wherever
  it runs.
- Then the gateway app of ``serve --ray``: two replicas on a third node of two GPUs (the first two nodes' GPUs
  are held by a placement group), a shared KV folder, a Chroma server. The replicas run the same tiny
  random-weight model as the in-process engine here, so every answer through Ray must equal ``engine.generate``
  token for token; and the cache-affinity router must send every request for one set of documents to the same
  replica, while different sets use both. The corpus is ingested first, as ``ctx-experts ingest`` does (caches
  computed into the store's folder), and the app is built without naming a KV folder: the replicas must find
  ingestion's caches on disk.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_support import chroma_server, free_port, replica_stats, sse_events, tiny_engine

pytestmark = pytest.mark.slow
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

MAX_DOCUMENTS = 6  # the gateway's limit, below the default: shows the app's limits reach it
SERVED_NAME, API_KEY = "ray-tiny", "ray-test-key"  # the gateway's name and key: shows they reach it too
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WORDS = "harbour bridge market winter tower library garden railway museum festival island treaty".split()


def _doc_sets(count: int) -> list[list[dict]]:
    return [[{"text": f"The {WORDS[i % 12]} of Velmora number {i} opened in {1900 + i}.", "id": f"a{i}"},
             {"text": f"Set {i}: the {WORDS[(i + 5) % 12]} closes at dusk in winter.", "id": f"b{i}"}]
            for i in range(count)]


def _node_doc_sets(count: int) -> list[list[dict]]:
    return [[{"text": f"In node {i} the {WORDS[i % 12]} opened in {1800 + i}.", "id": f"n{i}"},
             {"text": f"Set {i} of the {WORDS[(i + 7) % 12]} closes at noon.", "id": f"m{i}"}]
            for i in range(count)]


@dataclass
class RayCluster:
    """The module's Ray cluster: the head this process started, the nodes added to it, Serve's one HTTP port."""

    port: int
    added: Any  # a ray.cluster_utils.Cluster over the head this process started: it adds and removes the others

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_node(self, **resources) -> None:
        """A raylet on this machine joining the head, on loopback as the head is (``_single_machine_ray``)."""
        from ctx_integrations.serve.ray_app import _single_machine_ray

        with _single_machine_ray():
            self.added.add_node(node_ip_address="127.0.0.1", **resources)

    def daemon_pids(self) -> set[int]:
        """The added nodes' own processes: those their ``Node`` started (the raylet) and the agents each raylet runs."""
        import psutil

        started = {info.process.pid for node in self.added.worker_nodes for infos in node.all_processes.values()
                   for info in infos}
        agents = {child.pid for pid in started for child in psutil.Process(pid).children()
                  if _title(child).startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))}
        return started | agents

    def remove_nodes(self) -> None:
        for node in list(self.added.worker_nodes):
            self.added.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray._private.worker import global_worker
    from ray.cluster_utils import Cluster

    from ctx_integrations.serve.ray_app import connect, stop

    with pytest.MonkeyPatch.context() as patch:
        # Ray gives its raylet 30 s to register (RAY_raylet_start_wait_time_s); on a 2-core machine busy with other
        # test workers it took longer and every test of the module errored at setup
        patch.setenv("RAY_raylet_start_wait_time_s", "120")
        # and Serve gives its HTTP proxy 60 s to be ready (a constant, not a setting): under the same load it took
        # longer once (an Intel 2-core machine, an evaluation beside the suite) and every test errored at setup
        patch.setattr("ray.serve._private.api.HTTP_PROXY_TIMEOUT", 180)
        # and Serve's controller kills a proxy not ready within 5 s (its worker had not even started, with other
        # test processes on both cores): the setup then failed with the proxy's ActorDiedError
        patch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        connect(num_cpus=2, num_gpus=1)  # the local cluster of `serve --ray` (its head listens on loopback only)
        nodes = RayCluster(free_port(), Cluster())
        nodes.added.head_node = global_worker.node
        nodes.added.redis_address = global_worker.node.redis_address
        try:
            nodes.add_node(num_cpus=1, num_gpus=1)
            # one HTTP proxy (on the head): every node is this machine, so a proxy per node would share the port
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": nodes.port})
            yield nodes
        finally:
            if ray.is_initialized():  # the last test stops it (and times that)
                stop()
            nodes.remove_nodes()


@pytest.fixture(scope="module")
def cluster_app(cluster, tmp_path_factory):
    """The app on the first two nodes (one GPU each): one replica per GPU of the cluster; yields (url, replicas)."""
    from ctx_integrations.serve.gpu_placement import replica_count
    from ctx_integrations.serve.ray_app import build_app, cluster_node_gpus, start

    replicas = replica_count(None, 1, cluster_node_gpus())
    app = build_app(replicas=replicas, cache_dir=tmp_path_factory.mktemp("kv"), gpus_per_replica=1,
                    engine_factory="tests.serve_support:tiny_engine", engine_options={"device": "cuda"})
    start(app, port=cluster.port)
    yield cluster.url, replicas


@dataclass
class RayApp:
    url: str
    kv_dir: Path  # where ingestion wrote the caches
    chroma_pid: int
    cluster: RayCluster


@pytest.fixture(scope="module")
def ray_app(cluster, tmp_path_factory):
    """The gateway app, replacing ``cluster_app``'s: two replicas, both on a node of two GPUs added for them."""
    import ray
    from ray.util.placement_group import placement_group

    from ctx_integrations.cli import load_demo_corpus
    from ctx_integrations.retrieval.store import DocumentStore
    from ctx_integrations.serve.limits import ServerLimits
    from ctx_integrations.serve.ray_app import build_app, cluster_node_gpus, start

    serve.delete("ctx")  # cluster_app's, if it ran: its replicas free their GPUs
    held = placement_group([{"GPU": 1}] * int(sum(cluster_node_gpus())), strategy="SPREAD")
    assert held.wait(timeout_seconds=60), "the first nodes' GPUs were not free"  # so no replica lands there
    cluster.add_node(num_cpus=2, num_gpus=2)
    data = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as patch, chroma_server(data) as chroma_url:
        patch.setenv("CTX_CACHE_DIR", str(data / "cache"))  # the default KV folder of ingest and serve lives here
        store = DocumentStore(chroma_url)
        store.engine = tiny_engine(cache_dir=store.kv_dir)  # what `ctx-experts ingest` does: caches computed now
        assert store.add(load_demo_corpus()[0]).cache_misses > 0
        chroma_pid = next(p.pid for p in _ray_processes() if "chroma" in " ".join(p.cmdline()))
        app = build_app(replicas=2, store_url=chroma_url, engine_factory="tests.serve_support:tiny_engine",
                        limits=ServerLimits(max_documents=MAX_DOCUMENTS), served_model_name=[SERVED_NAME],
                        api_key=API_KEY, gpus_per_replica=1, engine_options={"device": "cuda"})
        start(app, port=cluster.port)
        yield RayApp(cluster.url, store.kv_dir, chroma_pid, cluster)
        if ray.is_initialized():
            ray.util.remove_placement_group(held)


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
        for i, docs in enumerate(_node_doc_sets(12)):
            body = {"query": f"When did {i} open?", "documents": docs, "max_new_tokens": 2}
            answer = httpx.post(f"{url}/v1/answer", json=body, timeout=120).json()
            if round_ == 0:
                assert answer["token_ids"] == engine.generate(body["query"], docs, max_new_tokens=2).token_ids
                replica_of[i] = answer["replica"]
            else:  # the replica that computed them holds them in memory
                assert answer["replica"] == replica_of[i]
                assert answer["cache"]["hits"] == 2 and answer["cache"]["misses"] == 0
    assert len({node_of[name] for name in replica_of.values()}) == 2, "no document set went to the second node"


def _ray_processes() -> list:
    """This process and every process it started: the driver, GCS, raylet, agents, workers (and Chroma)."""
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _listening(process) -> list[tuple[str, int]]:
    import psutil

    try:
        return [(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _title(process) -> str:
    import psutil

    try:
        return " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def test_the_first_request_after_ingestion_reads_its_caches_from_disk_on_every_replica(ray_app):
    """Bugs caught: replicas pointed at another KV folder than ingestion's (the docs' old ``--cache-dir
    ./kv-shared`` recipe: every first request recomputes its documents), or an app whose default folder
    differs from ``ingest``'s."""
    assert any(ray_app.kv_dir.rglob("*.safetensors")), "ingestion wrote no cache to the store's folder"
    from ctx_integrations.cli import load_demo_corpus

    first_answer = {}
    for document in load_demo_corpus()[0]:  # each question retrieves other documents: they spread over replicas
        body = {"query": document.text, "top_k": 2, "max_new_tokens": 2}
        answer = httpx.post(f"{ray_app.url}/v1/answer", json=body, headers=AUTH, timeout=120).json()
        assert answer["cache"]["misses"] == 0, f"a retrieved document was recomputed: {answer['cache']}"
        first_answer.setdefault(answer["replica"], answer["cache"])
        if len(first_answer) == 2:
            break
    assert len(first_answer) == 2, "every request went to one replica"
    for replica, cache in first_answer.items():  # a replica's memory tier is empty before its first request
        assert {tier: n for tier, n in cache["hits_by_tier"].items() if n} == {"disk": 2}, f"{replica}: {cache}"


def test_two_replicas_answer_like_one_engine_with_document_affinity(ray_app):
    """Bugs caught: a router ignoring the documents (random replica per request, caches computed twice);
    replicas answering differently from the engine (a job field lost on the way through Ray)."""
    engine = tiny_engine()
    replica_of = {}
    for round_ in range(2):
        for i, docs in enumerate(_doc_sets(12)):
            body = {"query": f"When did number {i} open?", "documents": docs, "max_new_tokens": 3}
            answer = httpx.post(f"{ray_app.url}/v1/answer", json=body, headers=AUTH, timeout=120).json()
            assert answer["token_ids"] == engine.generate(body["query"], docs, max_new_tokens=3).token_ids
            if round_ == 0:
                replica_of[i] = answer["replica"]
            else:  # the same documents come back to the replica whose memory holds their caches
                assert answer["replica"] == replica_of[i]
                assert answer["cache"] == {**answer["cache"], "hits": 2, "misses": 0}
                if "hits_by_tier" in answer["cache"]:
                    assert answer["cache"]["hits_by_tier"].get("memory") == 2
    assert len(set(replica_of.values())) == 2, "every document set went to one replica"


def test_retrieval_from_the_chroma_server_streams_through_a_replica(ray_app):
    """Bug caught: the gateway not reaching the Chroma server, or streams not crossing the replica boundary."""
    body = {"query": "Who founded the city?", "top_k": 3, "max_new_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{ray_app.url}/v1/answer", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    answer = json.loads(events[-1][1])
    assert events[-1][0] == "answer" and "".join(json.loads(d)["text"] for _, d in events[:-1]) == answer["text"]
    assert len(answer["documents"]) == 3 and all("fused" in d["scores"] for d in answer["documents"])


def test_each_replica_reserves_its_own_gpu_and_gets_the_device_setting(ray_app):
    """Bugs caught: replicas reserving no GPU (Ray leaves CUDA_VISIBLE_DEVICES alone: every engine on cuda:0),
    two replicas on one GPU, or ``--device cuda`` not reaching a replica (or reaching it as the physical GPU
    index, which a replica that sees one GPU does not have)."""
    placed = replica_stats(2)
    assert len(placed) == 2, f"not every replica answered: {placed}"
    assert {stats["device"] for stats in placed.values()} == {"cuda:0"}
    visible = sorted(stats["placement"]["cuda_visible_devices"] for stats in placed.values())
    assert visible == ["0", "1"], placed
    assert all(stats["placement"]["gpus"] == [stats["placement"]["cuda_visible_devices"]] for stats in placed.values())


def test_a_replica_error_is_a_4xx_naming_the_field(ray_app):
    """Bug caught: an error raised in a replica reaching the client as a 500 with Ray's remote trace."""
    response = httpx.post(f"{ray_app.url}/v1/answer", json={"query": "q", "documents": ["x"], "mode": "pced",
                                                        "options": {"gamma": -1}}, headers=AUTH, timeout=60)
    assert response.status_code == 422 and response.json()["error"]["param"] == "options"
    assert "Traceback" not in response.json()["error"]["message"]


def test_the_gateway_applies_the_apps_request_limits(ray_app):
    """Bug caught: ``build_app(limits=...)`` (``serve --ray --max-documents``) not reaching the gateway."""
    body = {"query": "q", "documents": ["x"] * (MAX_DOCUMENTS + 1), "max_new_tokens": 1}
    response = httpx.post(f"{ray_app.url}/v1/answer", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "documents" and str(MAX_DOCUMENTS) in error["message"]


def test_the_gateway_requires_the_api_key_and_answers_to_the_served_name(ray_app):
    """Bug caught: ``build_app(api_key=..., served_model_name=...)`` (``serve --ray --api-key``) not reaching the
    gateway: an open API behind Ray, or the old default name "ctx-integrations (ray)"."""
    refused = httpx.get(f"{ray_app.url}/v1/models", timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(f"{ray_app.url}/v1/models", headers=AUTH, timeout=60).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert httpx.get(f"{ray_app.url}/healthz", timeout=60).status_code == 200


def test_every_ray_process_listens_on_loopback_only(ray_app):
    """Bug caught: Ray's GCS, raylet, object manager, workers, dashboard agent or metrics exporters bound to
    0.0.0.0 / :: although the app was started for 127.0.0.1 (Ray's default when the node's address is not
    loopback). The one documented exception: Serve's inter-deployment gRPC server, one per replica."""
    listeners, exceptions = [], []
    for process in _ray_processes():
        if process.pid == ray_app.chroma_pid:
            continue
        for ip, port in _listening(process):
            address = ipaddress.ip_address(ip.split("%")[0])
            address = getattr(address, "ipv4_mapped", None) or address  # ::ffff:127.0.0.1 is loopback too
            if address.is_loopback:
                listeners.append((ip, port))
            elif address.is_unspecified and _title(process).startswith("ray::ServeReplica"):
                exceptions.append((process.pid, port))
            else:
                raise AssertionError(f"{_title(process)} (pid {process.pid}) listens on {ip}:{port}")
    assert len(listeners) >= 5, f"too few Ray listeners found to be meaningful: {listeners}"
    pids = [pid for pid, _ in exceptions]  # the gateway and two engine replicas: one port each at most
    assert len(pids) == len(set(pids)) <= 3, f"more than Serve's one gRPC port per replica: {exceptions}"


def test_serve_and_ray_shut_down_in_under_10_s(ray_app):
    """Bug caught: a shutdown waiting on Ray's defaults (a 2 s drain poll per replica, the controller's 30 s
    timeout) or on a replica that never stops, and Ray processes left running after it."""
    import ray

    from ctx_integrations.serve.ray_app import stop

    seconds = stop()
    assert not ray.is_initialized()
    assert seconds["total"] < 10, f"shutdown took {seconds} s"
    # the nodes this module added to the head are not the app's to stop, but every worker of theirs must be gone
    daemons = ray_app.cluster.daemon_pids()
    workers = [_title(p) for p in _left(ray_app) if p.pid not in daemons]
    assert not workers, f"processes still running after shutdown: {workers}"
    ray_app.cluster.remove_nodes()
    left = [_title(p) for p in _left(ray_app)]
    assert not left, f"processes still running after the added nodes stopped: {left}"


def _left(ray_app) -> list:
    """The processes this one started that still run, but Chroma and its own compile workers."""
    return [p for p in _ray_processes()[1:] if p.pid != ray_app.chroma_pid and p.is_running()
            and p.status() != "zombie" and not _own_compile_worker(p)]


def _own_compile_worker(process) -> bool:
    """A structured-output compile zygote (or its worker) that this test process started (for another test in the
    same pytest worker; it lives as long as its engine's process): not Ray's. A replica's would have a Ray worker
    as its parent, and would count."""
    import os

    import psutil

    try:
        zygote = next((p for p in [process, *process.parents()] if p.ppid() == os.getpid()), None)
        return zygote is not None and "compile_worker" in " ".join(zygote.cmdline())
    except psutil.Error:
        return False
