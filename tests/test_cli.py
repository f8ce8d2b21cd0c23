"""``ctx-experts demo`` end to end on the embedded model, then ``ask`` in every registered mode on its store."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

import ctx_integrations  # noqa: F401  (registers every mode)
from ctx_integrations.cli import DEMO_LARGE_SEED, load_demo_corpus
from ctx_integrations.engine.core.machine import available_cores, default_threads, native_bf16
from ctx_integrations.engine.core.registry import available_modes
from ctx_integrations.evaluation import world_set
from tests.helpers import run_cli

pytestmark = pytest.mark.slow
# Part 2 at a size CI affords (the demo's default is 6 questions x 8 passages).
LARGE_QUESTIONS, LARGE_PASSAGES = 2, 8


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """Run the demo once into a fresh store; return (store folder, printed text)."""
    store = tmp_path_factory.mktemp("demo") / "store"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_cli("--dtype", "float32", "demo", "--store", str(store), "--large-questions", str(LARGE_QUESTIONS),
                       "--large-passages", str(LARGE_PASSAGES)) == 0
    return store, out.getvalue()


def test_demo_answers_every_question_from_warm_caches(demo_run):
    _, out = demo_run
    documents, questions = load_demo_corpus()
    assert out.startswith("store ") and f"{len(documents)} added" in out
    assert f"KV caches: {len(documents)} computed" in out
    # fp32 asked for (greedy answers below are the reference path's); the line says why, per CPU feature
    why = r"asked for; this device's default is bfloat16" if native_bf16() else r"this CPU has no bf16 arithmetic .+"
    cores, threads = available_cores(), default_threads()  # torch's count capped at the cores this process may use
    assert re.search(rf"^model .+ on cpu: dtype float32 \({why}\); {threads} CPU threads? \({cores} physical "
                     rf"cores? available to this process\)$", out, flags=re.M)
    for item in questions:
        block = out.split(f"Q: {item['question']}")[1].split("\nQ: ")[0]
        pced = block.split("[pced]")[1].split("[concat]")[0]
        assert item["answer"] in pced and "contains the expected answer: yes" in pced  # greedy, fp32: deterministic
        assert re.search(r"cited: \S+ \(r=[\d.]+, \d+ tokens\)", pced)
        assert "KV cache 3 hits / 0 misses" in pced
        assert "[concat]" in block
    assert out.rstrip().endswith("KV cache misses while answering: 0")


def test_demo_part_two_reports_each_modes_accuracy_rate_over_several_questions(demo_run):
    _, out = demo_run
    part = out.split("== Part 2: ")[1]
    assert part.startswith(f"{LARGE_QUESTIONS} questions, each over {LARGE_PASSAGES} retrieved passages of ~256 tokens")
    assert f"KV caches: {LARGE_QUESTIONS * LARGE_PASSAGES} computed, 0 reused" in part
    ran_with = r"^\(model .+ on cpu: dtype float32 \(.+\); \d+ CPU threads? .+; README's counts name theirs\)$"
    assert re.search(ran_with, part, flags=re.M)  # what the counts depend on
    examples = world_set(LARGE_QUESTIONS, documents=LARGE_PASSAGES, document_tokens=256, seed=DEMO_LARGE_SEED)
    for example in examples:  # each question and what would be right, before its first answer
        header = f"  {example.id} ({example.kind.replace('_', '-')}): {example.question}\n  expected: "
        assert header + repr(example.answers[0]) in part
        assert part.index(header) < part.index(f"  {example.id} [concat]")
    modes = ("concat", "pced", "ape", "soft_nbce")
    answers = re.findall(r"^  (world-0-\d+) \[(\w+)\] em=([\d.]+) ", part, flags=re.M)
    assert [(q, m) for q, m, _ in answers] == [(f"world-0-{i:03d}", m) for i in range(LARGE_QUESTIONS) for m in modes]
    rows = {line.split()[0]: line.split() for line in part.split("cite R")[1].splitlines()
            if line.split()[:1] and line.split()[0] in modes}
    assert tuple(rows) == modes
    for mode in modes:  # the rate is the count of this mode's correct answers above, over all questions
        correct = sum(float(em) == 1.0 for _, m, em in answers if m == mode)
        assert rows[mode][1] == f"{correct}/{LARGE_QUESTIONS}", (mode, rows[mode])
    assert rows["concat"][4:6] == ["1.0x", "1.0x"] and rows["concat"][6:] == ["-", "-"]  # no attribution
    assert float(rows["pced"][4].rstrip("x")) > 1  # warm caches reach the first token sooner than one long prompt
    for mode in ("pced", "ape"):  # both attribute tokens to passages by default, so both have citation scores
        assert rows[mode][6] != "-" or rows[mode][7] != "-", rows[mode]


def test_a_second_demo_computes_nothing(demo_run, capsys):
    store, _ = demo_run
    assert run_cli("--threads", "1", "--dtype", "float32", "demo", "--store", str(store), "--modes", "pced",
                   "--max-new-tokens", "2", "--large-modes", "pced", "--large-questions", str(LARGE_QUESTIONS),
                   "--large-passages", str(LARGE_PASSAGES)) == 0
    unchanged = len(load_demo_corpus()[0])
    out = capsys.readouterr().out
    assert f"0 added, 0 updated, {unchanged} unchanged; KV caches: 0 computed" in out
    assert "; 1 CPU thread (" in out  # --threads reaches the engine's scheduler
    assert f"KV caches: 0 computed, {LARGE_QUESTIONS * LARGE_PASSAGES} reused" in out
    assert out.rstrip().endswith("KV cache misses while answering: 0")


def test_ask_over_the_request_budget_the_cli_was_given_is_refused_with_the_flag_to_raise(demo_run, capsys):
    """Bug caught: ``--max-request-bytes`` parsed but never handed to the engine (the 2 GiB default would answer)."""
    store, _ = demo_run
    assert run_cli("--max-request-bytes", "64KiB", "ask", "Who designed the Copper Bridge in Velmora?", "--store",
                   str(store), "--mode", "pced", "--top-k", "3", "--max-new-tokens", "2") == 2
    err = capsys.readouterr().err
    assert "more than this engine's per-request budget of 0.1 MiB" in err and "--max-request-bytes" in err


@pytest.mark.parametrize("mode", available_modes())
def test_ask_in_every_mode_on_the_demo_store(demo_run, capsys, mode):
    store, _ = demo_run
    question = "Who designed the Copper Bridge in Velmora?"
    assert run_cli("ask", question, "--store", str(store), "--mode", mode, "--top-k", "3", "--max-new-tokens", "6",
                   "--json") == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["question"] == question and answer["mode"] == mode
    assert 0 < len(answer["token_ids"]) <= 6 and answer["text"].strip()
    assert [d["id"] for d in answer["documents"]][0] == "velmora-copper-bridge"
    assert answer["timings"]["ttft_s"] > 0
