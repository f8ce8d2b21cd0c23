"""The public facade's helpers, without a model: ``check_mode``, the option aliases at the framework edges,
``StructuredOutput.from_response_format`` and the tool-call stream filter of an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from ctx_integrations import StructuredOutput, ToolCallFilter, check_mode
from ctx_integrations.adapters import aliased, length_budget
from ctx_integrations.engine.core.tools import ToolCallFormat
from ctx_integrations.errors import InvalidOptionError, UnknownModeError


# -- check_mode: the mode's name and its options, one call ---------------------------------------------------------
def test_check_mode_accepts_a_mode_and_its_options():
    check_mode("pced")
    check_mode("pced", {"gamma": 2.0})
    check_mode("concat", {})


@pytest.mark.parametrize(("mode", "options", "error", "says"), [
    ("pcde", None, UnknownModeError, "unknown mode 'pcde': choose one of .*pced"),
    ("pcde", {"gamma": 2.0}, UnknownModeError, "unknown mode 'pcde'"),  # the name is checked first
    ("pced", {"gama": 2.0}, InvalidOptionError, "mode 'pced' does not accept gama; its options are: .*gamma"),
    ("concat", {"gamma": 2.0}, InvalidOptionError, "mode 'concat' does not accept gamma; its options are: none"),
    ("pced", ["gamma"], InvalidOptionError, "options of mode 'pced' must be a mapping .* got list"),
    (["pced"], None, UnknownModeError, "unknown mode"),
])
def test_check_mode_refuses_with_typed_errors(mode, options, error, says):
    with pytest.raises(error, match=says):
        check_mode(mode, options)


# -- aliases at the edges ---------------------------------------------------------------------------------------------
def test_aliased_renames_the_alias_and_leaves_the_rest():
    assert aliased({"max_new_tokens": 5, "temperature": 0.5}, "max_tokens", "max_new_tokens") == {
        "max_tokens": 5, "temperature": 0.5}
    assert aliased({"max_tokens": 5}, "max_tokens", "max_new_tokens") == {"max_tokens": 5}
    assert aliased({}, "max_tokens", "max_new_tokens") == {}
    given = {"model": "m"}
    assert aliased(given, "model_name", "model") == {"model_name": "m"} and given == {"model": "m"}  # a copy


def test_aliased_refuses_both_in_the_edges_words():
    with pytest.raises(InvalidOptionError, match="^give max_tokens or its alias max_new_tokens, not both$"):
        aliased({"max_tokens": 3, "max_new_tokens": 3}, "max_tokens", "max_new_tokens")
    with pytest.raises(InvalidOptionError, match="^give max_new_tokens or its alias max_tokens, not both$"):
        aliased({"max_tokens": 3, "max_new_tokens": 4}, "max_new_tokens", "max_tokens")


def test_none_counts_as_not_given():
    """Keyword arguments with a ``None`` default (LlamaIndex's synthesizer) pass both names; only the given one
    counts, and an alias given as ``None`` alone still reaches the field (its own validation speaks)."""
    assert aliased({"max_new_tokens": None, "max_tokens": 7}, "max_new_tokens", "max_tokens") == {"max_new_tokens": 7}
    assert aliased({"max_new_tokens": 7, "max_tokens": None}, "max_new_tokens", "max_tokens") == {"max_new_tokens": 7}
    assert aliased({"max_tokens": None}, "max_new_tokens", "max_tokens") == {"max_new_tokens": None}


def test_length_budget_reads_either_name_with_a_default():
    assert length_budget({"max_tokens": 4}) == length_budget({"max_new_tokens": 4}) == 4
    assert length_budget({}, 9) == length_budget({"max_tokens": None}, 9) == 9
    assert length_budget({}) is None
    assert length_budget({"max_tokens": 2}, 9, name="max_new_tokens") == 2
    with pytest.raises(InvalidOptionError, match="give max_tokens or its alias max_new_tokens"):
        length_budget({"max_tokens": 1, "max_new_tokens": 2})
    with pytest.raises(InvalidOptionError, match="give max_new_tokens or its alias max_tokens"):
        length_budget({"max_tokens": 1, "max_new_tokens": 2}, name="max_new_tokens")


# -- structured output and tool calls from the facade ----------------------------------------------------------------
class Person(BaseModel):
    name: str


@pytest.mark.parametrize(("value", "expected"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, StructuredOutput(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
     StructuredOutput(json={"type": "object"})),
    (Person, StructuredOutput(json=Person)),
    (StructuredOutput(regex="a+"), StructuredOutput(regex="a+")),
])
def test_structured_output_from_response_format(value, expected):
    assert StructuredOutput.from_response_format(value) == expected


@pytest.mark.parametrize("value", [{"type": "yaml"}, "json", {"type": "json_schema"}, 3])
def test_an_unknown_response_format_is_a_typed_error(value):
    with pytest.raises(InvalidOptionError, match="response_format must be"):
        StructuredOutput.from_response_format(value)


def test_the_tool_call_filter_of_an_engine_uses_its_models_call_format():
    fmt = ToolCallFormat(begin="<call>", end="</call>")
    engine = SimpleNamespace(layout=SimpleNamespace(tool_format=fmt))  # what the filter reads of an Engine
    calls = ToolCallFilter.for_engine(engine)
    assert calls.marker == "<call>"
    assert calls.push("Hello <ca") == "Hello "  # a tail that may open a call is held back
    assert calls.push("ll>{") == ""


# -- the same rule at every edge (no model is loaded: the refusals come before any engine is touched) ----------------
def test_every_edge_refuses_both_budget_names():
    from ctx_integrations.langchain import ChatContextOfExperts, ContextOfExpertsRunnable
    from ctx_integrations.llama_index import ExpertDecoderLLM

    both = {"max_tokens": 3, "max_new_tokens": 4}
    with pytest.raises(InvalidOptionError, match="give max_tokens or its alias max_new_tokens, not both"):
        ChatContextOfExperts(**both)  # pydantic's AliasChoices took the first one silently
    chat = ChatContextOfExperts()
    with pytest.raises(InvalidOptionError, match="give max_tokens or its alias max_new_tokens, not both"):
        chat._request([], None, both)
    runnable = ContextOfExpertsRunnable()
    with pytest.raises(InvalidOptionError, match="give max_tokens or its alias max_new_tokens, not both"):
        runnable._settings({"configurable": both})  # configurable["max_tokens"] won silently
    llm = ExpertDecoderLLM()
    with pytest.raises(InvalidOptionError, match="give max_new_tokens or its alias max_tokens, not both"):
        llm._request(None, [], both)  # max_tokens overwrote max_new_tokens silently
    with pytest.raises(InvalidOptionError, match="give model or its alias model_name, not both"):
        ChatContextOfExperts(model="a", model_name="b")


def test_every_edge_takes_either_budget_name():
    from ctx_integrations.langchain import ChatContextOfExperts, ContextOfExpertsRunnable
    from ctx_integrations.llama_index import ExpertDecoderLLM

    assert ChatContextOfExperts()._request([], None, {"max_new_tokens": 3}).sampling.max_tokens == 3
    assert ContextOfExpertsRunnable()._settings({"configurable": {"max_new_tokens": 3}})[2].max_tokens == 3
    llm = ExpertDecoderLLM(max_tokens=6)
    assert llm.max_new_tokens == 6
    assert llm.sampling_params({"max_tokens": 5}).max_tokens == 5  # was dropped: the LLM's 6 answered
    assert llm._request(None, [], {"max_tokens": 2}).sampling.max_tokens == 2
