"""docs/modes.md is the modes' declarations as a table: regenerated, it must be the file as committed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from ctx_integrations import available_modes, mode_spec
from tests.mode_cases import builtin_entry_points

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("modes_doc", ROOT / "tools" / "modes_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_modes_md_is_generated_from_the_declarations():
    """Bug caught: an option added, renamed or re-ranged in engine/modes/specs.py while the docs say the old one.
    Fix: ``python tools/modes_doc.py``."""
    assert (ROOT / "docs" / "modes.md").read_text(encoding="utf-8") == _tool().render()


def test_the_table_names_every_mode_of_the_library_and_none_of_another_package():
    """Bugs caught: a built-in mode left out of the table; the table changing with what else is installed (the test
    plugin's ``cad`` written into docs/modes.md on a machine that has it)."""
    tool = _tool()
    text = tool.render()
    ours = tool.library_modes()
    assert set(ours) == set(builtin_entry_points()) and set(ours) <= set(available_modes())
    assert [line[4:-1] for line in text.splitlines() if line.startswith("## `")] == ours
    for name in set(available_modes()) - set(ours):
        assert f"`{name}`" not in text


def test_the_table_names_every_option_with_its_default():
    text = _tool().render()
    for name in _tool().library_modes():
        assert f"## `{name}`" in text
        for option in mode_spec(name).options:
            assert f"| `{option.name}` | {option.expected().replace('|', chr(92) + '|')} | `{option.default!r}` |" \
                in text


def test_the_readmes_table_of_modes_names_exactly_the_librarys_modes():
    """Bug caught: a built-in mode added or renamed while README.md's table of modes (written by hand, with the
    measured defaults) still lists the old set. A package's modes are not the README's to list."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### The modes\n", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])]
    assert sorted(named) == sorted(_tool().library_modes())
