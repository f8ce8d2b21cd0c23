"""The server honours structured output, tools, logprobs and the sampling knobs (the issue: they were answered
with HTTP 200 and plain prose, so ``ChatOpenAI.with_structured_output`` failed downstream).

A fake backend shows each field reaching the engine's job and each answer rendered in OpenAI's shape; the
embedded model, served in-process and called with the official ``openai`` client and LangChain's
``ChatOpenAI``, shows every answer valid against its schema.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from ctx_integrations.serve.app import create_app  # noqa: E402
from tests.test_serve_openai_api import CHAT, FakeBackend, openai_error, send  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class CallingBackend(FakeBackend):
    """Answers with a tool call and log-probabilities, as the engine's backend does."""

    def canned(self) -> dict:
        return {**super().canned(), "text": "", "finish_reason": "eos",
                "tool_calls": [{"id": "call_1", "name": "get_weather",
                                "arguments": {"city": "Oslo", "unit": "celsius"}}],
                "logprobs": [{"token": "<", "logprob": -0.1, "bytes": [60], "top_logprobs": []}]}


def test_every_knob_reaches_the_engine():
    backend = FakeBackend()
    body = {**CHAT, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
            "presence_penalty": -0.5, "logprobs": True, "top_logprobs": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}}
    assert send(create_app(backend=backend, model_name="fake"), "POST", "/v1/chat/completions",
                json=body).status_code == 200
    sampling = backend.jobs[0]["sampling"]
    assert {k: sampling[k] for k in ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                                     "logprobs")} == {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                                                      "frequency_penalty": 0.5, "presence_penalty": -0.5, "logprobs": 3}
    assert json.loads(sampling["structured"]["json"]) == CITY
    send(create_app(backend=backend, model_name="fake"), "POST", "/v1/chat/completions",
         json={**CHAT, "response_format": {"type": "json_object"}, "logprobs": True})
    assert backend.jobs[1]["sampling"]["structured"] == {"json_object": True}
    assert backend.jobs[1]["sampling"]["logprobs"] == 0  # the chosen token's only
    answer = send(create_app(backend=backend, model_name="fake"), "POST", "/v1/answer",
                  json={"query": "q", "documents": ["d"], "token_top_k": 4, "min_p": 0.2, "logprobs": 1,
                        "response_format": {"type": "json_object"}})
    assert answer.status_code == 200 and backend.jobs[2]["sampling"]["top_k"] == 4
    assert backend.jobs[2]["sampling"]["structured"] == {"json_object": True}


def test_tools_and_tool_messages_reach_the_engine():
    backend = FakeBackend()
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    response = send(create_app(backend=backend, model_name="fake"), "POST", "/v1/chat/completions",
                    json={**CHAT, "messages": history, "tools": [WEATHER],
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                          "parallel_tool_calls": False})
    assert response.status_code == 200, response.text
    job = backend.jobs[0]
    assert job["tools"] == [WEATHER] and job["tool_choice"] == "get_weather" and job["parallel_tool_calls"] is False
    assert job["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert job["messages"][2] == {"role": "tool", "content": "22C", "tool_call_id": "call_1"}
    send(create_app(backend=backend, model_name="fake"), "POST", "/v1/chat/completions",
         json={**CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert "tools" not in backend.jobs[1]  # none: the tools are not offered


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "top_k": "5"}, "top_k"),
    ({**CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages.0"),
    ({**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0"),
])
def test_bad_values_are_refused_by_name(body, param):
    response = send(create_app(backend=FakeBackend(), model_name="fake"), "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert openai_error(response)["param"] == param


def test_tool_calls_and_logprobs_are_answered_in_openais_shape():
    app = create_app(backend=CallingBackend(), model_name="fake")
    body = {**CHAT, "tools": [WEATHER], "logprobs": True}
    choice = send(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]
    assert choice["logprobs"] == {"content": [{"token": "<", "logprob": -0.1, "bytes": [60], "top_logprobs": []}]}
    events = [json.loads(line[6:]) for line in send(app, "POST", "/v1/chat/completions",
                                                    json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    finish = events[-1]["choices"][0]
    assert finish["finish_reason"] == "tool_calls" and finish["delta"]["tool_calls"][0]["index"] == 0
    assert finish["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_an_answer_cut_short_is_length_even_with_calls():
    class CutBackend(CallingBackend):
        def canned(self) -> dict:
            return {**super().canned(), "finish_reason": "length"}

    choice = send(create_app(backend=CutBackend(), model_name="fake"), "POST", "/v1/chat/completions",
                  json={**CHAT, "tools": [WEATHER]}).json()["choices"][0]
    assert choice["finish_reason"] == "length"


def test_a_schema_the_compiler_refuses_is_a_400_naming_response_format(embedded_engine):
    body = {**CHAT, "model": None, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}}
    response = send(create_app(embedded_engine), "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400 and openai_error(response)["param"] == "response_format"


# -- the embedded model, with the stock clients ----------------------------------------------------------------

def _client(engine) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=create_app(engine, model_name="local"))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://test"))


def test_the_openai_client_gets_schema_valid_json_and_logprobs(embedded_engine):
    async def main():
        client = _client(embedded_engine)
        schema = await client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Name a big city and its population."}],
            max_tokens=60, logprobs=True, top_logprobs=2,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        mode = await client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Give the capital of France as JSON with a key "
                                                                 "capital."}],
            max_tokens=40, response_format={"type": "json_object"})
        return schema.choices[0], mode.choices[0]

    schema, mode = asyncio.run(main())
    assert schema.finish_reason == "stop"
    jsonschema.validate(json.loads(schema.message.content), CITY)
    tokens = schema.logprobs.content
    assert "".join(t.token for t in tokens) == schema.message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    assert mode.finish_reason == "stop" and isinstance(json.loads(mode.message.content), dict)


def test_the_openai_client_gets_tool_calls_streamed_or_not(embedded_engine):
    async def main():
        client = _client(embedded_engine)
        asked = dict(model="local", messages=QUESTION, tools=[WEATHER], tool_choice="required",
                     parallel_tool_calls=False, max_tokens=48)
        whole = await client.chat.completions.create(**asked)
        stream = await client.chat.completions.create(**asked, stream=True)
        chunks = [chunk async for chunk in stream]
        return whole.choices[0], chunks

    whole, chunks = asyncio.run(main())
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # the call's markup is never streamed as text
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [(call.function.name,
                                                                            call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


class City(BaseModel):
    city: str
    population: int


def test_langchains_chat_openai_with_structured_output_against_the_server(embedded_engine):
    """The issue's reproduction: ``ChatOpenAI.with_structured_output`` against this server."""
    langchain_openai = pytest.importorskip("langchain_openai")
    transport = httpx.ASGITransport(app=create_app(embedded_engine, model_name="local"))
    llm = langchain_openai.ChatOpenAI(base_url="http://test/v1", api_key="unused", model="local", max_tokens=60,
                                      temperature=0, max_retries=0,
                                      http_async_client=httpx.AsyncClient(transport=transport, base_url="http://test"))

    async def main():
        schema = await llm.with_structured_output(City).ainvoke("Name a big city and its population.")
        calling = await llm.with_structured_output(City, method="function_calling").ainvoke(
            "Name a big city and its population.")
        return schema, calling

    for city in asyncio.run(main()):
        assert isinstance(city, City) and city.city
