"""The ``nq`` evaluation set: real retrieval over a passage corpus, gold ranks, recall@k, and ``eval --set nq``.

Runs on a 12-passage slice of the NQ-open corpus shipped in tests/data (4 questions), with tiny random models
for the answers; the library's default embedder (MiniLM) retrieves in the CLI test, a table embedder that
places every passage exactly where a test wants it in the others.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from ctx_integrations import Engine
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation import load_set, markdown_table, nq_set, recall_at_k
from ctx_integrations.evaluation.nq import passage_text, read_nq
from ctx_integrations.evaluation.runner import evaluate, retrieval_recall
from tests.helpers import run_cli, tiny_loaded

DATA = Path(__file__).parent / "data"
PASSAGES, QUESTIONS = DATA / "nq_slice_passages.jsonl", DATA / "nq_slice_questions.jsonl.gz"


def _rows(path: Path) -> list[dict]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


class PlacingEmbedder:
    """Vectors that put, for every question, the passages in a chosen order: passage ``i`` of the corpus sits
    at angle ``ranks[question][passage]`` from the question, so the retriever's ranking is known exactly."""

    name, identity, dimension, spec = "placing", "placing:1", 64, None

    def __init__(self, passages: list[dict], questions: list[dict], order: dict[str, list[str]]):
        self.texts = {passage_text(p): i for i, p in enumerate(passages)}
        self.questions = {q["question"]: q["id"] for q in questions}
        self.order = order  # question id -> passage ids, best first (the rest come after, in file order)
        self.ids = [p["id"] for p in passages]

    def embed_documents(self, texts):
        return np.stack([np.eye(self.dimension, dtype=np.float32)[self.texts[t]] for t in texts])

    def embed_query(self, text):
        ranked = self.order[self.questions[text]] + [i for i in self.ids if i not in self.order[self.questions[text]]]
        vector = np.zeros(self.dimension, np.float32)
        for place, pid in enumerate(ranked):
            vector[self.ids.index(pid)] = 1.0 - 0.05 * place
        return vector / np.linalg.norm(vector)


@pytest.fixture()
def placed(tmp_path):
    passages, questions = _rows(PASSAGES), _rows(QUESTIONS)
    # q0001's gold first, q0005's third, q0006's gold never in the top 3, q0012's second
    order = {"nq-q0001": ["nq-p0001"], "nq-q0005": ["nq-p0000", "nq-p0003", "nq-p0005"],
             "nq-q0006": ["nq-p0000", "nq-p0003", "nq-p0007"], "nq-q0012": ["nq-p0014", "nq-p0012"]}
    return PlacingEmbedder(passages, questions, order), tmp_path / "store"


def test_retrieval_finds_each_gold_passage_where_the_retriever_ranked_it(placed):
    embedder, store = placed
    examples = nq_set([PASSAGES, QUESTIONS], None, top_k=3, store_dir=store, embedder=embedder)
    by_id = {e.id: e for e in examples}
    assert [e.id for e in examples] == ["nq-q0001", "nq-q0005", "nq-q0006", "nq-q0012"]  # the file's order
    assert [by_id[q].meta["gold_rank"] for q in by_id] == [1, 3, None, 2]
    assert [by_id[q].gold for q in by_id] == [(0,), (2,), (), (1,)]
    assert [by_id[q].kind for q in by_id] == ["gold_retrieved", "gold_retrieved", "gold_missed", "gold_retrieved"]
    first = by_id["nq-q0005"]
    assert [d.id for d in first.documents] == ["nq-p0000", "nq-p0003", "nq-p0005"]
    scores = [d.score for d in first.documents]
    assert scores == sorted(scores, reverse=True) and all(0.5 < s < 1 for s in scores)  # r = (cos + 1) / 2
    assert first.documents[0].scores["dense"] == pytest.approx(2 * scores[0] - 1, abs=1e-6)
    assert first.documents[0].text.startswith("Title: ")
    assert first.answers == ("Xiu Li Dai", "Dai Xiuli", "Dai Yongge", "Yongge Dai")
    assert retrieval_recall(examples) == {"recall@1": 0.25, "recall@2": 0.5, "recall@3": 0.75}


def test_the_sample_is_seeded_and_gold_retrieved_only_skips_the_misses(placed):
    embedder, store = placed
    def ids(**options):
        return [e.id for e in nq_set([QUESTIONS, PASSAGES], top_k=3, store_dir=store, embedder=embedder, **options)]

    assert ids(n_questions=2, seed=3) == ids(n_questions=2, seed=3)
    samples = {tuple(ids(n_questions=2, seed=seed)) for seed in range(6)}
    assert len(samples) > 1 and all(len(s) == 2 for s in samples)
    assert ids(n_questions=4, gold_retrieved_only=True) == ["nq-q0001", "nq-q0005", "nq-q0012"]
    assert "nq-q0006" not in ids(n_questions=3, gold_retrieved_only=True, seed=1)


