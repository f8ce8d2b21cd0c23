"""Attack suite for the HTTP server: hostile and mistaken requests, each answered with a typed 4xx naming the field.

Every case is sent to a real uvicorn process on 127.0.0.1 (a tiny random-weight engine, small limits)
and classified: ``typed`` (the expected 4xx, ``param`` naming the field), ``untyped`` (a 5xx),
``silent`` (accepted: 2xx), ``hang`` (no answer within the client timeout), ``dropped`` (the
connection closed without a response) or ``wrong`` (a 4xx, but not the expected status or field).
Only ``typed`` passes. The families are those of issues 27 and 28: mode options that repeat a
request field, knob values out of range, loosely typed values, malformed or non-UTF-8 bodies, lone
surrogates, oversized bodies and fields, and connections that never finish sending.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serve_support import closed_within, start_server

pytest.importorskip("fastapi")

READ_TIMEOUT_S = 1.0
LIMITS = ("--max-body-bytes", str(256 * 1024), "--max-query-chars", "1000", "--max-documents", "4",
          "--max-document-chars", "2000", "--max-messages", "4", "--read-timeout", str(READ_TIMEOUT_S))
CLIENT_TIMEOUT_S = 20.0
DOCS = ["The harbour bridge of Velmora was finished in 1911.", "Velmora's winter market opens on the first snow."]
ANSWER = {"query": "When was the bridge finished?", "documents": DOCS, "max_new_tokens": 2}
BATCH = {"queries": ["Bridge?", "Market?"], "documents": DOCS, "max_new_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Name a bridge."}], "max_tokens": 2}
REPEATED = ["max_new_tokens", "mode", "query", "seed", "stop", "temperature", "top_p", "timeout", "documents"]


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


def _json_cases() -> list[tuple[str, str, object, int, str]]:
    """``(id, path, body, status, param)``: a JSON value sent as the body, the status and ``param`` expected."""
    cases: list[tuple[str, str, object, int, str]] = []
    # 1. mode options that repeat a top-level request field (500 in issue 28)
    for name in REPEATED:
        value = 5 if name in ("max_new_tokens", "seed") else ("pced" if name == "mode" else 0.5)
        cases.append((f"options-repeat-{name}-answer", "/v1/answer", _with(ANSWER, options={name: value}), 422,
                      f"options.{name}"))
        cases.append((f"options-repeat-{name}-batch", "/v1/answer/batch", _with(BATCH, options={name: value}), 422,
                      f"options.{name}"))
        cases.append((f"options-repeat-{name}-chat-ctx", "/v1/chat/completions",
                      _with(CHAT, ctx={"top_k": 2, "options": {name: value}}), 422, f"ctx.options.{name}"))
    # 2. knob values out of range or of the wrong kind
    for mode, knob, value in [("pced", "beta", 1e300), ("pced", "gamma", 1e300), ("pced", "gamma", -1e300),
                              ("soft_nbce", "beta", 1e300), ("soft_nbce", "tau", 1e300), ("ape", "scale", 1e300),
                              ("ape", "attention_temperature", 1e300), ("rapid", "eta", 1e300),
                              ("pced", "beta", [1]), ("pced", "gamma", {"a": 1}), ("pced", "gamma", "x" * 300)]:
        cases.append((f"knob-{mode}-{knob}-{str(value)[:8]}", "/v1/answer",
                      _with(ANSWER, mode=mode, options={knob: value}), 422 if not isinstance(value, str) else 413,
                      f"options.{knob}"))
    cases += [
        ("knob-gamma-negative", "/v1/answer", _with(ANSWER, options={"gamma": -1}), 422, "options"),
        ("knob-unknown-option", "/v1/answer", _with(ANSWER, options={"nope": 1}), 422, "options"),
        ("mode-unknown", "/v1/answer", _with(ANSWER, mode="nope"), 422, "mode"),
        ("mode-list", "/v1/answer", _with(ANSWER, mode=["pced"]), 422, "mode"),
        ("mode-dict", "/v1/answer", _with(ANSWER, mode={"a": 1}), 422, "mode"),
        ("mode-int", "/v1/answer/batch", _with(BATCH, mode=3), 422, "mode"),
        ("options-not-object", "/v1/answer", _with(ANSWER, options=[1]), 422, "options"),
    ]
    # 3. loosely typed values that used to be accepted silently
    for field, value in [("max_new_tokens", "5"), ("max_new_tokens", True), ("max_new_tokens", 5.5),
                         ("max_new_tokens", 0), ("max_new_tokens", 10**9), ("seed", "1"), ("seed", True),
                         ("temperature", "0.5"), ("temperature", True), ("temperature", -1), ("top_p", "1"),
                         ("top_p", 0), ("stop", 5), ("stop", [1]), ("stop", [""]), ("timeout", "1"), ("timeout", True),
                         ("timeout", -1), ("stream", "true"), ("stream", 1), ("query", 5), ("query", None),
                         ("query", ["q"]), ("query", "   "), ("top_k", "2"), ("top_k", True)]:
        body = _with(ANSWER, **{field: value})
        if field == "top_k":
            body.pop("documents")
        cases.append((f"type-answer-{field}-{value!r:.10}", "/v1/answer", body, 422,
                      "body" if value == "   " else field))
    for value, param in [("text", "documents"), ([5], "documents.0"), ([{"text": 5}], "documents.0.text"),
                         ([{"text": "x", "score": "0.5"}], "documents.0.score"),
                         ([{"text": "x", "score": 2}], "documents.0.score"), ([], "documents"),
                         ([{"text": "x", "extra": 1}], "documents.0.extra")]:
        cases.append((f"type-documents-{json.dumps(value)[:20]}", "/v1/answer", _with(ANSWER, documents=value), 422,
                      param))
    for field, value, param in [("max_tokens", "5", "max_tokens"), ("max_tokens", True, "max_tokens"),
                                ("seed", "1", "seed"), ("messages", "hi", "messages"),
                                ("messages", [{"role": "robot", "content": "hi"}], "messages.0.role"),
                                ("messages", [{"role": "user", "content": 5}], "messages.0.content"),
                                ("temperature", "1", "temperature"), ("stream", "yes", "stream"),
                                ("stop", "", "stop"), ("stop", ["a", ""], "stop"),
                                ("ctx", {"top_k": "2"}, "ctx.top_k"), ("ctx", {"mode": 1}, "ctx.mode")]:
        cases.append((f"type-chat-{field}-{json.dumps(value)[:16]}", "/v1/chat/completions",
                      _with(CHAT, **{field: value}), 422, param))
    # an OpenAI field the server does not implement is refused (400), not validated as a value (422)
    cases.append(("refused-chat-n-2", "/v1/chat/completions", _with(CHAT, n=2), 400, "n"))
    for field, value, param in [("queries", "q", "queries"), ("queries", [], "queries"), ("queries", [5], "queries.0"),
                                ("queries", ["q", " "], "body")]:
        cases.append((f"type-batch-{field}-{json.dumps(value)}", "/v1/answer/batch", _with(BATCH, **{field: value}),
                      422, param))
    # 4. bodies that are JSON but not an object
    for path in ("/v1/answer", "/v1/answer/batch", "/v1/chat/completions"):
        for value in ([ANSWER], 5, "text", None):
            cases.append((f"not-an-object-{path.rsplit('/', 1)[1]}-{json.dumps(value)[:8]}", path, value, 422, "body"))
    # 5. field sizes beyond the server's limits, under the body limit (413 naming the field)
    cases += [
        ("size-query", "/v1/answer", _with(ANSWER, query="q" * 1001), 413, "query"),
        ("size-documents-count", "/v1/answer", _with(ANSWER, documents=["d"] * 5), 413, "documents"),
        ("size-document-text", "/v1/answer", _with(ANSWER, documents=["d" * 2001]), 413, "documents"),
        ("size-document-object", "/v1/answer", _with(ANSWER, documents=[{"text": "d" * 2001}]), 413,
         "documents.0.text"),
        ("size-top-k", "/v1/answer", {"query": "q", "top_k": 5}, 413, "top_k"),
        ("size-batch-query", "/v1/answer/batch", _with(BATCH, queries=["q" * 1001]), 413, "queries"),
        ("size-batch-documents", "/v1/answer/batch", _with(BATCH, documents=["d"] * 5), 413, "documents"),
        ("size-messages-count", "/v1/chat/completions", _with(CHAT, messages=CHAT["messages"] * 5), 413, "messages"),
        ("size-message-text", "/v1/chat/completions",
         _with(CHAT, messages=[{"role": "user", "content": "m" * 2001}]), 413, "messages.0.content"),
        ("size-ctx-top-k", "/v1/chat/completions", _with(CHAT, ctx={"top_k": 5}), 413, "ctx.top_k"),
    ]
    return cases


def _raw_cases() -> list[tuple[str, str, bytes, int, str]]:
    """``(id, path, raw body, status, param)``: bodies that are not valid UTF-8 JSON, or too large."""
    cases: list[tuple[str, str, bytes, int, str]] = []
    bodies = {"/v1/answer": ANSWER, "/v1/answer/batch": BATCH, "/v1/chat/completions": CHAT}
    for path, body in bodies.items():
        name = path.rsplit("/", 1)[1]
        text = json.dumps(body)
        cases += [
            (f"json-truncated-{name}", path, text[:-5].encode(), 400, "body"),
            (f"json-trailing-comma-{name}", path, text[:-1].encode() + b",}", 400, "body"),
            (f"json-empty-{name}", path, b"", 422, "body"),
            (f"json-utf16-{name}", path, text.encode("utf-16"), 400, "body"),
            (f"json-utf16le-{name}", path, text.encode("utf-16-le"), 400, "body"),
            (f"json-latin1-{name}", path, text.replace("Name", "Nämé").replace("bridge", "brïdge").encode("latin-1"),
             400, "body"),
            (f"json-nan-{name}", path, text[:-1].encode() + b', "temperature": NaN}', 422, "temperature"),
            (f"json-inf-number-{name}", path, text[:-1].encode() + b', "temperature": 1e400}', 422, "temperature"),
            (f"size-body-declared-{name}", path, b'{"q": "' + b"q" * (300 * 1024) + b'"}', 413, "body"),
        ]
        # a lone surrogate anywhere in the text: refused, never a response that cannot be written
        for surrogate in ("\\ud800", "\\udfff", "\\ud83d"):
            cases.append((f"surrogate-{surrogate[1:]}-{name}", path,
                          text.replace("bridge", "bri" + surrogate + "dge").replace("Bridge", "B" + surrogate).encode(),
                          400, "body"))
    cases.append(("surrogate-in-document-id", "/v1/answer", json.dumps(
        _with(ANSWER, documents=[{"text": "x", "id": "a"}])).replace('"a"', '"\\udc00"').encode(), 400, "body"))
    cases.append(("surrogate-in-metadata", "/v1/answer", json.dumps(
        _with(ANSWER, documents=[{"text": "x", "metadata": {"k": "a"}}])).replace('"a"', '"\\ud800"').encode(),
                  400, "body"))
    return cases


JSON_CASES = _json_cases()
RAW_CASES = _raw_cases()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("attack")
    with start_server(*LIMITS, log=data / "server.log") as (url, _):
        yield url


def classify(send, status: int, param: str) -> tuple[str, str]:
    """Send one request; ``(outcome, detail)`` with outcome typed/untyped/silent/hang/dropped/wrong."""
    try:
        response = send()
    except httpx.TimeoutException:
        return "hang", f"no answer within {CLIENT_TIMEOUT_S} s"
    except httpx.TransportError as error:
        return "dropped", f"{type(error).__name__}: {error}"
    detail = f"{response.status_code} {response.text[:300]}"
    if response.status_code >= 500:
        return "untyped", detail
    if response.status_code < 400:
        return "silent", detail
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "wrong", detail
    named = error.get("param") == param or (param != "body" and str(error.get("param", "")).startswith(param))
    if response.status_code == status and named and error.get("message"):
        return "typed", detail
    return "wrong", detail


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_json_attack_is_a_typed_4xx(server, path, body, status, param):
    outcome, detail = classify(lambda: httpx.post(f"{server}{path}", json=body, timeout=CLIENT_TIMEOUT_S),
                               status, param)
    assert outcome == "typed", f"ATTACK-{outcome.upper()} (wanted {status} param={param}): {detail}"


@pytest.mark.parametrize(("path", "content", "status", "param"), [c[1:] for c in RAW_CASES],
                         ids=[c[0] for c in RAW_CASES])
def test_raw_body_attack_is_a_typed_4xx(server, path, content, status, param):
    def send() -> httpx.Response:
        return httpx.post(f"{server}{path}", content=content, headers={"content-type": "application/json"},
                          timeout=CLIENT_TIMEOUT_S)

    outcome, detail = classify(send, status, param)
    assert outcome == "typed", f"ATTACK-{outcome.upper()} (wanted {status} param={param}): {detail}"


@pytest.mark.parametrize("stream", [False, True])
def test_chunked_oversized_body_is_413(server, stream):
    """A body without Content-Length is counted while it is read (also when it asks for a stream)."""
    def chunks():
        yield b'{"stream": ' + (b"true" if stream else b"false") + b', "documents": ["x"], "query": "'
        for _ in range(5):
            yield b"q" * 65536
        yield b'"}'

    outcome, detail = classify(lambda: httpx.post(f"{server}/v1/answer", content=chunks(), timeout=CLIENT_TIMEOUT_S),
                               413, "body")
    assert outcome == "typed", f"ATTACK-{outcome.upper()}: {detail}"


def test_unknown_model_is_404_naming_the_model(server):
    outcome, detail = classify(lambda: httpx.get(f"{server}/v1/models/nope", timeout=CLIENT_TIMEOUT_S), 404, "model")
    assert outcome == "typed", f"ATTACK-{outcome.upper()}: {detail}"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize(("name", "sent", "first_line"), [
    ("half-headers", b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Ty", b""),
    ("request-line-only", b"POST /v1/answer HTTP/1.1\r\n", b""),
    ("nothing-sent", b"", b""),
    ("half-body", b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"query\": \"", b"HTTP/1.1 408"),
    ("half-chunked-body", b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"que\r\n",
     b"HTTP/1.1 408"),
    ("garbage-request-line", b"\x16\x03\x01\x02\x00 not http\r\n\r\n", b"HTTP/1.1 400"),
    ("huge-header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n", b"HTTP/1.1 431"),
])
def test_connection_that_never_finishes_is_closed_in_time(server, name, sent, first_line):
    """Half-sent requests are answered (408 / 400 / 431) or closed within the read timeout, never held open."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=5) as sock:
        started = time.monotonic()
        if sent:
            sock.sendall(sent)
        closed, received = closed_within(sock, READ_TIMEOUT_S * 2 + 5)
        elapsed = time.monotonic() - started
    outcome = "typed" if closed and received.startswith(first_line) and elapsed < READ_TIMEOUT_S * 2 + 3 else "hang"
    assert outcome == "typed", f"ATTACK-{outcome.upper()}: closed={closed} after {elapsed:.1f} s: {received[:120]!r}"


