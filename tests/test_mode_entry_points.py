"""Modes are found through entry points: the built-in ones exactly as pyproject.toml declares them, and a package
whose entry point fails to load is reported by name with its error while every other mode keeps working.

No model loads here (the CLI's and the server's listings included).
"""

from __future__ import annotations

import importlib.metadata
import json
import warnings

import pytest

from ctx_integrations import (
    available_modes,
    check_mode,
    describe_modes,
    mode_spec,
    unavailable_modes,
)
from ctx_integrations.engine.core import mode_catalog, registry
from ctx_integrations.engine.core.mode_spec import ModeSpec
from ctx_integrations.engine.modes import specs
from ctx_integrations.errors import ModeUnavailableError, ModeUnavailableWarning, UnknownModeError
from tests.helpers import run_cli
from tests.mode_cases import builtin_entry_points
from tests.mode_discovery import BROKEN, GROUP, MISSING, discovering, entry_point


def _warned(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = call()
    return value, [w for w in caught if issubclass(w.category, ModeUnavailableWarning)]


# -- the built-in modes are this package's entry points ---------------------------------------------------------------
def test_the_installed_entry_points_are_the_ones_pyproject_declares():
    """Bug caught: a stale install or ctx_integrations.egg-info whose entry points are not pyproject.toml's (a mode
    added to pyproject but missing at run time). Fix: pip install --no-deps -e ."""
    ours = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)
            if ep.dist is not None and ep.dist.name == "ctx-integrations"}
    assert ours == builtin_entry_points()


def test_every_builtin_declaration_has_its_entry_point():
    """Bug caught: a ModeSpec written in engine/modes/specs.py but never registered (it would silently not exist)."""
    declared = {value.name: name for name, value in vars(specs).items() if isinstance(value, ModeSpec)}
    assert {mode: f"ctx_integrations.engine.modes.specs:{name}" for mode, name in declared.items()} == \
        builtin_entry_points()
    assert set(declared) <= set(available_modes())


# -- a broken entry point ---------------------------------------------------------------------------------------------
def test_a_broken_entry_point_is_warned_about_once_listed_and_refused_with_its_error():
    with discovering(BROKEN):
        modes, first = _warned(available_modes)
        again, second = _warned(available_modes)
        assert len(first) == 1 and second == []  # once per process
        assert "mode 'broken' is unavailable" in str(first[0].message)
        assert modes == again and "broken" not in modes
        reason = unavailable_modes()["broken"]
        assert list(unavailable_modes()) == ["broken"]
        assert f"entry point broken = {MISSING}:SPEC" in reason
        assert f"ModuleNotFoundError: No module named '{MISSING}'" in reason and "reinstall" in reason
        for ask in (lambda: mode_spec("broken"), lambda: check_mode("broken", {}),
                    lambda: registry.resolve_mode("broken")):
            with pytest.raises(ModeUnavailableError) as caught:
                ask()
            assert isinstance(caught.value, UnknownModeError)  # existing except clauses keep working
            assert str(caught.value) == f"mode 'broken' is declared but unavailable: {reason}"
        assert describe_modes()["unavailable"] == [{"name": "broken", "reason": reason}]


def test_the_other_modes_work_beside_a_broken_one():
    """Bug caught: one plugin's import error hiding every mode (the loop stopped at the first failure)."""
    real = available_modes()
    first = entry_point("aaa_broken", f"{MISSING}:SPEC")
    with discovering(BROKEN, before=(first,)):  # one read before the real entry points, one after
        modes, warned = _warned(available_modes)
        assert modes == real and len(warned) == 2
        check_mode("pced", {"gamma": 1.0})
        assert registry.resolve_mode("concat").__name__ == "run_concat"
        assert sorted(unavailable_modes()) == ["aaa_broken", "broken"]


@pytest.mark.parametrize(("value", "says"), [
    ("ctx_integrations.engine.modes.specs:PRIORS", "names a tuple, not a ModeSpec"),
    ("ctx_integrations.engine.modes.specs:PCW", "names mode 'pcw': name the entry point after its mode"),
    ("ctx_integrations.engine.modes.specs:NO_SUCH_SPEC", "AttributeError"),
])
def test_an_entry_point_that_names_no_fitting_mode_spec_is_unavailable_with_why(value, says):
    with discovering(entry_point("odd", value)):
        _, warned = _warned(available_modes)
        assert len(warned) == 1 and says in unavailable_modes()["odd"]
        with pytest.raises(ModeUnavailableError, match=says):
            mode_spec("odd")


def test_no_entry_point_at_all_says_to_reinstall():
    """Bug caught: an uninstalled source tree (or stale metadata) answering every mode with a bare 'unknown mode'."""
    with discovering(real=False):
        modes, warned = _warned(available_modes)
        assert modes == [] and len(warned) == 1 and "pip install -e ." in str(warned[0].message)
        with pytest.raises(UnknownModeError, match=r"unknown mode 'pced': no mode is declared: .* pip install -e \."):
            mode_spec("pced")


def test_a_mode_whose_module_fails_to_import_is_unavailable_when_it_is_used(monkeypatch):
    """The declaration loads (no torch), its code does not: the error names the mode, the module and what failed."""
    spec = ModeSpec("late_broken", "a test mode", "none", module=MISSING)
    available_modes()
    monkeypatch.setitem(mode_catalog._DECLARED, "late_broken", spec)  # declared for this test only
    with pytest.raises(ModeUnavailableError, match=f"mode 'late_broken': its module {MISSING} failed to import: "
                                                   f"No module named '{MISSING}'"):
        registry.resolve_mode("late_broken")


# -- where the modes are listed, the unavailable ones are -------------------------------------------------------------
def test_ctx_experts_modes_lists_the_modes_their_options_and_the_unavailable_ones(capsys):
    with discovering(BROKEN):
        _warned(available_modes)
        assert run_cli("modes") == 0
        text = capsys.readouterr().out
        assert run_cli("modes", "--json") == 0
        listed = json.loads(capsys.readouterr().out)
    for name in available_modes():
        assert f"\n{name}" in f"\n{text}"
    assert "    gamma: a number in [0, 100] (default 5.0; paper)\n      weight of the retrieval prior" in text
    assert f"unavailable: broken\n  entry point broken = {MISSING}:SPEC" in text
    assert [mode["name"] for mode in listed["data"]] == available_modes()
    assert [mode["name"] for mode in listed["unavailable"]] == ["broken"]


def test_get_v1_modes_lists_the_unavailable_ones():
    pytest.importorskip("fastapi")
    from tests.test_serve_modes import _send

    with discovering(BROKEN):
        _warned(available_modes)
        response, _ = _send("GET", "/v1/modes")
        reason = unavailable_modes()["broken"]
        refused, _ = _send("POST", "/v1/answer", {"query": "q", "documents": ["d"], "mode": "broken"})
    assert response.status_code == 200 and response.json()["unavailable"] == [{"name": "broken", "reason": reason}]
    assert refused.status_code == 422 and reason in refused.text
