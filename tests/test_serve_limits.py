"""The server's limit middlewares in-process, at their boundaries: a body or headers of exactly the limit pass, one
byte more is refused, in OpenAI's error shape. No model and no uvicorn: a plain ASGI app behind each middleware.

The bug these catch is one a mutation run found surviving: a body whose declared length equals ``max_body_bytes``
refused (``>=`` for ``>``), which no test noticed; the header limit's boundary is pinned the same way.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.serve.errors import error_bytes
from ctx_integrations.serve.limits import (
    BodyLimitMiddleware,
    HeaderLimitMiddleware,
    ServerLimits,
    header_bytes,
    headers_too_large,
)

LIMIT = 1000


CALLS: list[dict[str, Any]] = []


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app behind the middleware: answers 200 with the body it was given, and records what it saw (its method,
    the body's messages, and the message ``receive`` gives after them: the server's own, e.g. ``http.disconnect``)."""
    messages = [await receive()]
    while messages[-1].get("more_body", False):
        messages.append(await receive())
    body = b"".join(message.get("body", b"") for message in messages)
    CALLS.append({"method": scope["method"], "messages": messages, "after": await receive()})
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _scope(headers: list[tuple[bytes, bytes]], method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "raw_path": b"/v1/answer", "query_string": b"", "http_version": "1.1",
            "headers": headers}


def _run(middleware: Any, scope: dict[str, Any], chunks: list[bytes] | list[dict[str, Any]],
         stall: bool = False) -> tuple[int, bytes]:
    """Send ``chunks`` (bytes, or whole ASGI messages) as the request body through ``middleware``; (status, response
    body). ``stall``: the client then sends nothing more (never a disconnect). Checks the response's ASGI messages."""
    incoming = [chunk if isinstance(chunk, dict) else
                {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    sent: list[dict[str, Any]] = []
    CALLS.clear()

    async def receive() -> dict[str, Any]:
        if not incoming and stall:
            await asyncio.sleep(3600)
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(middleware(scope, receive, send), 10))  # a middleware that waits forever fails
    if not sent:
        return 0, b""
    start, body = sent
    assert start["type"] == "http.response.start" and body["type"] == "http.response.body", sent
    if start["status"] != 200:  # the middleware's own answer: JSON, with its length
        assert start["headers"] == [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body["body"])).encode())], start
    return start["status"], body["body"]


def _body_limit() -> BodyLimitMiddleware:
    return BodyLimitMiddleware(_echo, ServerLimits(max_body_bytes=LIMIT))


TOO_LARGE_ADVICE = (f"more than this server's limit of {LIMIT} bytes (0.000954 MiB; max_body_bytes, --max-body-bytes): "
                    "send fewer or shorter documents, or retrieve them with top_k from the server's store")


def _error(content: bytes, status: int, kind: str) -> str:
    """The error's message, after checking the rest of its OpenAI shape."""
    error = json.loads(content)["error"]
    assert error == {"message": error["message"], "type": kind, "param": "body", "code": status}, error
    return error["message"]


@pytest.mark.parametrize(("declared", "status"), [(LIMIT - 1, 200), (LIMIT, 200), (LIMIT + 1, 413)])
def test_a_declared_length_up_to_the_limit_is_read_and_one_byte_more_refused(declared, status):
    body = b"x" * declared
    answered, content = _run(_body_limit(), _scope([(b"content-length", str(declared).encode())]), [body])
    assert answered == status, content
    if status == 200:
        assert content == body  # replayed as one message, then the server's own messages
        assert CALLS == [{"method": "POST", "messages": [{"type": "http.request", "body": body, "more_body": False}],
                          "after": {"type": "http.disconnect"}}]
    else:
        assert _error(content, 413, "invalid_request_error") == (
            f"the request body is {LIMIT + 1} bytes (Content-Length), {TOO_LARGE_ADVICE}") and CALLS == []


