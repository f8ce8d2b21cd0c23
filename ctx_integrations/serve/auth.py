"""API keys: with keys set (``--api-key``, ``$CTX_API_KEY``), every ``/v1`` route needs ``Authorization: Bearer KEY``.

The same contract as vLLM's ``--api-key``: only paths under ``/v1`` are protected, so health checks
(``/healthz``, ``/health``), ``/metrics`` and the OpenAPI pages stay reachable by probes and
scrapers, and a CORS preflight (``OPTIONS``) passes. A missing or wrong key is answered 401 in
OpenAI's error shape (``type: authentication_error``, ``code: invalid_api_key``, and
``WWW-Authenticate: Bearer``) before the body is read, so a client without the key cannot make the
server read, parse or queue anything. Keys are compared in constant time.

Written by hand because Starlette has no bearer-key middleware, and FastAPI's ``HTTPBearer``
dependency runs per route after the body is read (and not at all for an unknown ``/v1`` path,
which would then answer 404 without asking for the key).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.serve.errors import error_bytes

API_KEY_ENV = "CTX_API_KEY"
PROTECTED_PREFIX = "/v1"


def api_keys(keys: str | Sequence[str] | None) -> tuple[str, ...]:
    """The keys as a tuple (none: no authentication); refuses a key a client could not send as it is."""
    if keys is None:
        return ()
    found = (keys,) if isinstance(keys, str) else tuple(keys)
    for key in found:
        if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or " " in key:
            shown = "an empty key" if key == "" else f"a {type(key).__name__}" if not isinstance(key, str) else (
                "a key with spaces or characters outside printable ASCII")
            raise InvalidOptionError(f"an API key must be a non-empty string of printable ASCII without spaces (it "
                                     f"travels in the Authorization header), got {shown}")
    return found


def is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def _bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class ApiKeyMiddleware:
    """Refuse ``/v1`` requests without one of ``keys`` as their bearer token (401, OpenAI's shape)."""

    def __init__(self, app: Any, keys: Sequence[str]):
        if not keys:
            raise InvalidOptionError("ApiKeyMiddleware needs at least one key")
        self.app, self._keys = app, tuple(key.encode("ascii") for key in keys)

    def _allowed(self, scope: dict[str, Any]) -> bool:
        token = _bearer_token(scope.get("headers") or ())
        if token is None:
            return False
        matches = [hmac.compare_digest(token, key) for key in self._keys]  # every key compared: constant time
        return any(matches)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS" or not is_protected(scope["path"])
                or self._allowed(scope)):
            await self.app(scope, receive, send)
            return
        body = error_bytes("missing or invalid API key: send the server's key (--api-key, $CTX_API_KEY) as "
                           "'Authorization: Bearer KEY' (OpenAI clients: api_key=KEY)", 401, None, "invalid_api_key")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
