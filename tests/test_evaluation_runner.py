"""``evaluate`` and ``ctx-experts eval`` on tiny random models (mechanics), and once on the embedded model."""

from __future__ import annotations

import json

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core.citations import cited_documents
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation import evaluate, load_set, markdown_table, secret_code_set, world_set, write_report
from ctx_integrations.evaluation.runner import BRACKET_SYSTEM, CITE_ALL_SYSTEM, PCED_NO_PRIOR
from tests.helpers import run_cli, tiny_loaded


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine(tiny_loaded("llama", seed=1))


def test_evaluate_scores_every_example_with_every_system(tiny, tmp_path):
    examples = world_set(2, documents=3, document_tokens=24)
    report = evaluate(tiny, examples, ["pced", "single", "ape"], max_new_tokens=3, set_name="tiny")
    systems = ["pced", "single", "ape", PCED_NO_PRIOR, BRACKET_SYSTEM, CITE_ALL_SYSTEM]
    assert [row["system"] for row in report.rows] == systems
    assert len(report.records) == len(examples) * len(systems)
    for record in report.records:
        example = next(e for e in examples if e.id == record["example"])
        if record["system"] == CITE_ALL_SYSTEM:  # cites every retrieved document, answers nothing
            assert record["cited"] == [0, 1, 2] and record["substring_em"] is None
            assert record["citation_precision"] == pytest.approx(len(example.gold) / 3)
        else:
            assert record["ttft_s"] > 0 and 1 <= record["new_tokens"] <= 3
        if record["system"] == "single":  # single's only source is the top-scored document
            top = max(range(3), key=lambda i: example.documents[i].score)
            assert record["cited"] == [top] and record["cache_hits"] == 1
        if record["system"] == "ape":  # attribution on: every answer cites something
            assert record["cited"]
    pced = next(r for r in report.rows if r["system"] == "pced")
    mine = [r for r in report.records if r["system"] == "pced"]
    assert pced["f1"] == pytest.approx(sum(r["f1"] for r in mine) / 2)
    assert pced["cache_hits"] == 3  # warm store: one hit per document
    table = markdown_table(report)
    assert table.splitlines()[0].startswith("| system | examples | substring_em | f1 | citation_precision")
    assert "| cite all | 2 | - | - |" in table
    paths = write_report(report, tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][0]["system"] == "pced"
    assert paths["quality_plot"].stat().st_size > 1000 and paths["citation_plot"].is_file()


def test_the_bracket_baseline_reads_its_own_markers(tiny, monkeypatch):
    examples = world_set(1, documents=2, document_tokens=24)
    seen = {}

    def fake_generate(query, documents, **kwargs):
        seen["query"], seen["documents"] = query, [d.text for d in documents]
        return real("x", documents[:1], mode="single", max_new_tokens=1)

    real = tiny.generate
    monkeypatch.setattr(tiny, "generate", fake_generate)
    from ctx_integrations.evaluation.runner import System, _answer

    record = _answer(tiny, examples[0], System(BRACKET_SYSTEM, "concat", cites="brackets"), 4, 0.25)
    assert seen["query"].endswith("like [1].") and seen["documents"][1].startswith("[2] ")
    assert record["cited"] == []  # the tiny model wrote no [n] marker


def test_evaluate_refuses_unknown_modes_and_empty_sets(tiny):
    with pytest.raises(InvalidOptionError, match="unknown mode"):
        evaluate(tiny, world_set(1), ["pcde"])
    with pytest.raises(InvalidOptionError, match="at least one example"):
        evaluate(tiny, [], ["pced"])


def test_secret_code_set_has_exact_lengths_and_the_code_in_the_needle(tiny):
    examples = secret_code_set(tiny.layout, 2, documents=3, document_tokens=40, seed=5)
    for example in examples:
        assert all(len(tiny.layout.context_ids(d.text)) == 40 for d in example.documents)
        (needle,) = example.gold
        assert [example.answers[0] in d.text for d in example.documents] == [i == needle for i in range(3)]
    assert load_set("secret_code", tiny, n_questions=1, documents=2, document_tokens=40)[0].kind == "secret_code"


