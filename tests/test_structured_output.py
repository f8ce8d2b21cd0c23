"""Structured output in the engine: every answer keeps to its format (JSON schema, JSON mode, regex, choice,
grammar), in every mode that emits one answer, and is refused by a mode that cannot hold it (RAPID).

A tiny random model has no idea of JSON, so an answer that parses and validates shows the constraint did
all the work; the embedded model's answers are validated against their schemas as a user would.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from ctx_integrations import Engine, SamplingParams
from ctx_integrations.engine.core.decoding import TokenSampler
from ctx_integrations.engine.core.structured import StructuredOutput, TokenConstraint, bounded_integers
from ctx_integrations.errors import (
    InvalidOptionError,
    InvalidStructuredOutputError,
    MissingDependencyError,
    NoAllowedTokenError,
    UnsupportedSamplingError,
)
from tests.helpers import tiny_loaded
from tests.test_core_pced import DOCS, QUESTION

# bounded, so even a random model completes it within the budget
SMALL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                          "rank": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "capital": {"type": "boolean"}},
         "required": ["city", "rank", "capital"]}
BUDGET = 48


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3))


def _valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def _schema(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=BUDGET, structured=StructuredOutput(json=SMALL), **kwargs)


@pytest.mark.parametrize("mode", ["concat", "pced", "single", "soft_nbce", "nbce", "pcw", "ape", "map_reduce",
                                  "truncated"])
def test_every_one_answer_mode_keeps_to_the_schema(engine, mode):
    plain = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=8)
    with pytest.raises(ValueError):
        json.loads(plain.text)  # the random model writes no JSON of its own
    answer = engine.generate(QUESTION, DOCS, mode=mode, sampling=_schema())
    assert answer.finish_reason == "eos", answer.text
    assert set(_valid(answer.text, SMALL)) == {"city", "rank", "capital"}


def test_chat_ippd_sampling_and_exclusive_ape_keep_to_the_schema(engine):
    assert _valid(engine.chat([{"role": "user", "content": "hi"}], sampling=_schema()).text, SMALL)
    for answer in engine.generate_many([QUESTION, "Where is Marrowgate?"], DOCS, sampling=_schema()):
        assert answer.finish_reason == "eos" and _valid(answer.text, SMALL)
    for seed in range(3):
        assert _valid(engine.generate(QUESTION, DOCS, sampling=_schema(temperature=1.5, seed=seed)).text, SMALL)
    flex = Engine(engine.loaded)  # APE on FlexAttention's merge runs as an exclusive job
    assert _valid(flex.generate(QUESTION, DOCS, mode="ape", attention_kernel="flex", sampling=_schema()).text, SMALL)
    assert flex.stats()["exclusive_s"] > 0


def test_json_mode_regex_choice_and_grammar(engine):
    def chat(output: StructuredOutput, budget: int = BUDGET) -> str:
        answer = engine.chat([{"role": "user", "content": "hi"}],
                             sampling=SamplingParams(max_tokens=budget, structured=output))
        assert answer.finish_reason == "eos", answer.text
        return answer.text

    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", chat(StructuredOutput(regex=r"[0-9]{3}-[0-9]{2}")))
    assert chat(StructuredOutput(choice=["yes", "no", "maybe so"])) in {"yes", "no", "maybe so"}
    assert re.fullmatch(r"(ab)+c", chat(StructuredOutput(grammar='root ::= ("ab")+ "c"')))
    pinned = {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"]}
    assert json.loads(chat(StructuredOutput(json=pinned))) == {"ok": True}


def test_a_pydantic_model_or_a_json_string_is_a_schema(engine):
    class City(BaseModel):
        name: str
        rank: int

    from_model = StructuredOutput(json=City)
    assert json.loads(from_model.json)["required"] == ["name", "rank"]
    assert StructuredOutput(json=json.dumps(SMALL)) == StructuredOutput(json=SMALL)  # hashable, one compiled format
    assert StructuredOutput(json_object=True).schema() == {"type": "object"}


@pytest.mark.parametrize("bad, message", [
    (dict(), "exactly one of"),
    (dict(json=SMALL, regex="a"), "exactly one of"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "must be a JSON object"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", 3]), "choice must be a non-empty list"),
    (dict(json_object="yes"), "json_object must be True or False"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_bad_formats_fail_where_they_are_written(bad, message):
    with pytest.raises(InvalidOptionError, match=message):
        StructuredOutput(**bad)


def test_a_format_the_compiler_refuses_fails_in_the_callers_thread(engine):
    # (a $ref to nothing is refused sooner, when the StructuredOutput is built: tests/test_schema_support.py)
    broken = SamplingParams(structured=StructuredOutput(json={"type": "integer", "minimum": 1.5}))
    with pytest.raises(InvalidStructuredOutputError, match="cannot be compiled"):
        engine.generate(QUESTION, DOCS, sampling=broken)
    # an async stream's format compiles off the caller's thread (an event loop's): its refusal is the first piece's
    stream = engine.astream(QUESTION, DOCS, sampling=SamplingParams(structured=StructuredOutput(grammar="root ::= (")))
    with pytest.raises(InvalidStructuredOutputError, match="cannot be compiled"):
        asyncio.run(anext(stream))


def test_rapid_refuses_structured_output(engine):
    with pytest.raises(UnsupportedSamplingError, match="rapid.*structured") as refused:
        engine.generate(QUESTION, DOCS, mode="rapid", sampling=_schema())
    assert refused.value.field == "structured"


def test_no_allowed_token_is_a_typed_error(engine):
    """A mode whose fused scores put -inf on every token the format allows (a nucleus rule) cannot go on."""
    grammar = engine.loaded.grammars.compile(StructuredOutput(choice=["yes"]))
    sampler = TokenSampler(constraint=TokenConstraint(grammar))
    allowed = sampler.adjusted(torch.zeros(49152))
    scores = torch.where(torch.isfinite(allowed), torch.full_like(allowed, -torch.inf), torch.zeros_like(allowed))
    with pytest.raises(NoAllowedTokenError, match="every token the structured-output format allows"):
        sampler(scores)


def test_the_library_works_without_xgrammar_and_names_the_extra(monkeypatch):
    """Decoding and building formats never need xgrammar (structured.py imports it only to compile); compiling a
    format without it says which extra to install."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    engine = Engine(tiny_loaded("llama", seed=3))
    params = SamplingParams(max_tokens=2, structured=StructuredOutput(json_object=True))  # built without xgrammar
    assert engine.chat([{"role": "user", "content": "hi"}], max_new_tokens=2).token_ids
    with pytest.raises(MissingDependencyError, match=re.escape("pip install 'ctx-integrations[structured]'")):
        engine.chat([{"role": "user", "content": "hi"}], sampling=params)
    assert issubclass(MissingDependencyError, ImportError)


