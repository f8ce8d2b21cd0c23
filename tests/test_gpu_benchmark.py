"""``benchmarks/gpu.py --dry-run``: the GPU benchmark's code runs end to end at tiny shapes on CPU.

The GPU numbers come from a lent GPU (docs/gpu.md); this keeps the script from rotting in between and
checks what every row must satisfy whatever the timings: each section and case is present, nothing
failed, ratios are computed against the same run's baseline, and IPPD's answers equal the
prefix-cached batch's answers token for token (fp32).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu


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
    assert [(r["documents"], r["method"].split()[0]) for r in decode] == [
        (n, m) for n in shapes.decode_streams for m in ("dynamic", "static")]
    assert all(r["steps_per_s"] > 0 and r["first_call_s"] > 0 for r in decode)


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
