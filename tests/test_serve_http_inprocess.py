"""The app in-process, with a fake backend: responses always writable, and the OpenAPI document complete.

Responses are always writable: lone surrogates and non-finite floats coming from the backend.
Input cannot bring lone surrogates any more (400), but text also comes from stores and models; a
response that cannot be encoded used to raise while being written, so the client saw a dropped
connection (issue 28). In-process (httpx's ASGI transport) with a fake backend that returns such text.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

pytest.importorskip("fastapi")

from ctx_integrations.errors import RequestTooLargeError  # noqa: E402
from ctx_integrations.serve.app import create_app  # noqa: E402
from ctx_integrations.serve.encoding import SafeJSONResponse, sse  # noqa: E402
from tests.serve_support import CannedBackend  # noqa: E402

BAD_TEXT = "lone \ud800 surrogate \udfff"
FIXED_TEXT = "lone \ufffd surrogate \ufffd"


class SurrogateBackend(CannedBackend):
    """Answers with a lone surrogate in the text, a document and a token, and an infinite timing."""

    pieces = ("\ud800",)

    def canned(self) -> dict:
        return {"text": BAD_TEXT, "mode": "pced", "token_ids": [1], "trace": [], "finish_reason": "stop",
                "timings": {"ttft_s": math.inf, "prompt_tokens": 3.0}, "cache": {},
                "documents": [{"text": BAD_TEXT, "id": "\udc00", "score": math.nan}]}


def _post(path: str, body: dict) -> httpx.Response:
    async def send() -> httpx.Response:
        app = create_app(backend=SurrogateBackend(), model_name="fake")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(send())


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/answer", {"query": "q", "documents": ["d"]}),
    ("/v1/answer/batch", {"queries": ["q", "r"], "documents": ["d"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_json_answers_with_lone_surrogates_and_infinities_are_written(path, body):
    """Bug caught: UnicodeEncodeError / ValueError while writing the response (a dropped connection)."""
    response = _post(path, body)
    assert response.status_code == 200
    text = response.content.decode("utf-8")  # strict: the bytes are valid UTF-8
    assert FIXED_TEXT in text
    assert "\ufffd" in text and "Infinity" not in text and "NaN" not in text


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/answer", {"query": "q", "documents": ["d"], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
def test_streams_with_lone_surrogates_are_written(path, body):
    """Bug caught: an SSE stream cut at the first token that cannot be encoded."""
    response = _post(path, body)
    assert response.status_code == 200
    text = response.content.decode("utf-8")
    assert "\ufffd" in text and ("event: answer" in text or "[DONE]" in text)


def test_the_encoders_replace_lone_surrogates_and_drop_non_finite_numbers():
    rendered = SafeJSONResponse({"a": BAD_TEXT, "b": [math.inf, 1.5]}).body
    assert json.loads(rendered) == {"a": FIXED_TEXT, "b": [None, 1.5]}
    assert sse({"t": "\ud800"}, "token") == 'event: token\ndata: {"t":"\ufffd"}\n\n'.encode()
    assert SafeJSONResponse({"a": "é"}).body == '{"a":"é"}'.encode()  # valid text is kept as is


def test_openapi_documents_the_request_bodies():
    """Bug caught: bodies parsed by the routes themselves vanishing from /openapi.json (and /docs)."""
    app = create_app(backend=SurrogateBackend(), model_name="fake")
    schema = app.openapi()
    for path, model in [("/v1/answer", "AnswerRequest"), ("/v1/answer/batch", "BatchRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "properties" in schema["components"]["schemas"][model]
    assert "DocumentIn" in schema["components"]["schemas"] and "ChatMessage" in schema["components"]["schemas"]


class OverBudgetBackend(SurrogateBackend):
    """Refuses every request as the engine does one whose KV caches exceed its byte budget."""

    async def answer(self, job: dict) -> dict:
        raise RequestTooLargeError("this request needs 9.0 MiB of KV cache, more than the 4.0 MiB ... "
                                   "(--max-batch-bytes on the command line)")


def test_a_request_over_the_kv_byte_budget_is_a_400_that_keeps_the_engine_s_advice():
    """Bug caught: the budget refusal answered as a server error (500) or a body-size 413, or its advice lost.
    OpenAI answers a prompt over the context length with 400, which stock clients surface."""
    async def send() -> httpx.Response:
        app = create_app(backend=OverBudgetBackend(), model_name="fake")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/answer", json={"query": "q", "documents": ["d"]})

    response = asyncio.run(send())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and "--max-batch-bytes on the command line" in error["message"]