# -- the embedded model ------------------------------------------------------------------------------------------

class Person(BaseModel):
    name: str
    age: int


def test_the_embedded_model_answers_valid_json(embedded_engine):
    person = Person.model_json_schema()
    chat = embedded_engine.chat([{"role": "user", "content": "Give me a person with a name and an age."}],
                                sampling=SamplingParams(max_tokens=60, structured=StructuredOutput(json=Person)))
    assert chat.finish_reason == "eos"
    Person.model_validate(_valid(chat.text, person))
    answer = embedded_engine.generate("Who is the mayor of Marrowgate, and how old is the city?", DOCS,
                                      sampling=SamplingParams(max_tokens=60, structured=StructuredOutput(json=Person)))
    assert answer.finish_reason == "eos"
    _valid(answer.text, person)
    free = embedded_engine.chat([{"role": "user", "content": "Give the capital of France as JSON with a key capital."}],
                                sampling=SamplingParams(max_tokens=40, structured=StructuredOutput(json_object=True)))
    assert free.finish_reason == "eos" and isinstance(_valid(free.text, {"type": "object"}), dict)


def test_json_strings_never_hold_raw_control_characters(engine):
    """xgrammar's rule for a string with a maxLength lets U+0000-U+001F through; JSON forbids them unescaped, so
    such tokens are masked: a model that prefers one gets the next best token the format allows."""
    tokenizer, grammars = engine.loaded.tokenizer, engine.loaded.grammars
    letter = tokenizer.convert_tokens_to_ids("a")
    unit = next(i for i, token in enumerate(grammars._info.decoded_vocab) if token == b"\x1f")
    short = {"type": "string", "maxLength": 8}
    schemas = [(short, '"'), ({"type": "object", "properties": {"s": short}}, '{"s": "')]
    for schema, opened in schemas:
        sampler = TokenSampler(constraint=TokenConstraint(grammars.compile(StructuredOutput(json=schema))))
        for token in tokenizer.encode(opened, add_special_tokens=False):
            sampler.accept(token)
        scores = torch.zeros(49152)
        scores[unit], scores[letter] = 10.0, 5.0
        assert sampler(scores) == letter


UNBOUNDED = {"type": "object", "properties": {"rank": {"type": "integer"}}, "required": ["rank"]}


