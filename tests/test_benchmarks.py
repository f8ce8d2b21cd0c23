"""Every benchmark script runs end to end on the embedded model at a tiny size and writes its JSON.

The published tables come from the default (long) runs; these smoke runs keep the scripts from
rotting and check the invariants a benchmark row must satisfy whatever the model answers (IPPD's
answers equal sequential decoding; RAPID with eta = 0 answers exactly as the long-context target).
"""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path

import pytest

import benchmarks.common

pytestmark = pytest.mark.slow

WORDS = ("river harbour council bridge market winter tower library school garden railway museum festival "
         "mountain island treaty founder painter engineer merchant").split()


@pytest.fixture(autouse=True)
def reference_dtype(monkeypatch):
    """The scripts load the model with the library's default dtype (bf16 on a CPU with AMX / AVX512-BF16); the
    invariants checked here are exact ones (RAPID eta = 0 answers as the target, IPPD as one by one), which the
    library promises in fp32: every script runs on the fp32 reference path, whatever the CPU."""
    monkeypatch.setenv("CTX_DTYPE", "float32")


@pytest.fixture(autouse=True)
def small_musique(tmp_path, monkeypatch):
    """A MuSiQue-shaped file of short passages, so the smoke runs are fast and need no shared data."""
    rng = random.Random(0)
    rows = [{"id": f"tiny-{q}", "question": f"Which {WORDS[q]} is named in the passages?",
             "answers": [WORDS[q]],
             "documents": [" ".join(rng.choice(WORDS) for _ in range(60)).capitalize() + "." for _ in range(5)]}
            for q in range(3)]
    path = tmp_path / "musique_tiny.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    monkeypatch.setattr(benchmarks.common, "MUSIQUE", path)


def run_benchmark(name: str, argv: list[str], tmp_path: Path) -> list[dict]:
    module = importlib.import_module(f"benchmarks.{name}")
    output = tmp_path / f"{name}.json"
    module.main([*argv, "--output", str(output)])
    payload = json.loads(output.read_text())
    assert payload["benchmark"] == name and payload["environment"]["torch"]
    assert payload["rows"], f"{name} wrote no rows"
    return payload["rows"]


def test_ttft(tmp_path):
    rows = run_benchmark("ttft", ["--grid", "4x64", "--examples", "1", "--repeats", "1",
                                  "--max-new-tokens", "4"], tmp_path)
    assert {r["mode"] for r in rows} == {"concat", "pced (cold)", "pced (warm)"}
    assert all(r["ttft_s"] > 0 and 0 <= r["accuracy"] <= 1 for r in rows)
    assert next(r for r in rows if r["mode"] == "concat")["ttft_speedup_vs_concat"] == 1.0


def test_ape(tmp_path):
    rows = run_benchmark("ape", ["--grid", "4x64", "--examples", "1", "--musique", "1", "--temperatures", "0.9",
                                 "--scales", "0.9", "--max-new-tokens", "4"], tmp_path)
    modes = {r.get("mode") for r in rows}
    assert {"concat", "ape warm", "pced warm"} <= modes
    assert any(r.get("T") == 0.9 and r.get("S") == 0.9 for r in rows)


def test_ape_attribution(tmp_path):
    # the script itself raises if attribution changed the tokens
    (row,) = run_benchmark("ape_attribution", ["--grid", "3x32", "--repeats", "1", "--max-new-tokens", "2"], tmp_path)
    assert row["case"] == "3x32" and row["total_on_s"] > 0 and row["total_off_s"] > 0
    assert row["total_ratio"] == row["total_on_s"] / row["total_off_s"]


