"""Agents run a tool with a plain ``str`` parameter and use its result (issue 57, item 1): a LlamaIndex
``FunctionAgent``, a LangChain bind_tools loop (execute the call, send the ``ToolMessage`` back) and the
``openai`` client's loop against the server, on the embedded SmolLM2 (and on the 0.5B model, skipped when it is
not fetched). Before, the unbounded string was filled until ``max_tokens`` and the call came back as prose.

The first step names the tool (SmolLM2 answers in prose when the choice is its own), one call at a time (the
budget of this file: each agent's two model calls stay within a few dozen tokens); the 0.5B model shows the
``tool_choice="auto"`` path, its calls written as fenced JSON.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ctx_integrations import Engine
from ctx_integrations.errors import IncompleteStructuredOutputError, ModelLoadError
from tests.helpers import tiny_loaded

FACT = "FACT-7731: permissive, with a patent grant"  # what the tool answers: the marker its result is followed by
QUESTION = "Call licence_facts with spdx_id Apache-2.0, then say whether the licence is permissive."
LICENCE_TOOL = {"type": "function", "function": {
    "name": "licence_facts", "description": "Facts about a software licence, by its SPDX id (MIT, Apache-2.0)",
    "parameters": {"type": "object", "properties": {"spdx_id": {"type": "string"}}, "required": ["spdx_id"]}}}
QWEN = "qwen2.5-coder-0.5b"


def licence_facts(spdx_id: str) -> str:
    """Facts about a software licence, by its SPDX id (MIT, Apache-2.0)."""
    assert isinstance(spdx_id, str) and len(spdx_id) <= 128  # at most the default bound of an unbounded string
    return f"{spdx_id}: {FACT}"


@pytest.fixture
def short_strings(monkeypatch) -> None:
    """The embedded model's unbounded string bounded to 8 characters (the documented override, not the default
    128): SmolLM2 fills the string to its bound ("spdx_id_2023-01-01_..."), and 128 characters at a token or two
    each would spend this file's time budget; the default bound is tested in tests/test_tools.py."""
    monkeypatch.setenv("CTX_SCHEMA_MAX_LENGTH", "8")


@pytest.fixture(scope="module")
def tiny() -> Engine:
    """A tiny random model: where a call is cut, not what it says, is under test (milliseconds a token)."""
    return Engine(tiny_loaded("llama", seed=3))


@pytest.fixture(scope="module")
def qwen_engine() -> Engine:
    from ctx_integrations import local_model_name

    try:
        local_model_name(QWEN)
    except ModelLoadError:
        pytest.skip(f"{QWEN} is not fetched (ctx-experts models fetch {QWEN})")
    return Engine.from_pretrained(QWEN)


def _prompts(engine: Engine, monkeypatch) -> list[list[dict]]:
    """The conversations ``engine`` is asked to answer from now on (its chat and stream_chat, sync and async)."""
    seen: list[list[dict]] = []
    submit = engine.submit_chat

    def recording(messages, **settings):
        seen.append([dict(m) for m in messages])
        return submit(messages, **settings)

    monkeypatch.setattr(engine, "submit_chat", recording)
    return seen


def _used_the_result(seen: list[list[dict]]) -> None:
    """The tool ran and its result went back to the model as a ``tool`` message of the next turn."""
    assert len(seen) >= 2
    results = [m for m in seen[-1] if m.get("role") == "tool"]
    assert results and FACT in results[0]["content"]
    calls = [m for m in seen[-1] if m.get("tool_calls")]
    assert calls and calls[0]["tool_calls"][0]["function"]["name"] == "licence_facts"


def _final_is_prose(text: str) -> None:
    assert isinstance(text, str) and "<tool_call>" not in text and '"arguments"' not in text


# -- LlamaIndex ---------------------------------------------------------------------------------------------------
def _function_agent(engine: Engine, choice: str | None, tokens: int):
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool

    from ctx_integrations.llama_index import ExpertDecoderLLM

    return FunctionAgent(tools=[FunctionTool.from_defaults(licence_facts)], allow_parallel_tool_calls=False,
                         llm=ExpertDecoderLLM(engine=engine, max_new_tokens=tokens), initial_tool_choice=choice)


async def _run(agent, iterations: int):
    return await agent.run(QUESTION, max_iterations=iterations)


def test_a_llama_index_function_agent_runs_a_str_tool(embedded_engine, monkeypatch, short_strings):
    seen = _prompts(embedded_engine, monkeypatch)
    answer = asyncio.run(_run(_function_agent(embedded_engine, "licence_facts", 40), 3))
    _used_the_result(seen)
    _final_is_prose(str(answer))


