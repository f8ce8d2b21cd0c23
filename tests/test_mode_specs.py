"""Every mode's declaration (engine/modes/specs.py) against its code, and every declared bound against check_mode.

Generated over the registry: a mode added later is held to the same tests without editing this file. No model
loads here; the mode functions are only inspected.
"""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ctx_integrations import available_modes, check_mode, mode_options, mode_spec
from ctx_integrations.engine.core import mode_catalog, registry
from ctx_integrations.engine.core.mode_spec import ModeSpec, Option
from ctx_integrations.engine.core.registry import register_mode, resolve_mode
from ctx_integrations.errors import InvalidOptionError, ModeDeclarationError, UnknownModeError

ROOT = Path(__file__).resolve().parents[1]
MODES = available_modes()
OPTIONS = [(mode, option) for mode in MODES for option in mode_spec(mode).options]
IDS = [f"{mode}-{option.name}" for mode, option in OPTIONS]


def refused(mode: str, name: str, value: object) -> bool:
    try:
        check_mode(mode, {name: value})
    except InvalidOptionError as error:
        assert str(error).startswith(f"mode {mode!r}: option {name} must be "), error
        assert str(error).endswith(f", got {value!r}"), error
        return True
    return False


# -- the declaration is the code's ---------------------------------------------------------------------------------
def test_every_builtin_mode_is_declared():
    assert set(MODES) >= {"pced", "ape", "rapid", "ippd", "soft_nbce", "nbce", "pcw", "concat", "single", "truncated",
                          "map_reduce"}


@pytest.mark.parametrize("mode", MODES)
def test_declared_options_are_the_functions_keyword_options_in_order_with_their_defaults(mode):
    parameters = inspect.signature(resolve_mode(mode)).parameters.values()
    keyword = [(p.name, p.default) for p in parameters if p.kind is p.KEYWORD_ONLY]
    assert [(o.name, o.default) for o in mode_spec(mode).options] == keyword
    assert mode_options(mode) == dict(keyword)
    others = [p for p in parameters if p.kind is not p.KEYWORD_ONLY]
    assert len(others) == 1 and others[0].default is inspect.Parameter.empty  # the context(s), nothing else


@pytest.mark.parametrize("mode", MODES)
def test_the_declaration_says_how_the_mode_runs(mode):
    spec = mode_spec(mode)
    assert spec.name == mode and spec.summary and spec.paper
    assert registry.answers_many(mode) is spec.many and (mode == "ippd") is spec.many
    assert spec.picks_each_token is (mode != "rapid")
    assert resolve_mode(mode).__module__ == spec.module


# -- every declared bound and choice is enforced ---------------------------------------------------------------------
def _below(option: Option, bound: float) -> float:
    return bound - 1 if option.kind is int else math.nextafter(bound, -math.inf)


def _above(option: Option, bound: float) -> float:
    return bound + 1 if option.kind is int else math.nextafter(bound, math.inf)


@pytest.mark.parametrize(("mode", "option"), OPTIONS, ids=IDS)
def test_each_bound_is_enforced_just_outside_and_accepted_on_it(mode, option):
    if option.minimum is not None:
        assert refused(mode, option.name, _below(option, option.minimum))
        assert refused(mode, option.name, option.minimum) is not option.min_inclusive
        assert not refused(mode, option.name, _above(option, option.minimum))
    if option.maximum is not None:
        assert refused(mode, option.name, _above(option, option.maximum))
        assert refused(mode, option.name, option.maximum) is not option.max_inclusive
        assert not refused(mode, option.name, _below(option, option.maximum))
    if option.kind in (int, float):
        assert refused(mode, option.name, math.nan)
        assert refused(mode, option.name, math.inf) is not (option.allow_inf and option.maximum is None)
        assert refused(mode, option.name, True) and refused(mode, option.name, "1")


@pytest.mark.parametrize(("mode", "option"), OPTIONS, ids=IDS)
def test_each_option_takes_its_type_and_choices_only(mode, option):
    assert not refused(mode, option.name, option.default)
    assert refused(mode, option.name, None) is not option.optional
    assert refused(mode, option.name, [option.default]) is not (option.kind is object)
    for choice in option.choices:
        assert not refused(mode, option.name, choice)
    if option.kind is str:
        assert refused(mode, option.name, "no-such-choice") is bool(option.choices)
        assert refused(mode, option.name, 1)
    if option.kind is bool:
        assert not refused(mode, option.name, True) and not refused(mode, option.name, False)
        assert refused(mode, option.name, 1) and refused(mode, option.name, "true")
    if option.kind is int:
        assert refused(mode, option.name, 1.5)
    if option.kind is object:  # an Engine or an embedder: a string from the command line or JSON never is one
        assert refused(mode, option.name, "x") and refused(mode, option.name, 3)


