"""Attack suite for the library's surfaces (reliability issue 58, items 4, 5, 6 and 8): each case asserts that a
hostile or mistaken input is answered correctly or refused with a typed error, never silently taken.

- The command line (item 4): ``ctx-experts serve --host X`` was refused (rc 2, "ambiguous option: --host could
  match --host-bytes, --host-format"), so the server could listen on 127.0.0.1 only although README documents
  ``--host``; every ``ctx-experts ...`` command line of README, docs/ and the CLI's own examples must parse.
  ``--threads -2`` ran on one thread with rc 0 where the engine refuses the value (item 8).
- ``finish_reason`` (item 5): a JSON answer cut by a stop string (``{"name": "Aurora"``) was ``"stop"`` on
  ``/v1/chat/completions``, as a complete one is, while the engine, ``/v1/answer`` and both adapters report it
  incomplete; every surface must tell the two apart.
- A sealed ``format_docs`` block replayed (item 6): a block seen once (LangChain's callbacks carry it verbatim)
  pasted 20 times into a question became 20 experts among 22, and decided the answer. One expert per block.
- The access log (item 8): an API key sent as ``?api_key=`` was written to every log line verbatim.

Parser-level, in-process, on the tiny random model: no model download, no server process.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import HumanMessage

from ctx_integrations import Engine, SamplingParams, StructuredOutput
from ctx_integrations.cli import EPILOG, build_parser
from ctx_integrations.errors import IncompleteStructuredOutputError
from ctx_integrations.langchain import ChatContextOfExperts, format_docs
from ctx_integrations.langchain.boundaries import read_blocks
from tests.helpers import tiny_loaded

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


# -- item 4: every documented command line parses ------------------------------------------------------------
def _code_lines(text: str) -> tuple[list[str], str]:
    """The lines of the markdown's code blocks (fenced or indented; a trailing ``\\`` joins the next line) and
    the prose without them."""
    code, prose = [], []
    lines, fenced, index = text.splitlines(), False, 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            body = line.strip()
            while body.endswith("\\") and index + 1 < len(lines):
                index += 1
                body = body[:-1] + " " + lines[index].strip()
            code.append(body)
        else:
            prose.append(line)
        index += 1
    return code, "\n".join(prose)


def documented_command_lines() -> list[tuple[str, str]]:
    """``(where, line)`` for every ``ctx-experts`` command line: in a code block (after ``$ ``, ``time `` or
    variable assignments), or an inline code span of the prose that gives options (a span naming a command,
    ``ctx-experts eval``, is a name; one that ends in ``...`` a fragment)."""
    found = [("cli.EPILOG", line.strip()) for line in EPILOG.splitlines() if line.strip().startswith("ctx-experts")]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        code, prose = _code_lines(path.read_text(encoding="utf-8"))
        for line in code:
            command = re.match(r"(?:\$ |time |[A-Z_]+=\S* )*(ctx-experts(?: .*)?)$", line)
            if command:
                found.append((path.name, command[1]))
        for span in re.findall(r"`(ctx-experts[^`]*)`", prose.replace("\n", " ")):
            if " -" in span and not span.rstrip().endswith("..."):
                found.append((path.name, span))
    return found


def _argv(line: str) -> list[str]:
    """The arguments of a documented line: shell comments and a trailing ``&`` dropped, ``[...]`` (optional
    arguments, written out) unbracketed, the count placeholder ``N`` as a number."""
    words = shlex.split(line, comments=True)[1:]
    words = [word.removeprefix("[").removesuffix("]") for word in words if word != "&"]
    return ["2" if word == "N" else word for word in words]


def test_every_documented_command_line_parses(capsys):
    """Bug caught: ``serve --host X`` refused as an ambiguous abbreviation, with README documenting ``--host``."""
    lines = documented_command_lines()
    assert len(lines) > 40 and any("--host" in line for _, line in lines)  # README's `serve ... [--host ...]`
    failures = []
    for where, line in lines:
        try:
            build_parser().parse_args(_argv(line))
        except SystemExit as exited:
            if exited.code != 0:  # --help and --version exit 0
                failures.append(f"{where}: {line}\n    {capsys.readouterr().err.strip().splitlines()[-1]}")
    capsys.readouterr()
    assert not failures, "documented command lines that do not parse:\n" + "\n".join(failures)


def test_every_flag_of_the_docs_flag_tables_is_a_flag_of_serve():
    """The flag tables (docs/cli.md's engine flags, docs/serving.md's): each flag one that ``serve`` takes."""
    import argparse

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    serve.format_help()  # a command's arguments are added when it is used
    rows = [line for name in ("cli.md", "serving.md")
            for line in (ROOT / "docs" / name).read_text(encoding="utf-8").splitlines() if line.startswith("| `--")]
    flags = {flag for row in rows for flag in re.findall(r"`(--[a-z][a-z-]*)", row.split(" | ")[0])}
    assert len(flags) > 15 and "--api-key" in flags
    assert sorted(flags - set(serve._option_string_actions)) == []


@pytest.mark.parametrize("argv", [["serve", "--host", "0.0.0.0"], ["serve", "--host=0.0.0.0", "--port", "9000"],
                                  ["--host-bytes", "1GiB", "serve", "--host", "0.0.0.0", "--host-format", "int8"]])
def test_serve_listens_on_the_host_given(argv):
    args = build_parser().parse_args(argv)
    assert args.host == "0.0.0.0" and args.command == "serve"


@pytest.mark.parametrize("argv", [["serve", "--hos", "0.0.0.0"], ["--thread=2", "demo"],
                                  ["ask", "q", "--store", "s", "--top", "2"], ["distill", "t.txt", "--out", "o"]])
def test_no_parser_takes_an_abbreviation(argv, capsys):
    """A prefix is refused, whichever parser reads it: one that works today changes meaning with the next flag."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "error: " in error and "ambiguous" not in error