def test_rapid_answers_cite_the_drafters_chunks(tiny):
    docs = ["The vault code is 4721 and it opens the north door.", "Bread is baked daily in the town."]
    answer = tiny.generate("What is the vault code?", docs, mode="rapid", max_new_tokens=6, draft_context_tokens=8,
                           chunk_tokens=8, ranking="bm25")
    drafted_from = sorted({c["document"] for c in answer.extra["chunks"]})
    cited = cited_documents(answer.citations(tiny.loaded.tokenizer, threshold=0.01))
    assert set(cited) <= set(drafted_from)
    assert bool(cited) == any(answer.extra["drafted_tokens"])


def test_eval_cli_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, *a, **k: Engine(tiny_loaded("llama"))))
    out = tmp_path / "out"
    assert run_cli("eval", "--set", "world", "--questions", "2", "--documents", "2", "--document-tokens", "24",
                   "--modes", "pced,concat", "--max-new-tokens", "2", "--output", str(out), "--no-plots") == 0
    printed = capsys.readouterr().out
    assert "set world: 2 questions" in printed and "| pced | 2 |" in printed and "| concat [n] | 2 |" in printed
    assert sorted(p.name for p in out.iterdir()) == ["world.json", "world.md", "world.records.jsonl"]
    assert run_cli("eval", "--modes", "pcde") == 2
    assert "unknown mode 'pcde'" in capsys.readouterr().err
    calls = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: calls.append(k) or generate(self, *a, **k))
    assert run_cli("eval", "--set", "world", "--questions", "1", "--documents", "2", "--document-tokens", "24",
                   "--modes", "soft_nbce", "--variant", "soft_nbce:rule=nbce_code:rho=0.8", "--no-baselines",
                   "--max-new-tokens", "2", "--output", str(out), "--no-plots") == 0
    printed = capsys.readouterr().out
    assert "| soft_nbce | 1 |" in printed and "| soft_nbce rule=nbce_code rho=0.8 | 1 |" in printed
    import json

    rows = {row["system"]: row for row in json.loads((out / "world.json").read_text())["rows"]}
    assert set(rows) == {"soft_nbce", "soft_nbce rule=nbce_code rho=0.8"}
    variant_calls = [k for k in calls if k.get("rule") == "nbce_code"]
    assert variant_calls and all(k["rho"] == 0.8 and k["mode"] == "soft_nbce" for k in variant_calls)
    assert any(k["mode"] == "soft_nbce" and "rule" not in k and k["max_new_tokens"] == 2 for k in calls)
    for bad, message in (("soft_nbce", "names no option"), ("soft_nbce:gama=1", "does not accept gama"),
                         ("pcde:gamma=1", "unknown mode 'pcde'"), ("pced:gamma", "not KEY=VALUE")):
        assert run_cli("eval", "--variant", bad) == 2
        assert message in capsys.readouterr().err
    assert run_cli("eval", "--set", "musique", "--data", str(tmp_path / "none.jsonl")) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_on_the_embedded_model(embedded_engine):
    examples = world_set(1, documents=3, document_tokens=40, kinds=("single_hop",), seed=2)
    report = evaluate(embedded_engine, examples, ["pced", "single"], max_new_tokens=20, baselines=False,
                      pced_ablation=False)
    pced = next(r for r in report.rows if r["system"] == "pced")
    assert pced["cache_hits"] == 3 and pced["ttft_s"] > 0 and pced["tokens_per_s"] > 0
    # an invented single-hop fact (greedy, fp32: deterministic): read off and cited to its one document
    assert pced["substring_em"] == 1.0 and pced["citation_precision"] == 1.0 and pced["citation_recall"] == 1.0


def test_citation_precision_on_supported_questions_leaves_out_the_unanswerable():
    """An unanswerable question has no gold support: citing anything there scores precision 0, which the
    plain mean counts and the supported-only mean leaves out."""
    from ctx_integrations.evaluation.runner import System, summarize

    base = dict(system="pced", substring_em=0.0, f1=0.0, citation_recall=None)
    records = [dict(base, example="a", kind="unanswerable", gold=[], cited=[1], citation_precision=0.0),
               dict(base, example="b", kind="single_hop", gold=[0], cited=[0, 1], citation_precision=0.5),
               dict(base, example="c", kind="single_hop", gold=[2], cited=[2], citation_precision=1.0)]
    row = summarize(records, [System("pced", "pced")])[0]
    assert row["citation_precision"] == pytest.approx(0.5)
    assert row["citation_precision_supported"] == pytest.approx(0.75)
