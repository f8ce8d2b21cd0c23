"""The HTTP API end to end against a real ``uvicorn`` process serving a tiny random-weight engine.

Answers are compared token for token with the same engine called in-process (same seed, same
weights), so a server that dropped a score, an option or a sampling setting on the way would fail.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.serve_support import metric, sse_events, start_server, tiny_engine

pytest.importorskip("fastapi")

DOCS = [{"text": "The harbour bridge of Velmora was finished in 1911.", "id": "bridge", "score": 0.9},
        {"text": "Velmora's winter market opens on the first snow.", "id": "market", "score": 0.4}]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("serve")
    with start_server("--store", str(data / "store"), "--max-in-flight", "2", log=data / "server.log") as (url, _):
        yield url


def post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def test_answer_equals_the_engine_and_keeps_scores(server, engine):
    """Bug caught: a score, an option or max_new_tokens lost between the JSON body and engine.generate."""
    response = post(server, "/v1/answer", {"query": "When was the bridge finished?", "documents": DOCS,
                                           "mode": "pced", "options": {"gamma": 2.0}, "max_new_tokens": 12})
    assert response.status_code == 200, response.text
    body = response.json()
    local = engine.generate("When was the bridge finished?", DOCS, mode="pced", gamma=2.0, max_new_tokens=12)
    assert body["token_ids"] == local.token_ids and body["text"] == local.text
    assert [d["score"] for d in body["documents"]] == [0.9, 0.4]
    assert body["options"] == {"gamma": 2.0} and len(body["trace"]) == 12
    assert {"ttft_s", "total_s"} <= set(body["timings"]) and "hits" in body["cache"]


def test_answer_retrieves_from_the_store_with_every_score(server):
    """Bug caught: retrieval that keeps only the fused score, or ignores top_k."""
    body = post(server, "/v1/answer", {"query": "Who founded the city?", "top_k": 3, "max_new_tokens": 4}).json()
    assert len(body["documents"]) == 3
    for doc in body["documents"]:
        assert {"dense", "dense_norm", "sparse", "sparse_norm", "retrieval", "fused"} <= set(doc["scores"])
        assert doc["score"] == pytest.approx(doc["scores"]["fused"])
    scores = [d["score"] for d in body["documents"]]
    assert scores == sorted(scores, reverse=True)


def test_stream_sends_one_event_per_token_then_the_answer(server, engine):
    """Bug caught: a stream that buffers the answer, drops pieces, or ends without the final Answer."""
    with httpx.stream("POST", f"{server}/v1/answer", json={"query": "Bridge?", "documents": DOCS, "stream": True,
                                                          "max_new_tokens": 10}, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert [e for e, _ in events[:-1]] == ["token"] * (len(events) - 1) and events[-1][0] == "answer"
    answer = json.loads(events[-1][1])
    pieces = [json.loads(data)["text"] for _, data in events[:-1]]
    assert len(pieces) == len(answer["token_ids"]) == 10
    assert "".join(pieces) == answer["text"] == engine.generate("Bridge?", DOCS, max_new_tokens=10).text


def test_batch_of_shared_documents_runs_ippd_like_the_engine(server, engine):
    """Bug caught: the batch endpoint answering one by one with another mode, or mixing up answer order."""
    queries = ["When was the bridge finished?", "When does the market open?"]
    body = post(server, "/v1/answer/batch", {"queries": queries, "documents": DOCS, "max_new_tokens": 6}).json()
    assert body["mode"] == "ippd" and body["shared_documents"] is True
    local = engine.generate_many(queries, DOCS, mode="ippd", max_new_tokens=6)
    assert [a["token_ids"] for a in body["answers"]] == [a.token_ids for a in local]
    assert all(a["mode"] == "ippd" for a in body["answers"])


def test_chat_completions_with_the_openai_client(server, engine):
    """Bug caught: a wire format stock OpenAI clients cannot parse, or a stream that differs from the answer."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)
    messages = [{"role": "user", "content": "Name a bridge."}]
    name = _served_model(server)
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=8)
    expected = engine.chat(messages, max_new_tokens=8)
    assert reply.choices[0].message.content == expected.text and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # retrieval-augmented: the extra "ctx" field names the store; the reply carries the documents and scores
    rag = client.chat.completions.create(model=name, messages=messages, max_tokens=4,
                                         extra_body={"ctx": {"top_k": 2, "mode": "pced"}})
    extra = rag.model_extra["ctx"]
    assert extra["mode"] == "pced" and len(extra["documents"]) == 2 and "fused" in extra["documents"][0]["scores"]


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"query": "q", "documents": DOCS, "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"query": "q", "documents": DOCS, "mode": "nope"}, 422, "mode"),
    ({"query": "q", "documents": DOCS, "mode": "nope", "stream": True}, 422, "mode"),
    ({"query": "q", "documents": DOCS, "options": {"gamma": -1}}, 422, "options"),
    ({"query": "q", "documents": ["  "]}, 422, "documents"),
    ({"query": "q", "documents": [{"text": "x", "score": 3}]}, 422, "documents.0.score"),
    ({"query": "q", "documents": DOCS, "top_k": 2}, 422, "body"),
    ({"documents": DOCS}, 422, "query"),
    ({"query": "q", "documents": DOCS, "temperatur": 1}, 422, "temperatur"),
])
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, field):
    """Bug caught: a 500 with a trace, an SSE stream that starts before validation, or an unnamed field."""
    response = post(server, "/v1/answer", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"]


def test_chat_errors_name_the_field(server):
    response = post(server, "/v1/chat/completions", {"messages": [], "max_tokens": 4})
    assert response.status_code == 422 and response.json()["error"]["param"] == "messages"
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"  # not implemented: refused


def test_overload_is_503_with_retry_after_and_a_disconnect_cancels(server):
    """Bugs caught: unbounded admission; a disconnected stream that keeps decoding to max_new_tokens.

    Two streams of 4000 tokens fill the server (max-in-flight 2); a third request is refused. Both
    clients then disconnect: the engine must then report no active request and two cancelled ones
    within seconds; without cancellation it would keep decoding the abandoned streams for minutes.
    """
    async def scenario() -> tuple[httpx.Response, float, str]:
        long = {"query": "Bridge?", "documents": DOCS, "stream": True, "max_new_tokens": 4000}
        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            async def read_one_token_then_leave() -> None:
                async with client.stream("POST", "/v1/answer", json=long) as response:
                    await release.wait()
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            return  # leaving the block closes the connection mid-stream

            first = asyncio.create_task(read_one_token_then_leave())
            second = asyncio.create_task(read_one_token_then_leave())
            deadline = time.monotonic() + 60
            while metric((await client.get("/metrics")).text, "ctx_serve_in_flight_requests") < 2:
                assert time.monotonic() < deadline, "the two streams were never both admitted"
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/answer", json={"query": "q", "documents": DOCS, "max_new_tokens": 1})
            release.set()
            await asyncio.wait_for(asyncio.gather(first, second), 120)
        return refused, _engine_idle(server)

    refused, metrics = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "server_error"  # OpenAI's kind, not a Python class name
    assert metric(metrics, "ctx_engine_cancelled") >= 2
    assert metric(metrics, "ctx_serve_requests_total", endpoint="answer", outcome="cancelled") == 2
    assert metric(metrics, "ctx_serve_requests_total", endpoint="answer", outcome="overloaded") == 1
    assert metric(metrics, "ctx_serve_active_streams") == 0


def _engine_idle(server: str, within_s: float = 20.0) -> str:
    """Wait until the engine runs no request (``engine.stats()`` through /metrics); return the metrics text."""
    deadline = time.monotonic() + within_s
    while True:
        text = httpx.get(f"{server}/metrics").text
        if metric(text, "ctx_engine_active_requests") == 0 and metric(text, "ctx_engine_queue_depth") == 0:
            return text
        assert time.monotonic() < deadline, "the engine is still decoding a request nobody listens to"
        time.sleep(0.1)


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(server):
    """Bug caught: a plain (non-SSE) request whose client timed out still decoding 4000 tokens."""
    cancelled = metric(httpx.get(f"{server}/metrics").text, "ctx_engine_cancelled")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/answer", {"query": "q", "documents": DOCS, "max_new_tokens": 4000}, timeout=2)
    metrics = _engine_idle(server)
    assert metric(metrics, "ctx_engine_cancelled") == cancelled + 1
    assert metric(metrics, "ctx_serve_requests_total", endpoint="answer", outcome="cancelled") >= 1


def test_a_timeout_is_a_504_naming_the_field(server):
    """Bug caught: a request past its timeout hanging, or failing as a 500."""
    response = post(server, "/v1/answer", {"query": "q", "documents": DOCS, "max_new_tokens": 4000, "timeout": 0.5})
    assert response.status_code == 504 and response.json()["error"]["param"] == "timeout"


def test_metrics_and_healthz(server):
    """Bug caught: counters that never move, or a histogram without the answers' TTFT."""
    assert httpx.get(f"{server}/healthz").json()["status"] == "ok"
    post(server, "/v1/answer", {"query": "q", "documents": DOCS, "max_new_tokens": 2})
    text = httpx.get(f"{server}/metrics").text
    assert metric(text, "ctx_serve_answers_total", mode="pced") >= 1
    assert metric(text, "ctx_serve_ttft_seconds_count") >= 1
    assert metric(text, "ctx_serve_cache_hits_total", tier="memory") >= 1  # DOCS were cached by earlier requests
    assert metric(text, "ctx_engine_bytes_memory") > 0 and "ctx_serve_waiting_requests" in text


def test_sigterm_drains_the_requests_in_flight(tmp_path):
    """Bug caught: SIGTERM dropping a stream half-way instead of finishing it before the process exits."""
    with start_server(log=tmp_path / "server.log") as (url, process):
        with httpx.stream("POST", f"{url}/v1/answer", json={"query": "Bridge?", "documents": DOCS, "stream": True,
                                                           "max_new_tokens": 60}, timeout=120) as response:
            lines = response.iter_lines()
            head = [next(lines), next(lines)]
            process.send_signal(signal.SIGTERM)
            events = sse_events([*head, *lines])
        # uvicorn re-raises the captured SIGTERM once its graceful shutdown is over
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert events[-1][0] == "answer" and len(json.loads(events[-1][1])["token_ids"]) == 60


@pytest.mark.slow
def test_the_ctx_experts_serve_command_answers_like_the_embedded_engine(tmp_path, embedded_engine):
    """End to end on the embedded model: the real console command, its argument wiring, and the answer.

    Bug caught: `ctx-experts serve` loading another model or dropping a setting on the way to the engine.
    """
    import os
    import subprocess
    import sys

    from ctx_integrations.serve.model_names import model_id
    from tests.serve_support import ROOT, free_port, wait_healthy

    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        # fp32 as the fixture's engine (a bf16 CPU defaults to bf16, whose near-ties can pick other tokens)
        process = subprocess.Popen([sys.executable, "-m", "ctx_integrations.cli", "--threads", "1", "serve",
                                    "--port", str(port), "--cache-dir", str(tmp_path / "kv"), "--dtype", "float32"],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log)
        body = {"query": "When was the bridge finished?", "documents": DOCS, "max_new_tokens": 8}
        answer = post(url, "/v1/answer", body).json()
        expected = embedded_engine.generate(body["query"], DOCS, max_new_tokens=8)
        assert answer["token_ids"] == expected.token_ids and answer["text"] == expected.text
        assert httpx.get(f"{url}/healthz").json()["model"] == model_id(embedded_engine.loaded.name)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _served_model(url: str) -> str:
    return httpx.get(f"{url}/healthz").json()["model"]


def test_models_are_listed_in_openais_shape(server):
    """Bug caught: GET /v1/models 404 (issue 27), so clients that list models before chatting fail."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=60)
    name = _served_model(server)
    assert [m.id for m in client.models.list().data] == [name]
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model" and card.owned_by == "ctx-integrations"
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("gpt-nonexistent")
    assert refused.value.body["param"] == "model" and name in refused.value.body["message"]


def test_usage_counts_the_prompt_with_its_documents_on_every_path(server, engine):
    """Bug caught: usage.prompt_tokens 0 on retrieval-augmented chat (issue 27) or without the documents."""
    from ctx_integrations.engine.core.chat import conversation_ids
    from tests.helpers import concatenated_prompt_tokens as prompt_tokens

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)
    question = "Who founded the city?"
    messages = [{"role": "user", "content": question}]
    name = _served_model(server)
    rag = client.chat.completions.create(model=name, messages=messages, max_tokens=3,
                                         extra_body={"ctx": {"top_k": 2}})
    texts = [d["text"] for d in rag.model_extra["ctx"]["documents"]]
    expected = prompt_tokens(engine, question, texts)
    assert rag.usage.prompt_tokens == expected > len(conversation_ids(engine.layout, messages))
    assert rag.usage.total_tokens == expected + rag.usage.completion_tokens
    streamed = list(client.chat.completions.create(model=name, messages=messages, max_tokens=3, stream=True,
                                                   extra_body={"ctx": {"top_k": 2}}))
    assert streamed[-1].usage.prompt_tokens == expected
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=3)
    assert plain.usage.prompt_tokens == len(conversation_ids(engine.layout, messages))
    answer = post(server, "/v1/answer", {"query": "Bridge?", "documents": DOCS, "max_new_tokens": 2}).json()
    assert answer["timings"]["prompt_tokens"] == prompt_tokens(engine, "Bridge?", [d["text"] for d in DOCS])
    batch = post(server, "/v1/answer/batch", {"queries": ["Bridge?", "Market?"], "documents": DOCS,
                                              "max_new_tokens": 2}).json()
    assert [a["timings"]["prompt_tokens"] for a in batch["answers"]] == [
        prompt_tokens(engine, q, [d["text"] for d in DOCS]) for q in ("Bridge?", "Market?")]


def test_langchains_chat_openai_lists_models_and_gets_usage(server, engine):
    """Bug caught: a wire format LangChain's OpenAI client cannot read (models, choices or usage)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from tests.helpers import concatenated_prompt_tokens as prompt_tokens

    name = _served_model(server)
    llm = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=name, max_tokens=4,
                                      temperature=0, timeout=120, extra_body={"ctx": {"top_k": 2}})
    assert [m.id for m in llm.root_client.models.list().data] == [name]
    reply = llm.invoke("Who founded the city?")
    # the same retrieval through /v1/answer names the documents the chat reply was answered from
    retrieved = post(server, "/v1/answer", {"query": "Who founded the city?", "top_k": 2, "max_new_tokens": 1}).json()
    texts = [d["text"] for d in retrieved["documents"]]
    assert reply.usage_metadata["output_tokens"] == 4
    assert reply.usage_metadata["input_tokens"] == prompt_tokens(engine, "Who founded the city?", texts)


def test_llama_index_openai_like_lists_models_and_gets_usage(server):
    """Bug caught: a wire format LlamaIndex's OpenAI-compatible LLM cannot read."""
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    name = _served_model(server)
    llm = openai_like.OpenAILike(model=name, api_base=f"{server}/v1", api_key="unused", is_chat_model=True,
                                 max_tokens=4, temperature=0.0, timeout=120, context_window=8192)
    assert [m.id for m in llm._get_client().models.list().data] == [name]
    response = llm.chat([ChatMessage(role="user", content="Name a bridge.")])
    usage = response.raw.usage
    assert usage.completion_tokens == 4 and usage.prompt_tokens > 0 and response.message.content is not None