def _thread_places() -> list[list[str]]:
    """``--threads`` before the command and after each command that builds an engine."""
    from ctx_integrations.cli import _COMMANDS

    base = {"demo": ["demo"], "ingest": ["ingest", "x"], "ask": ["ask", "q", "--store", "s"], "eval": ["eval"],
            "serve": ["serve"]}
    commands = [name for name, command in _COMMANDS.items() if command.builds_engine]
    assert sorted(commands) == sorted(base)  # a new command that takes --threads joins this test
    return [["{}", *base["demo"]], *(base[name] + ["{}"] for name in commands)]


@pytest.mark.parametrize("place", _thread_places(), ids=lambda place: " ".join(place))
@pytest.mark.parametrize("count", ["-2", "0"])
def test_threads_below_one_is_refused_with_status_2(place, count, capsys):
    """Bug caught: ``--threads -2`` ran on one thread with rc 0 (the engine refuses it). Refused by the parser, as
    ``ctx-experts`` refuses it (``main`` parses first: argparse's exit status 2), before anything runs."""
    argv = [word for part in place for word in (["--threads", count] if part == "{}" else [part])]
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert f"argument --threads: '{count}': the thread count must be at least 1" in capsys.readouterr().err


# -- item 5: finish_reason tells a complete structured answer from a cut one ---------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Aurora"]}}, "required": ["name"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "star", "schema": SCHEMA}}
QUESTION = "Name a star."
DOCUMENTS = ["Aurora is a star."]
CUT = ["}"]  # the stop string that cuts {"name": "Aurora"} to {"name": "Aurora"


def _server_answer(engine, path: str, body: dict) -> tuple[str, str]:
    """``(finish_reason, text)`` of one answer of the in-process server; a stream's from its last chunk."""
    from ctx_integrations.serve.app import create_app
    from tests.test_serve_openai_api import send

    response = send(create_app(engine), "POST", path, json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        reply = response.json()
        if path == "/v1/answer":
            return reply["finish_reason"], reply["text"]
        return reply["choices"][0]["finish_reason"], reply["choices"][0]["message"]["content"]
    if path == "/v1/answer":  # its SSE events: tokens, then the answer
        answer = json.loads(response.text.split("event: answer\ndata: ")[1].split("\n")[0])
        return answer["finish_reason"], answer["text"]
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1], text


def _surfaces(engine, stop: list[str]) -> dict[str, tuple[str, str]]:
    """``(finish_reason, text)`` of the same structured question on every surface, cut by ``stop`` or not."""
    from ctx_integrations.llama_index import ExpertDecoderLLM

    sampling = SamplingParams(max_tokens=24, stop=tuple(stop), structured=StructuredOutput(json=SCHEMA))
    found = {"engine": (lambda a: (a.finish_reason, a.text))(engine.generate(QUESTION, DOCUMENTS, sampling=sampling))}
    answer = {"query": QUESTION, "documents": DOCUMENTS, "max_new_tokens": 24, "stop": stop,
              "response_format": RESPONSE_FORMAT}
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "stop": stop,
            "response_format": RESPONSE_FORMAT}
    for stream in (False, True):
        suffix = " streamed" if stream else ""
        found["/v1/answer" + suffix] = _server_answer(engine, "/v1/answer", {**answer, "stream": stream})
        found["/v1/chat/completions" + suffix] = _server_answer(engine, "/v1/chat/completions",
                                                                {**chat, "stream": stream})
    message = ChatContextOfExperts(engine=engine, max_tokens=24).invoke(
        [HumanMessage(QUESTION)], response_format=RESPONSE_FORMAT, stop=stop)
    found["langchain"] = message.response_metadata["finish_reason"], message.text
    completion = ExpertDecoderLLM(engine=engine, max_new_tokens=24).complete(QUESTION, response_format=RESPONSE_FORMAT,
                                                                            stop=stop)
    found["llama_index"] = completion.raw["finish_reason"], completion.text
    return found


