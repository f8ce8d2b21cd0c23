"""``benchmarks/gpu.py --dry-run``: the GPU benchmark's code runs end to end at tiny shapes on CPU.

The GPU numbers come from a lent GPU (docs/gpu-benchmark.md); this keeps the script from rotting in between
and checks what every row must satisfy whatever the timings: each section and case is present, nothing
failed, ratios are computed against the same run's baseline, and IPPD's answers equal the
prefix-cached batch's answers token for token (fp32). ``--budget``: the headline table in priority order,
cases that would not fit skipped with the reason, every case printed and written as it finishes, the
watchdog's hard stop at the deadline; and the roofline's arithmetic (``benchmarks/roofline.py``) against
published parameter counts, a real cache's bytes and hand-computed numbers.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import gpu, roofline
from benchmarks.budget import Budget, Watchdog
from ctx_integrations import Answer


@pytest.mark.slow
def test_dry_run_covers_every_section_and_writes_the_json(tmp_path):
    rows = gpu.main(["--dry-run", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "gpu.json").read_text())
    assert payload["rows"] == json.loads(json.dumps(rows, default=str))
    assert payload["settings"]["dry_run"] and payload["settings"]["sections"] == list(gpu.SECTIONS)
    assert payload["settings"]["complete"] and set(payload["settings"]["model_build_s"]) == {"tiny"}
    assert not [r for r in rows if "error" in r]
    by_section = {name: [r for r in rows if r["section"] == name] for name in gpu.SECTIONS}
    shapes = gpu.DRY
    pced = by_section["pced"]
    assert {(r["documents"], r["mode"]) for r in pced} == {(n, m) for n in shapes.pced_docs
                                                           for m in ("concat", "pced cold", "pced warm")}
    assert all(r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"] and r["new_tokens"] == shapes.new_tokens for r in pced)
    assert all(r["ttft_speedup_vs_concat"] == 1.0 for r in pced if r["mode"] == "concat")
    assert {r["context_tokens"] for r in by_section["ape"]} == set(shapes.ape_contexts)
    assert len(by_section["ape"]) == 4 * len(shapes.ape_contexts)
    ippd = [r for r in by_section["ippd"] if r["method"] == "ippd"]
    assert [r["same_answers"] for r in ippd] == [f"{n}/{n}" for n in shapes.ippd_questions]
    assert [r["mode"] for r in by_section["rapid"]] == ["concat", "rapid warm"] * len(shapes.rapid_contexts)
    assert 0 <= by_section["rapid"][1]["acceptance_rate"] <= 1
    assert [r["mode"] for r in by_section["soft_nbce"]] == ["concat", "soft_nbce"] * len(shapes.soft_nbce_contexts)
    assert [r["concurrent"] for r in by_section["scheduler"]] == list(shapes.concurrency)
    assert all(r["speedup"] > 0 for r in by_section["scheduler"])
    assert [r["tier"] for r in by_section["cache"]] == ["device memory", "pinned host -> device",
                                                       "pageable host -> device", "disk (page cache) -> device"]
    assert len({r["megabytes"] for r in by_section["cache"]}) == 1
    decode = by_section["decode"]
    methods = ("eager", "compiled") if torch.cuda.is_available() else ("eager",)  # the CPU's default: eager only
    assert [(r["documents"], r["method"].split()[0]) for r in decode] == [
        (n, m) for n in shapes.decode_streams for m in methods]
    assert all(r["steps_per_s"] > 0 and r["first_call_s"] > 0 for r in decode)
    assert [r["documents"] for r in by_section["peer"]] == list(shapes.peer_docs)
    assert all(r["new_tokens"] == shapes.new_tokens and r["decode_tokens_per_s"] > 0 for r in by_section["peer"])
    bandwidth, = by_section["bandwidth"]
    assert bandwidth["device"] == "cpu" and bandwidth["measured_gb_per_s"] > 0 and bandwidth["spec_gb_per_s"] is None
    assert all(r["roofline_fraction"] > 0 and r["gb_per_step"] > 0 for r in pced)


def test_only_runs_the_chosen_sections(tmp_path):
    rows = gpu.main(["--dry-run", "--only", "cache", "--out", str(tmp_path)])
    assert {r["section"] for r in rows} == {"cache"} and len(rows) == 4
    with pytest.raises(SystemExit, match="unknown section"):
        gpu.main(["--dry-run", "--only", "pced,flash"])
    with pytest.raises(SystemExit, match="unknown model shape"):
        gpu.main(["--dry-run", "--models", "llama-9b"])


def test_documents_have_exactly_the_asked_tokens_and_questions_equal_suffixes():
    cpu = gpu.torch.device("cpu")
    loaded = gpu.build_model("tiny", gpu.load_tokenizer(), cpu, gpu.torch.float32)
    corpus = gpu.Corpus(gpu.Engine(loaded).layout)
    docs = corpus.documents(3, 57, seed=0)
    assert [len(corpus.layout.context_ids(d)) for d in docs] == [57, 57, 57] and len(set(docs)) == 3
    questions = corpus.questions(5)
    assert len(set(questions)) == 5 and len({len(corpus.layout.suffix_ids(q)) for q in questions}) == 1


# -- --budget: the headline table, skipped cases, incremental rows, the watchdog --------------------------
def _table_cases(shapes=gpu.DRY) -> list[tuple]:
    """(section, label value) of every table case, in the plan's order."""
    most, fewest = max(shapes.pced_docs), min(shapes.peer_docs)
    return [("bandwidth", None), ("pced", most), *[("scheduler", k) for k in shapes.table_concurrency],
            *[("ippd", q) for q in shapes.table_ippd_questions], ("pced", fewest), ("peer", fewest),
            *[("ape", c) for c in shapes.table_ape_contexts], *[("peer", n) for n in shapes.peer_docs if n != fewest],
            ("decode", most), ("decode", fewest)]


