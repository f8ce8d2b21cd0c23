"""``ctx-experts serve``: load the engine (and the store), then run uvicorn or the Ray Serve app.

uvicorn handles SIGTERM/SIGINT: it stops accepting connections, waits up to ``--drain-timeout`` for
the requests in flight (streams included) to finish, then runs the app's shutdown, which closes
the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctx_integrations.errors import InvalidOptionError, missing_dependency


def _require(module: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as error:
        raise missing_dependency(module, extra) from error


def serve(args: argparse.Namespace, open_store: Callable[[argparse.Namespace, bool], Any]) -> int:
    if not 0 < args.port < 65536:
        raise InvalidOptionError(f"--port must be in 1..65535, got {args.port}")
    if args.ray:
        _require("ray.serve", "ray")
        from ctx_integrations.serve.ray_app import run_ray_serve

        return run_ray_serve(args)
    _require("fastapi", "serve")
    _require("uvicorn", "serve")
    import uvicorn

    from ctx_integrations.engine.core.engine import Engine
    from ctx_integrations.serve.app import create_app

    store = open_store(args, True) if args.store else None
    cache_dir = Path(args.cache_dir) if args.cache_dir else (store.kv_dir if store is not None else None)
    options = {} if args.max_queued is None else {"max_queued_requests": args.max_queued}
    engine = Engine.from_pretrained(args.model, device=args.device, cache_dir=cache_dir, **options)
    if store is not None:
        store.engine = engine
    app = create_app(engine, store, max_in_flight=args.max_in_flight)
    print(f"serving {engine.loaded.name} on http://{args.host}:{args.port} "
          f"(store: {store.location if store is not None else 'none'})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.drain_timeout)
    return 0
