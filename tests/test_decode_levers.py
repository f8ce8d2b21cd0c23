"""The decode-lever benchmark (``benchmarks/decode_levers.py``) on a tiny random model: what it measures, not speeds.

What each test would catch is named beside it: a quality measure that compares a lever with itself
(or the reference with another lever), a prefix agreement that keeps counting after the first
difference, a static-cache decode with positions off by one, an int4 packing with the wrong zero
convention, a speedup taken against another repeat, row count or run, a missing lever that crashes the
run instead of reporting itself skipped, and a llama.cpp row read from the wrong thread count.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks import decode_levers as levers
from benchmarks.decode_levers import (
    COLUMNS,
    REFERENCE,
    Decoder,
    Int4Linear,
    LeverRun,
    Plan,
    Prepared,
    common_prefix,
    greedy,
    lever_rows,
    llama_bench_row,
    run_levers,
)
from tests.helpers import greedy_reference, tiny_loaded

TINY = Plan(rows=(1, 2), context=8, warmup_steps=1, steps=1, repeats=2, new_tokens=6)


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded("llama", seed=0)


@pytest.fixture
def no_torchao(monkeypatch):
    """torchao not importable, whatever this machine has (``None`` in ``sys.modules`` makes import raise)."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)


def test_reference_agrees_with_itself_and_int8_does_not_match_it_exactly(tiny, no_torchao):
    # a quality measure reading the reference's own answers for every lever, or an int8 lever that
    # quantised nothing (returning the fp32 model), would give int8 a zero error here
    asked = ["int8-dynamic-per-channel", REFERENCE]
    runs = {run.name: run for run in run_levers(tiny, asked, TINY, log=lambda _: None)}
    assert list(runs) == [REFERENCE, "int8-dynamic-per-channel"]  # the reference runs first whatever the order asked
    reference = runs[REFERENCE].quality
    assert reference.reference_tokens > 0
    assert reference.agreed_tokens == reference.reference_tokens
    assert reference.max_abs_dlogit == reference.max_abs_dlogit_steps == 0.0
    assert runs["int8-dynamic-per-channel"].quality.max_abs_dlogit > 0
    for run in runs.values():  # every repeat of every row count timed, each first warm-up kept
        assert {rows: len(ms) for rows, ms in run.ms.items()} == {1: 2, 2: 2}
        assert set(run.warmup_s) == {1, 2} and run.prepare_s is not None


def test_each_repeat_starts_with_the_next_lever_so_load_bursts_do_not_always_hit_the_reference(tiny, no_torchao,
                                                                                              monkeypatch):
    # a timing loop that always starts with the reference (what it did) puts every burst of a shared machine's
    # load at the start of a repeat on the reference, the denominator of every ratio
    monkeypatch.setattr(levers, "time_decode", lambda *args, **kwargs: (1.0, 0.0))
    lines: list[str] = []
    plan = Plan(rows=(1,), context=8, warmup_steps=1, steps=1, repeats=3, new_tokens=2)
    run_levers(tiny, [REFERENCE, "int8-dynamic-per-channel"], plan, log=lines.append)
    timed = [line.split()[:2] for line in lines if line.startswith("  r=")]
    assert timed == [["r=0", REFERENCE], ["r=0", "int8-dynamic-per-channel"],
                     ["r=1", "int8-dynamic-per-channel"], ["r=1", REFERENCE],
                     ["r=2", REFERENCE], ["r=2", "int8-dynamic-per-channel"]]


def test_greedy_equals_transformers_generate_on_both_cache_kinds():
    # the eager static-cache path (what the compiled lever runs, without compiling) must decode as generate:
    # a cache position off by one, or a reset that leaves the last prompt's keys, changes these tokens
    # (on a model whose answers move with positions: the default tiny model's barely do)
    tiny = tiny_loaded("llama", seed=0, position_sensitive=True)
    prompts = levers.demo_prompts(tiny.tokenizer)[:2]
    eos = set(tiny.eos_token_ids)
    for static in (False, True):
        decoder = Decoder(Prepared(tiny.model, tiny.model.forward, static_cache=static),
                          max_len=max(map(len, prompts)) + 8)
        for prompt in prompts:  # the second prompt reuses (resets) the static cache of the first
            tokens, logits = greedy(decoder, prompt, 8, eos)
            assert [t for t in tokens if t not in eos] == greedy_reference(tiny, prompt, 8)
            with torch.inference_mode():
                expected = tiny.model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
            torch.testing.assert_close(torch.stack(logits), expected, atol=1e-3, rtol=1e-4)