def test_ippd(tmp_path):
    rows = run_benchmark("ippd", ["--questions", "2", "--max-new-tokens", "4"], tmp_path)
    assert {r["set"] for r in rows} == {"synthetic", "musique"}
    ippd = [r for r in rows if r["method"].startswith("ippd")]
    assert ippd and all(r["same_as_sequential"] == 1.0 for r in ippd)
    # the prefix-cached baseline answers exactly as one-by-one decoding too (a fair baseline), and is the ratio's base
    cached = [r for r in rows if r["method"].startswith("prefix-cached")]
    assert {r["method"] for r in cached} == {"prefix-cached", "prefix-cached warm"}
    assert all(r["same_as_sequential"] == 1.0 and r["vs_prefix_cached"] == 1.0 for r in cached)
    assert all(r["vs_prefix_cached"] > 0 for r in ippd)


def test_rapid_with_eta_zero_answers_as_the_target(tmp_path):
    rows = run_benchmark("rapid", ["--contexts", "1024", "--new-tokens", "8", "--eta", "0",
                                   "--draft-context-tokens", "256", "--chunk-tokens", "128", "--gamma", "4"], tmp_path)
    for question in ("code", "describe"):
        by_mode = {r["mode"]: r for r in rows if r["question"] == question}
        assert {"concat", "drafter", "rapid eta=0"} <= set(by_mode)
        assert by_mode["rapid eta=0"]["answer"] == by_mode["concat"]["answer"]
        assert 0 <= by_mode["rapid eta=0"]["acceptance"] <= 1


def test_pced_variants(tmp_path):
    rows = run_benchmark("pced_variants", ["--musique", "1", "--synthetic", "1", "--n-docs", "3", "--doc-tokens",
                                           "64", "--max-new-tokens", "4"], tmp_path)
    assert {r["dataset"] for r in rows} == {"secret-code", "musique"}
    assert {"pced logprobs max", "concat"} <= {r["variant"] for r in rows}


def test_soft_nbce(tmp_path):
    rows = run_benchmark("soft_nbce", ["--lengths", "800", "--depths", "0.5", "--chunk-tokens", "256",
                                       "--musique", "1", "--max-new-tokens", "4"], tmp_path)
    niah = [r for r in rows if r.get("task") == "niah"]
    assert {r["mode"] for r in niah} == {"soft_nbce", "nbce", "pcw", "pced"}
    assert all(r["streams"] >= 3 and r["cache_misses"] == 0 for r in niah)  # warmed before timing
    assert sum("summary" in r for r in rows) == 4


def test_llama_index_warm(tmp_path):
    pytest.importorskip("llama_index.core")
    rows = run_benchmark("llama_index_warm", ["--top-k", "2", "--max-new-tokens", "4", "--questions", "1"], tmp_path)
    by_query = {r["query"]: r for r in rows}
    assert by_query["cold"]["cache_misses"] > 0
    assert by_query["repeat"]["cache_misses"] == 0 and by_query["ingested"]["cache_misses"] == 0


def test_serving(tmp_path):
    """Every row has the same requests timed concurrently and one at a time, and consistent percentiles."""
    rows = run_benchmark("serving", ["--quick"], tmp_path)
    assert {r["corpus"] for r in rows} == {"demo", "synthetic"} and {r["mode"] for r in rows} == {"pced", "methods"}
    assert {r["load"] for r in rows} == {"K=1", "K=2", "4/s"}
    for r in rows:
        assert r["requests"] == 3 and r["answers_per_s"] > 0 and r["serial_answers_per_s"] > 0
        assert r["ttft_p50_s"] <= r["ttft_p95_s"] <= r["latency_p95_s"]
        assert r["speedup_vs_serial"] == pytest.approx(r["answers_per_s"] / r["serial_answers_per_s"])
        # the scheduler's time split over the concurrent cell: shares of its busy time, rows per step
        assert 0 < r["forward_share"] and r["forward_share"] + r["exclusive_share"] <= 1 + 1e-9
        assert r["overhead_ms_per_step"] >= 0 and r["rows_per_step"] > 0
        # every method of the mix (pced, ape, rapid, concat, ippd) runs in the shared batch: no exclusive step
        assert r["exclusive_share"] == 0


