"""LangChain: ``bind_tools``, ``with_structured_output`` (every method), the sampling knobs and logprobs on
``ChatContextOfExperts``. Every parsed value and every tool call is validated against its schema: on a tiny
random model (the constraint does all the work) and on the embedded model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from typing_extensions import TypedDict  # noqa: E402

from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.errors import IncompleteStructuredOutputError, InvalidOptionError  # noqa: E402
from ctx_integrations.langchain import ChatContextOfExperts  # noqa: E402
from ctx_integrations.langchain.chat_model import to_chat_messages  # noqa: E402
from tests.helpers import tiny_loaded  # noqa: E402
from tests.test_core_pced import DOCS, QUESTION  # noqa: E402


class Small(BaseModel):
    """A place and its rank (bounded, so a random model completes it)."""

    city: str = Field(max_length=6)
    rank: int = Field(ge=0, le=9)


class SmallDict(TypedDict):
    """A place's rank."""

    rank: int


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
SMALL_SCHEMA = {"title": "Small", "description": "A place and its rank", "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6},
                               "rank": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["city", "rank"]}


@pytest.fixture(scope="module")
def chat() -> ChatContextOfExperts:
    # a random model writes every unbounded integer to its longest (16 digits, the interoperable range the engine
    # holds them to): a call to add with its wrapper takes about 70 tokens
    return ChatContextOfExperts(engine=Engine(tiny_loaded("llama", seed=3)), max_tokens=96)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_parses_a_pydantic_model_by_every_method(chat, method):
    plain = chat.invoke("Name a city.").content
    with pytest.raises(ValueError):
        json.loads(plain)  # the random model writes no JSON of its own
    parsed = chat.with_structured_output(Small, method=method).invoke("Name a city and its rank.")
    assert isinstance(parsed, Small)
    raw = chat.with_structured_output(Small, method=method, include_raw=True).invoke("Name a city.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Small) and isinstance(raw["raw"], AIMessage)
    if method == "function_calling":
        assert raw["raw"].tool_calls[0]["name"] == "Small" and raw["raw"].content == ""


@pytest.mark.parametrize("schema", [SMALL_SCHEMA, SmallDict])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_a_json_schema_or_a_typed_dict(chat, schema, method):
    parsed = chat.with_structured_output(schema, method=method).invoke("Name a city and its rank.")
    jsonschema.validate(parsed, SMALL_SCHEMA if schema is SMALL_SCHEMA else {
        "type": "object", "properties": {"rank": {"type": "integer"}}, "required": ["rank"]})


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_an_answer_cut_by_max_tokens_is_an_error_not_a_partial_value(chat, method):
    short = ChatContextOfExperts(engine=chat.engine, max_tokens=4)
    for schema in (Small, SMALL_SCHEMA):
        with pytest.raises(IncompleteStructuredOutputError,
                           match=r"raise max_tokens|raise max_new_tokens \(LangChain's max_tokens\)"):
            short.with_structured_output(schema, method=method).invoke("Name a city.")
    raw = short.with_structured_output(Small, method=method, include_raw=True).invoke("Name a city.")
    assert isinstance(raw["parsing_error"], IncompleteStructuredOutputError) and raw["parsed"] is None


def test_json_mode_without_a_schema_is_any_object(chat):
    bound = chat.bind(response_format={"type": "json_object"}, max_tokens=96)
    message = bound.invoke("Describe a city.")
    if message.response_metadata["finish_reason"] == "eos":  # a random model may still be writing at the budget
        assert isinstance(json.loads(message.content), dict)
    assert message.content.startswith("{")
    with pytest.raises(InvalidOptionError, match="with_structured_output.*needs a schema"):
        chat.with_structured_output(None, method="json_schema")
    with pytest.raises(InvalidOptionError, match="method must be one of"):
        chat.with_structured_output(Small, method="xml")


def test_bind_tools_gives_tool_calls_valid_against_their_schemas(chat):
    for choice in ("any", "required", True, "add"):
        message = chat.bind_tools([add], tool_choice=choice, parallel_tool_calls=False).invoke("What is 3 plus 4?")
        assert message.content == "" and [call["name"] for call in message.tool_calls] == ["add"]
        jsonschema.validate(message.tool_calls[0]["args"], ADD_SCHEMA)
        assert message.tool_calls[0]["id"].startswith("call_")
    auto = chat.bind_tools([add, Small]).invoke("What is 3 plus 4?")
    for call in auto.tool_calls:
        jsonschema.validate(call["args"], ADD_SCHEMA if call["name"] == "add" else SMALL_SCHEMA)


def test_streamed_tool_calls_merge_into_the_message_and_never_show_as_text(chat):
    bound = chat.bind_tools([add], tool_choice="add", parallel_tool_calls=False)
    whole = bound.invoke("What is 3 plus 4?")
    merged = None
    for chunk in bound.stream("What is 3 plus 4?"):
        assert "<tool_call>" not in chunk.content
        merged = chunk if merged is None else merged + chunk
    assert merged.content == "" and [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls]

    async def astream():
        total = None
        async for chunk in bound.astream("What is 3 plus 4?"):
            total = chunk if total is None else total + chunk
        return total

    assert [c["args"] for c in asyncio.run(astream()).tool_calls] == [c["args"] for c in whole.tool_calls]


def test_tool_messages_go_back_to_the_model():
    call = {"name": "add", "args": {"a": 3, "b": 4}, "id": "call_1", "type": "tool_call"}
    history = [HumanMessage("What is 3 plus 4?"), AIMessage("", tool_calls=[call]),
               ToolMessage("7", tool_call_id="call_1")]
    assert to_chat_messages(history)[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "content": "7", "tool_call_id": "call_1"}]


