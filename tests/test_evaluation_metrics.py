"""Answer and citation metrics against hand-computed values, and the evaluation sets' invariants."""

from __future__ import annotations

import json
import re

import pytest

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation import (
    abstains,
    best_f1,
    bracket_citations,
    citation_precision,
    citation_recall,
    load_set,
    musique_set,
    normalize_answer,
    substring_match,
    token_f1,
    world_set,
)
from ctx_integrations.evaluation.metrics import mean_defined
from ctx_integrations.evaluation.runner import score_answer
from ctx_integrations.evaluation.sets import ABSTENTIONS, KINDS


def test_squad_normalisation_drops_case_punctuation_and_articles():
    assert normalize_answer("The  Cat's hat, an  Apple!") == "cats hat apple"


def test_token_f1_matches_hand_computation():
    # pred [red, house], gold [red, barn]: 1 common token, P = R = 1/2, F1 = 1/2
    assert token_f1("the red house", "a red barn") == pytest.approx(0.5)
    # pred [ilsa, brenn, is, mayor] vs gold [ilsa, brenn]: P = 2/4, R = 1, F1 = 2/3
    assert token_f1("Ilsa Brenn is mayor.", "Ilsa Brenn") == pytest.approx(2 / 3)
    assert token_f1("nothing", "Ilsa Brenn") == 0.0
    assert best_f1("Ilsa Brenn is mayor.", ["Brenn", "Ilsa Brenn"]) == pytest.approx(2 / 3)
    assert best_f1("anything", []) == 0.0


def test_substring_match_normalises_both_sides():
    assert substring_match("It was founded by Ilsa Brenn, in 1900.", ["ilsa brenn"]) == 1.0
    assert substring_match("It was founded by Ilsa.", ["Ilsa Brenn"]) == 0.0
    assert substring_match("anything", ["", "the"]) == 0.0  # an empty normalised answer matches nothing


ABSTAINING = [
    "The documents do not mention the default value.",
    "Based on the information provided, the default value is not specified in the documents.",
    "The information provided does not specify the default.",
    "The provided text doesn't say which unit it takes.",
    "The given documents don\u2019t contain that.",  # a typographic apostrophe
    "This is not covered in the passages above.",
    "does not have a direct answer in the given documents",  # the one real abstention of the 2026-12-02 template run
    "There is no information about the founder of Braxel Corp.",
    "It is not mentioned.",
    "The founder of Braxel is unknown.",
    "I cannot answer this question from the given documents.",
    "The answer cannot be determined from the context.",
    "I don't know.",
    "There is no such option in ls.",
    "ls does not have a --max-entries option.",
    "grep has no --fuzzy-match option.",
    "The --verify-checksum option does not exist in cp.",
    "It is not a valid option of tail.",
]
ANSWERING = [  # invented answers, some in the negative: what the former list of phrases counted as abstentions
    "Based on the information provided, the `--json` option does not output any differences.",
    "sort --frobnicate does not have any effect.",
    "If not specified, the default is 10 seconds.",
    "The -i option cannot be combined with -v.",
    "Based on the information provided, the default is 4.",
    "Based on the documents, wget does not retry by default.",
    "It does not follow symbolic links in the documents directory.",
    "The program reads data from the input text and does not modify it.",
    "The option is not supported by busybox.",
    "It is not specified by POSIX.",
    "The founder of Braxel Corp is Tom Reed.",
    "",
]


@pytest.mark.parametrize("text", ABSTAINING)
def test_abstains_on_a_statement_that_the_documents_do_not_answer(text):
    assert abstains(text) == 1.0
    assert abstains(text.upper().replace(" ", "  \n")) == 1.0  # case and white space do not matter


@pytest.mark.parametrize("text", ANSWERING)
def test_abstains_not_on_an_answer_in_the_negative(text):
    assert abstains(text) == 0.0


def test_unanswerable_questions_are_scored_by_abstention_and_the_rest_by_their_answers():
    world = world_set(24, documents=4, seed=1)
    unanswerable = next(e for e in world if e.kind == "unanswerable")
    single = next(e for e in world if e.kind == "single_hop")
    assert score_answer(unanswerable, "The documents do not say who founded it.") == 1.0
    assert score_answer(unanswerable, "It was founded by Tom Reed, who does not live there.") == 0.0
    assert score_answer(unanswerable, "It was founded by someone who cannot be named.") == 0.0
    assert score_answer(single, f"The answer is {single.answers[0]}.") == 1.0
    assert score_answer(single, "The documents do not say.") == 0.0


