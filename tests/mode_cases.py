"""The conformance suite's modes: every registered mode, built-in or a package's, never a list kept by hand.

A test that every mode must pass is decorated with :func:`every_mode`: it is parametrised over
``available_modes()`` (the test plugin's ``cad`` included where it is installed), and a mode whose declaration
exempts it from the test's property (``ModeSpec.exemptions``) is skipped with the declaration's reason.
``tests/test_mode_conformance.py`` fails when such a test no longer covers every mode. Why: a mode left out of a
hand-kept list silently skipped the attack and hardening suites.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ctx_integrations import available_modes, mode_spec

ROOT = Path(__file__).resolve().parents[1]
MODES = available_modes()
# Options that keep a mode's case fast on the tiny models (a shorter summary or draft); every other mode, a plugin's
# included, runs with its declared defaults.
SMALL_OPTIONS: dict[str, dict[str, Any]] = {
    "map_reduce": {"summary_tokens": 3},
    "rapid": {"draft_context_tokens": 16, "chunk_tokens": 8},
}


def small_options(mode: str) -> dict[str, Any]:
    return dict(SMALL_OPTIONS.get(mode, {}))


def every_mode(conformance: str | None = None, *, extra: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Parametrise a test's ``mode`` over every available mode (and ``extra`` cases such as ``"chat"``).

    ``conformance``: the property of :data:`~ctx_integrations.engine.core.mode_spec.CONFORMANCE` the test checks; a
    mode exempt from it is skipped with its declared reason. The test is tagged, so the guard test can read back
    what it was parametrised with."""

    def decorate(test: Callable) -> Callable:
        params = []
        for mode in MODES:
            why = mode_spec(mode).exemption(conformance) if conformance is not None else None
            marks = [pytest.mark.skip(reason=f"{mode}: {why}")] if why else []
            params.append(pytest.param(mode, marks=marks, id=mode))
        params += [pytest.param(case, id=case) for case in extra]
        test = pytest.mark.parametrize("mode", params)(test)
        test.every_mode = conformance or "every mode"
        return test

    return decorate


def builtin_entry_points() -> dict[str, str]:
    """This library's own ``ctx_integrations.modes`` entry points, as pyproject.toml declares them."""
    import tomllib  # Python 3.11+, like the dev setup

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return dict(project["entry-points"]["ctx_integrations.modes"])
