"""The Makefile's torch choice, read with ``make -n`` (prints the commands, runs nothing) on a venv path that is empty.

Bugs caught: ``TORCH=cuda`` installing the same torch as the default (no ``--isolated``: pip's local
configuration, which on this project's machines serves the CPU wheel, would still apply); the torch
install coming after ``pip install -e .`` (which would then pull its own torch); a misspelt ``TORCH`` value
silently installing the CPU wheel; ``TORCH_INDEX`` ignored.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry(tmp_path: Path, *variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", "demo", f"VENV={tmp_path / 'venv'}", *variables], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def torch_install(commands: str) -> str:
    line, = [line for line in commands.splitlines() if "install" in line and "torch==" in line]
    return line


@pytest.mark.parametrize("variables, flags, kind", [
    ((), [], "torch.version.cuda is None"),
    (("TORCH=cpu",), [], "torch.version.cuda is None"),
    (("TORCH=cuda",), ["--isolated"], "torch.version.cuda is not None"),
    (("TORCH=cuda", "TORCH_INDEX=https://example.invalid/cu130"), ["--isolated", "--index-url",
                                                                   "https://example.invalid/cu130"],
     "torch.version.cuda is not None"),
])
def test_torch_goes_in_first_pinned_and_of_the_kind_asked(tmp_path, variables, flags, kind):
    done = dry(tmp_path, *variables)
    assert done.returncode == 0, done.stderr
    commands = done.stdout
    install = torch_install(commands)
    words = install.split()
    assert words[words.index("--no-compile") + 1:words.index("torch==2.13.0;")] == flags
    assert f"assert {kind}\"" in commands  # the venv's torch is kept only when it already is that kind
    assert commands.index(install) < commands.index("install --no-compile -e .")
    assert f"touch {tmp_path / 'venv'}/.torch-{variables[0].split('=')[1] if variables else 'cpu'}" in commands


def test_an_unknown_torch_kind_is_refused(tmp_path):
    done = dry(tmp_path, "TORCH=gpu")
    assert done.returncode != 0 and "TORCH=gpu: use TORCH=cpu (the default) or TORCH=cuda" in done.stderr


def test_the_dtype_legs_run_every_file_that_marks_a_test_for_them(tmp_path):
    """The legs name their files (collecting the whole suite costs 46 s a process); a test marked ``dtype_legs``
    in a file they do not name would run in neither dtype's leg, and the main run deselects it."""
    done = subprocess.run(["make", "-n", "test", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    legs = [line.split() for line in done.stdout.splitlines() if "-m dtype_legs" in line]
    assert [words[0] for words in legs] == ["CTX_DTYPE=bfloat16", "CTX_DTYPE=float32"]
    marker = re.compile(r"^\s*(@pytest\.mark\.dtype_legs\b|pytestmark\s*=.*\bpytest\.mark\.dtype_legs\b)", re.M)
    marking = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
               if marker.search(path.read_text(encoding="utf-8"))}
    assert marking, "no test file marks a test dtype_legs: the scan or the marker's name changed"
    for words in legs:
        assert {word for word in words if word.startswith("tests/")} == marking
