"""Scale-out on Ray Serve: N engine replicas behind a router that keeps each document on one replica.

Three pieces, all Ray Serve's own facilities:

- :class:`EngineReplica`, a deployment with ``num_replicas`` copies of the engine, each reserving one CPU
  and ``gpus_per_replica`` GPUs (``ray_actor_options``), so Ray places them on distinct GPUs of the
  cluster's nodes (or shares one GPU by fraction); each engine takes the GPU Ray gave it
  (:mod:`~ctx_integrations.serve.gpu_placement`). Their KV caches persist in one shared folder
  (``Engine(cache_dir=shared)``), so a cache computed by one replica is a disk hit for the others (on
  several machines: when that folder is shared storage); the memory tier stays per replica, and that is
  what routing protects.
- :class:`DocumentAffinityRouter`, a Ray Serve ``RequestRouter`` (``request_router_config``): it ranks
  the replica that owns most of the request's documents on a consistent-hash ring first and every
  other replica second. Ray Serve's router then takes the first rank's replica unless its queue is
  full (``max_ongoing_requests``), else the least loaded of the rest; the router also puts the
  others first when the owner is ``imbalance`` requests busier than the least loaded replica.
- :class:`Gateway`, the HTTP ingress: the same FastAPI app as ``ctx-experts serve``
  (:func:`~ctx_integrations.serve.app.create_app`), with a :class:`RayBackend` that sends each job
  through a ``DeploymentHandle``, and the document store on a Chroma server reached over HTTP.
  Retrieval happens in the gateway, so the router sees the documents of every request.

Two choices the CLI and the Python API share, so one documented recipe works:

- **The KV folder is the one ingestion wrote.** :func:`kv_folder` resolves it as ``ctx-experts ingest``
  does (the user's KV root, unless a folder is given), so the replicas' first request after
  ingestion is a disk hit instead of a recomputation into an empty folder.
- **Ray stays on the interface the user asked for.** Ray binds its own gRPC servers (GCS, raylet,
  object manager, workers, dashboard agent, metrics) to loopback only when the node's address is
  loopback; :func:`start` passes ``_node_ip_address`` for a loopback ``host`` (the default), and
  Serve's HTTP proxy gets the same host. Serve's inter-deployment gRPC server is the one exception
  (Ray hard-codes ``[::]:0``): docs/serving.md says so and how to firewall it.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ctx_integrations.errors import CtxIntegrationsError, InvalidOptionError
from ctx_integrations.paths import kv_root
from ctx_integrations.serve.auth import api_keys
from ctx_integrations.serve.backend import LocalBackend
from ctx_integrations.serve.gpu_placement import (
    check_gpus_per_replica,
    check_replica_device,
    default_gpus_per_replica,
    replica_count,
    replica_device,
)
from ctx_integrations.serve.limits import ServerLimits
from ctx_integrations.serve.model_names import model_id, served_model_names
from ctx_integrations.serve.routing import HashRing, affinity_ranking, job_documents


def _shuffled(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """``replicas`` in a random order: Ray Serve takes the first of equally loaded replicas in a rank, so an
    unshuffled rank would send every request without documents (or every spill) to the same idle replica."""
    return random.sample(replicas, len(replicas))


class DocumentAffinityRouter(RequestRouter):
    """Send a request to the replica most likely to hold its documents' caches; else to the least loaded.

    It keys on Ray Serve's replica ids (unique in the cluster), never on a host, process or node, so replicas
    on several nodes share one ring, and the router works wherever the handle calling it runs."""

    def initialize_state(self, imbalance: int = 4, vnodes: int = 64, **_: Any) -> None:
        self.imbalance, self.vnodes = imbalance, vnodes
        self._ring: HashRing | None = None

    def _ring_for(self, replicas: list[RunningReplica]) -> HashRing:
        names = sorted(r.replica_id.unique_id for r in replicas)
        if self._ring is None or self._ring.nodes != names:
            self._ring = HashRing(names, self.vnodes)
        return self._ring

    def _queue_len(self, replica: RunningReplica) -> int | None:
        return self.replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        texts = job_documents(pending_request.args[0]) if pending_request is not None and pending_request.args else []
        if not texts:
            return [_shuffled(candidate_replicas)]  # a chat without documents: Ray picks the least loaded
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = affinity_ranking(self._ring_for(candidate_replicas), texts)
        owner = by_name[ranked[0]]
        others = _shuffled([r for r in candidate_replicas if r is not owner])
        owner_len = self._queue_len(owner)
        lengths = [n for n in (self._queue_len(r) for r in others) if n is not None]
        if owner_len is not None and lengths and owner_len - min(lengths) >= self.imbalance:
            return [others, [owner]]
        return [[owner], others]


def _engine_factory(path: str | None) -> Any:
    if path is None:
        return None
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# How long a replica waits, once told to stop, for its requests in flight; it polls every
# SHUTDOWN_POLL_S (Ray's default 2 s poll made an idle shutdown pay for the poll on every replica).
DRAIN_TIMEOUT_S = 10.0
SHUTDOWN_POLL_S = 0.2


def replica_engine(model: str | None, cache_dir: str | None, engine_factory: str | None = None,
                   engine_options: dict[str, Any] | None = None) -> Any:
    """The engine of one replica: ``engine_factory(cache_dir=...)`` (tests), else ``model`` with ``engine_options``.

    Ray reserves one CPU per replica (``num_cpus=1``), so the engine runs one torch thread unless the options
    ask for more; the count is also set on this (the replica's) thread.
    """
    import torch

    options = {"threads": 1, **(engine_options or {})}
    torch.set_num_threads(options["threads"])
    factory = _engine_factory(engine_factory)
    if factory is not None:
        return factory(cache_dir=cache_dir)
    from ctx_integrations import Engine

    return Engine.from_pretrained(model, cache_dir=cache_dir, **options)


def placement(gpus_per_replica: float) -> dict[str, Any]:
    """Where this replica runs: its node, the GPU ids Ray assigned it and the ``CUDA_VISIBLE_DEVICES`` it sees."""
    import ray

    context = ray.get_runtime_context()
    assigned = [str(i) for i in context.get_accelerator_ids().get("GPU", [])] if gpus_per_replica else []
    return {"node": context.get_node_id(), "gpus": assigned,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=DocumentAffinityRouter),
                  max_ongoing_requests=8, ray_actor_options={"num_cpus": 1},
                  graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class EngineReplica:
    """One engine (the scheduler batches the requests Ray sends it concurrently); answers carry ``replica``.

    Its engine's device follows the GPUs Ray reserved for it (:func:`replica_device`); ``stats()`` says where
    it runs (``placement``) and on which device."""

    def __init__(self, model: str | None, cache_dir: str | None, engine_factory: str | None = None,
                 engine_options: dict[str, Any] | None = None, gpus_per_replica: float = 0.0):
        self.placement = placement(gpus_per_replica)
        options = dict(engine_options or {})
        options["device"] = replica_device(options.get("device"), gpus_per_replica, self.placement["gpus"],
                                           self.placement["cuda_visible_devices"])
        self.device = options["device"]
        self.backend = LocalBackend(replica_engine(model, cache_dir, engine_factory, options))
        self.name = serve.get_replica_context().replica_id.unique_id

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        return {**await self.backend.answer(job), "replica": self.name}

    async def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for event in self.backend.stream(job):
            yield {"answer": {**event["answer"], "replica": self.name}} if "answer" in event else event

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**a, "replica": self.name} for a in await self.backend.batch(job)]

    def stats(self) -> dict[str, Any]:
        return {"replica": self.name, "device": self.device, "placement": self.placement, **self.backend.stats()}


def _library_error(error: BaseException) -> BaseException:
    """The library error a replica raised (Ray wraps it with the remote trace), so it maps to a 4xx."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, CtxIntegrationsError) else error


class RayBackend:
    """A :class:`~ctx_integrations.serve.backend.Backend` that forwards jobs to :class:`EngineReplica` handles."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.handle.answer.remote(job)
        except CtxIntegrationsError as error:
            raise _library_error(error) from None

    async def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        events = self.handle.options(stream=True).stream.remote(job)
        try:
            async for event in events:
                yield event
        except CtxIntegrationsError as error:
            raise _library_error(error) from None
        finally:
            events.cancel()  # a no-op once finished; cancels the replica's request if the client left

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            return await self.handle.batch.remote(job)
        except CtxIntegrationsError as error:
            raise _library_error(error) from None

    def stats(self) -> dict[str, Any]:
        return {}  # per-replica engine stats are not aggregated here: a handle reaches one replica per call

    async def close(self) -> None:
        return None


@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S,
                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
@serve.ingress()
class Gateway:
    """The HTTP ingress: validation, retrieval from the Chroma server, metrics; answers come from replicas."""

    def __init__(self, engines: Any, store_url: str | None, max_in_flight: int | None = None,
                 model_names: tuple[str, ...] = ("ctx-integrations",), limits: ServerLimits | None = None,
                 api_keys: tuple[str, ...] = ()):
        from ctx_integrations.retrieval.store import DocumentStore

        self.backend = RayBackend(engines)
        self.store = DocumentStore(store_url) if store_url else None
        self.max_in_flight, self.model_names, self.limits, self.api_keys = max_in_flight, model_names, limits, api_keys

    def __serve_build_asgi_app__(self) -> Any:
        from ctx_integrations.serve.app import create_app

        return create_app(backend=self.backend, store=self.store, max_in_flight=self.max_in_flight,
                          model_name=self.model_names, limits=self.limits, api_key=self.api_keys or None)


def kv_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The KV root the replicas share: ``cache_dir`` if given, else the user's KV root (``$CTX_CACHE_DIR/kv``).

    That root is where ``ctx-experts ingest`` writes, whatever the store, and where ``ask``, ``serve``
    and the LlamaIndex / LangChain integrations look: one KV store per model, so replicas started
    after an ingestion find its caches on disk.
    """
    return Path(cache_dir).expanduser() if cache_dir is not None else kv_root()


def build_app(*, replicas: int, cache_dir: str | os.PathLike | None = None, store_url: str | None = None,
              model: str | None = None, engine_factory: str | None = None, max_in_flight: int | None = None,
              max_ongoing_requests: int = 8, drain_timeout_s: float = DRAIN_TIMEOUT_S,
              limits: ServerLimits | None = None, engine_options: dict[str, Any] | None = None,
              served_model_name: str | Sequence[str] | None = None, api_key: str | Sequence[str] | None = None,
              gpus_per_replica: float = 0.0) -> Any:
    """The bound Ray Serve application: ``Gateway`` over ``replicas`` copies of ``EngineReplica``.

    ``cache_dir``: the KV folder every replica shares (default :func:`kv_folder`: the one ingestion
    into ``store_url`` wrote). ``store_url``: a Chroma server (``http://host:port``) for retrieval, or
    ``None`` (documents inline only). ``engine_factory``: ``"module:function"`` building the engine from
    ``cache_dir=`` (tests use a tiny model). ``drain_timeout_s``: how long a stopping replica waits for
    its requests in flight. ``limits``: the gateway's request limits (default :class:`ServerLimits`'s);
    Ray's own HTTP proxy reads the request, so the header read deadline is not applied there.
    ``engine_options``: :class:`~ctx_integrations.Engine` options every replica's engine gets (``threads``,
    default 1 per replica; ``disk_format``; ``dtype``; the byte budgets), as ``ctx-experts serve --ray`` passes
    its flags. ``served_model_name`` / ``api_key``: as :func:`~ctx_integrations.serve.app.create_app`'s ``model_name``
    / ``api_key`` (default name: the model's, as an id; ``"ctx-integrations"`` with an ``engine_factory``).
    ``gpus_per_replica``: the GPUs each replica reserves (0: none, the engines run on the CPU unless
    ``engine_options["device"]`` says otherwise; a fraction shares one GPU); ``engine_options["device"]`` is then
    each replica's own device (``cuda``: the GPU Ray gave it), checked here.
    """
    check_gpus_per_replica(gpus_per_replica)
    check_replica_device((engine_options or {}).get("device"), gpus_per_replica)
    if replicas < 1:
        raise InvalidOptionError(f"replicas must be >= 1, got {replicas}")
    if drain_timeout_s < 0:
        raise InvalidOptionError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
    if store_url is not None and not store_url.startswith(("http://", "https://")):
        raise InvalidOptionError(f"the store of a Ray Serve app must be a Chroma server URL, got {store_url!r}: "
                                 "start one with `chroma run --path DIR --port PORT`")
    folder = kv_folder(cache_dir)
    shutdown = {"graceful_shutdown_timeout_s": drain_timeout_s}
    engines = EngineReplica.options(num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
                                    ray_actor_options={"num_cpus": 1, "num_gpus": gpus_per_replica},
                                    **shutdown).bind(model, str(folder), engine_factory, engine_options,
                                                     gpus_per_replica)
    return Gateway.options(**shutdown).bind(engines, store_url, max_in_flight,
                                            served_model_names(served_model_name, _default_id(model, engine_factory)),
                                            limits, api_keys(api_key))


def _default_id(model: str | None, engine_factory: str | None) -> str:
    if engine_factory is not None:
        return "ctx-integrations"
    from ctx_integrations import EMBEDDED_MODEL_NAME

    return model_id(model or EMBEDDED_MODEL_NAME)


def ray_node_address(host: str) -> str | None:
    """``"127.0.0.1"`` when ``host`` is loopback (Ray's own servers then stay on loopback), else ``None``.

    Ray (2.x) binds its gRPC servers, dashboard agent and metrics exporters to 127.0.0.1 exactly when the
    node's address is 127.0.0.1, and to every interface otherwise; ``None`` leaves Ray's choice (the
    machine's address, every interface) for a server that is meant to be reachable from outside.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        return "127.0.0.1" if ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # a host name other than localhost: Ray's own choice
        return None


@contextmanager
def _single_machine_ray() -> Iterator[None]:
    """While Ray starts: take 127.0.0.1 as this node's address, as Ray does on macOS and Windows.

    On Linux ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough: Ray replaces a loopback
    address with the machine's reachable one unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when
    Ray is imported, so this process's copy is set too; the environment carries it to the GCS and raylet
    started here). Both are restored once the cluster runs: it keeps the address it started with.
    """
    from ray._private import ray_constants

    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_RAY_CLUSTER_ENV)
    ray_constants.ENABLE_RAY_CLUSTER, os.environ[_RAY_CLUSTER_ENV] = False, "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = saved_env


_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect(*, address: str | None = None, host: str = "127.0.0.1", num_cpus: int = 2,
            num_gpus: int | None = None) -> None:
    """Join the Ray cluster at ``address`` (``ray.init(address=...)``, e.g. ``"auto"`` on a node that ran
    ``ray start``), else start a local one (``num_cpus`` / ``num_gpus``, no dashboard UI); nothing if joined already.

    A local cluster for a loopback ``host`` listens on loopback only; a joined cluster keeps its own addresses
    and resources (Ray refuses ``num_cpus`` when joining). Either way the replicas' workers get this checkout on
    their ``PYTHONPATH`` and one OpenMP thread.
    """
    import ray

    if ray.is_initialized():
        return
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}
    if address is not None:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
        return
    node_address = ray_node_address(host)
    with _single_machine_ray() if node_address else nullcontext():
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address=node_address, runtime_env=runtime_env)


def cluster_node_gpus() -> list[float]:
    """The GPUs of each live node of the cluster this process joined (Ray's ``GPU`` resource, logical or real)."""
    import ray

    return [float(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node.get("Alive")]


def start(app: Any, *, host: str = "127.0.0.1", port: int = 8000, num_cpus: int = 2, num_gpus: int | None = None,
          address: str | None = None, name: str = "ctx") -> None:
    """:func:`connect` (the cluster at ``address``, else a local one), then run ``app`` on http://host:port.

    With a loopback ``host`` every Ray process started here listens on loopback only, except Serve's
    inter-deployment gRPC server in each replica (Ray hard-codes ``[::]``); a cluster this process had
    already joined keeps its own addresses.
    """
    connect(address=address, host=host, num_cpus=num_cpus, num_gpus=num_gpus)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix="/")


def stop(*, joined: bool = False, name: str = "ctx") -> dict[str, float]:
    """Shut Serve down (each replica drains its requests in flight: ``drain_timeout_s``), then Ray.

    ``joined``: the cluster was joined (``connect(address=...)``), not started here: only the app ``name`` is
    deleted and this process leaves, so the cluster and its other Serve apps keep running.
    Returns the seconds each took (``serve``, ``ray``) and in all (``total``).
    """
    import ray

    started = time.perf_counter()
    if not joined:
        serve.shutdown()
    elif ray.is_initialized():
        try:
            serve.delete(name)
        except RayServeException:  # Serve never started there: there is no app to delete
            pass
    served = time.perf_counter()
    ray.shutdown()
    ended = time.perf_counter()
    return {"serve": served - started, "ray": ended - served, "total": ended - started}


def replica_options(args: Any, engine_options: dict[str, Any] | None) -> dict[str, Any]:
    """What every replica's ``Engine.from_pretrained`` gets from the command line: the engine flags and ``--device``
    (each replica loads its own model, so a device it is not told about would be silently its default)."""
    options = dict(engine_options or {})
    if getattr(args, "device", None):
        options["device"] = args.device
    return options


def gpus_per_replica_of(args: Any) -> float:
    """``--gpus-per-replica``, checked; not given: 1 when this (the driver's) machine has CUDA, else 0."""
    if args.gpus_per_replica is not None:
        return check_gpus_per_replica(args.gpus_per_replica)
    import torch

    return default_gpus_per_replica(args.device, torch.cuda.is_available())


def local_gpus() -> int:
    """The GPUs a local Ray cluster started here gets: the ones torch sees (``CUDA_VISIBLE_DEVICES`` applies)."""
    import torch

    return torch.cuda.device_count()


def run_ray_serve(args: Any, limits: ServerLimits | None = None, engine_options: dict[str, Any] | None = None,
                  keys: tuple[str, ...] = ()) -> int:
    """``ctx-experts serve --ray``: run until interrupted, then shut Serve and Ray down (draining requests).

    Every flag is checked before Ray starts; the number of replicas (``--replicas``, else one per
    ``--gpus-per-replica`` GPUs) is checked against the cluster's GPUs before any replica is placed: against a
    local cluster before it starts, against ``--ray-address``'s once joined (leaving it if they do not fit).
    """
    import signal
    import threading

    if args.store and not str(args.store).startswith(("http://", "https://")):
        raise InvalidOptionError("--ray needs --store to be a Chroma server URL (http://127.0.0.1:PORT, started "
                                 "with `chroma run`), since every replica and the gateway reach it over HTTP")
    if args.ray_address is not None and args.ray_cpus is not None:
        raise InvalidOptionError("--ray-cpus sizes a local Ray cluster; with --ray-address the cluster has its own "
                                 "CPUs (`ray start --num-cpus N` on each node): drop --ray-cpus")
    gpus = gpus_per_replica_of(args)
    options = replica_options(args, engine_options)
    cache_dir = kv_folder(args.cache_dir)

    def app_of(replicas: int) -> Any:
        return build_app(replicas=replicas, cache_dir=cache_dir, store_url=args.store, model=args.model,
                         max_in_flight=args.max_in_flight, drain_timeout_s=args.drain_timeout, limits=limits,
                         engine_options=options, served_model_name=args.served_model_name, api_key=keys or None,
                         gpus_per_replica=gpus)

    if args.ray_address is None:
        node_gpus = local_gpus() if gpus else 0
        replicas = replica_count(args.replicas, gpus, [node_gpus])
        app = app_of(replicas)
        start(app, host=args.host, port=args.port, num_cpus=args.ray_cpus or replicas,
              num_gpus=node_gpus if gpus else None)
    else:
        # every flag checked (by build_app) before joining; the count once the cluster's GPUs are known
        app_of(args.replicas if args.replicas is not None else 1)
        connect(address=args.ray_address)
        try:
            replicas = replica_count(args.replicas, gpus, cluster_node_gpus())
            start(app_of(replicas), host=args.host, port=args.port, address=args.ray_address)
        except BaseException:
            stop(joined=True)
            raise
    print(f"serving {replicas} replicas ({gpus:g} GPU(s) each) on http://{args.host}:{args.port} (Ray Serve; "
          f"cluster: {args.ray_address or 'local'}; KV caches in {cache_dir}; store: {args.store or 'none'})",
          flush=True)
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    stop_requested.wait()
    print(f"stopped in {stop(joined=args.ray_address is not None)['total']:.1f} s", flush=True)
    return 0