def test_citation_precision_and_recall_are_undefined_where_they_divide_by_zero():
    assert citation_precision([0, 2], [2, 3]) == pytest.approx(0.5)
    assert citation_recall([0, 2], [2, 3]) == pytest.approx(0.5)
    assert citation_precision([2], [2, 3]) == 1.0 and citation_recall([2], [2, 3]) == 0.5
    assert citation_precision([], [1]) is None  # citing nothing is not perfect precision
    assert citation_recall([1], []) is None and citation_precision([1], []) == 0.0  # unanswerable: any cite is wrong
    assert mean_defined([1.0, None, 0.0]) == 0.5 and mean_defined([None]) is None


def test_bracket_citations_reads_valid_markers_once_in_order():
    assert bracket_citations("See [2] and [1, 3][9] and [2].", 3) == [1, 0, 2]
    assert bracket_citations("no markers", 3) == []


def test_world_set_is_seeded_and_sized():
    first, again, other = world_set(8, documents=5, seed=3), world_set(8, documents=5, seed=3), world_set(8, seed=4)
    assert [e.to_dict() for e in first] == [e.to_dict() for e in again]
    assert [e.question for e in first] != [e.question for e in other]
    assert [e.kind for e in first] == list(KINDS) * 2
    assert all(len(e.documents) == 5 for e in first)
    long_docs = world_set(4, documents=3, document_tokens=200)
    short_docs = world_set(4, documents=3, document_tokens=40)
    for e in long_docs:
        assert all(140 <= len(d.text.split()) <= 175 for d in e.documents)  # ~200 tokens at ~1.3 tokens a word
    assert all(len(d.text.split()) <= 45 for e in short_docs for d in e.documents)
    assert all(0.3 <= d.score <= 0.95 for e in first for d in e.documents)
    assert len({d.id for e in first for d in e.documents}) == 8 * 5


def test_world_gold_answers_are_in_the_gold_documents_and_nowhere_for_unanswerable():
    for example in world_set(24, documents=4, seed=1):
        gold_texts = [example.documents[i].text for i in example.gold]
        if example.kind == "unanswerable":
            assert example.gold == () and example.answers == ABSTENTIONS
            subject = re.match(r"Who founded (.+)\?", example.question).group(1)
            assert not any(subject in d.text for d in example.documents)
        elif example.kind == "single_hop":
            assert len(gold_texts) == 1 and example.answers[0] in gold_texts[0]
        elif example.kind == "two_hop":  # the answer in one gold document, the bridge entity in both
            company = re.match(r"In which town does the founder of (.+) live\?", example.question).group(1)
            assert len(gold_texts) == 2
            assert sum(example.answers[0] in t for t in gold_texts) == 1
            assert sum(company in t for t in gold_texts) == 1
            founder = re.search(r"founded by (\w+ \w+)", next(t for t in gold_texts if company in t)).group(1)
            assert founder in next(t for t in gold_texts if company not in t)
        else:
            assert len(gold_texts) == 2 and [a in t for a, t in zip(example.answers, gold_texts)] in (
                [True, True], [False, False])
            assert {a for a in example.answers for t in gold_texts if a in t} == set(example.answers)
        non_gold = [d.text for i, d in enumerate(example.documents) if i not in example.gold]
        if example.kind != "unanswerable":
            assert not any(a in t for a in example.answers for t in non_gold)


@pytest.mark.parametrize("kwargs", [dict(n_questions=0), dict(documents=1), dict(document_tokens=4),
                                    dict(kinds=("nonsense",))])
def test_world_set_refuses_bad_sizes(kwargs):
    with pytest.raises(InvalidOptionError):
        world_set(**kwargs)


def test_musique_set_reads_the_file_and_refuses_a_missing_one(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    rows = [{"id": f"q{i}", "question": f"Q{i}?", "answers": ["A"], "documents": ["d0", "d1", "d2"]} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples = musique_set(path, 2)
    assert [e.id for e in examples] == ["q0", "q1"] and not examples[0].has_gold
    assert [d.score for d in examples[0].documents] == [1.0, 0.95, 0.9]
    with pytest.raises(InvalidOptionError, match="not found"):
        musique_set(tmp_path / "missing.jsonl")
    monkeypatch.delenv("CTX_MUSIQUE", raising=False)
    with pytest.raises(InvalidOptionError, match="CTX_MUSIQUE"):  # no default outside the repository
        musique_set()
    monkeypatch.setenv("CTX_MUSIQUE", str(path))
    assert [e.id for e in musique_set(n_questions=1)] == ["q0"]
    with pytest.raises(InvalidOptionError, match="unknown evaluation set"):
        load_set("squad")
    with pytest.raises(InvalidOptionError, match="needs the engine"):
        load_set("secret_code")
