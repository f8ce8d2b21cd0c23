"""``ctx-experts serve``: load the engine (and the store), then run uvicorn or the Ray Serve app.

uvicorn handles SIGTERM/SIGINT: it stops accepting connections, waits up to ``--drain-timeout`` for
the requests in flight (streams included) to finish, then runs the app's shutdown, which closes
the engine. The request limits (``--max-body-bytes``, ``--read-timeout``, ...) are
:class:`~ctx_integrations.serve.limits.ServerLimits`, with the same defaults as ``create_app``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctx_integrations.errors import InvalidOptionError, missing_dependency
from ctx_integrations.serve.limits import ServerLimits

_LIMIT_HELP = {
    "max_body_bytes": "bytes of one request body; more is refused with 413",
    "max_query_chars": "characters of one query (or batch question); more is refused with 413",
    "max_documents": "documents of one request (inline, or top_k); more is refused with 413",
    "max_document_chars": "characters of one document or chat message; more is refused with 413",
    "max_messages": "messages of one chat request; more is refused with 413",
    "read_timeout_s": "seconds a client has to send its headers and body; then 408 / the connection is closed",
    "max_header_bytes": "bytes of a request's line and headers together; more is refused with 431",
}


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-body-bytes``, ``--max-query-chars``, ... : one flag per :class:`ServerLimits` field."""
    defaults = ServerLimits()
    for name, help_text in _LIMIT_HELP.items():
        flag = "--read-timeout" if name == "read_timeout_s" else "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        parser.add_argument(flag, dest=name, type=type(default), default=default,
                            help=f"{help_text} (default {default})")


def limits_from(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{name: getattr(args, name) for name in _LIMIT_HELP})


def _require(module: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as error:
        raise missing_dependency(module, extra) from error


def serve(args: argparse.Namespace, open_store: Callable[[argparse.Namespace, bool], Any],
          engine_options: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """``ctx-experts serve``: ``open_store`` and ``engine_options`` (``--threads``, ``--disk-format``,
    ``--dtype``, the byte budgets) come from the main CLI, which imports this module only when the command runs;
    with ``--ray`` the options reach every replica's engine."""
    if not 0 < args.port < 65536:
        raise InvalidOptionError(f"--port must be in 1..65535, got {args.port}")
    if args.ray:
        _require("ray.serve", "ray")
        from ctx_integrations.serve.ray_app import run_ray_serve

        return run_ray_serve(args, limits_from(args), engine_options(args))
    _require("fastapi", "serve")
    _require("uvicorn", "serve")
    from ctx_integrations.engine.core.engine import Engine
    from ctx_integrations.serve.app import create_app
    from ctx_integrations.serve.http_server import run

    limits = limits_from(args)  # refuse a bad limit before the model loads

    store = open_store(args, True) if args.store else None
    cache_dir = Path(args.cache_dir) if args.cache_dir else (store.kv_dir if store is not None else None)
    options = engine_options(args)
    if args.max_queued is not None:
        options["max_queued_requests"] = args.max_queued
    engine = Engine.from_pretrained(args.model, device=args.device, cache_dir=cache_dir, **options)
    if store is not None:
        store.engine = engine
    app = create_app(engine, store, max_in_flight=args.max_in_flight, limits=limits)
    print(f"serving {engine.loaded.name} on http://{args.host}:{args.port} "
          f"(store: {store.location if store is not None else 'none'})", flush=True)
    run(app, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0
