"""Attack suite: structured-output formats that cost their compiler (issue 58, items 1-2); each case typed or correct.

The breaks: a format compiled on the event loop (``/v1/answer`` and ``/v1/answer/batch`` froze ``/healthz`` for
12-15 s); a compile with no bound on its size or time; a compile that went on after its client left, counted
nowhere. Now a format over ``max_format_bytes`` is refused before it compiles, a compile past
``format_compile_timeout_s`` is stopped, a cancelled request's compile is stopped (its worker process killed), a
compiling request is in flight (``/metrics``, ``--max-in-flight``), and a repeated format is a lookup.

The inputs are small: the limits are lowered instead. ``SLOW`` is 50 bytes of JSON schema that xgrammar compiles
for more than ten minutes (a pattern's nested repetition), so each case stops it well before.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")

from ctx_integrations import Engine, SamplingParams, StructuredOutput  # noqa: E402
from ctx_integrations.errors import FormatCompileTimeoutError, FormatTooLargeError  # noqa: E402
from ctx_integrations.serve.app import create_app  # noqa: E402
from tests.helpers import tiny_loaded  # noqa: E402
from tests.serve_support import metric  # noqa: E402
from tests.test_core_pced import DOCS, QUESTION  # noqa: E402

SLOW = {"type": "string", "pattern": "([a-z ]{1,100}){1,100}"}
SMALL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
LIMIT = 2048  # max_format_bytes of the engine under test
WORDS = [f"value-{i}" for i in range(300)]  # 3 KB in every kind below
BIG = {"json": {"type": "string", "enum": WORDS}, "regex": "(" + "|".join(WORDS) + ")",
       "grammar": "root ::= " + " | ".join(json.dumps(w) for w in WORDS), "choice": WORDS}
CHAT = [{"role": "user", "content": "Name a city."}]


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "pick", "description": "Pick one.", "parameters": parameters}}


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("llama", seed=3)


@pytest.fixture(scope="module")
def engine(loaded) -> Engine:
    return Engine(loaded, max_format_bytes=LIMIT, format_compile_timeout_s=60)


def _sampling(schema: dict) -> SamplingParams:
    return SamplingParams(structured=StructuredOutput(json=schema), max_tokens=6)


def _busy(engine: Engine) -> list[int]:
    return engine.loaded.grammars.pool.workers()["busy"]


async def _compiling(engine: Engine, task: asyncio.Future | None = None, timeout_s: float = 120.0) -> int:
    """The pid of the worker compiling a format now, once one is (the first waits for the pool to start); ``task``:
    the request's, which must not end first."""
    deadline = time.monotonic() + timeout_s
    while not _busy(engine):
        assert time.monotonic() < deadline, "no format started compiling"
        assert task is None or not task.done(), f"the request ended before its format compiled: {task.result()!r}"
        await asyncio.sleep(0.02)
    return _busy(engine)[0]


def _gone(pid: int, within_s: float = 3.0) -> bool:
    """Whether process ``pid`` is gone (killed and reaped) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Ticks:
    """The event loop's longest stall while it runs: a task that wakes every 10 ms."""

    def __init__(self) -> None:
        self.longest, self._task = 0.0, asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.longest, last = max(self.longest, now - last), now

    def stop(self) -> float:
        self._task.cancel()
        return self.longest


# -- the size limit: refused before anything compiles --------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BIG))
def test_a_format_over_max_format_bytes_is_refused_before_it_compiles(engine, kind, monkeypatch):
    monkeypatch.setattr(type(engine.loaded.grammars), "_build", lambda *_: pytest.fail("the format was compiled"))
    sampling = SamplingParams(structured=StructuredOutput(**{kind: BIG[kind]}))
    for ask in (lambda: engine.submit(QUESTION, DOCS, sampling=sampling), lambda: engine.astream(
            QUESTION, DOCS, sampling=sampling), lambda: engine.generate_many([QUESTION], DOCS, sampling=sampling)):
        with pytest.raises(FormatTooLargeError, match=rf"more than the limit of {LIMIT} bytes \(max_format_bytes; "
                                                      r"--max-format-bytes.*raise the limit"):
            ask()