def _case_key(case: dict) -> tuple:
    value = next((case[k] for k in ("documents", "concurrent", "questions", "context_tokens") if k in case), None)
    return case["section"], value


@pytest.mark.slow
def test_the_budget_runs_the_table_in_order_writes_every_case_at_once_and_skips_what_would_not_fit(
        tmp_path, monkeypatch, capsys):
    """APE's cases are given an estimate no budget covers: they become skipped rows, the rest runs."""
    snapshots = []
    real_write = gpu.write_results

    def recording_write(name, rows, settings, output=None, extra=None):
        path = real_write(name, rows, settings, output, extra)
        payload = json.loads(path.read_text())  # valid JSON every time
        snapshots.append(([(r["section"], r.get("skipped") is not None) for r in payload["rows"]],
                          payload["settings"]["complete"], len(payload["summary"]), capsys.readouterr().out))
        return path

    real_ape = gpu.ape_case
    monkeypatch.setattr(gpu, "write_results", recording_write)
    monkeypatch.setattr(gpu, "ape_case", lambda bench, context: replace(real_ape(bench, context), prior_s=1e6))
    fired = []
    monkeypatch.setattr(gpu, "hard_exit", fired.append)
    rows = gpu.main(["--dry-run", "--budget", "600", "--out", str(tmp_path)])

    payload = json.loads((tmp_path / "gpu.json").read_text())
    settings = payload["settings"]
    assert not fired and "interrupted" not in settings and settings["complete"]
    assert settings["sections"] == [gpu.TABLE] and settings["budget_s"] == 600 and settings["shapes"]["repeats"] == 1
    assert [_case_key(c) for c in settings["cases"]] == _table_cases()
    assert settings["seconds"] < 600
    # each case says what it compiled (nothing on the CPU: the engines' default compile_mode is the eager step)
    assert all(c["graphs_compiled"] == 0 and c["cudagraph_skips"] == 0 for c in settings["cases"])
    skipped = [c for c in settings["cases"] if c["status"] == "skipped"]
    assert [c["section"] for c in skipped] == ["ape", "ape"]
    assert all(c["status"] == "done" for c in settings["cases"] if c["section"] != "ape")
    ape_rows = [r for r in rows if r["section"] == "ape"]
    assert len(ape_rows) == 2 and all(r["skipped"].startswith("over budget: needs ~") for r in ape_rows)
    # one write per case (plus the final one), each with the rows of the cases before it and its own
    assert len(snapshots) == len(settings["cases"]) + 1
    sections = [[s for s, _ in snapshot[0]] for snapshot in snapshots]
    assert all(a == b[:len(a)] and len(b) > len(a) for a, b in zip(sections[:-2], sections[1:-1]))
    assert [snapshot[1] for snapshot in snapshots] == [False] * (len(snapshots) - 1) + [True]
    # each case's table is printed before its rows are written, and before the next case runs
    assert "### bandwidth (tiny" in snapshots[0][3] and "### pced (tiny, documents=4" in snapshots[1][3]
    assert "| tiny | pced warm | 4 |" in snapshots[1][3] and "### pced" not in snapshots[0][3]
    # the headline rows: every one present, APE's marked skipped with the reason
    summary = {r["row"]: r for r in payload["summary"]}
    assert summary["PCED warm TTFT, 4 x 40"]["value"].endswith(" s")
    assert "of the bandwidth limit" in summary["concat decode, batch 1, 4 x 40"]["versus"]
    assert "of the bandwidth limit" in summary["PCED decode, 5 rows x ~40 columns"]["versus"]
    assert {"2 concurrent PCED requests", "4 concurrent PCED requests", "IPPD, 2 questions", "IPPD, 4 questions",
            "transformers generate, 2 x 40", "transformers generate, 4 x 40", "memory bandwidth (cpu)"} <= set(summary)
    # the compiled step's rows: on the CPU only the eager step runs, and the row says so
    for row in ("compiled decode step, PCED, 5 rows", "compiled decode step, concat, batch 1, 2 x 40"):
        assert (summary[row]["value"], summary[row]["versus"]) == ("-", "the eager step only: not on CUDA")
    decode = [r for r in rows if r["section"] == "decode"]
    assert [(r["documents"], r.get("answer_mode"), r["method"]) for r in decode] == [
        (4, "pced", "eager step"), (2, "concat", "eager step")]
    assert summary["APE prefill, 80 tokens, cold (auto kernel)"]["value"] == "skipped"
    assert summary["APE prefill, 160 tokens, warm (flex)"]["versus"].startswith("over budget")
    peer = [r for r in rows if r["section"] == "peer"]
    assert [r["new_tokens"] for r in peer] == [gpu.DRY.new_tokens] * 2
    assert all(0 < r["ttft_s"] <= r["total_s"] and r["prompt_tokens"] > r["documents"] * 40 for r in peer)
    pced = [r for r in rows if r["section"] == "pced"]
    assert [r["mode"] for r in pced] == ["concat", "pced warm"] * 2
    assert all(r["roofline_fraction"] > 0 and r["rows"] == (1 if r["mode"] == "concat" else r["documents"] + 1)
               for r in pced)