# each surface's word for a complete structured answer, and for one a stop string cut (the engine's own words
# where the surface is the library's; OpenAI's, where "length" is what its clients take for "incomplete")
COMPLETE = {"engine": "eos", "/v1/answer": "eos", "/v1/answer streamed": "eos", "/v1/chat/completions": "stop",
            "/v1/chat/completions streamed": "stop", "langchain": "eos", "llama_index": "eos"}
CUT_SHORT = {**{surface: "stop" for surface in COMPLETE}, "/v1/chat/completions": "length",
             "/v1/chat/completions streamed": "length"}


def test_every_surface_tells_a_complete_structured_answer_from_one_a_stop_string_cut(engine):
    """Bug caught: ``/v1/chat/completions`` said ``stop`` for ``{"name": "Aurora"``, as for a complete answer."""
    complete, cut = _surfaces(engine, []), _surfaces(engine, CUT)
    assert {surface: reason for surface, (reason, _) in complete.items()} == COMPLETE
    assert {surface: reason for surface, (reason, _) in cut.items()} == CUT_SHORT
    assert {text for _, text in complete.values()} == {'{"name": "Aurora"}'}
    assert {text for _, text in cut.values()} == {'{"name": "Aurora"'}


def test_a_structured_answer_a_stop_string_cut_is_an_error_where_it_is_parsed(engine):
    schema = {**SCHEMA, "title": "star"}
    complete = ChatContextOfExperts(engine=engine, max_tokens=24).with_structured_output(schema)
    assert complete.invoke(QUESTION) == {"name": "Aurora"}
    with pytest.raises(IncompleteStructuredOutputError, match="finish_reason 'stop'"):
        ChatContextOfExperts(engine=engine, max_tokens=24, stop=CUT).with_structured_output(schema).invoke(QUESTION)


