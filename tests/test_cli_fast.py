"""The command line answers help, argument errors and unknown modes without importing torch.

Each check runs ``python -m ctx_integrations.cli`` in a fresh subprocess (the worktree's package, as a
user's shell would), so a module-level ``import torch`` anywhere on the way makes it fail: the
subprocess then takes many seconds and ``torch`` shows up in ``sys.modules``. The time bound is
generous (this CI machine is shared); the measured times are printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctx_integrations.cli import BUILTIN_MODES

ROOT = Path(__file__).resolve().parents[1]
FAST_S = 5.0  # the target is < 2 s on an idle machine; importing torch alone takes longer than this here


def run_cli_process(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ctx_integrations.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return done, time.perf_counter() - started


@pytest.mark.parametrize(("argv", "status", "says"), [
    (("--help",), 0, "ingest"),
    (("ask", "--help"), 0, "--json"),
    (("ingest", "--help"), 0, "--progress"),
    (("distill", "--help"), 0, "usage: ctx-experts distill"),  # its arguments come from a torch module: loaded
    (("ask",), 2, "the following arguments are required"),
    (("nonsense",), 2, "invalid choice"),
    (("ask", "what?", "--mode", "nope"), 2, "unknown mode(s) 'nope': choose from pced"),
    (("demo", "--modes", "pced,nope"), 2, "unknown mode(s) 'nope'"),
    (("ingest", "/no/such/folder"), 2, "does not exist"),
])
def test_help_and_argument_errors_answer_fast(argv, status, says):
    done, seconds = run_cli_process(*argv)
    print(f"ctx-experts {' '.join(argv)}: {seconds:.2f} s")
    assert done.returncode == status, done.stderr
    assert says in done.stdout + done.stderr
    if argv[0] != "distill":
        assert seconds < FAST_S


def test_importing_the_cli_and_the_package_does_not_import_torch():
    code = ("import sys, ctx_integrations, ctx_integrations.cli; from ctx_integrations.cli import build_parser; "
            "build_parser(); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_package_still_exports_engine_answer_document():
    import ctx_integrations
    from ctx_integrations import Answer, Document, Engine
    from ctx_integrations.documents import Document as RealDocument
    from ctx_integrations.engine.core.answer import Answer as RealAnswer
    from ctx_integrations.engine.core.engine import Engine as RealEngine

    assert (Engine, Answer, Document) == (RealEngine, RealAnswer, RealDocument)
    assert {"Engine", "Answer", "Document"} <= set(dir(ctx_integrations))
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        ctx_integrations.Engin  # noqa: B018


def test_the_cli_knows_every_registered_mode_without_torch():
    from ctx_integrations.engine.core.registry import available_modes

    assert sorted(BUILTIN_MODES) == sorted(available_modes())


def test_engine_options_pass_threads_and_disk_format_only_when_given():
    from ctx_integrations.cli import build_parser, engine_options

    parse = build_parser().parse_args
    assert engine_options(parse(["ask", "q", "--store", "s"])) == {}
    assert engine_options(parse(["--threads", "0", "--disk-format", "int8", "ask", "q", "--store", "s"])) == {
        "threads": 1, "disk_format": "int8"}