def test_unbounded_integers_are_held_to_the_interoperable_range(engine):
    """A random model writes digits while it may (here until max_tokens, unheld); held to +-(2**53 - 1), it closes
    the object within the budget. The schema given stays what answers are valid against."""
    answer = engine.chat([{"role": "user", "content": "Name a city and its rank."}],
                         sampling=SamplingParams(max_tokens=64, structured=StructuredOutput(json=UNBOUNDED)))
    assert answer.finish_reason == "eos" and abs(_valid(answer.text, UNBOUNDED)["rank"]) <= 2**53 - 1
    bounded = json.loads(bounded_integers(json.dumps({
        "type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0},
                                         "d": {"type": "integer", "default": {"type": "integer"}},
                                         "l": {"type": "array", "items": {"type": ["integer", "null"]}}},
        "$defs": {"x": {"type": "integer", "maximum": 5}}})))
    assert bounded["properties"]["n"] == {"type": "integer", "exclusiveMinimum": 0, "maximum": 2**53 - 1}
    assert bounded["properties"]["d"]["default"] == {"type": "integer"}  # data, not a schema
    assert bounded["properties"]["l"]["items"] == {"type": ["integer", "null"], "minimum": -(2**53) + 1,
                                                   "maximum": 2**53 - 1}
    assert bounded["$defs"]["x"] == {"type": "integer", "maximum": 5, "minimum": -(2**53) + 1}
    assert StructuredOutput(json=UNBOUNDED).schema() == UNBOUNDED  # what answers are checked against is the user's


# -- the format's own rules, without a model (the structured target of `make mutate`) -------------------------------
def test_a_schema_that_is_not_an_object_is_refused_naming_what_was_given():
    from ctx_integrations.engine.core.schema_support import UnsupportedSchemaError

    with pytest.raises(InvalidStructuredOutputError, match=r"got list$"):
        StructuredOutput(json=[1, 2])
    with pytest.raises(InvalidStructuredOutputError, match=r"got type$"):  # a class that is not a pydantic model
        StructuredOutput(json=int)
    with pytest.raises(InvalidStructuredOutputError, match=r"cannot be written as JSON: .*set"):
        StructuredOutput(json={"type": "object", "default": {1, 2}})
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):  # a keyword the grammar cannot enforce
        StructuredOutput(json={"type": "array", "uniqueItems": True})


def test_exactly_one_format_is_taken_and_a_lone_choice_is_one_choice():
    with pytest.raises(InvalidOptionError) as none:
        StructuredOutput()
    assert str(none.value) == ("StructuredOutput takes exactly one of json, json_object, regex, choice, grammar, "
                               "structural_tag; got none")
    with pytest.raises(InvalidOptionError) as two:
        StructuredOutput(regex="a", grammar='root ::= "a"')
    assert str(two.value).endswith("; got regex, grammar")
    assert StructuredOutput(choice="yes").choice == ("yes",)  # a string is one choice, not three letters
    listed = StructuredOutput(choice=["yes", "no"])
    assert listed.choice == ("yes", "no") and hash(listed) == hash(StructuredOutput(choice=("yes", "no")))


def test_every_format_names_a_kind_the_compile_worker_builds():
    from ctx_integrations.engine.core.compile_worker import KINDS
    from ctx_integrations.engine.core.structured import format_source

    formats = {"json": StructuredOutput(json={"type": "object"}), "json_object": StructuredOutput(json_object=True),
               "regex": StructuredOutput(regex="[a-z]+"), "choice": StructuredOutput(choice=["a"]),
               "grammar": StructuredOutput(grammar='root ::= "a"'),
               "structural_tag": StructuredOutput(structural_tag='{"type": "structural_tag"}')}
    kinds = {name: format_source(output)[0] for name, output in formats.items()}
    assert kinds == {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "grammar",
                     "grammar": "grammar", "structural_tag": "structural_tag"}
    assert set(kinds.values()) <= set(KINDS)


def test_an_exclusive_bound_the_schema_gives_is_kept_and_not_doubled():
    from ctx_integrations.engine.core.structured import INTEROPERABLE_INTEGERS, SchemaBounds, narrowed_schema

    out = json.loads(narrowed_schema('{"type": "integer", "exclusiveMaximum": 5}', SchemaBounds()))
    assert out == {"type": "integer", "exclusiveMaximum": 5, "minimum": INTEROPERABLE_INTEGERS[0]}
    out = json.loads(narrowed_schema('{"type": "integer", "exclusiveMinimum": 0}', SchemaBounds()))
    assert out == {"type": "integer", "exclusiveMinimum": 0, "maximum": INTEROPERABLE_INTEGERS[1]}