# -- the errors -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "options", "says"), [
    ("pced", {"gamma": "abc"}, "mode 'pced': option gamma must be a number in [0, 100], got 'abc'"),
    ("pced", {"prior_floor": 0}, "mode 'pced': option prior_floor must be a number in (0, 1], got 0"),
    ("pced", {"beta": -1}, "mode 'pced': option beta must be a number in [0, 100], or None, got -1"),
    ("pced", {"switch": "words"}, "mode 'pced': option switch must be one of 'token', 'word', got 'words'"),
    ("rapid", {"gamma": 0}, "mode 'rapid': option gamma must be an integer >= 1, got 0"),
    ("soft_nbce", {"tau": 0}, "mode 'soft_nbce': option tau must be a number >= 1e-09 (inf allowed), got 0"),
    ("ape", {"attribution": 1}, "mode 'ape': option attribution must be True, False or None, got 1"),
    ("rapid", {"compare_target": 1}, "mode 'rapid': option compare_target must be True or False, got 1"),
    ("pced", {"gama": 2.0}, "mode 'pced' does not accept gama; its options are: aggregation, beta, gamma, prior, "
                            "prior_floor, prior_tau, query_likelihood, score_space, switch (did you mean gamma?)"),
    ("concat", {"gamma": 2.0}, "mode 'concat' does not accept gamma; its options are: none"),
])
def test_a_bad_option_is_refused_naming_mode_option_expectation_and_value(mode, options, says):
    with pytest.raises(InvalidOptionError) as caught:
        check_mode(mode, options)
    assert str(caught.value) == says


def test_an_unknown_mode_is_refused_listing_the_declared_ones():
    with pytest.raises(UnknownModeError) as caught:
        mode_spec("pcde")
    assert str(caught.value) == f"unknown mode 'pcde': choose one of {', '.join(MODES)}"
    assert str(caught.value).startswith("unknown mode 'pcde': choose one of ape, ")


def test_the_declarations_and_check_mode_need_no_torch():
    """The command line and the server check a request against them before any model code is imported."""
    code = ("import sys; from ctx_integrations import available_modes, check_mode, mode_spec\n"
            "names = available_modes(); [mode_spec(n).describe() for n in names]; check_mode('pced', {'gamma': 1.0})\n"
            "try:\n    check_mode('pced', {'gamma': 'abc'})\nexcept ValueError as e:\n    print(e)\n"
            "print(len(names), sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["mode 'pced': option gamma must be a number in [0, 100], got 'abc'",
                                        f"{len(MODES)} []"]


# -- a declaration that does not hold is refused when it is made -----------------------------------------------------
@pytest.fixture
def scratch_mode():
    """Forget the test's mode afterwards, so the registry and the declared modes are as before."""
    yield "scratch"
    registry._MODES.pop("scratch", None)
    mode_catalog._DECLARED.pop("scratch", None)


def test_register_mode_refuses_a_function_that_drifted_from_its_declaration(scratch_mode):
    spec = ModeSpec(scratch_mode, "a test mode", "none", (Option("k", int, 3, "a count", minimum=1),))
    with pytest.raises(ModeDeclarationError, match=r"takes the keyword options \[\('k', 4\)\], its declaration "
                                                   r"\[\('k', 3\)\]"):
        register_mode(spec)(lambda ctx, *, k=4: None)
    with pytest.raises(ModeDeclarationError, match="takes the keyword options"):
        register_mode(spec)(lambda ctx, *, k=3, extra=None: None)
    with pytest.raises(ModeDeclarationError, match="no function is registered"):
        resolve_mode(scratch_mode)

    def plan(ctx, *, k=3):
        return k

    assert register_mode(spec)(plan) is plan and resolve_mode(scratch_mode) is plan
    check_mode(scratch_mode, {"k": 2})
    with pytest.raises(InvalidOptionError, match="^mode 'scratch': option k must be an integer >= 1, got 0$"):
        check_mode(scratch_mode, {"k": 0})
    with pytest.raises(ModeDeclarationError, match="declared twice"):
        register_mode(ModeSpec(scratch_mode, "another", "none"))


@pytest.mark.parametrize(("arguments", "says"), [
    (dict(name="k", kind=int, default=0, help="h", minimum=1), "its default 0 is not an integer >= 1"),
    (dict(name="k", kind=float, default=0.5, help="h", choices=("a",)), "only a str option has choices"),
    (dict(name="k", kind=str, default="a", help="h", maximum=1.0), "only an int or float option has a range"),
    (dict(name="k", kind=list, default=[], help="h"), "kind must be one of"),
    (dict(name="k", kind=float, default=1.0, help="h", origin="ours"), "origin must be one of"),
    (dict(name="k", kind=float, default=1.0, help=""), "help must be one line"),
    (dict(name="k", kind=object, default=None, help="h", optional=True), "says what it expects"),
])
def test_an_option_that_contradicts_itself_is_refused(arguments, says):
    with pytest.raises(ModeDeclarationError, match=says):
        Option(**arguments)


def test_a_mode_declaring_an_option_twice_is_refused():
    option = Option("k", int, 1, "a count")
    with pytest.raises(ModeDeclarationError, match="declares an option twice"):
        ModeSpec("twice", "s", "p", (option, option))