def test_ape_search(tmp_path):
    rows = run_benchmark("ape_search", ["--dev", "1", "--test", "1", "--grid", "0.9", "1.0", "--max-new-tokens", "2"],
                         tmp_path)
    assert [r["system"] for r in rows][:2] == ["concat", "ape"] and len(rows) == 3
    tuned = rows[2]
    assert tuned["system"] == f"ape T={tuned['T']} S={tuned['S']}" and {tuned["T"], tuned["S"]} <= {0.9, 1.0}
    assert all(r["examples"] == 1 for r in rows)


def test_rule_dtype(tmp_path):
    from ctx_integrations.engine.modes.pced import PCEDFusion

    rule = PCEDFusion.__call__
    rows = {r["dtype"]: r for r in run_benchmark("rule_dtype", ["--quick"], tmp_path)}
    assert set(rows) == {"bfloat16", "float16", "float32"}
    assert rows["float32"]["steps"] > 0 and rows["float32"]["min_gap"] >= 0
    # the control: the formula re-evaluated in fp32 is the engine's own choice, token and winner, at every step
    assert rows["float32"]["tokens_differ"] == rows["float32"]["winners_differ"] == 0
    assert rows["float32"]["resolution_at_median_score"] < rows["float16"]["resolution_at_median_score"] \
        < rows["bfloat16"]["resolution_at_median_score"]
    assert PCEDFusion.__call__ is rule  # the engine's rule is put back


def test_host_reads(tmp_path):
    rows = run_benchmark("host_reads", ["--quick"], tmp_path)
    assert [r["case"] for r in rows] == ["pced, greedy", "pced, sampled", "ape (citations on)"]
    assert all(r["steps"] > 0 and r["reads_per_step_min"] == r["reads_per_step_max"] == 1 for r in rows)
    ippd = json.loads((tmp_path / "host_reads.json").read_text())["ippd_choice"]
    assert [r["questions"] for r in ippd] == [1, 4] and ippd[0]["choice_operations"] == ippd[1]["choice_operations"]


def test_compiled_step(tmp_path):
    # Dynamo's tracing only (an Inductor compile costs ~20 s here): the script runs, and the compiled step answers
    # as the eager one without falling back
    rows = run_benchmark("compiled_step", ["--quick", "--backend", "eager"], tmp_path)
    assert [row["step"] for row in rows] == ["eager", "compiled (eager)"]
    assert all(row["tokens_equal_eager"] and not row["fell_back"] and row["steps_per_s"] > 0 for row in rows)


def test_serving_remote_cache(tmp_path, monkeypatch):
    """The replica cases in one run: private tiers never hit across replicas, a shared remote tier does, and the
    remote tier's transfer row is consistent (benchmarks/serving.py --remote-cache). On the tiny model (each
    replica's copy loaded apart), so the smoke run takes seconds; the published table is the embedded model's."""
    import shutil

    from ctx_integrations.engine.core import model
    from tests.helpers import tiny_loaded

    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH: apt-get install redis-server")
    monkeypatch.setattr(model, "load_model", lambda name: tiny_loaded("llama", seed=0))
    module = importlib.import_module("benchmarks.serving")
    output = tmp_path / "serving_remote.json"
    module.main(["--quick", "--remote-cache", "auto", "--output", str(output)])
    payload = json.loads(output.read_text())
    rows = {r["case"]: r for r in payload["rows"]}
    assert [r["replicas"] for r in payload["rows"]] == [1, 2, 2] and all(r["answers_per_s"] > 0 for r in rows.values())
    assert rows["2 replicas, private tiers"]["remote_hits"] == 0
    assert rows["2 replicas, shared remote tier"]["remote_hits"] > 0
    (transfer,) = payload["remote_transfer"]
    assert transfer["remote_s"] > 0 and transfer["recompute_vs_remote"] == pytest.approx(
        transfer["recompute_s"] / transfer["remote_s"])