@pytest.mark.parametrize(("size", "status"), [(LIMIT, 200), (LIMIT + 1, 413)])
def test_a_chunked_body_up_to_the_limit_is_read_and_one_byte_more_refused(size, status):
    chunks = [b"x" * 300] * (size // 300) + [b"y" * (size % 300)]
    answered, content = _run(_body_limit(), _scope([]), chunks)
    assert answered == status, content
    if status == 200:
        assert content == b"".join(chunks)
    else:
        assert _error(content, 413, "invalid_request_error") == (
            f"the request body is more than {LIMIT} bytes (counted while reading it), {TOO_LARGE_ADVICE}")


def test_messages_without_body_or_more_body_keys_are_read_as_asgi_says():
    """ASGI makes both keys optional: no ``body`` is b"", no ``more_body`` is the last message."""
    answered, content = _run(_body_limit(), _scope([]), [{"type": "http.request", "more_body": True},
                                                         {"type": "http.request", "body": b"ab"}])
    assert (answered, content) == (200, b"ab")


def test_a_content_length_that_is_not_a_number_is_400_quoting_40_bytes_of_it():
    answered, content = _run(_body_limit(), _scope([(b"content-length", b"x" * 50)]), [b"{}"])
    assert answered == 400
    assert _error(content, 400, "invalid_request_error") == f"Content-Length {b'x' * 40!r} is not a number of bytes"


def test_a_client_that_leaves_while_sending_gets_nothing_and_the_app_never_runs():
    answered, _ = _run(_body_limit(), _scope([]), [{"type": "http.request", "body": b"{", "more_body": True},
                                                   {"type": "http.disconnect"}])
    assert answered == 0 and CALLS == []


def test_a_body_that_stops_arriving_is_408_after_the_read_timeout():
    middleware = BodyLimitMiddleware(_echo, ServerLimits(read_timeout_s=0.05))
    answered, content = _run(middleware, _scope([]), [{"type": "http.request", "body": b"{", "more_body": True}],
                             stall=True)
    assert answered == 408 and CALLS == []
    assert _error(content, 408, "invalid_request_error") == (
        "the request body did not arrive within 0.05 s (read_timeout_s, --read-timeout): send the whole body at once")


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
def test_bodiless_methods_pass_unread(method):
    """A GET's (unexpected) body is the app's business: not read, not refused, not replayed."""
    body = b"x" * (LIMIT + 1)
    answered, content = _run(_body_limit(), _scope([(b"content-length", str(len(body)).encode())], method), [body])
    assert (answered, content) == (200, body) and CALLS[0]["method"] == method


def test_non_http_scopes_pass_both_middlewares():
    seen = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((scope["type"], await receive()))
        await send("started")

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        seen.append(message)

    limits = ServerLimits(max_header_bytes=1, max_body_bytes=1)
    for middleware in (HeaderLimitMiddleware(app, limits), BodyLimitMiddleware(app, limits)):
        asyncio.run(middleware({"type": "lifespan"}, receive, send))
    assert seen == [("lifespan", {"type": "lifespan.startup"}), "started"] * 2


@pytest.mark.parametrize(("query", "line"), [(b"a=1", b"GET /v1/answer?a=1 HTTP/1.1\r\n"),
                                             (b"", b"GET /v1/answer HTTP/1.1\r\n")])
def test_header_bytes_counts_the_request_line_and_every_field_as_sent(query, line):
    scope = {**_scope([(b"host", b"x"), (b"x-big", b"abc")], method="GET"), "query_string": query}
    assert header_bytes(scope) == len(line + b"host: x\r\nx-big: abc\r\n")


def test_the_header_messages_name_the_limit_and_what_to_do():
    assert headers_too_large(LIMIT, LIMIT + 1) == (
        f"the request line and headers are {LIMIT + 1} bytes, more than this server's limit of {LIMIT} bytes "
        "(max_header_bytes, --max-header-bytes): send fewer or shorter headers (cookies, tokens)")
    assert headers_too_large(LIMIT) == (
        f"the request line and headers grew past this server's limit of {LIMIT} bytes (max_header_bytes, "
        "--max-header-bytes): send fewer or shorter headers (cookies, tokens)")


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize(("extra", "status"), [(0, 200), (1, 431)])
def test_headers_up_to_the_limit_pass_and_one_byte_more_is_431(method, extra, status):
    headers = [(b"host", b"x"), (b"x-big", b"")]
    room = LIMIT - header_bytes(_scope(headers, method))
    scope = _scope([(b"host", b"x"), (b"x-big", b"a" * (room + extra))], method)
    middleware = HeaderLimitMiddleware(_echo, ServerLimits(max_header_bytes=LIMIT))
    answered, content = _run(middleware, scope, [b"{}"])
    assert answered == status, content
    if status == 431:
        error = json.loads(content)["error"]
        assert error == {"message": headers_too_large(LIMIT, LIMIT + 1), "type": "invalid_request_error",
                         "param": "headers", "code": 431}
    else:
        assert content == b"{}"


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "64KiB", None])
def test_a_bad_header_limit_is_a_typed_error(value):
    with pytest.raises(InvalidOptionError, match="max_header_bytes must be an int >= 1"):
        ServerLimits(max_header_bytes=value)


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "1", None])
def test_a_bad_read_timeout_is_a_typed_error(value):
    with pytest.raises(InvalidOptionError, match="read_timeout_s must be a finite number of seconds > 0"):
        ServerLimits(read_timeout_s=value)


@pytest.mark.parametrize("value", [0.01, 1, 30.0])
def test_a_read_timeout_above_zero_is_accepted(value):
    assert ServerLimits(read_timeout_s=value).read_timeout_s == value


def test_error_bytes_has_openais_shape():
    """The middlewares' bodies: OpenAI's shape, ``type`` one of its kinds by status (not ``request_too_large``)."""
    assert json.loads(error_bytes("m", 431, "headers")) == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "headers", "code": 431}}
