"""benchmarks/kv_formats.py on a tiny random model: the bytes it reports, the disk check it must enforce, its JSON.

The tiny model has head_dim 64 (as SmolLM2 and Qwen2.5), so the per-entry and per-token overheads of the
entry files (token ids, header, int8's scales) weigh about what they weigh for real models.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_formats
from ctx_integrations import Engine
from ctx_integrations.evaluation import default_systems, evaluate, load_set
from tests.helpers import tiny_loaded


def _tiny():
    return tiny_loaded("llama", seed=3, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def engines(tmp_path):
    made = kv_formats.format_engines(_tiny(), tmp_path / "kv", None)
    yield made
    for engine in made.values():
        engine.close()


def test_bytes_per_token_and_read_back_errors(engines):
    documents = kv_formats.load_documents(engines["native"], 2, 64)
    rows = {r["format"]: r for r in kv_formats.measure_tiers(engines, documents, 1, lambda _: None)}
    assert set(rows) == set(kv_formats.FORMATS)
    assert rows["int8"]["disk_vs_native"] < 0.3
    assert rows["fp16"]["disk_vs_native"] == pytest.approx(0.5, abs=0.02)
    assert rows["bf16"]["disk_vs_native"] == pytest.approx(0.5, abs=0.02)
    native_fp32 = 2 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    assert rows["native"]["theory_B_per_token"] == native_fp32
    for row in rows.values():
        # the files hold the KV plus headers and token ids: never less than the theory, never much more
        assert row["theory_B_per_token"] <= row["disk_B_per_token"] <= row["theory_B_per_token"] * 1.15 + 16
        assert row["memory_B_per_token"] == native_fp32 and row["memory_vs_native"] == 1.0  # decoded to fp32
        assert row["compute_ms_per_doc"] > 0 and row["disk_ms_per_doc"] > 0 and row["memory_ms_per_doc"] > 0
    assert rows["native"]["kv_rel_rms"] == 0 and rows["native"]["kv_max_abs"] == 0
    assert 0 < rows["fp16"]["kv_rel_rms"] < rows["bf16"]["kv_rel_rms"] < 0.01  # bf16 keeps 8 mantissa bits, fp16 11
    assert 0 < rows["int8"]["kv_rel_rms"] < 0.02


def test_a_pass_not_read_from_disk_is_refused(engines):
    examples = load_set("secret_code", engines["native"], n_questions=2, document_tokens=32)
    texts = list(dict.fromkeys(d.text for e in examples for d in e.documents))
    kv_formats.write_formats(engines, texts)
    report, counts = kv_formats.evaluate_from_disk(engines["int8"], examples, "pced", 2)
    assert counts == {"disk_hits": len(texts), "memory_hits": 0, "host_hits": 0, "misses": 0}
    assert len(report.records) == 2
    # the same pass again without emptying the memory tier: every hit is a memory hit, which measures nothing
    with pytest.raises(kv_formats.NotFromDiskError, match="0 of 8 documents read from disk"):
        kv_formats.evaluate_from_disk(engines["int8"], examples, "pced", 2, clear_memory=False)
    # an engine whose folder has no entries computes them (misses): refused too
    other = load_set("secret_code", engines["native"], n_questions=1, document_tokens=32, seed=5)
    with pytest.raises(kv_formats.NotFromDiskError, match="misses"):
        kv_formats.evaluate_from_disk(engines["fp16"], other, "pced", 2)


def test_native_from_disk_answers_as_fresh_entries(engines, tmp_path):
    """Native entries read back are bit for bit the computed ones, so the answers equal a memory-only engine's."""
    examples = load_set("world", n_questions=2)
    kv_formats.write_formats(engines, list(dict.fromkeys(d.text for e in examples for d in e.documents)))
    from_disk, _ = kv_formats.evaluate_from_disk(engines["native"], examples, "pced", 6)
    fresh_engine = Engine(engines["native"].loaded)  # same model (same scheduler), no disk tier
    try:
        fresh = evaluate(fresh_engine, examples, ["pced"], max_new_tokens=6,
                         systems=default_systems(["pced"], baselines=False, pced_ablation=False))
    finally:
        fresh_engine.close()
    assert [r["text"] for r in from_disk.records] == [r["text"] for r in fresh.records]
    assert all(r["cache_misses"] == 0 for r in from_disk.records)


def test_main_writes_every_format_with_the_tables_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_formats, "load", lambda model: _tiny())
    output = tmp_path / "kv_formats.json"
    kv_formats.main(["--quick", "--output", str(output)])
    payload = json.loads(output.read_text())
    assert payload["benchmark"] == "kv_formats" and payload["environment"]["torch"]
    settings = payload["settings"]
    assert settings["date"] and settings["threads"] >= 1 and "cpu" in settings
    assert "load average" in settings["load"]["before"] and "load average" in settings["load"]["after"]
    tiers = [r for r in payload["rows"] if r["table"] == "tiers"]
    accuracy = [r for r in payload["rows"] if r["table"] == "accuracy"]
    assert [r["format"] for r in tiers] == list(kv_formats.FORMATS)
    assert all(set(kv_formats.TIERS_BYTES_COLUMNS + kv_formats.TIERS_TIME_COLUMNS) <= set(r) for r in tiers)
    assert {(r["set"], r["format"]) for r in accuracy} == {(s, f) for s in kv_formats.SETS for f in kv_formats.FORMATS}
    assert all(set(kv_formats.ACCURACY_COLUMNS) <= set(r) for r in accuracy)
    for row in accuracy:
        assert row["questions"] == 2 and len(row["answers"]) == 2
        assert row["misses"] == 0 and row["disk_hits"] == 8  # 2 questions x 4 documents, each read back once
        if row["format"] == "native":
            assert row["differ_vs_native"] == 0 and row["delta_em"] == 0 and row["em_within_one_question"]


def test_formats_always_include_native_first():
    assert kv_formats.parse_args(["--formats", "int8,fp16"]).formats == ["native", "fp16", "int8"]
    assert kv_formats.parse_args([]).formats == list(kv_formats.FORMATS)
    with pytest.raises(SystemExit):
        kv_formats.parse_args(["--formats", "int4"])
