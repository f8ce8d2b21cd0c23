"""The server's resource limits, and the ASGI middlewares that enforce the header size, body size and read deadline.

Every limit is checked before any tokenisation, so one oversized or slow request cannot stall the
event loop or keep memory: headers over ``max_header_bytes`` are answered 431, the body is refused
from its ``Content-Length`` before a byte is read (413), a chunked body is counted while it is read
and dropped the moment it passes the limit, and a body that does not arrive within ``read_timeout_s``
is answered 408. The per-field limits (query, documents, messages) are pydantic validators in
:mod:`ctx_integrations.serve.schemas` that read these values from the validation context.

Why hand-written middlewares: Starlette and FastAPI have no header-size, body-size or body-deadline
setting, and uvicorn bounds only headers that arrive in pieces (``h11_max_incomplete_event_size``:
headers that reach the server in one read are parsed whatever their size); these are the usual
ASGI wrappers around ``receive``. Headers that never finish, or pass the limit while they arrive, are
handled by :mod:`ctx_integrations.serve.http_server`, which owns the uvicorn side (431 in the same shape).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.serve.errors import error_bytes

MIB = 1024 * 1024
KIB = 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server (every field is a ``create_app`` / ``ctx-experts serve`` option).

    ``max_body_bytes``: the whole JSON body (413 beyond it). ``max_query_chars``: one query or batch
    question. ``max_documents``: inline documents and ``top_k``. ``max_document_chars``: one document's
    text, and one chat message's text. ``max_messages``: messages of one chat request.
    ``read_timeout_s``: seconds a client has to send its headers and its body; a connection still
    sending after it is answered 408 (body) or closed (headers). ``max_header_bytes``: the request line and
    header fields together (431 beyond it).
    """

    max_body_bytes: int = 16 * MIB
    max_query_chars: int = 32_768
    max_documents: int = 128
    max_document_chars: int = 131_072
    max_messages: int = 256
    read_timeout_s: float = 30.0
    max_header_bytes: int = 64 * KIB

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_query_chars", "max_documents", "max_document_chars", "max_messages",
                     "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(f"{name} must be an int >= 1, got {value!r}")
        timeout = self.read_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise InvalidOptionError(f"read_timeout_s must be a finite number of seconds > 0, got {timeout!r}")


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def refuse(send: Any, status: int, message: str, param: str) -> None:
    """Answer a request with an OpenAI-shaped error (:func:`~ctx_integrations.serve.errors.error_bytes`), from an
    ASGI middleware."""
    body = error_bytes(message, status, param)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def header_bytes(scope: dict[str, Any]) -> int:
    """Bytes of the request line and header fields as HTTP/1.1 sends them (``name: value\\r\\n`` each)."""
    query = scope.get("query_string") or b""
    line = (len(scope.get("method", "")) + 1 + len(scope.get("raw_path") or b"") + (1 + len(query) if query else 0)
            + len(" HTTP/") + len(scope.get("http_version", "1.1")) + 2)
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or ())


def headers_too_large(limit: int, size: int | None = None) -> str:
    """The 431 message: ``size`` measured, or ``None`` when the headers grew past the limit while arriving."""
    measured = f"are {size} bytes, more than" if size is not None else "grew past"
    return (f"the request line and headers {measured} this server's limit of {limit} bytes (max_header_bytes, "
            "--max-header-bytes): send fewer or shorter headers (cookies, tokens)")


class HeaderLimitMiddleware:
    """Answer 431 to a request whose request line and headers exceed ``limits.max_header_bytes``.

    uvicorn refuses headers over the limit only while they are still arriving; headers that reached it
    in one read are parsed whatever their size, and are measured here, before the app sees them.
    """

    def __init__(self, app: Any, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size, limit = header_bytes(scope), self.limits.max_header_bytes
            if size > limit:
                await refuse(send, 431, headers_too_large(limit, size), "headers")
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Read each request body once, within ``limits.max_body_bytes`` and ``limits.read_timeout_s``, then replay it.

    The app sees the same ``receive`` messages as without the middleware (the body first, then the
    server's own messages, such as ``http.disconnect``), so FastAPI and the disconnect polling work
    unchanged. A refused body is never kept: chunks read so far are dropped with the exception.
    """

    def __init__(self, app: Any, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(scope, receive), self.limits.read_timeout_s)
        except _BodyRefused as refused:
            await refuse(send, refused.status, str(refused), "body")
            return
        except TimeoutError:
            await refuse(send, 408, f"the request body did not arrive within {self.limits.read_timeout_s:g} s "
                         "(read_timeout_s, --read-timeout): send the whole body at once", "body")
            return
        if body is None:  # the client left while sending
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> _BodyRefused:
        limit = self.limits.max_body_bytes
        return _BodyRefused(413, f"the request body is {size}, more than this server's limit of {limit} bytes "
                                 f"({limit / MIB:.3g} MiB; max_body_bytes, --max-body-bytes): send fewer or shorter "
                                 "documents, or retrieve them with top_k from the server's store")

    async def _read(self, scope: dict[str, Any], receive: Any) -> bytes | None:
        limit = self.limits.max_body_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise _BodyRefused(400, f"Content-Length {declared[:40]!r} is not a number of bytes")
            if int(declared) > limit:
                raise self._too_large(f"{int(declared)} bytes (Content-Length)")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_large(f"more than {limit} bytes (counted while reading it)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