def test_a_budget_too_small_for_any_case_skips_them_all_with_the_reason_and_still_writes_valid_json(
        tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(gpu, "hard_exit", fired.append)  # the 2 s deadline may pass while the model is built
    rows = gpu.main(["--dry-run", "--budget", "2", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "gpu.json").read_text())
    assert [_case_key(c) for c in payload["settings"]["cases"]] == _table_cases()
    assert rows == payload["rows"] and len(rows) == len(_table_cases())
    assert all(r["skipped"].startswith("over budget: needs ~") and r["skipped"].endswith("left of 2 s") for r in rows)
    assert {r["value"] for r in payload["summary"]} == {"skipped"}
    assert fired in ([], [124])
    if fired:
        assert payload["settings"]["interrupted"].startswith("the budget of 2 s ran out during ")


def test_at_the_deadline_the_watchdog_records_the_case_in_flight_and_ends_the_run(tmp_path, monkeypatch):
    """A case that overruns its estimate: the JSON names it, with what finished before it, and the exit is 124."""
    seen = []
    ended = threading.Event()

    def exit_now(status):
        seen.append((status, json.loads((tmp_path / "gpu.json").read_text())))
        ended.set()

    def slow() -> list[dict]:
        assert ended.wait(60), "the watchdog did not fire"
        return [{"measured_gb_per_s": 1.0}]

    monkeypatch.setattr(gpu, "hard_exit", exit_now)
    monkeypatch.setattr(gpu, "Budget", functools.partial(gpu.Budget, reserve_s=0.5))
    monkeypatch.setattr(gpu, "PLANNERS", {**gpu.PLANNERS, "bandwidth": lambda bench: [
        lambda: gpu.Case("bandwidth", {}, lambda: [{"measured_gb_per_s": 2.0}], 0.0),
        lambda: gpu.Case("bandwidth", {"slow": True}, slow, 0.0)]})
    gpu.main(["--dry-run", "--budget", "6", "--only", "bandwidth", "--out", str(tmp_path)])
    (status, payload), = seen
    assert status == 124 and not payload["settings"]["complete"]
    assert payload["settings"]["interrupted"] == "the budget of 6 s ran out during bandwidth {'slow': True}"
    assert [(r.get("slow"), r.get("measured_gb_per_s"), r.get("error")) for r in payload["rows"]] == [
        (None, 2.0, None), (True, None, "interrupted: the budget of 6 s ran out")]


def test_budget_estimates_scale_with_the_measured_slowdown_and_refuse_what_does_not_fit():
    now = [100.0]
    budget = Budget(60, started=100.0, margin=1.25, reserve_s=5.0, clock=lambda: now[0])
    assert budget.refusal(44.0) is None  # 55 s fits in 60 - 5
    assert budget.refusal(44.1) == ("over budget: needs ~55 s (estimate 44 s x slowdown 1.00 x margin 1.25), "
                                    "55 s left of 60 s")
    budget.record(10.0, 5.0)  # faster than estimated: estimates are not lowered
    assert budget.slowdown() == 1.0 and budget.estimate(8.0) == 10.0
    budget.record(10.0, 35.0)  # 40 s taken for 20 s estimated
    now[0] = 140.0
    assert budget.slowdown() == 2.0 and budget.estimate(6.0) == 15.0
    assert budget.refusal(6.0) is None and budget.refusal(6.1) is not None  # 15 s of 20 - 5
    now[0] = 170.0
    assert budget.left() == -10.0 and "0 s left of 60 s" in budget.refusal(0.1)
    with pytest.raises(ValueError, match="> 0 seconds"):
        Budget(0)


def test_the_watchdog_fires_once_at_its_deadline_and_not_when_cancelled():
    calls = []
    fired = threading.Event()
    dog = Watchdog(time.perf_counter() + 0.05, lambda: calls.append("deadline"),
                   exit=lambda status: (calls.append(status), fired.set()))
    assert fired.wait(5) and calls == ["deadline", 124] and dog.fired
    quiet = Watchdog(time.perf_counter() + 0.05, lambda: calls.append("late"), exit=calls.append)
    quiet.cancel()
    time.sleep(0.2)
    assert calls == ["deadline", 124] and not quiet.fired


def test_bad_budgets_and_sections_are_refused():
    with pytest.raises(SystemExit, match="--budget must be a number of seconds > 0"):
        gpu.main(["--dry-run", "--budget", "0"])
    with pytest.raises(SystemExit, match="choose from .*table"):
        gpu.main(["--dry-run", "--only", "tabel"])


# -- the roofline arithmetic ------------------------------------------------------------------------------
def test_parameter_and_kv_arithmetic_match_the_published_models_and_a_built_one():
    eight, eight_tied = roofline.PUBLISHED["Llama-3.1-8B"]
    one, one_tied = roofline.PUBLISHED["Llama-3.2-1B"]
    assert roofline.param_count(eight, eight_tied) == 8_030_261_248  # Llama-3.1-8B's published count
    assert roofline.param_count(one, one_tied) == 1_235_814_400  # Llama-3.2-1B's
    assert roofline.kv_bytes_per_token(eight, 2) == 32 * 2 * 8 * 128 * 2 == 131072
    assert roofline.kv_bytes_per_token(one, 2) == 16 * 2 * 8 * 64 * 2 == 32768
    for name in ("llama-3.1-8b", "llama-3.2-1b"):  # the benchmark's shapes are the published ones
        assert {k: gpu.MODEL_SHAPES[name][k] for k in eight} == roofline.PUBLISHED[
            {"llama-3.1-8b": "Llama-3.1-8B", "llama-3.2-1b": "Llama-3.2-1B"}[name]][0]
    cpu = torch.device("cpu")
    loaded = gpu.build_model("tiny", gpu.load_tokenizer(), cpu, torch.bfloat16)
    model, config = loaded.model, loaded.model.config.to_dict()
    assert roofline.param_count(config, tied=False) == sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    assert roofline.weights_read_per_step(model) == 2 * (sum(p.numel() for p in model.parameters()) - embedding.numel())
    with torch.no_grad():  # what a real cache holds per token
        cache = model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert roofline.kv_bytes_per_token(config, 2) == stored // 5
    model.lm_head.weight = model.get_input_embeddings().weight  # tied: the output projection reads it all
    assert roofline.weights_read_per_step(model) == 2 * sum(p.numel() for p in model.parameters())


def test_roofline_fraction_and_step_bytes_with_known_numbers():
    assert roofline.decode_step_bytes(1000, 10, [5, 7]) == 1120
    assert roofline.roofline_fraction(10.0, 1e9, 1e11) == pytest.approx(0.1)
    # concat at 64 x 2048 on the 8B shape: 15.0 GB of weights read (no input embedding) + 131,135 tokens' KV
    step = roofline.decode_step_bytes(16_060_522_496 - 1_050_673_152, 131072, [131_135])
    assert step == 15_009_849_344 + 17_188_126_720 == 32_197_976_064
    # 34 tok/s x 32.2 GB per step over 4.8 TB/s
    assert roofline.roofline_fraction(34.0, step, 4.8e12) == pytest.approx(0.228069, abs=1e-6)
    with pytest.raises(ValueError):
        roofline.roofline_fraction(1.0, 1.0, 0.0)
    assert roofline.spec_bandwidth("NVIDIA H200") == 4.8e12
    assert roofline.spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert roofline.spec_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert roofline.spec_bandwidth("NVIDIA L40S") == 0.864e12 and roofline.spec_bandwidth("NVIDIA L4") == 0.3e12
    assert roofline.spec_bandwidth("NVIDIA GeForce GTX 1080") is None and roofline.spec_bandwidth(None) is None


def test_a_decode_rate_is_put_against_the_bytes_its_steps_read():
    """65 rows: the mean step reads each row's cached tokens plus half the answer, and the weights once."""
    cpu = torch.device("cpu")
    bench = gpu.Bench(gpu.build_model("tiny", gpu.load_tokenizer(), cpu, torch.bfloat16), gpu.DRY, strict=True)
    bench.memo["bandwidth"] = {"device": "test", "measured": 1e9, "spec": 2e9}
    answer = Answer(text="", token_ids=[1] * 33, trace=[], timings={"tokens_per_s": 10.0}, documents=[], mode="pced")
    row = bench.decode_roofline(answer, rows=65, cached_tokens=1000)
    step = bench.weights_per_step + bench.kv_per_token * (1000 + 65 * 16)
    assert bench.kv_per_token == 2 * 2 * 2 * 16 * 2  # tiny: 2 layers x K,V x 2 kv heads x 16 dims x bf16
    assert row == {"decode_tokens_per_s": 10.0, "rows": 65, "cached_tokens": 1000, "gb_per_step": step / 1e9,
                   "roofline_fraction": pytest.approx(10.0 * step / 1e9),
                   "roofline_fraction_spec": pytest.approx(10.0 * step / 2e9)}


def test_the_summary_reads_the_headline_rows_with_their_ratios():
    """The H200 run's numbers in, its headline sentences out; a failed case says why."""
    shapes = gpu.FULL
    model = {"model": "llama-3.1-8b"}
    rows = [
        {**model, "section": "bandwidth", "device": "NVIDIA H200", "measured_gb_per_s": 4400.0,
         "spec_gb_per_s": 4800.0},
        {**model, "section": "pced", "documents": 64, "mode": "concat", "ttft_s": 17.509, "decode_tokens_per_s": 34.0,
         "gb_per_step": 32.2, "roofline_fraction": 0.249, "roofline_fraction_spec": 0.228},
        {**model, "section": "pced", "documents": 64, "mode": "pced warm", "ttft_s": 0.849,
         "ttft_speedup_vs_concat": 20.62, "decode_tokens_per_s": 14.5, "gb_per_step": 33.4, "roofline_fraction": 0.11},
        {**model, "section": "scheduler", "concurrent": 16, "serial_requests": 8, "serial_answers_per_s": 1.045,
         "concurrent_answers_per_s": 7.874, "speedup": 7.536},
        {**model, "section": "scheduler", "concurrent": 32, "skipped": "over budget: needs ~40 s"},
        {**model, "section": "ippd", "questions": 16, "method": "ippd", "answers_per_s": 8.68,
         "vs_prefix_cached": 0.429},
        {**model, "section": "ippd", "questions": 16, "method": "prefix-cached batch", "answers_per_s": 20.25},
        {**model, "section": "ape", "context_tokens": 32768, "mode": "concat", "ttft_s": 1.9},
        {**model, "section": "ape", "context_tokens": 32768, "mode": "ape cold (auto kernel)",
         "error": "InductorError('NoValidChoicesError')"},
        {**model, "section": "ape", "context_tokens": 32768, "mode": "ape warm (flex)", "ttft_s": 0.19,
         "prefill_speedup_vs_concat": 10.0},
        {**model, "section": "peer", "documents": 8, "mode": "transformers generate", "ttft_s": 0.567, "total_s": 2.662,
         "decode_tokens_per_s": 14.8},
        {**model, "section": "decode", "documents": 64, "answer_mode": "pced", "method": "eager step",
         "steps_per_s": 41.3, "speedup": 1.0, "first_call_s": 3.1},
        {**model, "section": "decode", "documents": 64, "answer_mode": "pced", "method": "compiled step (CUDA graphs)",
         "steps_per_s": 82.6, "speedup": 2.0, "first_call_s": 95.2},
        {**model, "section": "decode", "documents": 8, "answer_mode": "concat", "method": "eager step",
         "steps_per_s": 46.1, "speedup": 1.0, "first_call_s": 1.2},
        {**model, "section": "decode", "documents": 8, "answer_mode": "concat", "error": "RuntimeError('boom')"},
    ]
    table = {r["row"]: (r["value"], r["versus"]) for r in gpu.summary(rows, shapes)}
    assert table == {
        "PCED warm TTFT, 64 x 2048": ("0.849 s", "20.6x concat's TTFT (17.509 s)"),
        "concat decode, batch 1, 64 x 2048": ("34.0 tok/s", "0.25 of the bandwidth limit (32.2 GB per step; 0.23 of "
                                                            "the datasheet's)"),
        "PCED decode, 65 rows x ~2048 columns": ("14.5 steps/s", "0.11 of the bandwidth limit (33.4 GB per step)"),
        "16 concurrent PCED requests": ("7.87 answers/s", "7.5x serial (1.04 answers/s over 8 requests)"),
        "32 concurrent PCED requests": ("skipped", "over budget: needs ~40 s"),
        "IPPD, 16 questions": ("8.7 answers/s", "0.43x prefix-cached batching (20.2 answers/s)"),
        "APE prefill, 32k tokens, cold (auto kernel)": ("-", "error: InductorError('NoValidChoicesError')"),
        "APE prefill, 32k tokens, warm (flex)": ("0.190 s", "10.0x concat's prefill (1.900 s)"),
        "transformers generate, 8 x 2048": ("TTFT 0.567 s, total 2.662 s, 14.8 tok/s", ""),
        "memory bandwidth (NVIDIA H200)": ("4400 GB/s measured", "datasheet 4800 GB/s"),
        "compiled decode step, PCED, 65 rows": ("82.6 steps/s", "2.00x the eager step (41.3 steps/s); first call "
                                                                 "95.2 s"),
        "compiled decode step, concat, batch 1, 8 x 2048": ("-", "error: RuntimeError('boom')"),
    }


def test_the_users_memory_table_is_the_computed_one():
    """docs/gpu.md's table is :func:`roofline.memory_table`'s output, so a change of either shows here."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text(encoding="utf-8")
    assert roofline.memory_table() in page
    rows = {(r["model"], r["documents"]): r for r in roofline.memory_rows()}
    eight = rows[("Llama-3.1-8B", 64)]  # 64 x 2048 x 128 KiB = 16 GiB; 65 rows x 2560 columns x 128 KiB
    assert eight["kv_documents_gib"] == 16.0 and eight["kv_rows_gib"] == 65 * 2560 * 128 / 2**20
    assert rows[("Llama-3.2-1B", 8)]["kv_documents_gib"] == 0.5 and eight["kv_per_token_kib"] == 128


def test_compile_counts_see_a_graph_dynamo_compiles():
    import torch

    before = gpu.compile_counts()
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    finally:
        torch._dynamo.reset()
    after = gpu.compile_counts()
    assert after["graphs_compiled"] == before["graphs_compiled"] + 1
    assert after["cudagraph_skips"] == before["cudagraph_skips"]  # no CUDA graph on the CPU, none skipped
