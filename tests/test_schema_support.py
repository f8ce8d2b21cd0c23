"""The keyword table of structured output (``engine/core/schema_support.py``) against xgrammar itself.

Every keyword :data:`ENFORCED` claims is compiled as the engine compiles it (``bounded_integers``, compact, strict)
and a matcher is fed values: each valid one (by jsonschema) is accepted and each violating one refused, so the
table cannot claim enforcement xgrammar does not give. Every refusal shows why it is one: xgrammar, given the
keyword, accepts a value that breaks it. And docs/python.md lists the same tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from ctx_integrations.engine.core import schema_support
from ctx_integrations.engine.core.schema_support import (
    ENFORCED,
    ENFORCED_FORMATS,
    FREE_FORMATS,
    MAX_SCHEMA_DEPTH,
    REFUSED,
    check_schema,
)
from ctx_integrations.engine.core.structured import bounded_integers
from ctx_integrations.errors import InvalidStructuredOutputError, UnsupportedSchemaError

xgr = pytest.importorskip("xgrammar")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)


def accepts(compiler, schema, text: str) -> bool:
    """Whether xgrammar, compiled as the engine compiles ``schema``, lets ``text`` through to its end."""
    compiled = compiler.compile_json_schema(bounded_integers(json.dumps(schema)), any_whitespace=False,
                                            strict_mode=True)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def valid(schema, text: str) -> bool:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(json.loads(text))


INT = {"type": "integer"}
DEFS = {"A": {"type": "integer", "maximum": 3}}
# keyword: (schema, values valid against it, values that break it): every one of the latter must be refused
ENFORCED_CASES = {
    "type": ({"type": ["integer", "null"]}, ["1", "null"], ['"a"', "1.5", "true"]),
    "enum": ({"enum": ["x", 1, None], "type": ["string", "integer", "null"]}, ['"x"', "1", "null"], ['"y"', "2"]),
    "const": ({"const": "hi", "type": "string"}, ['"hi"'], ['"ho"', '""']),
    "minLength": ({"type": "string", "minLength": 2}, ['"ab"'], ['"a"', '""']),
    "maxLength": ({"type": "string", "maxLength": 2}, ['"ab"', '""'], ['"abc"']),
    "pattern": ({"type": "string", "pattern": "^a+$"}, ['"aa"'], ['"b"', '"ab"']),
    "format": ({"type": "string", "format": "date"}, ['"2020-01-02"'], ['"nope"', '"2020-13-02"']),
    "minimum": ({"type": "number", "minimum": 1.5}, ["1.5", "2"], ["1.4", "1"]),
    "maximum": ({"type": "integer", "maximum": 3}, ["3"], ["4"]),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, ["0.5"], ["0", "-1"]),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, ["2"], ["3"]),
    "items": ({"type": "array", "items": INT}, ["[1]", "[]"], ['["a"]']),
    "prefixItems": ({"type": "array", "prefixItems": [INT, {"type": "string"}], "items": False},
                    ['[1, "a"]'], ['["a", 1]', '[1, "a", 2]']),
    "unevaluatedItems": ({"type": "array", "prefixItems": [INT], "unevaluatedItems": {"type": "string"}},
                         ['[1, "x"]'], ["[1, 2]"]),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, ["[1, 2]"], ["[1]", "[]"]),
    "maxItems": ({"items": INT, "maxItems": 1}, ["[1]"], ["[1, 2]"]),
    "properties": ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, ['{"a": 1}'], ['{"a": "x"}']),
    "required": ({"properties": {"a": INT, "b": INT}, "required": ["a"]}, ['{"a": 1}'], ['{"b": 1}', "{}"]),
    "additionalProperties": ({"type": "object", "additionalProperties": INT}, ['{"b": 1}', "{}"], ['{"b": "x"}']),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
                              ['{"a": 1}'], ['{"a": 1, "b": 2}']),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": False},
                          ['{"x": 1}'], ['{"x": "s"}', '{"y": 1}']),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 1, "type": "string"},
                       "additionalProperties": INT}, ['{"a": 1}'], ['{"ab": 1}']),
    "minProperties": ({"type": "object", "additionalProperties": INT, "minProperties": 1}, ['{"a": 1}'], ["{}"]),
    "maxProperties": ({"properties": {"a": INT, "b": INT}, "maxProperties": 1}, ['{"a": 1}'], ['{"a": 1, "b": 2}']),
    "anyOf": ({"anyOf": [INT, {"type": "string", "maxLength": 1}], "title": "T"}, ["1", '"a"'], ['"ab"', "null"]),
    "oneOf": ({"oneOf": [INT, {"type": "string"}]}, ["1", '"a"'], ["null", "1.5"]),
    "allOf": ({"allOf": [{"$ref": "#/$defs/A"}], "description": "d", "$defs": DEFS}, ["3"], ["4"]),
    "$ref": ({"$defs": DEFS, "type": "object", "properties": {"a": {"$ref": "#/$defs/A", "description": "d"},
                                                            "b": {"$ref": "#/properties/a"}},
              "required": ["a", "b"]}, ['{"a": 3, "b": 1}'], ['{"a": 4, "b": 1}', '{"a": 1, "b": 4}']),
    "$defs": ({"$defs": DEFS, "$ref": "#/$defs/A"}, ["3"], ["4"]),
    "definitions": ({"definitions": {"a/b": {"type": "integer", "maximum": 3}}, "$ref": "#/definitions/a~1b"},
                    ["3"], ["4"]),
}
# format: (a valid string, strings that break it)
FORMAT_CASES = {
    "date-time": ("2020-01-02T12:00:00Z", ["2020-01-02", "2020-13-02T12:00:00Z"]),
    "date": ("2020-01-02", ["2020-1-2", "2020-01-32"]),
    "time": ("12:00:00Z", ["12:00", "25:00:00Z"]),
    "duration": ("P1D", ["1D", "P"]),
    "email": ("a@b.co", ["nope", "a@"]),
    "hostname": ("example.com", ["a b", "-a-"]),
    "ipv4": ("10.0.0.1", ["256.0.0.1", "1.2.3"]),
    "ipv6": ("::1", ["1:2:3", "::g"]),
    "uri": ("https://x.org/a", ["nope", "a b"]),
    "uri-reference": ("/a/b", ["a b"]),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", ["123e4567e89b12d3a456426614174000"]),
    "uri-template": ("/a/{b}", ["/a/{b"]),
    "json-pointer": ("/a/b", ["a"]),
    "relative-json-pointer": ("0/a", ["/a"]),
}


def test_every_enforced_keyword_has_a_case():
    assert set(ENFORCED_CASES) == set(ENFORCED) and set(FORMAT_CASES) == set(ENFORCED_FORMATS)


@pytest.mark.parametrize("keyword", ENFORCED_CASES)
def test_an_enforced_keyword_is_accepted_and_xgrammar_refuses_every_value_that_breaks_it(compiler, keyword):
    schema, good, bad = ENFORCED_CASES[keyword]
    assert keyword in json.dumps(schema)
    check_schema(schema)
    check_schema(json.dumps(schema))
    for text in good:
        assert valid(schema, text) and accepts(compiler, schema, text), text
    for text in bad:
        assert not valid(schema, text) and not accepts(compiler, schema, text), text


def test_every_enforced_format_is_checked_by_xgrammar(compiler):
    for fmt, (good, bad) in FORMAT_CASES.items():
        schema = {"type": "string", "format": fmt}
        check_schema(schema)
        assert accepts(compiler, schema, json.dumps(good)), fmt
        assert not any(accepts(compiler, schema, json.dumps(text)) for text in bad), fmt


def test_free_formats_restrict_nothing_and_are_accepted(compiler):
    for fmt in FREE_FORMATS:
        check_schema({"type": "string", "format": fmt})
        assert jsonschema.Draft202012Validator({"format": fmt},
                                               format_checker=jsonschema.FormatChecker()).is_valid("anything")


X = {"type": "array", "items": INT}
# keyword: (a schema using it, a value xgrammar lets through that breaks it, or None where xgrammar cannot compile it)
REFUSED_CASES = {
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "uniqueItems": ({**X, "uniqueItems": True}, "[1, 2, 2]"),
    "contains": ({**X, "contains": {"const": 5}}, "[1, 2]"),
    "minContains": ({**X, "minContains": 1, "contains": {"const": 5}}, None),
    "maxContains": ({**X, "maxContains": 1, "contains": {"const": 5}}, "[5, 5]"),
    "additionalItems": ({"type": "array", "prefixItems": [INT], "additionalItems": False}, None),
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}, "6"),
    "then": ({"type": "integer", "then": {"maximum": 5}}, None),
    "else": ({"type": "integer", "else": {"maximum": 5}}, None),
    "dependentRequired": ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
                          '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "properties": {"a": INT, "b": INT},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependencies": ({"type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}}, None),
    "$dynamicRef": ({"$dynamicRef": "#node"}, None),
    "$recursiveRef": ({"$recursiveRef": "#"}, None),
    "contentEncoding": ({"type": "string", "contentEncoding": "base64"}, None),
    "contentMediaType": ({"type": "string", "contentMediaType": "application/json"}, None),
    "contentSchema": ({"type": "string", "contentSchema": INT, "contentMediaType": "application/json"}, None),
}


def test_every_refused_keyword_has_a_case():
    assert set(REFUSED_CASES) == set(REFUSED)
    assert not set(REFUSED) & (set(ENFORCED) | schema_support.ANNOTATIONS)


@pytest.mark.parametrize("keyword", REFUSED_CASES)
def test_a_refused_keyword_is_named_with_what_to_do(compiler, keyword):
    schema, breaking = REFUSED_CASES[keyword]
    with pytest.raises(UnsupportedSchemaError) as caught:
        check_schema(schema)
    assert caught.value.keyword == keyword and caught.value.path == "#"
    assert f"{keyword!r} at #" in str(caught.value) and REFUSED[keyword] in str(caught.value)
    assert isinstance(caught.value, InvalidStructuredOutputError)
    if breaking is not None:  # why it is refused: xgrammar takes the keyword and lets a value that breaks it through
        assert accepts(compiler, schema, breaking) and not valid(schema, breaking)


# (what is refused, the schema, its keyword, its path, a value xgrammar lets through that breaks it)
COMBINATIONS = [
    ("unique items in an array property", {"type": "object", "properties": {"tags": {**X, "uniqueItems": True}}},
     "uniqueItems", "#/properties/tags", '{"tags": [1, 1]}'),
    ("a length beside a format", {"type": "string", "format": "email", "maxLength": 5}, "maxLength", "#",
     '"aa@bb.cc"'),
    ("a pattern beside a format", {"type": "string", "format": "date", "pattern": "^2020"}, "format", "#",
     '"2021-01-02"'),
    ("a length beside a pattern", {"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength", "#", '"aaa"'),
    ("a lookahead", {"type": "string", "pattern": "^(?=a)b$"}, "pattern", "#", '"b"'),
    ("a lookbehind", {"type": "string", "pattern": "^(?<!a)b$"}, "pattern", "#", None),
    ("a format xgrammar does not check", {"type": "string", "format": "idn-email"}, "format", "#", '"nope"'),
    ("a format JSON Schema does not define", {"type": "string", "format": "base64"}, "format", "#", None),
    ("a regex format", {"type": "string", "format": "regex"}, "format", "#", '"[a-z"'),
    ("a string keyword without its type", {"maxLength": 2}, "maxLength", "#", '"abc"'),
    ("a pattern without its type", {"pattern": "^a$"}, "pattern", "#", '"b"'),
    ("a number keyword without its type", {"exclusiveMinimum": 1}, "exclusiveMinimum", "#", "1"),
    ("an array keyword without its type", {"maxItems": 1}, "maxItems", "#", "[1, 2]"),
    ("an object keyword without its type", {"minProperties": 1}, "minProperties", "#", "{}"),
    ("required without properties", {"required": ["a"]}, "required", "#", "{}"),
    ("required naming an undeclared property", {"type": "object", "additionalProperties": INT, "required": ["c"]},
     "required", "#", "{}"),
    ("propertyNames beside properties", {"type": "object", "properties": {"long": INT},
                                         "propertyNames": {"type": "string", "maxLength": 2}},
     "propertyNames", "#", '{"long": 1}'),
    ("a constraint beside enum", {"enum": ["a", "bb"], "type": "string", "maxLength": 1}, "maxLength", "#", '"bb"'),
    ("a type beside enum that a value lacks", {"enum": ["a", 1], "type": "string"}, "type", "#", "1"),
    ("a type beside const that the value lacks", {"const": 1, "type": "string"}, "type", "#", "1"),
    ("a constraint beside anyOf", {"type": "integer", "maximum": 5, "anyOf": [{"minimum": 0, "type": "integer"}]},
     "type", "#", "6"),
    ("required beside anyOf", {"anyOf": [{"type": "object", "properties": {"a": INT}}], "required": ["a"]},
     "required", "#", None),
    ("a constraint beside oneOf", {"maximum": 5, "oneOf": [INT]}, "maximum", "#", "6"),
    ("a constraint beside allOf", {"type": "integer", "maximum": 5, "allOf": [{"minimum": 0}]}, "type", "#", "6"),
    ("a constraint beside $ref", {"$defs": {"A": INT}, "type": "object", "properties": {
        "a": {"$ref": "#/$defs/A", "maximum": 3}}, "required": ["a"]}, "maximum", "#/properties/a", '{"a": 4}'),
    ("allOf of two schemas", {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
     "allOf", "#", "6"),
    ("allOf of no schema", {"allOf": []}, "allOf", "#", None),
    ("oneOf whose branches overlap", {"oneOf": [INT, {"type": "integer", "minimum": 0}]}, "oneOf", "#", "1"),
    ("oneOf over integer and number", {"oneOf": [INT, {"type": "number"}]}, "oneOf", "#", "1"),
    ("oneOf with untyped branches", {"oneOf": [{"minimum": 0, "type": "integer"}, {"enum": [1, 2]}]}, "oneOf", "#",
     "1"),
    ("oneOf with a boolean branch", {"oneOf": [True, INT]}, "oneOf", "#", None),
    ("a remote $ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}},
                       "required": ["a"]}, "$ref", "#/properties/a", None),
    ("a $ref to another file", {"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "$ref",
     "#/properties/a", None),
    ("an absolute $ref to this schema", {"$id": "https://ex.com/s", "$defs": {"A": INT}, "type": "object",
                                         "properties": {"a": {"$ref": "https://ex.com/s#/$defs/A"}}, "required": ["a"]},
     "$ref", "#/properties/a", '{"a": "x"}'),
    ("an anchor $ref", {"$defs": {"A": {"$anchor": "foo", "type": "integer", "maximum": 3}}, "type": "object",
                        "properties": {"a": {"$ref": "#foo"}}, "required": ["a"]}, "$ref", "#/properties/a", None),
    ("a $ref to nothing", {"properties": {"a": {"$ref": "#/$defs/Nope"}}}, "$ref", "#/properties/a", None),
    ("a $ref past an array's end", {"anyOf": [INT], "$defs": {"B": {"$ref": "#/anyOf/1"}}}, "$ref", "#/$defs/B",
     None),
    ("a $ref with a bad index", {"anyOf": [INT], "$defs": {"B": {"$ref": "#/anyOf/x"}}}, "$ref", "#/$defs/B", None),
    ("a $ref through a value", {"$defs": {"A": INT, "B": {"$ref": "#/$defs/A/type/x"}}}, "$ref", "#/$defs/B", None),
    ("$id below the root", {"type": "object", "properties": {"a": {"$id": "https://ex.com/a", "type": "integer"}}},
     "$id", "#/properties/a", None),
    ("draft 7's tuple items", {"type": "array", "items": [INT]}, "items", "#", None),
    ("a refused keyword in items", {"type": "array", "items": {"not": INT}}, "not", "#/items", None),
    ("a refused keyword in prefixItems", {"prefixItems": [INT, {"not": INT}]}, "not", "#/prefixItems/1", None),
    ("a refused keyword in anyOf", {"anyOf": [INT, {"type": "string", "if": {}}]}, "if", "#/anyOf/1", None),
    ("a refused keyword in $defs", {"$defs": {"a/b~": {"not": INT}}}, "not", "#/$defs/a~1b~0", None),
    ("a refused keyword in definitions", {"definitions": {"A": {"not": INT}}}, "not", "#/definitions/A", None),
    ("a refused keyword in patternProperties", {"type": "object", "patternProperties": {"^x": {"not": INT}}}, "not",
     "#/patternProperties/^x", None),
    ("a refused keyword in additionalProperties", {"type": "object", "additionalProperties": {"not": INT}}, "not",
     "#/additionalProperties", None),
    ("a refused keyword in unevaluatedItems", {"type": "array", "unevaluatedItems": {"not": INT}}, "not",
     "#/unevaluatedItems", None),
    ("a refused keyword in unevaluatedProperties", {"type": "object", "unevaluatedProperties": {"not": INT}}, "not",
     "#/unevaluatedProperties", None),
    ("a refused keyword in propertyNames", {"type": "object", "propertyNames": {"not": {"const": "a"}}}, "not",
     "#/propertyNames", None),
    ("a refused keyword in oneOf", {"oneOf": [INT, {"type": "string", "not": {}}]}, "not", "#/oneOf/1", None),
    ("a refused keyword in allOf", {"allOf": [{"type": "string", "not": {}}]}, "not", "#/allOf/0", None),
]


@pytest.mark.parametrize("case", COMBINATIONS, ids=[case[0] for case in COMBINATIONS])
def test_a_combination_xgrammar_would_drop_is_refused_where_it_is(compiler, case):
    _, schema, keyword, path, breaking = case
    with pytest.raises(UnsupportedSchemaError) as caught:
        check_schema(schema)
    assert (caught.value.keyword, caught.value.path) == (keyword, path), str(caught.value)
    assert f"{keyword!r} at {path} " in str(caught.value) and "docs/python.md" in str(caught.value)
    with pytest.raises(UnsupportedSchemaError):
        check_schema(json.dumps(schema))
    if breaking is not None:
        assert accepts(compiler, schema, breaking) and not valid(schema, breaking)


ACCEPTED = [
    ("annotations", {"type": "string", "title": "x", "description": "d", "examples": ["a"], "default": "a",
                     "$comment": "c", "deprecated": True, "readOnly": True, "writeOnly": True, "$schema": "s",
                     "$id": "https://ex.com/s", "$anchor": "a"}),
    ("keys that are no keyword", {"type": "object", "properties": {"a": INT}, "discriminator": {"not": 1},
                                  "nullable": True, "x-extra": {"uniqueItems": True}}),
    ("data keys hold data", {"type": "object", "properties": {"a": {**INT, "default": {"not": 1}}},
                             "examples": [{"if": 1}], "const_like": 1}),
    ("uniqueItems false", {**X, "uniqueItems": False}),
    ("enum of integers as floats beside type integer", {"enum": [1.0, 2], "type": "integer"}),
    ("enum of numbers", {"enum": [1.5, 2], "type": "number"}),
    ("enum of every type", {"enum": [True, None, [1], {"a": 1}, "s"],
                            "type": ["boolean", "null", "array", "object", "string"]}),
    ("const of an object", {"const": {"a": [1]}, "type": "object"}),
    ("oneOf by type", {"oneOf": [{"type": ["string", "null"]}, {"type": "array"}, INT]}),
    ("oneOf of no branch or one", {"anyOf": [{"oneOf": []}, {"oneOf": [True]}]}),
    ("boolean schemas", {"type": "object", "properties": {"a": True}, "additionalProperties": False}),
    ("a local $ref chain", {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": INT}, "$ref": "#/$defs/A"}),
    ("a root $ref", {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}}),
    ("a percent-escaped $ref", {"$defs": {"a b": INT}, "$ref": "#/$defs/a%20b"}),
    ("a $ref into a list", {"anyOf": [INT], "$defs": {"B": {"$ref": "#/anyOf/0"}}}),
    ("required of declared names, non-strings left to xgrammar", {"properties": {"a": INT}, "required": ["a", 5]}),
    ("patternProperties beside properties", {"type": "object", "properties": {"a": INT},
                                             "patternProperties": {"^x": INT}}),
    ("values of the wrong shape are xgrammar's to refuse", {"type": [5, "object"], "properties": 5,
                                                            "$defs": [1], "required": "a"}),
    ("a pattern that is no string is xgrammar's to refuse", {"type": "string", "pattern": 5}),
]


@pytest.mark.parametrize("case", ACCEPTED, ids=[case[0] for case in ACCEPTED])
def test_what_the_grammar_enforces_or_what_asks_nothing_is_accepted(case):
    check_schema(case[1])


def test_oneof_told_apart_by_a_discriminator_is_accepted_as_pydantic_writes_it(compiler):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Owner(BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")

    schema = Owner.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    check_schema(schema)
    assert accepts(compiler, schema, '{"pet": {"kind": "cat", "lives": 9}}')
    assert not accepts(compiler, schema, '{"pet": {"kind": "cat", "good": true}}')
    enum = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    told = {"oneOf": [enum, {**enum, "properties": {"k": {"enum": ["c"]}}}]}
    check_schema(told)
    for overlapping in ({"oneOf": [enum, enum]},  # the same values
                        {"oneOf": [enum, {**enum, "properties": {"k": INT}}]},  # no value listed
                        {"oneOf": [enum, {**enum, "properties": {"j": {"const": "c"}}}]},  # not declared
                        {"oneOf": [enum, {**enum, "properties": 5}]},
                        {"oneOf": [enum, {**enum, "properties": {"k": {"enum": "c"}}}]},
                        {"oneOf": [enum, {**enum, "required": []}]}):
        with pytest.raises(UnsupportedSchemaError, match="oneOf"):
            check_schema(overlapping)


def test_a_remote_ref_is_compiled_as_any_value(compiler):
    """Why a remote $ref is refused: xgrammar loads nothing and lets any value through."""
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}, "required": ["a"]}
    assert all(accepts(compiler, schema, text) for text in ('{"a": 1}', '{"a": "x"}', '{"a": [null]}'))


def test_nesting_is_limited_without_recursion():
    def nested(levels: int):
        schema: dict = {"type": "integer"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    check_schema(nested(MAX_SCHEMA_DEPTH))
    check_schema(json.dumps(nested(MAX_SCHEMA_DEPTH)))
    check_schema(json.dumps({"a": "[[[[" * MAX_SCHEMA_DEPTH, "b": [[["\\\"{"]]]}))  # brackets in strings are text
    for deep in (nested(MAX_SCHEMA_DEPTH + 1), {"enum": json.loads("[" * MAX_SCHEMA_DEPTH + "]" * MAX_SCHEMA_DEPTH)}):
        with pytest.raises(UnsupportedSchemaError, match=f"deeper than {MAX_SCHEMA_DEPTH} levels") as caught:
            check_schema(deep)
        assert (caught.value.keyword, caught.value.path) == ("depth", "#")
        with pytest.raises(UnsupportedSchemaError, match="deeper"):
            check_schema(json.dumps(deep))
    check_schema("{not json")  # left to the caller, which says it is not JSON


def _doc_section() -> str:
    text = (ROOT / "docs" / "python.md").read_text()
    return text.split("## Structured output: what a JSON schema may say", 1)[1].split("\n## ", 1)[0]


def test_the_docs_list_the_same_keywords_and_formats():
    section = _doc_section()
    enforced = section.split("**Enforced**", 1)[1].split("**Refused**", 1)[0]
    refused = section.split("**Refused**", 1)[1].split("**Formats**", 1)[0]
    formats = section.split("**Formats**", 1)[1].split("\n\n", 1)[0].split("Any other", 1)[0]
    assert re.findall(r"^- `([^`]+)`", enforced, re.M) == list(ENFORCED)
    assert re.findall(r"^- `([^`]+)`", refused, re.M) == list(REFUSED)
    assert re.findall(r"`([^`]+)`", formats) == [*ENFORCED_FORMATS, *FREE_FORMATS, "SecretStr", "bytes"]
    assert f"{MAX_SCHEMA_DEPTH} levels" in section


DOCS = " (the keywords structured output enforces: docs/python.md#structured-output-what-a-json-schema-may-say)"
BREAK = ", so an answer could break the schema: "
# one schema per refusal, and its whole message: what, where, why, and what to do
MESSAGES = [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at # cannot be enforced by the grammar" + BREAK
     + "drop it and remove duplicates from the answer yourself (`uniqueItems: false` is accepted)"),
    ({"properties": {"a": {"$id": "x"}}}, "'$id' at #/properties/a starts a new base for references, which the "
     "grammar resolves from the root only" + BREAK + "drop it, or move the schema to $defs"),
    ({"type": "integer", "anyOf": [INT]}, "'type' at # stands beside 'anyOf', and the grammar keeps only 'anyOf'"
     + BREAK + "move it into the 'anyOf' schemas"),
    ({"enum": ["a"], "maxLength": 1, "type": "string"}, "'maxLength' at # stands beside 'enum', and the grammar keeps "
     "only the listed values" + BREAK + "list only the values that satisfy it"),
    ({"const": "a", "minLength": 1, "type": "string"}, "'minLength' at # stands beside 'const', and the grammar keeps "
     "only the listed values" + BREAK + "list only the values that satisfy it"),
    ({"enum": ["a", 1], "type": "string"}, "'type' at # is not the type of every value 'enum' lists, and the grammar "
     "keeps only the listed values" + BREAK + "list only values of that type"),
    ({"const": 1, "type": "string"}, "'type' at # is not the type of every value 'const' lists, and the grammar keeps "
     "only the listed values" + BREAK + "list only values of that type"),
    ({"maxLength": 1}, "'maxLength' at # applies to strings, and without 'string' in the schema's type the grammar "
     "drops it" + BREAK + 'add "type": "string"'),
    ({"type": "string", "minimum": 1}, "'minimum' at # applies to numbers, and without 'number' in the schema's type "
     "the grammar drops it" + BREAK + 'add "type": "number"'),
    ({"type": "string", "pattern": "a", "maxLength": 2}, "'maxLength' at # stands beside 'pattern', and the grammar "
     "keeps only one of pattern, format and length" + BREAK + "put both into one `pattern` (a length as `^.{0,20}$`)"),
    ({"type": "string", "minLength": 2, "format": "date"}, "'minLength' at # stands beside 'format', and the grammar "
     "keeps only one of pattern, format and length" + BREAK + "put both into one `pattern` (a length as `^.{0,20}$`)"),
    ({"type": "string", "pattern": "a(?!b)"}, "'pattern' at # uses a lookahead or lookbehind, which the grammar drops"
     + BREAK + "write the pattern without (?=, (?!, (?<= or (?<!"),
    ({"type": "string", "format": "iri"}, "'format' at # is 'iri', a format the grammar does not check" + BREAK
     + "use one of date-time, date, time, duration, email, hostname, ipv4, ipv6, uri, uri-reference, uuid, "
     "uri-template, json-pointer, relative-json-pointer, or a `pattern`"),
    ({"properties": {}, "required": ["c"]}, "'required' at # names 'c', which `properties` does not declare, and the "
     "grammar requires only declared properties" + BREAK + "declare 'c' in `properties`"),
    ({"type": "object", "properties": {}, "propertyNames": {}}, "'propertyNames' at # stands beside `properties`, "
     "whose names the grammar does not check against it" + BREAK + "drop it, and from `properties` any name it "
     "refuses"),
    ({"type": "array", "items": [INT]}, "'items' at # is a list (draft 7's tuples), which the grammar does not read"
     + BREAK + "use `prefixItems` for the list and `items` for the rest"),
    ({"allOf": [INT, INT, INT]}, "'allOf' at # holds 3 schemas, and the grammar reads exactly one" + BREAK
     + "merge them into one schema"),
    ({"oneOf": [INT, INT]}, "'oneOf' at # has branches one value could match twice, and the grammar matches any "
     "branch" + BREAK + "use `anyOf`, or tell the branches apart by `type` or by a required property's `const`"),
    ({"$ref": "https://x/y"}, "'$ref' at # is 'https://x/y', a reference outside this schema, which the grammar "
     "cannot load" + BREAK + "copy the schema it names into $defs and refer to it as #/$defs/<name>"),
    ({"$ref": "#/nope"}, "'$ref' at # is '#/nope', which points at nothing in this schema" + BREAK
     + "name a schema it holds, such as #/$defs/<name>"),
]


@pytest.mark.parametrize("case", MESSAGES, ids=[message.split(" at ")[0] for _, message in MESSAGES])
def test_each_refusal_says_what_where_why_and_what_to_do(case):
    schema, message = case
    with pytest.raises(UnsupportedSchemaError) as caught:
        check_schema(schema)
    assert str(caught.value) == "the JSON schema's " + message + DOCS


def test_the_depth_refusal_says_what_to_do():
    with pytest.raises(UnsupportedSchemaError) as caught:
        check_schema("[" * (MAX_SCHEMA_DEPTH + 1))
    assert str(caught.value) == (f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays: "
                                 "flatten it, or name the repeated part in $defs and refer to it with $ref")
    check_schema("[" * MAX_SCHEMA_DEPTH + "]" * (MAX_SCHEMA_DEPTH + 5) + "[" * MAX_SCHEMA_DEPTH)  # depth, not count
    for text in ("[" * MAX_SCHEMA_DEPTH + "]" + "[[", "{" * MAX_SCHEMA_DEPTH + "}" + "{{", '["]", ' * 3 + "{" * 101):
        with pytest.raises(UnsupportedSchemaError, match="deeper"):
            check_schema(text)
    wide = {"type": "object",
            "properties": {f"p{i}": {"type": "array", "items": {}} for i in range(2 * MAX_SCHEMA_DEPTH)}}
    check_schema(json.dumps(wide))  # wide is not deep: every bracket closes
    with pytest.raises(UnsupportedSchemaError, match="deeper"):  # a deep value beside short ones is found too
        check_schema({"items": _nested_lists(MAX_SCHEMA_DEPTH), "title": "t"})


def _nested_lists(levels: int) -> list:
    nested: list = []
    for _ in range(levels - 1):
        nested = [nested]
    return nested


def _chain(hops: int, target: dict) -> dict:
    """A oneOf branch reached through ``hops`` local $refs."""
    defs = {f"R{i}": {"$ref": f"#/$defs/R{i + 1}"} for i in range(hops - 1)}
    return {"$defs": {**defs, f"R{hops - 1}": target}, "oneOf": [{"$ref": "#/$defs/R0"}, {"type": "string"}]}


def test_refs_are_followed_and_resolved_exactly(compiler):
    check_schema(_chain(8, INT))  # (the chain, $ref by $ref, to a schema with a type)
    assert accepts(compiler, _chain(8, INT), "1") and not accepts(compiler, _chain(8, INT), "null")
    with pytest.raises(UnsupportedSchemaError, match="'oneOf' at # has branches"):
        check_schema(_chain(9, INT))  # longer chains are not followed: refused, never assumed apart
    for ref in ("#/$defs/a~0b", "#/anyOf/0/items", "#/anyOf/0/items/maximum"):
        schema = {"anyOf": [{"type": "array", "items": {"type": "integer", "maximum": 3}}],
                  "$defs": {"a~b": INT, "B": {"$ref": ref}}}
        check_schema(schema)
    for ref in ("#/$defs/a~1b", "#/$defs/a~b~0", "#/anyOf/0/items/maximum/x", "#/anyOf/00x", "#/anyOf/-1"):
        with pytest.raises(UnsupportedSchemaError, match="points at nothing"):
            check_schema({"anyOf": [{"type": "array", "items": INT}], "$defs": {"a~b": INT, "B": {"$ref": ref}}})


def test_oneof_is_refused_at_its_own_node_unless_its_branches_are_apart():
    def refused(schema):
        with pytest.raises(UnsupportedSchemaError) as caught:
            check_schema(schema)
        assert (caught.value.keyword, caught.value.path) == ("oneOf", "#"), str(caught.value)

    refused({"oneOf": [INT, {"type": "string"}, {"type": "number"}]})  # the third overlaps the first
    kind = {"type": "object", "required": ["k"]}
    refused({"oneOf": [{**kind, "properties": {"k": {"const": "a"}}}, {**kind, "properties": {"k": True}}]})
    refused({"oneOf": [{**kind, "properties": {"k": {"const": "a"}}}, {**kind, "properties": 5}]})
    refused({"oneOf": [{**kind, "properties": {"k": {"enum": ["a", "b"]}}}, {**kind, "properties": {"k": {"enum": [
        "c"]}}}, {**kind, "properties": {"k": {"const": "a"}}}]})  # the third repeats the first's value
    refused({"oneOf": [{**kind, "properties": {"k": {"const": {"a": 1, "b": 2}}}},
                       {**kind, "properties": {"k": {"const": {"b": 2, "a": 1}}}}]})  # the same object
    by_ref = {"$defs": {"A": {"const": "a"}, "B": {"const": "b"}}, "oneOf": [
        {**kind, "properties": {"k": {"$ref": "#/$defs/A"}}}, {**kind, "properties": {"k": {"$ref": "#/$defs/B"}}}]}
    check_schema(by_ref)  # a discriminator whose values are $refs
    check_schema({"oneOf": [{"$ref": "#/$defs/X"}, {"type": "string"}], "$defs": {"X": {"type": ["integer", "null"]}}})


def test_enum_values_are_checked_against_every_type():
    for values, kinds in (([[1]], "string"), ([{"a": 1}], "array"), (["a"], "object"), ([None], "boolean"),
                          ([True], "integer"), ([1.5], "integer"), (["a"], "null")):
        with pytest.raises(UnsupportedSchemaError, match="'type' at # is not the type of every value"):
            check_schema({"enum": values, "type": kinds})
