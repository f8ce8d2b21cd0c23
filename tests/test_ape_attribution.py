"""APE cites by default wherever its attention kernel can, and says so where it cannot (issue 25).

Bugs caught: the default leaving APE's trace empty on the eager kernel (no citations without an
option); the flex kernel answering with an empty trace and no word why; ``attribution=False`` still
adding a note; a non-bool ``attribution`` (``"yes"``, ``1``) silently read as truthy; attribution
changing the answer's tokens; the CLI not printing the note.
"""

from __future__ import annotations

import pytest
import torch

import ctx_integrations  # noqa: F401  (registers every mode)
from ctx_integrations import Engine
from ctx_integrations.cli import _print_answer
from ctx_integrations.engine.modes.ape import FLEX_ATTRIBUTION_NOTE, ape_plan
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded

QUESTION = "What is the code?"
DOCS = ["The vault code is 4721.", "Paris is the capital of France and a large city.", "Bread is baked daily."]
OPTIONS = dict(max_new_tokens=5, attention_temperature=0.7, scale=0.8)


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_loaded("llama", seed=2))


@pytest.fixture(scope="module")
def answers(engine):
    """Default (eager on CPU), explicit off, default on the flex kernel, and flex with attribution forced."""
    return {
        "default": engine.generate(QUESTION, DOCS, mode="ape", **OPTIONS),
        "off": engine.generate(QUESTION, DOCS, mode="ape", attribution=False, **OPTIONS),
        "flex": engine.generate(QUESTION, DOCS, mode="ape", attention_kernel="flex", **OPTIONS),
        "flex forced": engine.generate(QUESTION, DOCS, mode="ape", attention_kernel="flex", attribution=True,
                                       **OPTIONS),
    }


def test_default_ape_on_cpu_names_a_document_for_every_token(answers):
    answer = answers["default"]
    assert len(answer.trace) == 5 and all(step.document in (0, 1, 2) for step in answer.trace)
    assert len(answer.extra["attention_mass"]) == 5 and "attribution_note" not in answer.extra
    assert sum(answer.citation_counts().values()) == 5


def test_the_flex_kernel_gives_no_trace_and_says_why(answers):
    answer = answers["flex"]  # FlexAttention runs unfused on CPU (torch >= 2.5), so this is the real flex path
    assert all(step.document is None for step in answer.trace) and "attention_mass" not in answer.extra
    assert answer.extra["attribution"] == "unavailable"
    assert answer.extra["attribution_note"] == FLEX_ATTRIBUTION_NOTE and "attribution=True" in FLEX_ATTRIBUTION_NOTE
    assert answer.to_dict()["extra"]["attribution_note"] == FLEX_ATTRIBUTION_NOTE  # what the server and adapters send


def test_attribution_true_runs_the_row_and_false_turns_it_off_without_a_note(answers):
    forced, off = answers["flex forced"], answers["off"]
    assert [s.document for s in forced.trace] == [s.document for s in answers["default"].trace]
    assert "attribution" not in forced.extra
    assert all(step.document is None for step in off.trace)
    assert not {"attribution", "attribution_note", "attention_mass"} & set(off.extra)


def test_attribution_never_changes_the_tokens(answers):
    tokens = answers["off"].token_ids
    assert len(tokens) == 5 and all(a.token_ids == tokens for a in answers.values())


def test_the_plan_runs_apes_row_unless_flex_is_asked_for_and_says_when_it_cannot_cite():
    # (flex, record, note): "auto" is APE's row on CUDA too (the row records on the batch's flex kernel as well)
    for device in ("cpu", torch.device("cuda")):
        assert ape_plan(None, "auto", device) == (False, True, None)
        assert ape_plan(None, "eager", device) == (False, True, None)
        assert ape_plan(False, "auto", device) == (False, False, None)
        assert ape_plan(None, "flex", device) == (True, False, FLEX_ATTRIBUTION_NOTE)
        assert ape_plan(False, "flex", device) == (True, False, None)
        assert ape_plan(True, "flex", device) == (False, True, None)  # citations asked for: the row, which records
    with pytest.raises(InvalidOptionError, match="attention_kernel must be one of"):
        ape_plan(True, "flash", "cpu")  # forcing the row does not skip the kernel check
    with pytest.raises(InvalidOptionError, match="attention_kernel must be one of"):
        ape_plan(None, "flash", "cpu")


@pytest.mark.parametrize("bad", ["yes", "true", 1, 0, 1.0, [True]])
def test_a_non_bool_attribution_is_refused_by_name(engine, bad):
    with pytest.raises(InvalidOptionError, match=r"^mode 'ape': option attribution must be True, False or None, got "):
        engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=1, attribution=bad)
    with pytest.raises(InvalidOptionError, match=r"APE's attribution must be True, False or None"):
        ape_plan(bad, "auto", "cpu")  # the plan's own check, for a caller that bypasses the mode's declaration


def test_the_cli_prints_the_note_or_the_citations(answers, capsys):
    _print_answer(answers["flex"])
    said = capsys.readouterr().out
    assert f"cited: (attribution unavailable: {FLEX_ATTRIBUTION_NOTE}; sources listed above)" in said
    assert "--option attribution=true" in said
    _print_answer(answers["default"])
    assert "cited: " in (said := capsys.readouterr().out) and "tokens)" in said and "attribution" not in said
    _print_answer(answers["off"])
    assert "drop --option attribution=false" in capsys.readouterr().out