# -- reliability issue, item 6: headers over the limit (64 KiB by default) are 431 in OpenAI's error shape. The bug: a
#    65 KiB header that reached uvicorn in one read was parsed and answered 200 (h11 bounds only headers still
#    arriving, and uvicorn answered those with a plain-text 400)
HEADER_LIMIT = 64 * 1024
HEADERS = [("one-65-kib-header-get", "GET", "/healthz", {"X-Big": "a" * (65 * 1024)}),
           ("one-65-kib-header-chat", "POST", "/v1/chat/completions", {"X-Big": "a" * (65 * 1024)}),
           ("one-65-kib-header-stream", "POST", "/v1/answer", {"X-Big": "a" * (65 * 1024)}),
           ("many-small-headers", "GET", "/v1/models", {f"X-Part-{i}": "a" * 1000 for i in range(70)})]


@pytest.mark.parametrize(("method", "path", "headers"), [c[1:] for c in HEADERS], ids=[c[0] for c in HEADERS])
def test_headers_over_the_limit_are_431_naming_the_headers(server, method, path, headers):
    body = {"/v1/chat/completions": CHAT, "/v1/answer": {**ANSWER, "stream": True}}.get(path)
    outcome, detail = classify(lambda: httpx.request(method, f"{server}{path}", json=body, headers=headers,
                                                     timeout=CLIENT_TIMEOUT_S), 431, "headers")
    assert outcome == "typed", f"ATTACK-{outcome.upper()}: {detail}"
    assert "--max-header-bytes" in detail and str(HEADER_LIMIT) in detail, detail