@pytest.mark.parametrize(("values", "refused"), [(WORDS, "tool 'pick' parameters"), (WORDS[:150], "structural_tag")])
def test_tools_over_max_format_bytes_are_refused_before_they_compile(engine, monkeypatch, values, refused):
    """A tool's own schema over the limit is refused before xgrammar parses it; tools whose call format (the
    structural tag, which holds every tool's grammar) is over it, before that compiles."""
    monkeypatch.setattr(type(engine.loaded.grammars), "_build", lambda *_: pytest.fail("the format was compiled"))
    with pytest.raises(FormatTooLargeError, match=rf"{refused} format is .*\(max_format_bytes") as caught:
        engine.submit_chat(CHAT, tools=[_tool({"type": "object", "properties": {"a": {"enum": values}}})],
                           tool_choice="required", max_new_tokens=6)
    assert caught.value.field == "tools"


# -- the time limit, the cache ---------------------------------------------------------------------------------------

def test_a_compile_past_format_compile_timeout_s_is_stopped_and_typed(loaded):
    quick = Engine(loaded, format_compile_timeout_s=0.5)
    caught: list[BaseException] = []

    def ask() -> None:
        try:
            quick.generate(QUESTION, DOCS, sampling=_sampling(SLOW))
        except BaseException as error:  # noqa: BLE001 (asserted below)
            caught.append(error)

    thread = threading.Thread(target=ask)
    thread.start()
    pid = asyncio.run(_compiling(quick))
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(caught[0], FormatCompileTimeoutError)
    assert "within 0.5 s (format_compile_timeout_s; --format-compile-timeout-s" in str(caught[0])
    assert "the compile was stopped" in str(caught[0]) and "raise the limit" in str(caught[0])
    assert _gone(pid) and not _busy(quick)


def test_a_repeated_format_is_compiled_once(engine):
    grammars, output = engine.loaded.grammars, StructuredOutput(json=SMALL)
    first = grammars.submit(output).result(timeout=120)
    started = time.perf_counter()
    again = grammars.submit(StructuredOutput(json=dict(SMALL)))  # the same content, another object
    assert again.done() and again.result() is first
    assert time.perf_counter() - started < 0.01
    answer = engine.generate(QUESTION, DOCS, sampling=_sampling(SMALL))  # and the engine gets it from the cache
    assert answer.finish_reason == "length" or isinstance(json.loads(answer.text), dict)


# -- off the event loop, and stopped with its request --------------------------------------------------------------

async def _ask(engine: Engine, call: str) -> object:
    slow = _sampling(SLOW)
    if call == "agenerate":
        return await engine.agenerate(QUESTION, DOCS, sampling=slow)
    if call == "astream":
        return [piece async for piece in engine.astream(QUESTION, DOCS, sampling=slow)]
    if call == "agenerate_many":
        return await engine.agenerate_many([QUESTION, QUESTION], DOCS, sampling=slow)
    if call == "achat":
        return await engine.achat(CHAT, sampling=slow)
    tool = _tool({"type": "object", "properties": {"a": SLOW}, "required": ["a"]})
    return await engine.achat(CHAT, sampling=SamplingParams(max_tokens=6), tools=[tool], tool_choice="required")


@pytest.mark.parametrize("call", ["agenerate", "astream", "agenerate_many", "achat", "achat_tools"])
def test_an_async_call_compiles_off_the_loop_and_a_cancel_stops_the_compile(engine, call):
    pid, longest = asyncio.run(_cancelled_while_compiling(engine, lambda: _ask(engine, call), 0.5))
    assert longest < 0.25, f"the event loop stalled {longest:.2f} s while the format compiled"
    assert _gone(pid), "the cancelled request's compile is still running"
    assert not _busy(engine) and engine.stats()["active_requests"] == 0 and engine.stats()["queue_depth"] == 0



async def _cancelled_while_compiling(engine, work, seconds: float) -> tuple[int, float]:
    """Start ``work()`` as a task, wait until its format compiles, let it compile ``seconds`` while timing the loop,
    then cancel it: the compiling worker's pid and the loop's longest stall meanwhile."""
    task = asyncio.ensure_future(work())
    pid = await _compiling(engine, task)
    ticks = Ticks()
    await asyncio.sleep(seconds)  # the compile goes on meanwhile
    longest = ticks.stop()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return pid, longest