def test_a_resumed_context_steps_as_its_own_prefill_would():
    # the timed steps start from keys and values copied in: a copy that left the cache short (steps over
    # one token instead of the context are faster, and wrong) or put layers out of order changes these logits
    tiny = tiny_loaded("llama", seed=0, position_sensitive=True)
    context = levers.context_keys_values(tiny.model, rows=2, length=12, seed=3)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, tiny.model.config.vocab_size, (2, 12), generator=generator)  # the same ids
    token = torch.tensor([[5], [7]])
    for static in (False, True):
        decoder = Decoder(Prepared(tiny.model, tiny.model.forward, static_cache=static), max_len=20)
        decoder.prefill(ids)
        expected = decoder.step(token)
        decoder.resume(context)
        torch.testing.assert_close(decoder.step(token), expected)


def test_logit_error_covers_the_decode_steps_not_only_the_prefill(tiny):
    # a lever whose steps differ but whose prefill does not (a compiled step after an eager prefill) must
    # show it: here every step's logits are shifted by 0.5, which leaves every argmax, so the answers agree
    def shifted(**kwargs):
        out = tiny.model.forward(**kwargs)
        out.logits = out.logits + 0.5
        return out

    prompts = levers.demo_prompts(tiny.tokenizer)[:1]
    eos = set(tiny.eos_token_ids)
    max_len = len(prompts[0]) + 8
    reference = [greedy(Decoder(Prepared(tiny.model, tiny.model.forward), max_len), prompts[0], 6, eos)]
    quality = levers.measure_quality(Decoder(Prepared(tiny.model, shifted), max_len), prompts, reference, 6, eos)
    assert quality.agreed_tokens == quality.reference_tokens == 6
    assert quality.max_abs_dlogit == 0.0
    assert quality.max_abs_dlogit_steps == pytest.approx(0.5, abs=1e-4)


