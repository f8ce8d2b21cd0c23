"""Serving: an HTTP API over the engine (FastAPI + uvicorn) and scale-out on Ray Serve.

``create_app(engine, store)`` builds the FastAPI app (extra ``[serve]``); ``ray_app`` deploys replicas
behind a cache-affinity router (extra ``[ray]``). ``ctx-experts serve`` runs either.
"""

from __future__ import annotations

from typing import Any

from ctx_integrations.serve.limits import ServerLimits

__all__ = ["ServerLimits", "create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See :func:`ctx_integrations.serve.app.create_app` (imported lazily: FastAPI is an optional extra)."""
    try:
        from ctx_integrations.serve.app import create_app as build
    except ImportError as error:  # fastapi missing
        from ctx_integrations.errors import missing_dependency

        raise missing_dependency(error.name or "fastapi", "serve") from error
    return build(*args, **kwargs)