@pytest.mark.parametrize("framework", ["langchain", "llama_index"])
def test_the_frameworks_async_calls_compile_off_the_loop_and_stop_with_their_task(engine, framework):
    from pydantic import BaseModel, Field

    class Slow(BaseModel):
        a: str = Field(pattern=SLOW["pattern"])

    if framework == "langchain":
        pytest.importorskip("langchain_core")
        from ctx_integrations.langchain import ChatContextOfExperts

        work = ChatContextOfExperts(engine=engine, max_tokens=6).with_structured_output(Slow).ainvoke("Name one.")
    else:
        pytest.importorskip("llama_index.core")
        from llama_index.core.prompts import PromptTemplate

        from ctx_integrations.llama_index import ExpertDecoderLLM

        work = ExpertDecoderLLM(engine=engine, max_new_tokens=6).astructured_predict(Slow, PromptTemplate("Name one."))

    pid, longest = asyncio.run(_cancelled_while_compiling(engine, lambda: work, 0.3))
    assert longest < 0.25 and _gone(pid)


# -- the server ------------------------------------------------------------------------------------------------------

def _body(path: str, schema: dict) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    if path == "/v1/answer/batch":
        return {"queries": [QUESTION, QUESTION], "documents": DOCS, "response_format": fmt, "max_new_tokens": 6}
    if path == "/v1/chat/completions":
        return {"messages": CHAT, "response_format": fmt, "max_tokens": 6}
    return {"query": QUESTION, "documents": DOCS, "response_format": fmt, "max_new_tokens": 6,
            "stream": path.endswith("stream")}


async def _leaving(app, path: str, body: dict, leave: asyncio.Event) -> int:
    """POST ``body`` to ``app`` as a raw ASGI client that disconnects once ``leave`` is set: the status answered."""
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    statuses: list[int] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    route = path.removesuffix("#stream")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    await app(scope, receive, send)
    return statuses[0]


@pytest.mark.parametrize("path", ["/v1/answer", "/v1/answer/batch", "/v1/chat/completions", "/v1/answer#stream"])
def test_healthz_answers_and_the_request_is_in_flight_while_its_format_compiles(engine, path):
    app = create_app(engine, max_in_flight=1)

    async def main() -> dict:
        leave = asyncio.Event()
        request = asyncio.create_task(_leaving(app, path, _body(path, SLOW), leave))
        pid = await _compiling(engine, request)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            started = time.perf_counter()
            health = await client.get("/healthz")
            took = time.perf_counter() - started
            during = (await client.get("/metrics")).text
            refused = await client.post("/v1/answer", json=_body("/v1/answer", SMALL))
            leave.set()  # the client leaves
            status = await request
            after = (await client.get("/metrics")).text
        return {"pid": pid, "health": health.status_code, "took": took, "during": during, "refused": refused,
                "status": status, "after": after}

    seen = asyncio.run(main())
    assert seen["health"] == 200 and seen["took"] < 1.0, f"/healthz took {seen['took']:.2f} s"
    assert metric(seen["during"], "ctx_serve_in_flight_requests") == 1
    assert seen["refused"].status_code == 503 and "--max-in-flight" in seen["refused"].json()["error"]["message"]
    assert seen["status"] == 499 and metric(seen["after"], "ctx_serve_in_flight_requests") == 0
    assert _gone(seen["pid"]), "the compile went on after its client left"


def test_the_server_answers_the_limits_with_400s_naming_them(loaded):
    app = create_app(Engine(loaded, max_format_bytes=LIMIT, format_compile_timeout_s=0.5))

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [await client.post(path, json=_body(path, schema)) for path, schema in (
                ("/v1/answer", BIG["json"]), ("/v1/chat/completions", BIG["json"]), ("/v1/answer", SLOW),
                ("/v1/answer/batch", SLOW))]

    too_large, too_large_chat, too_slow, too_slow_batch = asyncio.run(main())
    for response, flag in ((too_large, "--max-format-bytes"), (too_large_chat, "--max-format-bytes"),
                           (too_slow, "--format-compile-timeout-s"), (too_slow_batch, "--format-compile-timeout-s")):
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "response_format", response.text
        assert flag in error["message"] and "raise the limit" in error["message"]