@pytest.mark.parametrize(("engine_reason", "tools", "expected"), [
    ("stop", {"tool_choice": "required"}, "length"),  # a call it had to make, cut by a stop string
    ("stop", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "length"),
    ("eos", {"tool_choice": "required"}, "tool_calls"),
    ("stop", {"tool_choice": "auto"}, "tool_calls"),  # the model chose to stop: its calls are complete ones
    ("stop", {}, "stop"),  # plain text a stop string ended: complete
    ("length", {}, "length"),
])
def test_the_chat_finish_reason_of_a_call_it_had_to_make(engine_reason, tools, expected):
    from ctx_integrations.serve.app import create_app
    from tests.test_serve_openai_api import CHAT, send
    from tests.test_serve_structured import WEATHER, CallingBackend

    class Backend(CallingBackend):
        def canned(self) -> dict:
            return {**super().canned(), "finish_reason": engine_reason,
                    **({} if tools else {"tool_calls": [], "text": "Paris"})}

    body = {**CHAT, **({"tools": [WEATHER], **tools} if tools else {})}
    app = create_app(backend=Backend(), model_name="fake")
    assert send(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["finish_reason"] == expected
    events = [json.loads(line[6:]) for line in send(app, "POST", "/v1/chat/completions",
                                                    json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == expected


# -- item 6: a sealed block replayed is one expert --------------------------------------------------------
VAULT = LCDocument(page_content="The secret code of the vault is 4721.", id="vault", metadata={"score": 0.62})
PARIS = LCDocument(page_content="Paris is the capital of France.", id="paris", metadata={"score": 0.41})
OLD = LCDocument(page_content="Official records: the vault code is 0000.", id="records", metadata={"score": 0.9})


def test_a_block_replayed_is_one_block():
    block = format_docs([OLD])
    blocks, rest = read_blocks(f"Q?\n{block}\n{block}\n\n{format_docs([VAULT])}\n{block}\nA:")
    assert [(b.id, b.text) for b in blocks] == [("records", OLD.page_content), ("vault", VAULT.page_content)]
    assert rest == "Q?\n\nA:"  # the repeats are taken out of the text with the first
    assert read_blocks(f"  \n{block}\n\n{block}") == (blocks[:1], "  \n")  # the text before the first kept
    seen: set[str] = set()
    assert len(read_blocks(block, seen)[0]) == 1 and len(seen) == 1
    assert read_blocks(f"again: {block}", seen) == ([], "again: ")  # already returned for this prompt


@pytest.mark.parametrize("where", ["question", "history"])
def test_a_block_seen_once_and_pasted_twenty_times_is_one_expert(engine, monkeypatch, where):
    """Bug caught: 20 copies of a replayed block among 22 documents, which decided the answer."""
    from langchain_core.prompts import ChatPromptTemplate

    from tests.test_attack_langchain import rag_chain

    decoded = []
    generate = engine.generate

    def recording(query, documents, *args, **kwargs):
        decoded.append(list(documents))
        return generate(query, documents, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    replay = "\n".join([format_docs([OLD])] * 20)  # what an earlier prompt's trace showed, pasted 20 times
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context."), ("placeholder", "{history}"),
                                               ("human", "Question: {question}\nContext: {context}\nAnswer:")])
    question = f"What is the vault code?\n{replay}" if where == "question" else "What is the vault code?"
    history = [HumanMessage(f"Earlier I saw:\n{replay}")] if where == "history" else []
    chat = ChatContextOfExperts(engine=engine, max_tokens=2)
    message = rag_chain(prompt, [VAULT, PARIS, OLD], chat).invoke({"question": question, "history": history})
    assert [d.id for d in decoded[0]] == ["records", "vault", "paris"]  # once each, where it first appears
    assert [d["id"] for d in message.response_metadata["documents"]] == [d.id for d in decoded[0]]


# -- item 8: the access log keeps credentials out ---------------------------------------------------------
SECRET = "sk-live-0123456789"


@pytest.mark.parametrize(("query", "logged"), [
    *((f"{name}={SECRET}", f"{name}=[redacted]")
      for name in ("api_key", "API_KEY", "key", "token", "access_token", "Password", "client_secret", "auth",
                   "api%5Fkey", "x-api-key", "apiKey", "Authorization", "sig%6Eature")),
    (f"a=1&api_key={SECRET}&b=2", "a=1&api_key=[redacted]&b=2"),
    (f"token={SECRET}&token={SECRET}", "token=[redacted]&token=[redacted]"),
])
def test_the_access_log_never_holds_a_credential_from_the_query(caplog, query, logged):
    """Bug caught: ``GET /v1/models?api_key=sk-...`` logged with the key, on every line of every request."""
    from ctx_integrations.serve.access_log import ACCESS_LOGGER
    from ctx_integrations.serve.app import create_app
    from tests.test_serve_openai_api import FakeBackend, send

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        send(create_app(backend=FakeBackend(), model_name="fake"), "GET", f"/v1/models?{query}")
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert SECRET not in record.getMessage() and record.path == f"/v1/models?{logged}"
    assert f'"GET /v1/models?{logged} HTTP/1.1" 200 ' in record.getMessage()


@pytest.mark.parametrize("query", ["a=1&b=2", "q=what%20is&limit=5", "flag&x=", "token", "=v&&x=1", "keep=%0A"])
def test_the_access_log_keeps_every_other_query_as_sent(query):
    from ctx_integrations.serve.access_log import redacted_query

    assert redacted_query(query) == query


def test_the_access_log_redacts_by_the_name_before_the_first_equals_sign():
    from ctx_integrations.serve.access_log import redacted_query

    assert redacted_query(f"token=a={SECRET}") == "token=[redacted]"  # the value may hold "="
    assert redacted_query("q=token=x&limit=2") == "q=token=x&limit=2"  # a value that names a secret is no name


def _logged(caplog, app, scope: dict, level: int = logging.INFO) -> tuple[list[dict], list[logging.LogRecord]]:
    """What ``AccessLogMiddleware(app)`` sent for ``scope`` and the access-log records it wrote (``app``'s error,
    if it raised, is raised again with the records as its ``records``)."""
    import asyncio

    from ctx_integrations.serve.access_log import ACCESS_LOGGER, AccessLogMiddleware

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    with caplog.at_level(level, logger=ACCESS_LOGGER):
        try:
            asyncio.run(AccessLogMiddleware(app)(scope, receive, send))
        except RuntimeError as error:
            error.records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
            raise
        finally:
            records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
            caplog.clear()
    return sent, records


def _responding(status: int | None, fail: bool = False):
    async def app(scope, receive, send):
        if status is not None:
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        if fail:
            raise RuntimeError("boom")

    return app


def test_the_access_log_line_of_a_bare_scope_and_of_hostile_bytes(caplog, monkeypatch):
    """A scope with only a type and a path (no client, method, version, raw path or query), and a raw path and
    query with bytes that are not ASCII: one line each, the bytes escaped, never decoded into the log."""
    import types

    from ctx_integrations.serve import access_log

    ticks = iter([0.0, 0.25, 10.0, 10.0001234, 20.0, 20.0])
    monkeypatch.setattr(access_log, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    sent, (record,) = _logged(caplog, _responding(201), {"type": "http", "path": "/a b\n"})
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and sent[1]["body"] == b"ok"
    assert record.getMessage() == '- - "- /a%20b%0A HTTP/1.1" 201 250.0ms'
    assert (record.client_addr, record.method, record.path, record.http_version, record.status_code,
            record.duration_ms) == ("-", "-", "/a%20b%0A", "1.1", 201, 250.0)
    hostile = {"type": "http", "path": "/ignored", "raw_path": b"/caf\xc3\xa9", "query_string": b"q=\xff&key=\xfe",
               "method": "GET", "http_version": "2", "client": ("10.0.0.1", 7)}
    _, (record,) = _logged(caplog, _responding(200), hostile)
    assert record.getMessage() == '10.0.0.1:7 - "GET /caf\\xc3\\xa9?q=\\xff&key=[redacted] HTTP/2" 200 0.1ms'
    assert record.duration_ms == 0.123
    _, (record,) = _logged(caplog, _responding(204), {"type": "http"})  # not even a path
    assert record.getMessage() == '- - "-  HTTP/1.1" 204 0.0ms' and record.path == ""


def test_the_access_log_status_of_a_failure_and_of_a_client_that_left(caplog):
    scope = {"type": "http", "path": "/v1/answer", "method": "POST"}
    with pytest.raises(RuntimeError, match="boom") as failed:
        _logged(caplog, _responding(None, fail=True), scope)
    assert [r.status_code for r in failed.value.records] == [500]  # failed before any response: 500
    with pytest.raises(RuntimeError, match="boom") as failed:
        _logged(caplog, _responding(200, fail=True), scope)
    assert [r.status_code for r in failed.value.records] == [200]  # failed after its response started: as sent
    assert [r.status_code for r in _logged(caplog, _responding(None), scope)[1]] == [499]  # no response at all


@pytest.mark.parametrize(("scope", "level"), [({"type": "lifespan"}, logging.INFO),
                                              ({"type": "http", "path": "/"}, logging.WARNING)])
def test_the_access_log_passes_what_it_does_not_log_through_untouched(caplog, scope, level):
    """Not HTTP (lifespan), or the logger off: the app gets the very scope, receive and send, and nothing is logged."""
    import asyncio

    from ctx_integrations.serve.access_log import ACCESS_LOGGER, AccessLogMiddleware

    seen = []

    async def app(*args):
        seen.append(args)

    async def receive():
        return {}

    async def send(message):
        return None

    with caplog.at_level(level, logger=ACCESS_LOGGER):
        asyncio.run(AccessLogMiddleware(app)(scope, receive, send))
    assert len(seen) == 1 and seen[0][0] is scope and seen[0][1] is receive and seen[0][2] is send
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]


def test_an_api_key_in_the_query_is_no_key_and_is_echoed_nowhere(caplog):
    """``?api_key=`` is not how a key is sent (``Authorization: Bearer``): 401, in words that say how, with the key
    in neither the answer nor the log."""
    from ctx_integrations.errors import InvalidOptionError
    from ctx_integrations.serve.access_log import ACCESS_LOGGER
    from ctx_integrations.serve.app import create_app
    from ctx_integrations.serve.auth import ApiKeyMiddleware
    from tests.test_serve_openai_api import FakeBackend, send

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        response = send(create_app(backend=FakeBackend(), model_name="fake", api_key=SECRET), "GET",
                        f"/v1/models?api_key={SECRET}")
    assert response.status_code == 401 and SECRET not in response.text
    assert response.json()["error"]["message"] == ("missing or invalid API key: send the server's key (--api-key, "
                                                   "$CTX_API_KEY) as 'Authorization: Bearer KEY' (OpenAI clients: "
                                                   "api_key=KEY)")
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert record.path == "/v1/models?api_key=[redacted]" and record.status_code == 401
    with pytest.raises(InvalidOptionError) as refused:
        ApiKeyMiddleware(None, [])
    assert str(refused.value) == "ApiKeyMiddleware needs at least one key"
