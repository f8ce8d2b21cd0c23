"""The command line answers help, argument errors and unknown modes without importing torch.

Each check runs ``python -m ctx_integrations.cli`` in a fresh subprocess (the worktree's package, as a
user's shell would), so a module-level ``import torch`` anywhere on the way makes it fail: the
subprocess then takes many seconds and ``torch`` shows up in ``sys.modules``. The time bound is
generous (this CI machine is shared); the measured times are printed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctx_integrations import DEFAULT_MODE, available_modes

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
    (("ask", "what?", "--mode", "nope"), 2, f"unknown mode(s) 'nope': choose from {', '.join(available_modes())}"),
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


def test_the_cli_lists_every_declared_mode_without_torch():
    """``--mode``'s help is the modes' declarations (engine/modes/specs.py), not a list of its own that could miss one
    (tests/test_mode_specs.py holds every declaration to a registered function)."""
    done, seconds = run_cli_process("ask", "--help")
    assert done.returncode == 0, done.stderr
    assert f"decoding mode: {', '.join(available_modes())} (default {DEFAULT_MODE})" in " ".join(done.stdout.split())
    assert seconds < FAST_S


def test_engine_options_pass_threads_and_disk_format_only_when_given():
    from ctx_integrations.cli import build_parser, engine_options

    parse = build_parser().parse_args
    assert engine_options(parse(["ask", "q", "--store", "s"])) == {}
    assert engine_options(parse(["--threads", "1", "--disk-format", "int8", "ask", "q", "--store", "s"])) == {
        "threads": 1, "disk_format": "int8"}


# -- mistakes reported before any heavy import (issue 5) ------------------------------------------------------
ERROR_S = 3.0  # interpreter start included; these took 17-59 s when every import came first
HEAVY = ("torch", "transformers", "chromadb")


@pytest.mark.parametrize(("argv", "says"), [
    (("ask", "q?", "--store", "{tmp}/no-store"), "no store at {tmp}/no-store: build one with `ctx-experts ingest"),
    # --threads sets torch's threads: it must not import torch before the arguments are checked
    (("--threads", "1", "ask", "q?", "--store", "{tmp}/no-store"), "no store at"),
    (("ask", "q?", "--store", "{tmp}", "--threads", "1"), "no store at"),
    (("serve", "--store", "{tmp}/no-store"), "no store at"),
    (("ask", "q?", "--store", "{tmp}", "--model", "{tmp}/no-model"), "--model {tmp}/no-model: no such file or folder"),
    (("ingest", "README.md", "--store", "{tmp}/s", "--model", "./no-model.gguf"), "no such file or folder"),
    # a hub id never downloaded: at once, with how to get it (offline, transformers' retries took 77 s)
    (("ask", "q?", "--store", "{tmp}", "--model", "no-such-org/no-such-model"),
     "not in the Hugging Face cache; ctx-experts never downloads weights. Download them first (`hf download "
     "no-such-org/no-such-model`"),
    (("serve", "--store", "{tmp}", "--model", "no-such-model-name"), "not in the Hugging Face cache"),
    (("eval", "--set", "musique", "--data", "{tmp}/no.jsonl"), "MuSiQue file {tmp}/no.jsonl not found"),
    (("eval", "--data", "{tmp}/no.jsonl"), "--data is the MuSiQue file (--set musique) or the passages and questions "
                                           "files (--set nq, --set manuals), which --set world does not read"),
    (("eval", "--top-k", "4"), "--top-k and --store are options of --set nq and --set manuals"),
    (("eval", "--gold-retrieved-only"), "--gold-retrieved-only is an option of --set nq"),
    (("eval", "--set", "manuals", "--kinds", "single,bogus"), "unknown question kind 'bogus' for the manuals set"),
    (("eval", "--modes", "pced,nope"), f"unknown mode 'nope': choose one of {', '.join(available_modes())}"),
    # a mode's options, against its declaration, before the model loads (they were refused after a 12 s load)
    (("ask", "q?", "--store", "{tmp}", "--mode", "pced", "--option", "gamma=abc"),
     "error: mode 'pced': option gamma must be a number in [0, 100], got 'abc'"),
    (("ask", "q?", "--store", "{tmp}", "--mode", "pced", "--option", "gamma=100.5"),
     "error: mode 'pced': option gamma must be a number in [0, 100], got 100.5"),
    (("ask", "q?", "--store", "{tmp}", "--mode", "pced", "--option", "gama=2"),
     "error: mode 'pced' does not accept gama; its options are: aggregation, beta, gamma, prior, prior_floor, "
     "prior_tau, query_likelihood, score_space, switch (did you mean gamma?)"),
    (("ask", "q?", "--store", "{tmp}", "--mode", "rapid", "--option", "gamma=2.5"),
     "error: mode 'rapid': option gamma must be an integer >= 1, got 2.5"),
    (("ask", "q?", "--store", "{tmp}", "--mode", "rapid", "--option", "drafter=SmolLM2"),
     "error: mode 'rapid': option drafter must be an Engine, or None (draft with the target model), got 'SmolLM2'"),
    (("eval", "--variant", "soft_nbce:rule=nope"),
     "error: mode 'soft_nbce': option rule must be one of 'paper', 'nbce_code', got 'nope'"),
    (("ask", "q?", "--store", "{tmp}", "--rerank-top-n", "8"), "--rerank-top-n sets how many candidates"),
    (("ask", "q?", "--store", "{tmp}", "--top-k", "0"), "--top-k must be >= 1"),
    (("ask", "q?", "--store", "{tmp}", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    (("ingest", "README.md", "--store", "{tmp}/s", "--no-cache", "--disk-format", "int8"),
     "--no-cache computes no KV cache, so --disk-format would do nothing"),
    (("--dtype", "float32", "ingest", "README.md", "--store", "{tmp}/s", "--no-cache"), "so --dtype would do nothing"),
    (("ingest", "README.md", "--store", "README.md"), "--store README.md is a file"),
])
def test_mistakes_are_reported_before_torch_transformers_or_chromadb_is_imported(tmp_path, argv, says):
    """Each mistake is one ``error:`` line, exit status 2, within ``ERROR_S`` and with none of the heavy packages
    imported when it is raised (``main`` runs in a fresh interpreter and reports ``sys.modules`` after)."""
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    code = ("import json, sys; from ctx_integrations.cli import main; status = main(sys.argv[1:]); "
            f"print(json.dumps([status, [m for m in {HEAVY!r} if m in sys.modules]]))")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    print(f"ctx-experts {' '.join(argv)}: {seconds:.2f} s")
    assert json.loads(done.stdout.splitlines()[-1]) == [2, []], done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says.replace("{tmp}", str(tmp_path)) in lines[0], \
        done.stderr
    assert seconds < ERROR_S


def test_version_is_the_package_version_and_fast():
    from ctx_integrations import __version__

    done, seconds = run_cli_process("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ctx-experts {__version__}"
    assert seconds < ERROR_S


def test_top_level_help_is_a_description_the_commands_one_line_each_and_examples():
    """``ctx-experts --help`` as well-kept CLIs have it (it was the module's docstring, reST markup included)."""
    from ctx_integrations.cli import _COMMANDS, build_parser

    done = subprocess.run([sys.executable, "-m", "ctx_integrations.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "``" not in text and ":class:" not in text  # no docstring markup
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)
    usage, description = text.split("\n\n")[:2]
    assert usage == "usage: ctx-experts [-h] [--version] [engine options] COMMAND ..."
    assert description.startswith("Answer questions from your own documents")
    commands = text.split("\ncommands:\n")[1].split("\n\n")[0].splitlines()
    listed = {line.split()[0]: line.split(None, 1)[1] for line in commands[1:]}  # [0] is the COMMAND metavar
    assert listed == {name: command.help for name, command in _COMMANDS.items()}  # each on its own line, whole
    examples = [line.strip() for line in text.split("\nexamples:\n")[1].split("\n\n")[0].splitlines()]
    assert len(examples) >= 3 and all(line.startswith("ctx-experts ") for line in examples)
    for example in examples:  # every example is a valid command line
        build_parser().parse_args(shlex.split(example)[1:])
    assert "--version" in text and "ctx-experts COMMAND --help" in text


def test_a_hub_id_in_the_hugging_face_cache_passes_the_early_check(tmp_path, monkeypatch):
    """The check that refuses a hub id never downloaded lets one through that the cache holds (its folder layout:
    ``models--ORG--NAME/snapshots/REVISION/config.json``), and a folder without config.json is not taken for one."""
    from huggingface_hub import constants

    from ctx_integrations.cli import check_model_name
    from ctx_integrations.errors import ModelNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--some-org--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    with pytest.raises(ModelNotFoundError, match="hf download some-org/some-model"):
        check_model_name("some-org/some-model")  # a snapshot without its config.json
    (snapshot / "config.json").write_text("{}")
    check_model_name("some-org/some-model")
    check_model_name("qwen2.5-coder-0.5b")  # an alias: checked against its pins when it loads
    check_model_name(None)