# -- LangChain ----------------------------------------------------------------------------------------------------
def _langchain_loop(engine: Engine, choice: str | None, tokens: int, final_tokens: int) -> tuple[str, list]:
    """bind_tools, run each call, send the ToolMessage back, answer (what create_react_agent does, one round)."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    from ctx_integrations.langchain import ChatContextOfExperts

    run = tool(licence_facts)
    chat = ChatContextOfExperts(engine=engine, max_tokens=tokens)
    messages: list = [HumanMessage(QUESTION)]
    first = chat.bind_tools([run], tool_choice=choice, parallel_tool_calls=False).invoke(messages)
    assert first.tool_calls and not first.content  # a call, never its markup as text
    messages += [first, *(run.invoke(call) for call in first.tool_calls)]
    final = chat.bind_tools([run]).invoke(messages, max_tokens=final_tokens)
    return str(final.content), messages


def test_a_langchain_tool_loop_runs_a_str_tool(embedded_engine, monkeypatch, short_strings):
    seen = _prompts(embedded_engine, monkeypatch)
    final, _ = _langchain_loop(embedded_engine, "licence_facts", 40, 8)
    _used_the_result(seen)
    _final_is_prose(final)


def test_a_cut_call_is_a_typed_error_in_both_adapters(tiny):
    """The budget ends inside the call: an IncompleteStructuredOutputError, not the call's markup as the answer."""
    from langchain_core.tools import tool
    from llama_index.core.tools import FunctionTool

    from ctx_integrations.langchain import ChatContextOfExperts
    from ctx_integrations.llama_index import ExpertDecoderLLM

    chat = ChatContextOfExperts(engine=tiny, max_tokens=6).bind_tools([tool(licence_facts)],
                                                                                 tool_choice="any")
    with pytest.raises(IncompleteStructuredOutputError, match="cut before it was complete") as cut:
        chat.invoke(QUESTION)
    assert "<tool_call>" not in str(cut.value.text)
    with pytest.raises(IncompleteStructuredOutputError, match="licence_facts"):
        list(chat.stream(QUESTION))
    llm = ExpertDecoderLLM(engine=tiny, max_new_tokens=6)
    with pytest.raises(IncompleteStructuredOutputError, match="max_new_tokens"):
        llm.predict_and_call([FunctionTool.from_defaults(licence_facts)], QUESTION, tool_required=True)


# -- the server, with the openai client ---------------------------------------------------------------------------
def _client(engine: Engine):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from ctx_integrations.serve.app import create_app

    transport = httpx.ASGITransport(app=create_app(engine, model_name="local"))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://test"))


async def _openai_loop(engine: Engine, choice, tokens: int, final_tokens: int) -> tuple[str, list]:
    """The openai client's agent loop: call, run each tool call, send the results back, answer."""
    client = _client(engine)
    messages: list = [{"role": "user", "content": QUESTION}]
    first = (await client.chat.completions.create(model="local", messages=messages, tools=[LICENCE_TOOL],
                                                  tool_choice=choice, parallel_tool_calls=False,
                                                  max_tokens=tokens)).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    messages.append(first.message.model_dump(exclude_none=True))
    for call in first.message.tool_calls:  # the loop the issue saw fail: tool_calls was None
        result = licence_facts(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = (await client.chat.completions.create(model="local", messages=messages, tools=[LICENCE_TOOL],
                                                  max_tokens=final_tokens)).choices[0]
    return final.message.content or "", messages


def test_the_openai_clients_tool_loop_against_the_server(embedded_engine, monkeypatch, short_strings):
    seen = _prompts(embedded_engine, monkeypatch)
    final, _ = asyncio.run(_openai_loop(embedded_engine, "required", 40, 8))
    _used_the_result(seen)
    _final_is_prose(final)


def test_a_cut_call_on_the_server_is_openais_length_shape(tiny):
    """``finish_reason="length"``, ``content`` null and the cut call in ``tool_calls`` with its arguments as far as
    written (what OpenAI answers), streamed or not: never the call's markup as ``content``."""
    async def main():
        client = _client(tiny)
        asked = dict(model="local", messages=[{"role": "user", "content": QUESTION}], tools=[LICENCE_TOOL],
                     tool_choice={"type": "function", "function": {"name": "licence_facts"}}, max_tokens=12)
        whole = (await client.chat.completions.create(**asked)).choices[0]
        chunks = [chunk async for chunk in await client.chat.completions.create(**asked, stream=True)]
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    written = call.function.arguments  # as far as it got: a prefix of the call's arguments, never the markup
    assert call.function.name == "licence_facts" and "<tool_call>" not in written and '"name"' not in written
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: the client sees finish_reason "length", as from OpenAI
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert [t.function.name for t in streamed] == ["licence_facts"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# -- the 0.5B model, its own choice (tool_choice="auto"): the calls it writes as fenced JSON ---------------------
@pytest.mark.xfail(strict=True, reason="measured 2026-12-01 with the model fetched: the FunctionAgent calls the tool "
                   "again after its result until max_iterations=4 (WorkflowRuntimeError); the LangChain and openai "
                   "loops were not reached: remove this mark once it passes")
def test_the_05b_model_calls_a_str_tool_on_its_own_in_every_front_end(qwen_engine, monkeypatch):
    seen = _prompts(qwen_engine, monkeypatch)
    answer = asyncio.run(_run(_function_agent(qwen_engine, None, 96), 4))
    _used_the_result(seen)
    _final_is_prose(str(answer))
    final, _ = _langchain_loop(qwen_engine, None, 96, 48)
    _used_the_result(seen)
    _final_is_prose(final)
    final, _ = asyncio.run(_openai_loop(qwen_engine, "auto", 96, 48))
    _used_the_result(seen)
    _final_is_prose(final)
