"""The stock OpenAI clients against a real server with an API key and served model names, over HTTP.

The issue's reproduction: the ``openai`` client, LangChain's ``ChatOpenAI`` and LlamaIndex's
``OpenAILike`` pointed at ``ctx-experts serve`` as at vLLM's server, with ``api_key`` and the model
name. The server (a tiny random-weight engine on 127.0.0.1, tests/serve_support.py) takes its key
from ``$CTX_API_KEY`` and answers to two names; its access log is its stdout.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.serve_support import start_server, tiny_engine

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

KEY = "sk-local-test-key"
NAMES = ("velmora-tiny", "gpt-4o-mini")
MESSAGES = [{"role": "user", "content": "Name a bridge."}]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("openai_clients")
    log = data / "server.log"
    with start_server("--served-model-name", *NAMES, log=log, env={"CTX_API_KEY": KEY}) as (url, _):
        yield url, log


@pytest.fixture
def client(served):
    url, _ = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=120, max_retries=0)


def test_the_openai_client_with_the_key_and_a_served_name(client, engine):
    """Bug caught: no --api-key / --served-model-name; a model id with spaces and parentheses."""
    assert [m.id for m in client.models.list().data] == list(NAMES)
    reply = client.chat.completions.create(model=NAMES[1], messages=MESSAGES, max_tokens=6)
    assert reply.model == NAMES[1] and reply.choices[0].message.content == engine.chat(MESSAGES, max_new_tokens=6).text
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None] == [6]  # once, on the last chunk
    assert chunks[-1].choices == []


def test_the_openai_client_without_the_key_or_with_another_model_gets_typed_errors(served, client):
    url, _ = served
    for key in ("wrong-key", ""):
        anonymous = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "unused", timeout=60, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            anonymous.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=2)
        assert refused.value.code == "invalid_api_key" and refused.value.type == "authentication_error"
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="llama-3-70b", messages=MESSAGES, max_tokens=2)
    assert refused.value.code == "model_not_found" and refused.value.param == "model"
    assert httpx.get(f"{url}/healthz").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 3}, "n"),
    ({"logit_bias": {"42": -100}}, "logit_bias"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
])
def test_fields_the_server_does_not_implement_are_a_bad_request_naming_them(client, extra, param):
    """The issue: fields answered with HTTP 200 and plain prose (response_format, tools and logprobs are honoured
    now: tests/test_serve_structured.py)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=2, **extra)
    assert refused.value.param == param and refused.value.type == "invalid_request_error"


def test_langchains_chat_openai_with_the_key_streams_and_counts_usage_once(served):
    """Bug caught: ChatOpenAI's stream_options refused, or its usage counted twice (on two chunks)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    url, _ = served
    llm = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key=KEY, model=NAMES[0], max_tokens=5,
                                      temperature=0, timeout=120, max_retries=0, stream_usage=True)
    assert llm.invoke("Name a bridge.").usage_metadata["output_tokens"] == 5
    merged = None
    for chunk in llm.stream("Name a bridge."):
        merged = chunk if merged is None else merged + chunk
    assert merged.usage_metadata["output_tokens"] == 5
    wrong = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="wrong-key", model=NAMES[0], max_tokens=1,
                                        timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.invoke("Name a bridge.")


def test_llama_index_openai_like_with_the_key(served):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    url, _ = served
    llm = openai_like.OpenAILike(model=NAMES[0], api_base=f"{url}/v1", api_key=KEY, is_chat_model=True,
                                 max_tokens=4, temperature=0.0, timeout=120, context_window=8192, max_retries=0)
    assert [m.id for m in llm._get_client().models.list().data] == list(NAMES)
    response = llm.chat([ChatMessage(role="user", content="Name a bridge.")])
    assert response.raw.usage.completion_tokens == 4 and response.message.content is not None


def test_the_server_logs_one_access_line_per_request(served):
    """Bug caught: no access log: an operator could not see which requests came, failed or took long."""
    url, log = served
    marker = f"/v1/models/probe-{time.monotonic_ns()}"
    httpx.get(f"{url}{marker}", headers={"Authorization": f"Bearer {KEY}"})
    httpx.get(f"{url}{marker}")
    deadline = time.monotonic() + 10
    while len(lines := [line for line in log.read_text().splitlines() if marker in line]) < 2:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    pattern = r'INFO: +127\.0\.0\.1:\d+ - "GET {} HTTP/1\.1" {} \d+\.\dms$'
    assert re.search(pattern.format(re.escape(marker), 404), lines[0]), lines
    assert re.search(pattern.format(re.escape(marker), 401), lines[1]), lines
    assert len(lines) == 2  # one line each: uvicorn's own access log is off