def test_tool_history_reaches_the_prompt(chat):
    call = {"name": "add", "args": {"a": 3, "b": 4}, "id": "call_1", "type": "tool_call"}
    history = [HumanMessage("What is 3 plus 4?"), AIMessage("", tool_calls=[call]),
               ToolMessage("7", tool_call_id="call_1")]
    with_result = chat.bind_tools([add]).invoke(history, max_tokens=2)
    without = chat.bind_tools([add]).invoke(history[:1], max_tokens=2)
    assert with_result.usage_metadata["input_tokens"] > without.usage_metadata["input_tokens"] + 20


def test_the_sampling_knobs_and_logprobs_reach_the_engine(chat):
    plain = chat.invoke("Name a city.", max_tokens=5).response_metadata["token_ids"]
    assert len(set(plain)) > 1
    for knob in (dict(frequency_penalty=-2.0), dict(presence_penalty=-2.0), dict(repetition_penalty=0.01)):
        assert len(set(chat.invoke("Name a city.", max_tokens=5, **knob).response_metadata["token_ids"])) == 1
        as_field = ChatContextOfExperts(engine=chat.engine, max_tokens=5, **knob)
        assert len(set(as_field.invoke("Name a city.").response_metadata["token_ids"])) == 1
    assert chat.invoke("Name a city.", max_tokens=5, top_k=1, min_p=0.5, temperature=1.0,
                       seed=0).response_metadata["token_ids"] == plain  # top_k=1 is greedy
    logprobs = chat.invoke("Name a city.", max_tokens=3, logprobs=True, top_logprobs=2)
    content = logprobs.response_metadata["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    assert "logprobs" not in chat.invoke("Name a city.", max_tokens=2).response_metadata


def test_response_format_holds_an_answer_over_documents_and_tools_are_refused_there(chat):
    answer = chat.invoke(QUESTION, documents=DOCS, response_format=Small).content
    Small.model_validate_json(answer)
    with pytest.raises(InvalidOptionError, match="tools are offered to a conversation"):
        chat.bind_tools([add]).invoke(QUESTION, documents=DOCS)


# -- the embedded model ------------------------------------------------------------------------------------------

class City(BaseModel):
    """A city and its population."""

    city: str
    population: int


@pytest.mark.slow
def test_the_embedded_model_through_langchain(embedded_engine):
    chat = ChatContextOfExperts(engine=embedded_engine, max_tokens=60)
    for method in ("json_schema", "function_calling"):
        city = chat.with_structured_output(City, method=method).invoke("Name a big city and its population.")
        assert isinstance(city, City) and city.city
    call = chat.bind_tools([add], tool_choice="any", parallel_tool_calls=False).invoke("What is 3 plus 4?")
    jsonschema.validate(call.tool_calls[0]["args"], ADD_SCHEMA)
