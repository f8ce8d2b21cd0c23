"""The conformance suite cannot drop a mode: each of its tests is parametrised over every available mode.

Bugs caught: a test of the suite parametrised over a list of names again (a new mode, the test plugin's ``cad``
included, would silently skip the attack and hardening cases), a mode skipped without its declaration saying why,
a test of the suite losing its ``every_mode`` parametrisation. No model loads here.
"""

from __future__ import annotations

import importlib

import pytest

from ctx_integrations import available_modes, mode_spec
from ctx_integrations.engine.core.mode_spec import CONFORMANCE, ModeSpec
from ctx_integrations.errors import ModeDeclarationError
from tests.mode_cases import every_mode

# The suite: per test module, its tests that every mode must pass (test_cuda's run where a GPU is).
SUITE = {
    "tests.test_prepared_requests": {"test_a_warm_request_tokenises_no_document_and_hashes_no_key"},
    "tests.test_attack_engine": {"test_every_declared_bound_wrong_type_and_unknown_option_are_refused_by_the_engine",
                                 "test_a_tiny_top_p_samples_the_top_token",
                                 "test_non_finite_scores_fail_the_request_instead_of_emitting_token_zero"},
    "tests.test_hardening_inputs": {"test_request_over_the_memory_budget_is_refused_before_any_cache_is_computed"},
    "tests.test_hardening_injection": {"test_no_control_id_in_any_user_text_span_of_any_mode"},
    "tests.test_cuda": {"test_every_mode_runs_in_bf16"},
    "tests.test_mode_streams": {"test_a_streamed_and_a_concurrent_answer_equal_the_answer_alone"},
}


def _mode_params(test) -> list:
    (mark,) = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize" and m.args[0] == "mode"]
    return list(mark.args[1])


@pytest.mark.parametrize("module", sorted(SUITE))
def test_every_test_of_the_suite_runs_every_available_mode(module):
    tests = {name: value for name, value in vars(importlib.import_module(module)).items()
             if callable(value) and getattr(value, "every_mode", None)}
    assert set(tests) == SUITE[module]
    for name, test in tests.items():
        params = _mode_params(test)
        modes = [param.values[0] for param in params if param.values[0] in available_modes()]
        assert modes == available_modes(), name
        for param in params[:len(modes)]:
            skips = [mark.kwargs["reason"] for mark in param.marks if mark.name == "skip"]
            why = mode_spec(param.values[0]).exemption(test.every_mode) if test.every_mode in CONFORMANCE else None
            assert skips == ([f"{param.values[0]}: {why}"] if why else []), (name, param.values[0])


def test_a_mode_is_skipped_only_where_its_declaration_exempts_it():
    @every_mode("reuses_prepared_texts")
    def case(mode):
        """A test of the property MapReduce is exempt from."""

    skipped = {param.values[0]: param.marks[0].kwargs["reason"] for param in _mode_params(case) if param.marks}
    assert skipped == {"map_reduce": "map_reduce: " + mode_spec("map_reduce").exemption("reuses_prepared_texts")}


@pytest.mark.parametrize("exemptions", [(("no_such_property", "why"),), (("reuses_prepared_texts", " "),),
                                        ("reuses_prepared_texts",)])
def test_an_exemption_names_a_known_property_and_says_why(exemptions):
    with pytest.raises(ModeDeclarationError, match="an exemption is \\(property, why\\)"):
        ModeSpec("scratch", "a test mode", "none", exemptions=exemptions)