@pytest.mark.parametrize("value", [-1, "5", 2.0, True])
def test_a_bound_that_is_not_a_whole_number_at_least_zero_is_refused(value):
    from ctx_integrations.engine.core.structured import SchemaBounds

    with pytest.raises(InvalidOptionError, match="max_length must be a whole number >= 0"):
        SchemaBounds(max_length=value)


def test_the_packed_mask_is_xgrammars_layout_bit_for_bit():
    from ctx_integrations.engine.core.structured import pack_bits

    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[0, 31, 33, 69]] = True  # bit 31 of word 0 is the int32 sign bit; word 2 holds tokens 64..69
    packed = pack_bits(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (1, 3)
    assert packed.tolist() == [[1 - 2**31, 2, 2**5]]
    back = ((packed.view(-1, 1).to(torch.int64) >> torch.arange(32)) & 1).view(-1)[:70].bool()
    assert torch.equal(back, allowed)


def test_the_formats_text_keeps_its_characters_so_the_size_limit_counts_what_was_sent():
    """Non-ASCII text stays UTF-8 in what is compiled (and measured against max_format_bytes): escaped as \\u00e9 it
    would count six bytes a character where the user sent two."""
    from ctx_integrations.engine.core.structured import SchemaBounds, format_source, narrowed_schema

    assert format_source(StructuredOutput(choice=["café", "naïve"]))[1] == 'root ::= "café" | "naïve"'
    schema = StructuredOutput(json={"type": "string", "enum": ["café"]})
    assert format_source(schema)[1] == '{"type": "string", "enum": ["café"]}'
    assert narrowed_schema(schema.json, SchemaBounds()) == schema.json


def test_each_format_knows_its_kind_and_only_json_has_a_schema():
    kinds = {"json": StructuredOutput(json={"type": "object"}), "json_object": StructuredOutput(json_object=True),
             "regex": StructuredOutput(regex="a+"), "choice": StructuredOutput(choice=["a"])}
    assert {name: output.kind for name, output in kinds.items()} == {name: name for name in kinds}
    assert kinds["regex"].schema() is None and kinds["choice"].schema() is None
    assert kinds["json_object"].schema() == {"type": "object"}


def test_response_format_without_a_schema_is_any_json_and_non_models_are_refused():
    from pydantic import BaseModel as Model

    class City(Model):
        name: str

    assert StructuredOutput.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}) == \
        StructuredOutput(json={})
    for value in (dict, City(name="Oslo")):  # a class that is no pydantic model, a model's instance
        with pytest.raises(InvalidOptionError, match=r'^response_format must be \{"type": "text"\}'):
            StructuredOutput.from_response_format(value)


def test_the_mask_asks_the_matcher_once_a_step_and_closes_columns_past_the_vocabulary(engine):
    constraint = TokenConstraint(engine.loaded.grammars.compile(StructuredOutput(choice=["yes", "no"])))
    calls = []
    fill = constraint.matcher.fill_next_token_bitmask
    constraint.matcher = type("Counting", (), {"fill_next_token_bitmask": lambda self, m: calls.append(1) or fill(m),
                                               "accept_token": lambda self, t: True})()
    width = constraint.vocab_size + 5
    masked = constraint.mask(torch.zeros(2, width))
    constraint.mask(torch.zeros(width))
    assert len(calls) == 1  # two streams masked in one step: one fill
    assert torch.isinf(masked[:, constraint.vocab_size:]).all() and (masked[:, constraint.vocab_size:] < 0).all()
    assert torch.isfinite(masked[0]).sum() >= 2
    constraint.accept(0)
    constraint.mask(torch.zeros(width))
    assert len(calls) == 2  # a new step: asked again


def test_a_token_the_format_refuses_is_a_typed_error_saying_why(engine):
    constraint = TokenConstraint(engine.loaded.grammars.compile(StructuredOutput(choice=["yes"])))
    allowed = _allowed(constraint)
    refused = next(t for t in range(constraint.vocab_size) if t not in allowed)
    with pytest.raises(InvalidStructuredOutputError) as error:
        constraint.accept(refused)
    assert str(error.value) == (f"token {refused} was chosen but the format does not allow it here (a decoding "
                                "loop that picked without the constraint's mask)")


def _allowed(constraint: TokenConstraint) -> set[int]:
    masked = constraint.mask(torch.zeros(constraint.vocab_size))
    return set(torch.isfinite(masked).nonzero().flatten().tolist())