def test_recall_at_k_counts_ranks_and_misses():
    assert recall_at_k([1, 2, None, 4], 4) == {"recall@1": 0.25, "recall@2": 0.5, "recall@3": 0.5, "recall@4": 0.75}
    assert recall_at_k([], 3) == {}


def test_bad_nq_files_are_refused_by_name(tmp_path):
    with pytest.raises(InvalidOptionError, match="two files"):
        read_nq([PASSAGES])
    with pytest.raises(InvalidOptionError, match="one file of passages"):
        read_nq([PASSAGES, PASSAGES])
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "x", "question": "q", "answers": ["a"]}\n')
    with pytest.raises(InvalidOptionError, match="one file of passages"):
        read_nq([PASSAGES, other])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "x", "title": "t", "text": "a"}\nnot json\n')
    with pytest.raises(InvalidOptionError, match="line 2 is not JSON"):
        read_nq([broken, QUESTIONS])
    with pytest.raises(InvalidOptionError, match="not found"):
        read_nq([tmp_path / "missing.jsonl", QUESTIONS])
    orphan = tmp_path / "orphan.jsonl"
    orphan.write_text(json.dumps({"id": "q", "question": "q?", "answers": ["a"], "gold_passage": "nope"}) + "\n")
    with pytest.raises(InvalidOptionError, match="not in the passages file"):
        nq_set([PASSAGES, orphan], store_dir=tmp_path / "s")
    with pytest.raises(InvalidOptionError, match="two files"):
        load_set("nq", path=str(PASSAGES))
    with pytest.raises(InvalidOptionError, match="options of the nq set"):
        load_set("world", top_k=3)


def test_evaluate_reports_recall_and_gold_ranks(placed):
    embedder, store = placed
    examples = nq_set([PASSAGES, QUESTIONS], 2, seed=0, top_k=3, store_dir=store, embedder=embedder)
    engine = Engine(tiny_loaded("llama", seed=1))
    report = evaluate(engine, examples, ["pced", "single"], max_new_tokens=2, baselines=False, pced_ablation=False,
                      set_name="nq")
    assert report.settings["retrieval"] == retrieval_recall(examples)
    assert "retriever: recall@1" in markdown_table(report)
    for record in report.records:
        example = next(e for e in examples if e.id == record["example"])
        assert record["gold_rank"] == example.meta["gold_rank"] and len(record["trace"]) == record["new_tokens"]
        if record["system"] == "single":  # single cites the top-ranked passage: precision 1 iff it is the gold one
            assert record["citation_precision"] == (1.0 if example.meta["gold_rank"] == 1 else 0.0)
    row = next(r for r in report.rows if r["system"] == "pced")
    assert row["ttft_median_s"] > 0 and row["total_median_s"] >= row["ttft_median_s"]


def test_eval_cli_nq_retrieves_with_the_default_embedder_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, *a, **k: Engine(tiny_loaded("llama"))))
    out, store = tmp_path / "out", tmp_path / "store"
    common = ("eval", "--set", "nq", "--data", str(PASSAGES), str(QUESTIONS), "--questions", "2", "--top-k", "3",
              "--store", str(store), "--max-new-tokens", "2", "--output", str(out), "--no-plots", "--no-baselines")
    assert run_cli(*common, "--modes", "pced,single") == 0
    printed = capsys.readouterr().out
    assert "set nq: 2 questions" in printed and "| pced | 2 |" in printed and "retriever: recall@1" in printed
    report = json.loads((out / "nq.json").read_text())
    assert set(report["settings"]["retrieval"]) == {"recall@1", "recall@2", "recall@3"}
    records = [json.loads(line) for line in (out / "nq.records.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["system"] for r in records} == {"pced", "single"}
    for record in records:  # gold support is the gold passage's place among the retrieved ones, if retrieved
        assert record["gold"] == ([record["gold_rank"] - 1] if record["gold_rank"] else [])
    calls = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: calls.append(k) or generate(self, *a, **k))
    assert run_cli(*common, "--modes", "pced,single", "--variant", "pced:prior=rank", "--resume") == 0
    assert "resuming: 4 answers kept" in capsys.readouterr().out
    answered = [k for k in calls if k.get("max_new_tokens") == 2]
    assert len(answered) == 2 and all(k.get("prior") == "rank" for k in answered)  # only the new system ran
    rows = {r["system"]: r for r in json.loads((out / "nq.json").read_text())["rows"]}
    assert rows["pced"]["examples"] == rows["pced prior=rank"]["examples"] == 2
    assert len((out / "nq.records.jsonl").read_text().splitlines()) == 6
    assert run_cli(*common, "--modes", "pced") == 0  # without --resume the records file starts again
    assert len((out / "nq.records.jsonl").read_text().splitlines()) == 2
    assert run_cli("eval", "--set", "world", "--top-k", "3") == 2
    assert "options of --set nq" in capsys.readouterr().err
