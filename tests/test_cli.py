"""``ctx-experts demo`` end to end on the embedded model, then ``ask`` in every registered mode on its store."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

import ctx_integrations  # noqa: F401  (registers every mode)
from ctx_integrations.cli import load_demo_corpus
from ctx_integrations.engine.core.registry import available_modes
from tests.helpers import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """Run the demo once into a fresh store; return (store folder, printed text)."""
    store = tmp_path_factory.mktemp("demo") / "store"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_cli("demo", "--store", str(store)) == 0
    return store, out.getvalue()


def test_demo_answers_every_question_from_warm_caches(demo_run):
    _, out = demo_run
    documents, questions = load_demo_corpus()
    assert out.startswith("store ") and f"{len(documents)} added" in out
    assert f"KV caches: {len(documents)} computed" in out
    for item in questions:
        block = out.split(f"Q: {item['question']}")[1].split("\nQ: ")[0]
        pced = block.split("[pced]")[1].split("[concat]")[0]
        assert item["answer"] in pced and "contains the expected answer: yes" in pced  # greedy, fp32: deterministic
        assert re.search(r"cited: \S+ \(r=[\d.]+, \d+ tokens\)", pced)
        assert "KV cache 3 hits / 0 misses" in pced
        assert "[concat]" in block
    assert out.rstrip().endswith("KV cache misses while answering: 0")


def test_demo_part_two_compares_modes_on_sixteen_long_passages(demo_run):
    _, out = demo_run
    part = out.split("== Part 2: ")[1]
    assert part.startswith("16 retrieved passages of ~256 tokens") and "KV caches: 16 computed, 0 reused" in part
    question = re.search(r"Q: (.+?)   \(expected: (.+?), in (p\d\d)\)", part)
    assert question, part
    expected, gold = question.group(2), question.group(3)
    modes = ("concat", "pced", "ape", "soft_nbce")
    rows = {line.split()[0]: line for line in part.splitlines() if line.split()[:1] and line.split()[0] in modes}
    assert tuple(rows) == modes
    assert re.search(r"concat +[\d.]+ +[\d.]+ +1\.0x +1\.0x +- ", rows["concat"])  # ratios to itself, no citation
    # PCED answers and cites the passage that holds it (greedy, fp32: deterministic). Soft-NBCE with the paper's
    # Algorithm 1 (its default since the fidelity work) misses this question on the 135M model, as do 11 of the
    # 12 seeds probed; it and APE (attribution=True) must still cite a passage.
    assert rows["pced"].split("x  ")[-1].split()[0] == gold, rows["pced"]
    assert expected in rows["pced"]
    for mode in ("soft_nbce", "ape"):
        assert rows[mode].split("x  ")[-1].split()[0].startswith("p"), rows[mode]
    pced_ttft_ratio = float(re.search(r"pced +[\d.]+ +[\d.]+ +([\d.]+)x", rows["pced"]).group(1))
    assert pced_ttft_ratio > 1  # warm caches reach the first token sooner than reading 4k tokens in one prompt


def test_a_second_demo_computes_nothing(demo_run, capsys):
    store, _ = demo_run
    assert run_cli("demo", "--store", str(store), "--modes", "pced", "--max-new-tokens", "2",
                   "--large-modes", "pced") == 0
    unchanged = len(load_demo_corpus()[0])
    out = capsys.readouterr().out
    assert f"0 added, 0 updated, {unchanged} unchanged; KV caches: 0 computed" in out
    assert "KV caches: 0 computed, 16 reused" in out and out.rstrip().endswith("KV cache misses while answering: 0")


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
