"""One access-log line per HTTP request: client, method, path, status and duration, on a named logger.

uvicorn's own access log has no duration and logs when the response *starts* (a 30-second stream
is one line at its first byte); this middleware logs when the response is done, on the logger
``ctx_integrations.serve.access`` at INFO, so a deployment routes, filters or formats it with the
standard :mod:`logging` configuration. ``ctx-experts serve`` prints it next to uvicorn's own lines
(:func:`ctx_integrations.serve.http_server.run`; ``--no-access-log`` turns it off). It is outermost,
so refusals by the other middlewares (401, 413, 408) are logged like any answer; a request whose
client left before any response is logged with status 499, and one that failed with an unhandled
exception with 500. Each record also carries the values as attributes (``client_addr``, ``method``,
``path``, ``status_code``, ``duration_ms``) for structured log handlers.

The path is logged as the client sent it (percent-encoded, with its query string), so a request
cannot write a line break or other control characters into the log. A query parameter whose name looks like
a credential (``api_key``, ``key``, ``token``, ``access_token``, ``password``, ``secret``, ``auth``...: any
name holding one of :data:`SECRET_NAME_PARTS`, in any case or percent-encoding) is logged with its value
replaced by :data:`REDACTED`: a client that sends its key as ``?api_key=`` (some do, whatever the server
asks for) must not find it in every log line it reaches. Only the value goes; the name, the other
parameters and their order stay, so a line still says what was asked.

Written by hand: Starlette and uvicorn offer no access log with durations; it is a ~20-line wrapper of ``send``.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import quote, unquote_plus

ACCESS_LOGGER = "ctx_integrations.serve.access"
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection"
# a query parameter whose name (lower-cased, percent-decoded) holds one of these has its value redacted
SECRET_NAME_PARTS = ("key", "token", "secret", "passw", "pwd", "auth", "credential", "signature", "session",
                     "cookie", "jwt", "bearer")
REDACTED = "[redacted]"

logger = logging.getLogger(ACCESS_LOGGER)


def is_secret_name(name: str) -> bool:
    """Whether a query parameter named ``name`` (as sent: percent-encoded) may carry a credential."""
    plain = unquote_plus(name).lower()
    return any(part in plain for part in SECRET_NAME_PARTS)


def redacted_query(query: str) -> str:
    """``query`` (``a=1&api_key=sk-...``) with the value of every parameter :func:`is_secret_name` redacted."""
    pairs = []
    for pair in query.split("&"):
        name, equals, _ = pair.partition("=")
        pairs.append(f"{name}={REDACTED}" if equals and is_secret_name(name) else pair)
    return "&".join(pairs)


def _target(scope: dict[str, Any]) -> str:
    raw = scope.get("raw_path")
    path = raw.decode("ascii", "backslashreplace") if raw else quote(scope.get("path", ""))
    query = scope.get("query_string", b"")
    return f"{path}?{redacted_query(query.decode('ascii', 'backslashreplace'))}" if query else path


def _client(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class AccessLogMiddleware:
    """Log every HTTP request once its response is finished (or the request failed)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, sending)
        except BaseException:
            failed = True
            raise
        finally:
            code = status if status is not None else (500 if failed else CLIENT_CLOSED)
            duration_ms = (time.perf_counter() - started) * 1000
            values = {"client_addr": _client(scope), "method": scope.get("method", "-"), "path": _target(scope),
                      "http_version": scope.get("http_version", "1.1"), "status_code": code,
                      "duration_ms": round(duration_ms, 3)}
            logger.info('%s - "%s %s HTTP/%s" %d %.1fms', values["client_addr"], values["method"], values["path"],
                        values["http_version"], code, duration_ms, extra=values)
