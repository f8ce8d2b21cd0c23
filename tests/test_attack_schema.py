"""Issue 58 (3, 7): an attack suite against structured output's JSON schemas, at every door a schema comes in by.

Families: every refused keyword, at the root and nested in ``properties``, ``items``, ``anyOf``, ``$defs`` and a
tool's parameters; schemas nested 1,000 and 3,000 deep (a dict, JSON text, a server request); remote and dangling
``$ref``s. Each case is typed or correct: a library error (``UnsupportedSchemaError``, a 4xx naming
``response_format``), or an answer valid against the schema. Before, these were answers that broke the schema
and were reported finished (``[1, 2, 2]`` under ``uniqueItems``, finish ``eos``), or a ``RecursionError``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from ctx_integrations import Engine, SamplingParams, StructuredOutput
from ctx_integrations.engine.core.schema_support import REFUSED
from ctx_integrations.engine.core.tools import tool_request
from ctx_integrations.errors import CtxIntegrationsError, UnsupportedSchemaError
from tests.helpers import tiny_loaded
from tests.test_schema_support import REFUSED_CASES

pytest.importorskip("xgrammar")
QUESTION = "List three numbers."
DOCS = ["The numbers are 1, 2 and 2."]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3))


def _placed(schema: dict, where: str) -> tuple[dict, str]:
    """``schema`` placed ``where`` in a larger schema, and its path there."""
    if where == "root":
        return schema, "#"
    if where == "properties":
        return {"type": "object", "properties": {"x": schema}, "required": ["x"]}, "#/properties/x"
    if where == "items":
        return {"type": "array", "items": schema}, "#/items"
    if where == "anyOf":
        return {"anyOf": [{"type": "null"}, schema]}, "#/anyOf/1"
    return {"$defs": {"X": schema}, "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}}, "#/$defs/X"


def _typed(call, keyword: str, path: str) -> UnsupportedSchemaError:
    with pytest.raises(CtxIntegrationsError) as caught:
        call()
    error = caught.value
    assert isinstance(error, UnsupportedSchemaError), f"outcome=untyped-kind: {error!r}"
    assert (error.keyword, error.path) == (keyword, path), str(error)
    return error


@pytest.mark.parametrize("where", ["root", "properties", "items", "anyOf", "$defs"])
@pytest.mark.parametrize("keyword", REFUSED)
def test_every_refused_keyword_is_typed_wherever_it_is(keyword, where):
    schema, path = _placed(REFUSED_CASES[keyword][0], where)
    _typed(lambda: StructuredOutput(json=schema), keyword, path)
    _typed(lambda: StructuredOutput(json=json.dumps(schema)), keyword, path)
    _typed(lambda: StructuredOutput.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), keyword, path)


@pytest.mark.parametrize("keyword", ["uniqueItems", "not", "if", "contains"])
def test_a_tools_parameters_are_held_to_the_same_table(keyword):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": REFUSED_CASES[keyword][0]}}}}
    _typed(lambda: tool_request([tool], "required"), keyword, "#/properties/x")


def test_unique_items_is_refused_before_any_answer(engine):
    """The issue's case: ``[1, 2, 2]`` under ``uniqueItems``, finish ``eos``; now refused in the caller's thread."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 3,
              "uniqueItems": True}
    _typed(lambda: engine.generate(QUESTION, DOCS, sampling=SamplingParams(
        max_tokens=24, structured=StructuredOutput(json=schema))), "uniqueItems", "#")


def test_a_pydantic_set_is_refused_by_name():
    from pydantic import BaseModel

    class Tags(BaseModel):
        tags: set[int]

    _typed(lambda: StructuredOutput(json=Tags), "uniqueItems", "#/properties/tags")


@pytest.mark.parametrize("ref", ["https://example.com/schema.json", "other.json#/$defs/A", "#/$defs/Missing",
                                 "#anchor", "urn:uuid:1"])
def test_a_ref_the_grammar_cannot_resolve_is_typed(ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    error = _typed(lambda: StructuredOutput(json=schema), "$ref", "#/properties/a")
    assert ref in str(error) and "$defs" in str(error)


def _deep(levels: int, key: str = "items") -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", key: schema} if key == "items" else {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("levels", [1_000, 3_000])
def test_a_deep_schema_is_typed_not_a_recursion_error(levels):
    for schema in (_deep(levels), _deep(levels // 2, "properties")):
        error = _typed(lambda schema=schema: StructuredOutput(json=schema), "depth", "#")
        assert "100 levels" in str(error) and "$defs" in str(error)
    text = '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)  # (json.dumps
    _typed(lambda: StructuredOutput(json=text), "depth", "#")  # would recurse)
    nested: list = []
    for _ in range(levels):
        nested = [nested]
    data = {"type": "array", "items": {"type": "integer"}, "default": nested}
    _typed(lambda: StructuredOutput(json=data), "depth", "#")
    tool = {"type": "function", "function": {"name": "f", "parameters": _deep(levels, "properties")}}
    _typed(lambda: tool_request([tool], "required"), "depth", "#")


def test_the_server_answers_a_refused_or_deep_schema_with_a_400_naming_response_format():
    pytest.importorskip("fastapi")
    from ctx_integrations.serve.app import create_app
    from tests.serve_support import tiny_engine
    from tests.test_serve_openai_api import openai_error, send

    app = create_app(engine=tiny_engine(), model_name="tiny")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for schema in ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, _deep(150)):
        body = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        response = send(app, "POST", "/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = openai_error(response)
        assert error["param"] == "response_format" and "JSON schema" in error["message"]
    text = '{"type": "array", "items": ' * 2_999 + '{"type": "integer"}' + "}" * 2_999
    raw = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
           '"json_schema", "json_schema": {"name": "x", "schema": ' + text + "}}}")
    response = send(app, "POST", "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    openai_error(response)


# schemas the grammar enforces, each answered by a random model: what comes back is valid against it
CORRECT = {
    "a discriminated oneOf": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}},
         "required": ["kind", "n"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "ok": {"type": "boolean"}},
         "required": ["kind", "ok"]}]},
    "prefixItems and a recursive $ref": {"$defs": {"T": {"type": "array", "prefixItems": [
        {"type": "string", "format": "date"}, {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/T"}]}],
        "items": False, "minItems": 2}}, "$ref": "#/$defs/T"},
}


@pytest.mark.parametrize("name", CORRECT)
def test_an_enforced_schema_is_answered_validly(engine, name):
    schema = CORRECT[name]
    answer = engine.generate(QUESTION, DOCS, mode="concat", sampling=SamplingParams(
        max_tokens=64, structured=StructuredOutput(json=schema)))
    if answer.finish_reason == "length":  # cut by the budget: typed when parsed, never a broken finished answer
        return
    jsonschema.validate(json.loads(answer.text), schema, format_checker=jsonschema.FormatChecker())