def test_headers_just_under_the_limit_are_served(server):
    response = httpx.get(f"{server}/healthz", headers={"X-Big": "a" * (HEADER_LIMIT - 1024)}, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200, response.text


# -- reliability issue, item 6: the engine's per-request KV budget binds chat as every other request kind. The bug: a
#    /v1/chat/completions over max_request_bytes (streamed or not) answered 200. In-process (httpx's ASGI transport):
#    the budget is the engine's, and the app is the one uvicorn serves
BUDGETED = [("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "stream": True}),
            ("/v1/answer", ANSWER), ("/v1/answer", {**ANSWER, "stream": True}), ("/v1/answer/batch", BATCH)]


@pytest.fixture(scope="module")
def budgeted_app():
    from ctx_integrations import Engine
    from ctx_integrations.serve.app import create_app
    from tests.helpers import tiny_loaded

    return create_app(Engine(tiny_loaded("llama"), max_request_bytes=1))


@pytest.mark.parametrize(("path", "body"), BUDGETED, ids=[f"{p.rsplit('/', 1)[1]}-stream={b.get('stream', False)}"
                                                          for p, b in BUDGETED])
def test_every_request_kind_over_max_request_bytes_is_refused(budgeted_app, path, body):
    import asyncio

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=budgeted_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=CLIENT_TIMEOUT_S)

    response = asyncio.run(send())
    assert response.status_code == 400, f"ATTACK-SILENT: {response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "--max-request-bytes" in error["message"], error


def test_headers_growing_past_the_limit_while_arriving_are_431_in_the_same_shape(server):
    """Headers still arriving when they pass the limit are refused by uvicorn's h11 (a plain-text 400 before)."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEADER_LIMIT + 4096))
        closed, received = closed_within(sock, READ_TIMEOUT_S * 2 + 5)
    head, _, body = received.partition(b"\r\n\r\n")
    assert closed and head.startswith(b"HTTP/1.1 431"), received[:300]
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == 431 and error["param"] == "headers" and "--max-header-bytes" in error["message"], error
    assert error["type"] == "invalid_request_error", error
