"""The Makefile's torch choice, read with ``make -n`` (prints the commands, runs nothing) on a venv path that is empty.

Bugs caught: ``TORCH=cuda`` installing the same torch as the default (no ``--isolated``: pip's local
configuration, which on this project's machines serves the CPU wheel, would still apply); the torch
install coming after ``pip install -e .`` (which would then pull its own torch); a misspelt ``TORCH`` value
silently installing the CPU wheel; ``TORCH_INDEX`` ignored.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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


def test_the_dtype_leg_runs_every_file_that_marks_a_test_for_it_in_the_other_dtype(tmp_path):
    """The main run is the default dtype's leg; the second leg names its files (collecting the whole suite costs 46 s
    a process). Bugs caught: a test marked ``dtype_legs`` in a file the leg does not name (it would run in one
    dtype only), a main run that deselects the marked tests (they would skip the default dtype), a leg that
    runs the default dtype again instead of the other one."""
    done = subprocess.run(["make", "-n", "test", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = [line for line in done.stdout.replace("\\\n", " ").splitlines() if "-m pytest" in line]
    assert len(runs) == 2 and "-m" not in runs[0].split("-m pytest", 1)[1].split(), runs
    leg = runs[1].split("-m pytest", 1)[1].split()
    assert leg[leg.index("-m") + 1] == "dtype_legs"
    marker = re.compile(r"^\s*(@pytest\.mark\.dtype_legs\b|pytestmark\s*=.*\bpytest\.mark\.dtype_legs\b)", re.M)
    marking = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
               if marker.search(path.read_text(encoding="utf-8"))}
    assert marking, "no test file marks a test dtype_legs: the scan or the marker's name changed"
    assert {word for word in leg if word.startswith("tests/")} == marking
    # the leg's dtype: what the snippet prints, with the main run's dtype forced either way
    snippet = re.search(r"python -c '([^']+)'", runs[1]).group(1)
    assert "CTX_DTYPE=$other" in runs[1]
    for main_run, other in (("bfloat16", "float32"), ("float32", "bfloat16")):
        printed = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "CTX_DTYPE": main_run}, cwd=ROOT)
        assert printed.stdout.strip() == other, (main_run, printed.stdout, printed.stderr)
