"""Scale-out on Ray Serve: N engine replicas behind a router that keeps each document on one replica.

Three pieces, all Ray Serve's own facilities:

- :class:`EngineReplica`, a deployment with ``num_replicas`` copies of the engine. Their KV caches
  persist in one shared folder (``Engine(cache_dir=shared)``), so a cache computed by one replica is
  a disk hit for the others; the memory tier stays per replica, and that is what routing protects.
- :class:`DocumentAffinityRouter`, a Ray Serve ``RequestRouter`` (``request_router_config``): it ranks
  the replica that owns most of the request's documents on a consistent-hash ring first and every
  other replica second. Ray Serve's router then takes the first rank's replica unless its queue is
  full (``max_ongoing_requests``), else the least loaded of the rest; the router also puts the
  others first when the owner is ``imbalance`` requests busier than the least loaded replica.
- :class:`Gateway`, the HTTP ingress: the same FastAPI app as ``ctx-experts serve``
  (:func:`~ctx_integrations.serve.app.create_app`), with a :class:`RayBackend` that sends each job
  through a ``DeploymentHandle``, and the document store on a Chroma server reached over HTTP.
  Retrieval happens in the gateway, so the router sees the documents of every request.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ctx_integrations.errors import CtxIntegrationsError, InvalidOptionError
from ctx_integrations.serve.backend import LocalBackend
from ctx_integrations.serve.routing import HashRing, affinity_ranking, job_documents


class DocumentAffinityRouter(RequestRouter):
    """Send a request to the replica most likely to hold its documents' caches; else to the least loaded."""

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
            return [candidate_replicas]  # a chat without documents: Ray picks the least loaded
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = affinity_ranking(self._ring_for(candidate_replicas), texts)
        owner = by_name[ranked[0]]
        others = [r for r in candidate_replicas if r is not owner]
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


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=DocumentAffinityRouter),
                  max_ongoing_requests=8, ray_actor_options={"num_cpus": 1})
class EngineReplica:
    """One engine (the scheduler batches the requests Ray sends it concurrently); answers carry ``replica``."""

    def __init__(self, model: str | None, cache_dir: str | None, engine_factory: str | None = None,
                 threads: int | None = 1):
        import torch

        if threads:
            torch.set_num_threads(threads)
        factory = _engine_factory(engine_factory)
        if factory is not None:
            engine = factory(cache_dir=cache_dir)
        else:
            from ctx_integrations.engine.core.engine import Engine

            engine = Engine.from_pretrained(model, cache_dir=cache_dir)
        self.backend = LocalBackend(engine)
        self.name = serve.get_replica_context().replica_id.unique_id

    async def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        return {**await self.backend.answer(job), "replica": self.name}

    async def stream(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for event in self.backend.stream(job):
            yield {"answer": {**event["answer"], "replica": self.name}} if "answer" in event else event

    async def batch(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**a, "replica": self.name} for a in await self.backend.batch(job)]

    def stats(self) -> dict[str, Any]:
        return {"replica": self.name, **self.backend.stats()}


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


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Gateway:
    """The HTTP ingress: validation, retrieval from the Chroma server, metrics; answers come from replicas."""

    def __init__(self, engines: Any, store_url: str | None, max_in_flight: int | None = None,
                 model_name: str | None = None):
        from ctx_integrations.retrieval.store import DocumentStore

        self.backend = RayBackend(engines)
        self.store = DocumentStore(store_url) if store_url else None
        self.max_in_flight, self.model_name = max_in_flight, model_name

    def __serve_build_asgi_app__(self) -> Any:
        from ctx_integrations.serve.app import create_app

        return create_app(backend=self.backend, store=self.store, max_in_flight=self.max_in_flight,
                          model_name=self.model_name or "ctx-integrations (ray)")


def build_app(*, replicas: int, cache_dir: str | os.PathLike, store_url: str | None = None,
              model: str | None = None, engine_factory: str | None = None, max_in_flight: int | None = None,
              max_ongoing_requests: int = 8) -> Any:
    """The bound Ray Serve application: ``Gateway`` over ``replicas`` copies of ``EngineReplica``.

    ``cache_dir``: the KV folder every replica shares. ``store_url``: a Chroma server
    (``http://host:port``) for retrieval, or ``None`` (documents inline only). ``engine_factory``:
    ``"module:function"`` building the engine from ``cache_dir=`` (tests use a tiny model).
    """
    if replicas < 1:
        raise InvalidOptionError(f"replicas must be >= 1, got {replicas}")
    if store_url is not None and not store_url.startswith(("http://", "https://")):
        raise InvalidOptionError(f"the store of a Ray Serve app must be a Chroma server URL, got {store_url!r}: "
                                 "start one with `chroma run --path DIR --port PORT`")
    engines = EngineReplica.options(num_replicas=replicas, max_ongoing_requests=max_ongoing_requests).bind(
        model, str(cache_dir), engine_factory)
    return Gateway.bind(engines, store_url, max_in_flight, model)


def start(app: Any, *, host: str = "127.0.0.1", port: int = 8000, num_cpus: int = 2, name: str = "ctx") -> None:
    """Start a local Ray cluster (bounded resources, no dashboard) and run ``app`` on http://host:port."""
    import ray

    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix="/")


def run_ray_serve(args: Any) -> int:
    """``ctx-experts serve --ray``: run until interrupted, then shut Serve and Ray down (draining requests)."""
    import signal
    import threading

    import ray

    from ctx_integrations.paths import kv_root

    if args.store and not str(args.store).startswith(("http://", "https://")):
        raise InvalidOptionError("--ray needs --store to be a Chroma server URL (http://127.0.0.1:PORT, started "
                                 "with `chroma run`), since every replica and the gateway reach it over HTTP")
    cache_dir = args.cache_dir or str(kv_root())  # the root `ingest` fills: replicas start with its caches
    app = build_app(replicas=args.replicas, cache_dir=cache_dir, store_url=args.store, model=args.model,
                    max_in_flight=args.max_in_flight)
    start(app, host=args.host, port=args.port, num_cpus=args.ray_cpus or args.replicas)
    print(f"serving {args.replicas} replicas on http://{args.host}:{args.port} (Ray Serve; KV caches in "
          f"{cache_dir}; store: {args.store or 'none'})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()  # Serve drains the replicas' ongoing requests (graceful_shutdown_timeout_s)
    ray.shutdown()
    return 0
