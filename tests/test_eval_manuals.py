"""The ``manuals`` evaluation set: the shipped data's integrity, its build, the loader's kinds, gold and recall rule,
and ``eval --set manuals`` on the command line.

No model decodes here and no real embedder runs: the loader tests hand the set a retriever that returns the passages
each test chooses, so the gold ranks are known exactly.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctx_integrations.documents import Document
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation import load_set, manuals_set
from ctx_integrations.evaluation.manuals import (
    MANUALS_KINDS,
    PASSAGES_FILE,
    QUESTIONS_FILE,
    parse_kinds,
    read_manuals,
    stratified_sample,
)
from ctx_integrations.evaluation.metrics import bounded_match, normalize_answer, substring_match
from ctx_integrations.evaluation.nq import passage_text
from ctx_integrations.evaluation.runner import System, evaluate, retrieval_recall
from ctx_integrations.evaluation.sets import ABSTENTIONS

ROOT = Path(__file__).resolve().parents[1]
# the counts reached when the questions were keyed (docs/evaluation.md): a row lost is a test failure
AT_LEAST = {"single": 158, "two_doc": 60, "unanswerable": 109}


@pytest.fixture(scope="module")
def shipped():
    passages, questions = read_manuals()
    return {row["id"]: row for row in passages}, questions


def _build_tool():
    spec = importlib.util.spec_from_file_location("build_manuals_set", ROOT / "tools" / "build_manuals_set.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_manuals_set", module)
    spec.loader.exec_module(module)
    return module


# -- the data --------------------------------------------------------------------------------------------------
def test_the_shipped_questions_are_well_formed_and_counted(shipped):
    passages, questions = shipped
    ids = [q["id"] for q in questions]
    assert len(ids) == len(set(ids)) and len({q["question"] for q in questions}) == len(questions)
    counts = {kind: sum(q["kind"] == kind for q in questions) for kind in MANUALS_KINDS}
    assert all(counts[kind] >= AT_LEAST[kind] for kind in MANUALS_KINDS), counts
    for q in questions:
        assert all(g in passages for g in q["gold_passages"]), q["id"]
        if q["kind"] == "unanswerable":
            assert q["answers"] == [] and q["gold_passages"] == [] and 1 <= len(q["absent"]) <= 3, q["id"]
        else:
            assert q["answers"] and q["absent"] == [], q["id"]
            assert len(q["gold_passages"]) == (1 if q["kind"] == "single" else 2), q["id"]
    assert len({row["id"] for row in passages.values()}) == len(passages) == 1130


def test_no_answer_is_found_in_its_own_question(shipped):
    """A comparison answered by one of the names it asks about ("fold or fmt?" -> fold) scores any answer that
    repeats the question: such questions are not in the set."""
    _, questions = shipped
    assert [q["id"] for q in questions if q["answers"] and bounded_match(q["question"], q["answers"])] == []


def test_every_single_answer_is_in_its_gold_passage(shipped):
    passages, questions = shipped
    for q in (q for q in questions if q["kind"] == "single"):
        text = passage_text(passages[q["gold_passages"][0]])
        assert any(normalize_answer(a) for a in q["answers"]), q["id"]
        for answer in q["answers"]:  # SQuAD-normalised, and as the scorer (bounded_match) reads it
            assert normalize_answer(answer) in normalize_answer(text), (q["id"], answer)
            assert bounded_match(text, [answer]) == 1.0, (q["id"], answer)


def test_every_two_doc_fact_is_in_its_own_passage(shipped):
    passages, questions = shipped
    for q in (q for q in questions if q["kind"] == "two_doc"):
        assert [pid for pid, _ in q["facts"]] == q["gold_passages"] and len(set(q["gold_passages"])) == 2, q["id"]
        for pid, fact in q["facts"]:
            assert fact and fact in passages[pid]["text"], (q["id"], pid, fact)
        if q["answers"][0][0].isdigit():  # a computed answer is not a number either passage states
            assert not any(bounded_match(passage_text(passages[pid]), q["answers"]) for pid in q["gold_passages"]), \
                q["id"]


def test_no_absent_string_occurs_anywhere_in_the_corpus(shipped):
    passages, questions = shipped
    corpus = "\n".join(passage_text(row) for row in passages.values()).lower()
    absent = [(q["id"], s) for q in questions for s in q["absent"]]
    assert len(absent) >= AT_LEAST["unanswerable"]
    assert [pair for pair in absent if pair[1].lower() in corpus] == []


def test_passages_fit_the_evaluation_models_512_tokens(shipped):
    passages, _ = shipped
    texts = [passage_text(row) for row in passages.values()]
    # a sanity bound that needs no tokenizer (it catches a build that split nothing: the longest is ~2,300 chars)
    assert max(len(t) for t in texts) < 4096
    assert not any("PREAMBLE" in t or "ADDENDUM: How to use this License" in t for t in texts)  # no GFDL text
    tool = _build_tool()
    if not tool.tokenizer_file().is_file():
        pytest.skip("the evaluation model (ctx-experts models fetch qwen2.5-coder-0.5b) is not converted here")
    count = tool.fast_counter()
    assert max(count(t) for t in texts) <= 512


def test_the_build_regenerates_the_shipped_passages():
    tool = _build_tool()
    info = Path("/usr/share/info")
    if not (info / "grep.info.gz").is_file() or not (info / "time.info.gz").is_file() or \
            not tool.tokenizer_file().is_file():
        pytest.skip("needs /usr/share/info and the converted evaluation model")
    count = tool.fast_counter()
    some = (("grep", "grep"), ("time", "time"))  # two manuals: the whole build takes seconds
    rows = tool.build(info, count, manuals=some)
    shipped = [json.loads(line) for line in gzip.decompress(PASSAGES_FILE.read_bytes()).decode().splitlines()]
    assert rows == [r for r in shipped if r["id"].split("/")[0] in ("grep", "time")]
    assert tool.encode(rows) == tool.encode(tool.build(info, count, manuals=some))  # byte for byte
    assert rows[0]["id"] == "grep/top/1" and all(r["title"].startswith(("grep: ", "time: ")) for r in rows)


def test_info_text_loses_menus_markers_and_underlines_but_keeps_a_paragraph_after_a_menu():
    tool = _build_tool()
    body = ("1.1 Heading\n***********\n\nSee *note Block size::, and *note Other: (file)Node.\n"
            "\x00\x08[index\x00\x08]\n* Menu:\n\n* Entry::   what it is\n\n   A last remark, after the menu.\n"
            "***************\n")  # a diff's hunk separator, not an underline: not the length of the line above
    assert tool.plain_text(body) == ("1.1 Heading\n\nSee Block size, and see Other.\n\n"
                                     "   A last remark, after the menu.\n***************")


# -- the loader ------------------------------------------------------------------------------------------------
class ChosenRetriever:
    """A retriever that returns, for each question, the passages a test chose (then the corpus's first ones)."""

    def __init__(self, questions, chosen, fill):
        self.ids = {q["question"]: q["id"] for q in questions}
        self.chosen, self.fill = chosen, fill

    def retrieve(self, question, top_k):
        ids = list(self.chosen.get(self.ids[question], []))
        ids += [f for f in self.fill if f not in ids]
        return [Document(f"text of {pid}", id=pid, score=1.0 - 0.1 * i) for i, pid in enumerate(ids[:top_k])]


def test_the_loader_gives_each_kind_its_gold_and_counts_two_doc_only_when_both_are_retrieved(shipped):
    passages, questions = shipped
    one = next(q for q in questions if q["kind"] == "single")
    both, half = [q for q in questions if q["kind"] == "two_doc"][:2]
    none = next(q for q in questions if q["kind"] == "unanswerable")
    fill = [pid for pid in passages if not any(pid in q["gold_passages"] for q in (one, both, half))][:4]
    chosen = {one["id"]: [fill[0], one["gold_passages"][0]],  # gold second
              both["id"]: [both["gold_passages"][1], fill[0], both["gold_passages"][0]],  # ranks 3 and 1
              half["id"]: [half["gold_passages"][0]]}  # the other gold passage is missed
    examples = manuals_set(None, None, top_k=4, retriever=ChosenRetriever(questions, chosen, fill))
    assert len(examples) == len(questions) and [e.id for e in examples] == [q["id"] for q in questions]
    by_id = {e.id: e for e in examples}
    single, two, partial, unanswerable = (by_id[q["id"]] for q in (one, both, half, none))
    assert single.kind == "single" and single.gold == (1,) and single.meta["gold_rank"] == 2
    assert two.gold == (0, 2) and two.meta["gold_ranks"] == [3, 1] and two.meta["gold_rank"] == 3
    assert two.meta["all_gold_retrieved"] is True and two.answers == tuple(both["answers"])
    assert partial.gold == (0,) and partial.meta["gold_ranks"] == [1, None]
    assert partial.meta["gold_rank"] is None and partial.meta["all_gold_retrieved"] is False
    assert unanswerable.answers == ABSTENTIONS and unanswerable.gold == () and "gold_rank" not in unanswerable.meta
    assert {e.meta.get("answer_match") for e in examples if e.kind != "unanswerable"} == {"bounded"}
    assert unanswerable.meta["answer_match"] == "abstention"
    # recall over the three: the single at k >= 2, the two_doc at k >= 3, the half-retrieved one never
    recall = retrieval_recall([single, two, partial, unanswerable])
    assert recall == pytest.approx({"recall@1": 0, "recall@2": 1 / 3, "recall@3": 2 / 3, "recall@4": 2 / 3})
    assert all(len(e.documents) == 4 for e in examples)


def test_the_sample_is_seeded_stratified_and_restricted_to_the_kinds(shipped):
    _, questions = shipped
    def kinds_of(picked):
        return [sum(questions[i]["kind"] == k for i in picked) for k in MANUALS_KINDS]

    picked = stratified_sample(questions, 24, MANUALS_KINDS, seed=0)
    assert kinds_of(picked) == [8, 8, 8] and picked == sorted(picked)
    assert picked == stratified_sample(questions, 24, MANUALS_KINDS, seed=0)
    assert picked != stratified_sample(questions, 24, MANUALS_KINDS, seed=1)
    assert kinds_of(stratified_sample(questions, 7, ("single", "two_doc"), seed=3)) == [4, 3, 0]
    few = [q for q in questions if q["kind"] != "two_doc"] + [q for q in questions if q["kind"] == "two_doc"][:2]
    taken = [few[i]["kind"] for i in stratified_sample(few, 30, MANUALS_KINDS, seed=0)]
    assert len(taken) == 30 and taken.count("two_doc") == 2 and taken.count("single") == 14  # a short kind's share
    assert len(stratified_sample(questions, None, ("unanswerable",), seed=0)) == AT_LEAST["unanswerable"]


def test_bad_kinds_files_and_rows_are_refused_by_name(tmp_path, shipped):
    with pytest.raises(InvalidOptionError, match="unknown question kind 'bogus'.*single, two_doc, unanswerable"):
        parse_kinds("single,bogus")
    with pytest.raises(InvalidOptionError, match="no question kind"):
        parse_kinds(" , ")
    assert parse_kinds("unanswerable,single") == ("single", "unanswerable")
    with pytest.raises(InvalidOptionError, match="not found"):
        read_manuals([tmp_path / "missing.jsonl", QUESTIONS_FILE])
    passages, questions = shipped
    good = questions[0]
    for change, message in (({"kind": "multi_hop"}, "kind 'multi_hop'"),
                            ({"gold_passages": ["nope/1"]}, "'nope/1' is not in the passages file"),
                            ({"gold_passages": []}, "needs answers and one gold passage"),
                            ({"answers": "-i"}, "must be lists")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({**good, **change}) + "\n")
        with pytest.raises(InvalidOptionError, match=message):
            read_manuals([PASSAGES_FILE, bad])
    twice = tmp_path / "twice.jsonl"
    twice.write_text((json.dumps(good) + "\n") * 2)
    with pytest.raises(InvalidOptionError, match="repeated"):
        read_manuals([twice, PASSAGES_FILE])
    with pytest.raises(InvalidOptionError, match="reads two files"):
        load_set("manuals", path=str(PASSAGES_FILE))
    with pytest.raises(InvalidOptionError, match="kinds is an option of the manuals set"):
        load_set("world", kinds="single")
    with pytest.raises(InvalidOptionError, match="unknown question kind"):
        load_set("manuals", kinds="single,other")


# -- scoring ---------------------------------------------------------------------------------------------------
def test_bounded_match_finds_options_and_numbers_only_as_written():
    assert substring_match("Just ignore it.", ["-i"]) == 1.0  # why the set does not use substring_match
    assert bounded_match("Just ignore it.", ["-i"]) == 0.0
    assert bounded_match("Use ‘-i’.", ["-i"]) == 1.0 and bounded_match("use -iv", ["-i"]) == 0.0
    assert bounded_match("The -A option", ["-a"]) == 0.0 and bounded_match("status 12", ["2"]) == 0.0
    assert bounded_match("It exits with 2.", ["2"]) == 1.0
    assert bounded_match("the difference", ["diff"]) == 0.0 and bounded_match("Use diff.", ["diff"]) == 1.0
    assert bounded_match("set DU_BLOCK_SIZE", ["BLOCK_SIZE"]) == 0.0
    assert bounded_match("set ‘BLOCK_SIZE’", ["BLOCK_SIZE"]) == 1.0
    assert bounded_match("--Ignore-Case", ["--ignore-case"]) == 0.0 and bounded_match("x", ["", " "]) == 0.0


class ScriptedEngine:
    """Answers every question with the text a test chose (no model): what ``evaluate`` reads of an engine."""

    modes = ("concat",)
    loaded = SimpleNamespace(name="scripted", dtype="torch.float32", tokenizer=None)

    def __init__(self, replies):
        self.replies = replies

    def warm(self, documents):
        pass

    def generate(self, question, documents, **options):
        text = self.replies.get(question.split(" Cite the")[0], "x")
        return SimpleNamespace(text=text, token_ids=[1], cache_hits=0, cache_misses=0, trace=[],
                               timings={"ttft_s": 0.1, "total_s": 0.2, "tokens_per_s": 5.0})


def test_the_runner_scores_manuals_answers_bounded_and_abstentions_as_the_world_set_does(shipped):
    passages, questions = shipped
    one = next(q for q in questions if q["kind"] == "single" and q["answers"][0] == "-i")
    none = next(q for q in questions if q["kind"] == "unanswerable")
    fill = list(passages)[:4]
    examples = [e for e in manuals_set(None, None, top_k=2, retriever=ChosenRetriever(questions, {}, fill))
                if e.id in (one["id"], none["id"])]
    engine = ScriptedEngine({one["question"]: "I think it is ignored.", none["question"]: "That is not mentioned."})
    report = evaluate(engine, examples, systems=[System("concat [n]", "concat", cites="brackets")],
                      max_new_tokens=2, set_name="manuals")
    em = {r["example"]: r["substring_em"] for r in report.records}
    assert em == {one["id"]: 0.0, none["id"]: 1.0}
    engine.replies[one["question"]] = "Use -i."
    report = evaluate(engine, examples, systems=[System("concat [n]", "concat", cites="brackets")],
                      max_new_tokens=2, set_name="manuals")
    assert {r["example"]: r["substring_em"] for r in report.records}[one["id"]] == 1.0


# -- the command line ------------------------------------------------------------------------------------------
def test_eval_cli_reads_set_manuals_with_kinds_and_refuses_a_bad_kind(monkeypatch, capsys):
    import ctx_integrations.evaluation as evaluation
    from ctx_integrations.cli import main

    seen = {}

    def fake_load_set(name, *args, **kwargs):
        seen.update(kwargs, name=name)
        raise InvalidOptionError("stopped before the model loads")

    monkeypatch.setattr(evaluation, "load_set", fake_load_set)
    assert main(["eval", "--set", "manuals", "--kinds", "single,two_doc", "--questions", "6", "--seed", "2"]) == 2
    assert seen == {"name": "manuals", "path": None, "n_questions": 6, "seed": 2, "top_k": None, "store_dir": None,
                    "kinds": "single,two_doc"}
    assert "stopped before the model loads" in capsys.readouterr().err
    assert main(["eval", "--set", "manuals", "--kinds", "single,multi_hop"]) == 2
    assert "unknown question kind 'multi_hop'" in capsys.readouterr().err
    assert main(["eval", "--set", "world", "--kinds", "single"]) == 2
    assert "--kinds is an option of --set manuals" in capsys.readouterr().err
    assert main(["eval", "--set", "manuals", "--gold-retrieved-only"]) == 2
    assert "option of --set nq" in capsys.readouterr().err


def test_the_default_store_is_the_sets_own_folder_under_the_cache(tmp_path, monkeypatch, shipped):
    import ctx_integrations.retrieval.retriever as retriever_module
    import ctx_integrations.retrieval.store as store_module
    from ctx_integrations.evaluation.nq import corpus_key

    opened = {}

    class FakeStore:
        def __init__(self, folder, embedder=None, collection=None):
            opened.update(folder=Path(folder), collection=collection)

        def add(self, documents, warm=True):
            opened["documents"] = len(documents)

    class FakeRetriever:
        def __init__(self, store):
            pass

        def retrieve(self, question, top_k):
            return []

    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store_module, "DocumentStore", FakeStore)
    monkeypatch.setattr(retriever_module, "ScoredRetriever", FakeRetriever)
    examples = manuals_set(None, 3)
    passages, _ = read_manuals()
    assert opened == {"folder": tmp_path / "eval" / f"manuals-{corpus_key(passages)}",
                      "collection": "manuals_passages", "documents": 1130}
    assert [e.kind for e in examples] == sorted((e.kind for e in examples), key=MANUALS_KINDS.index) and \
        {e.kind for e in examples} == set(MANUALS_KINDS)


def test_the_licence_the_passages_are_offered_under_ships_beside_them():
    """The GFDL asks a modified version to carry the licence's unaltered text (section 4, I)."""
    from ctx_integrations.evaluation.manuals import DATA

    text = (DATA / "GFDL-1.3.txt").read_text(encoding="utf-8")
    assert text.lstrip().startswith("GNU Free Documentation License") and "Version 1.3, 3 November 2008" in text
    assert "`GFDL-1.3.txt`" in (DATA / "README.md").read_text(encoding="utf-8")
