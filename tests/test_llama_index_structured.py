"""LlamaIndex: ``ExpertDecoderLLM`` as a ``FunctionCallingLLM``: ``structured_predict`` (sync, async, streamed),
``as_structured_llm``, ``chat_with_tools``, ``predict_and_call`` and a ``FunctionAgent``, through LlamaIndex's own
programs and agents. Every object and every call is validated against its schema: on a tiny random model (it
writes no JSON of its own, so the constraint does all the work) and on the embedded model."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.core.types import PydanticProgramMode  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.errors import IncompleteStructuredOutputError, InvalidOptionError, NoToolCallError  # noqa: E402
from ctx_integrations.llama_index import ExpertDecoderLLM  # noqa: E402
from ctx_integrations.llama_index.tools import to_chat_messages  # noqa: E402
from tests.helpers import tiny_loaded  # noqa: E402


class Small(BaseModel):
    """A place and its rank (bounded, so a random model completes it)."""

    city: str = Field(max_length=6)
    rank: int = Field(ge=0, le=9)


class Ranking(BaseModel):
    """Places in order: a nested model in a list, and an unbounded integer."""

    places: list[Small] = Field(max_length=2)
    year: int


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


ADD = FunctionTool.from_defaults(fn=add)
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
PROMPT = PromptTemplate("Name a city and its rank in {country}.")
QUESTION = "What is 3 plus 4?"


@pytest.fixture(scope="module")
def llm() -> ExpertDecoderLLM:
    return ExpertDecoderLLM(engine=Engine(tiny_loaded("llama", seed=3)), max_new_tokens=96)


def test_structured_predict_returns_objects_valid_against_the_schema(llm):
    assert llm.metadata.is_function_calling_model
    with pytest.raises(ValueError):
        json.loads(llm.complete("Name a city.").text)  # the random model writes no JSON of its own
    small = llm.structured_predict(Small, PROMPT, country="France")
    assert isinstance(small, Small)
    assert isinstance(asyncio.run(llm.astructured_predict(Small, PROMPT, country="Peru")), Small)
    ranking = llm.structured_predict(Ranking, PROMPT, country="Chile")
    assert isinstance(ranking, Ranking) and abs(ranking.year) <= 2**53 - 1
    *_, last = llm.stream_structured_predict(Small, PROMPT, country="France")
    assert last == small


def test_as_structured_llm_answers_as_the_schema(llm):
    structured = llm.as_structured_llm(Small)
    response = structured.chat([ChatMessage(role=MessageRole.USER, content="Name a city and its rank.")])
    assert isinstance(response.raw, Small) and Small.model_validate_json(response.message.content) == response.raw
    completion = asyncio.run(structured.acomplete("Name a city and its rank."))
    assert isinstance(completion.raw, Small)


def test_chat_with_tools_gives_calls_valid_against_their_schemas(llm):
    for options in (dict(tool_required=True), dict(tool_choice="add"), dict(tool_choice="required")):
        response = llm.chat_with_tools([ADD], user_msg=QUESTION, **options)
        calls = llm.get_tool_calls_from_response(response)
        assert [call.tool_name for call in calls] == ["add"] and response.message.content == ""
        jsonschema.validate(calls[0].tool_kwargs, ADD_SCHEMA)
        assert [b.tool_name for b in response.message.blocks if isinstance(b, ToolCallBlock)] == ["add"]
    called = llm.predict_and_call([ADD], user_msg=QUESTION, tool_required=True)
    (source,) = called.sources
    assert source.raw_output == add(**source.raw_input["kwargs"]) and called.response == str(source.raw_output)
    awaited = asyncio.run(llm.apredict_and_call([ADD], user_msg=QUESTION, tool_required=True))
    assert awaited.sources[0].raw_input == source.raw_input


def test_a_text_answer_or_a_cut_call_is_a_typed_error(llm):
    auto = llm.chat_with_tools([ADD], user_msg=QUESTION)  # the random model answers in text when it may
    assert llm.get_tool_calls_from_response(auto, error_on_no_tool_call=False) == []
    with pytest.raises(NoToolCallError, match="tool_required=True"):
        llm.get_tool_calls_from_response(auto)
    with pytest.raises(IncompleteStructuredOutputError, match="raise max_new_tokens"):
        llm.structured_predict(Small, PROMPT, llm_kwargs={"max_tokens": 4}, country="France")


def test_streamed_calls_never_show_as_text_and_end_in_the_last_response(llm):
    whole = llm.chat_with_tools([ADD], user_msg=QUESTION, tool_choice="add")
    responses = list(llm.stream_chat_with_tools([ADD], user_msg=QUESTION, tool_choice="add"))
    assert all("<tool_call>" not in (r.delta or "") + (r.message.content or "") for r in responses)
    expected = [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(whole)]
    assert [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(responses[-1])] == expected

    async def astream():
        return [r async for r in await llm.astream_chat_with_tools([ADD], user_msg=QUESTION, tool_choice="add")]

    last = asyncio.run(astream())[-1]
    assert [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(last)] == expected


def test_a_function_agent_calls_the_tool_and_reads_its_result(llm):
    agent = FunctionAgent(tools=[ADD], llm=llm, initial_tool_choice="add")

    async def run():
        handler = agent.run(user_msg=QUESTION)
        results = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
        return results, await handler

    results, output = asyncio.run(run())
    assert [r.tool_name for r in results][:1] == ["add"]
    jsonschema.validate(results[0].tool_kwargs, ADD_SCHEMA)
    assert results[0].tool_output.raw_output == add(**results[0].tool_kwargs) and output.response is not None


def test_tool_calls_and_results_go_back_to_the_model(llm):
    call = ToolCallBlock(tool_call_id="call_1", tool_name="add", tool_kwargs={"a": 3, "b": 4})
    history = [ChatMessage(role=MessageRole.USER, content=QUESTION),
               ChatMessage(role=MessageRole.ASSISTANT, blocks=[call]),
               ChatMessage(role=MessageRole.TOOL, content="7", additional_kwargs={"tool_call_id": "call_1"})]
    assert to_chat_messages(history)[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "content": "7", "tool_call_id": "call_1"}]
    with_result = llm.chat(history, tools=[ADD.metadata.to_openai_tool()], max_tokens=2)
    without = llm.chat(history[:1], tools=[ADD.metadata.to_openai_tool()], max_tokens=2)
    assert with_result.raw["usage"]["prompt_tokens"] > without.raw["usage"]["prompt_tokens"] + 20


def test_what_cannot_be_honoured_is_refused(llm):
    with pytest.raises(InvalidOptionError, match="complete does not accept tools.*chat_with_tools"):
        llm.complete("hi", tools=[ADD.metadata.to_openai_tool()])
    with pytest.raises(InvalidOptionError, match="another LLM's program"):
        ExpertDecoderLLM(engine=llm.engine, pydantic_program_mode=PydanticProgramMode.OPENAI)
    answer = llm.chat([ChatMessage(role=MessageRole.USER, content="hi")], response_format=Small)
    Small.model_validate_json(answer.message.content)


# -- the embedded model ------------------------------------------------------------------------------------------

class City(BaseModel):
    """A city and its population."""

    city: str
    population: int


@pytest.mark.slow
def test_the_embedded_model_through_llama_index(embedded_engine):
    llm = ExpertDecoderLLM(engine=embedded_engine, max_new_tokens=60)
    city = llm.structured_predict(City, PromptTemplate("Name a big city in {country} and its population."),
                                  country="France")
    assert isinstance(city, City) and city.city
    called = llm.predict_and_call([ADD], user_msg=QUESTION, tool_required=True)
    jsonschema.validate(called.sources[0].raw_input["kwargs"], ADD_SCHEMA)
    assert called.sources[0].raw_output == add(**called.sources[0].raw_input["kwargs"])
