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
from ctx_integrations.serve.limits import (
    BodyLimitMiddleware,
    HeaderLimitMiddleware,
    ServerLimits,
    error_json,
    header_bytes,
)

LIMIT = 1000


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app behind the middleware: answers 200 with the body it was given."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _scope(headers: list[tuple[bytes, bytes]], method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "raw_path": b"/v1/answer", "query_string": b"", "http_version": "1.1",
            "headers": headers}


def _run(middleware: Any, scope: dict[str, Any], chunks: list[bytes]) -> tuple[int, bytes]:
    """Send ``chunks`` as the request body through ``middleware``; (status, response body)."""
    incoming = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _body_limit() -> BodyLimitMiddleware:
    return BodyLimitMiddleware(_echo, ServerLimits(max_body_bytes=LIMIT))


@pytest.mark.parametrize(("declared", "status"), [(LIMIT - 1, 200), (LIMIT, 200), (LIMIT + 1, 413)])
def test_a_declared_length_up_to_the_limit_is_read_and_one_byte_more_refused(declared, status):
    body = b"x" * declared
    answered, content = _run(_body_limit(), _scope([(b"content-length", str(declared).encode())]), [body])
    assert answered == status, content
    if status == 200:
        assert content == body
    else:
        error = json.loads(content)["error"]
        assert error["code"] == 413 and error["param"] == "body" and f"{LIMIT} bytes" in error["message"]
        assert "Content-Length" in error["message"]


@pytest.mark.parametrize(("size", "status"), [(LIMIT, 200), (LIMIT + 1, 413)])
def test_a_chunked_body_up_to_the_limit_is_read_and_one_byte_more_refused(size, status):
    chunks = [b"x" * 300] * (size // 300) + [b"x" * (size % 300)]
    answered, content = _run(_body_limit(), _scope([]), chunks)
    assert answered == status, content
    if status == 413:
        assert "counted while reading" in json.loads(content)["error"]["message"]


def test_a_content_length_that_is_not_a_number_is_400():
    answered, content = _run(_body_limit(), _scope([(b"content-length", b"12abc")]), [b"{}"])
    assert answered == 400 and json.loads(content)["error"]["param"] == "body"


def test_header_bytes_counts_the_request_line_and_every_field_as_sent():
    scope = {**_scope([(b"host", b"x"), (b"x-big", b"abc")], method="GET"), "query_string": b"a=1"}
    sent = b"GET /v1/answer?a=1 HTTP/1.1\r\nhost: x\r\nx-big: abc\r\n"
    assert header_bytes(scope) == len(sent)


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
        assert error == {"message": error["message"], "type": "request_too_large", "param": "headers", "code": 431}
        assert f"are {LIMIT + 1} bytes" in error["message"] and "--max-header-bytes" in error["message"]


def test_non_http_scopes_pass_the_header_limit():
    seen = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    asyncio.run(HeaderLimitMiddleware(app, ServerLimits(max_header_bytes=1))({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "64KiB", None])
def test_a_bad_header_limit_is_a_typed_error(value):
    with pytest.raises(InvalidOptionError, match="max_header_bytes"):
        ServerLimits(max_header_bytes=value)


def test_error_json_has_openais_shape():
    assert json.loads(error_json(431, "m", "request_too_large", "headers")) == {
        "error": {"message": "m", "type": "request_too_large", "param": "headers", "code": 431}}