def test_common_prefix_stops_at_the_first_difference():
    # counting equal positions instead would give 2 for the first case
    assert common_prefix([1, 9, 3], [1, 2, 3]) == 1
    assert common_prefix([1, 2], [1, 2, 3]) == 2  # a lever stopping early (EOS) agrees on what it said
    assert common_prefix([1, 2, 3, 4], [1, 2, 3]) == 3  # never more than the reference's tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_exact_on_weights_already_in_4_bit_groups(dtype):
    # weights of the form min + q * scale per group of 32 (the GGUF's Q4_1) must come back as they were:
    # a zero point of ``min`` instead of ``min + 8 * scale``, or scales laid out [out, groups], fails
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 16, 64
    low = torch.randn(out_features, in_features // 32, 1, generator=generator).to(dtype).float()
    scale = (torch.rand(out_features, in_features // 32, 1, generator=generator) * 0.1 + 0.01).to(dtype).float()
    steps = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=generator)
    steps[..., 0], steps[..., 1] = 0, 15  # as in Q4_1: every group's min and max are on its grid's ends
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_((low + steps * scale).reshape(out_features, in_features))
    x = torch.randn(3, 5, in_features, generator=generator)
    expected = linear(x)
    got = Int4Linear(linear, dtype)(x.to(dtype)).float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.1  # bf16 activations round the products
    torch.testing.assert_close(got, expected.detach(), atol=tolerance * expected.abs().max().item(), rtol=0)


def test_speedup_is_the_median_of_same_repeat_ratios_per_row_count():
    # repeat 0: reference 10 ms, lever 5 ms (2x); repeat 1: both 20 ms (1x) -> median 1.5. A ratio of
    # medians gives 1.2, one taken against the other row count's reference or inverted gives others
    reference = LeverRun(REFERENCE, 0.0, {1: 0.1, 8: 0.2}, {1: [10.0, 20.0], 8: [100.0, 100.0]})
    lever = LeverRun("lever", 1.0, {1: 0.1, 8: 0.2}, {1: [5.0, 20.0], 8: [25.0, 50.0]})
    rows = {(r["lever"], r["rows"]): r for r in lever_rows([lever, reference], (1, 8))}
    assert rows[("lever", 1)]["speedup_vs_fp32_eager"] == pytest.approx(1.5)
    assert rows[("lever", 8)]["speedup_vs_fp32_eager"] == pytest.approx(3.0)
    assert rows[(REFERENCE, 1)]["speedup_vs_fp32_eager"] == 1.0
    assert rows[("lever", 8)]["tok_s"] == pytest.approx(8 * 1000 / 37.5)  # rows per median step
    assert rows[("lever", 8)]["ms_per_repeat"] == [25.0, 50.0]  # in the order they ran


def peer_json(path, rows):
    path.write_text(json.dumps({"benchmark": "peer_llamacpp", "settings": {"baseline": "llama.cpp b11434"},
                                "rows": rows}))
    return path


def test_llama_bench_row_is_the_decode_test_at_the_asked_threads(tmp_path):
    path = peer_json(tmp_path / "peer.json", [
        {"table": "raw", "threads": 1, "test": "prefill pp512", "system": "llama-bench", "tok_s": 143.0},
        {"table": "raw", "threads": 1, "test": "decode tg128", "system": "ours (model)", "tok_s": 19.0},
        {"table": "raw", "threads": 2, "test": "decode tg128", "system": "llama-bench", "tok_s": 156.0},
        {"table": "raw", "threads": 1, "test": "decode tg128", "system": "llama-bench", "tok_s": 94.5, "runs": 2}])
    row = llama_bench_row(path, 1)
    assert row["tok_s"] == 94.5 and row["ms_per_step"] == pytest.approx(1000 / 94.5)
    assert "earlier run: peer.json" in row["lever"] and row.get("speedup_vs_fp32_eager") is None
    with pytest.raises(ValueError, match="threads there: \\[1, 2\\]"):
        llama_bench_row(path, 4)


def test_json_has_every_lever_with_the_table_fields_and_a_skipped_torchao(tmp_path, monkeypatch, tiny, no_torchao):
    # a missing optional package must not crash the run, and must say how to install it
    import ctx_integrations.engine.core.model

    monkeypatch.setattr(ctx_integrations.engine.core.model, "load_model", lambda *a, **k: tiny)
    peer = peer_json(tmp_path / "peer.json", [
        {"table": "raw", "threads": 1, "test": "decode tg128", "system": "llama-bench", "tok_s": 94.5}])
    output = tmp_path / "levers.json"
    asked = [REFERENCE, "int8-dynamic-per-tensor", "torchao-int8-weight-only"]
    levers.main(["--quick", "--levers", ",".join(asked), "--rows", "1", "--context", "8", "--new-tokens", "4",
                 "--llama-bench-json", str(peer), "--output", str(output)])
    payload = json.loads(output.read_text())
    rows = payload["rows"]
    assert [r["lever"] for r in rows[:3]] == asked and "llama.cpp" in rows[3]["lever"]
    assert all(set(COLUMNS) <= set(r) for r in rows)
    measured, skipped = rows[1], rows[2]
    assert measured["status"] == "ok" and measured["ms_per_step"] > 0 and measured["agreement"].count("/") == 1
    assert skipped["status"].startswith("skipped") and levers.TORCHAO_PIP in skipped["status"]
    assert skipped["ms_per_step"] is None and skipped["agreement"] is None
    settings = payload["settings"]
    assert settings["threads"] == 1 and settings["date"] and settings["torchao"] is None
    assert len(settings["load_average"]["before"]) == 3 and payload["environment"]["torch"] == torch.__version__


@pytest.mark.slow
def test_compiled_lever_answers_as_the_reference(tiny):
    # inductor over the static cache: a graph that kept one step's cache position as a constant, or read
    # the cache it wrote before, shows here as diverging answers
    runs = run_levers(tiny, [REFERENCE, "fp32-compiled"], Plan(rows=(1,), context=8, warmup_steps=1, steps=2,
                                                               repeats=1, new_tokens=8), log=lambda _: None)
    compiled = runs[1].quality
    assert compiled.agreed_tokens == compiled.reference_tokens
    assert compiled.max_abs_dlogit_steps < 1e-3
