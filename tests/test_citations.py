"""Sentence citations from hand-made traces, each mode's token sources, and APE's attention-mass attribution."""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Document, Engine
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.citations import (
    cited_documents,
    is_content,
    sentence_citations,
    sentence_spans,
    token_sources,
)
from ctx_integrations.engine.core.decoding import TraceStep
from ctx_integrations.engine.modes.ape import document_mass
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import embedded_tokenizer, tiny_loaded

PIECES = ["Ilsa", " Brenn", " is", " the", " mayor", ".", " She", " won", " in", " 2019", "."]


def test_content_tokens_skip_stop_words_and_punctuation():
    assert [is_content(p) for p in PIECES] == [True, True, False, False, True, False, False, True, False, True, False]


def test_sentences_end_at_terminal_punctuation_before_whitespace_or_the_end():
    assert sentence_spans(PIECES) == [(0, 6), (6, 11)]
    assert sentence_spans(["It", " is", " 3", ".", "5", " m", "."]) == [(0, 7)]  # "3.5" does not split
    assert sentence_spans(["A", "\n", "B"]) == [(0, 2), (2, 3)]
    assert sentence_spans([" ", "\n"]) == []


def test_a_document_is_cited_where_it_wins_enough_of_a_sentences_content_tokens():
    # sentence 1 content tokens: Ilsa, Brenn, mayor -> doc 0 wins Ilsa and mayor (2/3), doc 1 wins Brenn (1/3)
    # sentence 2 content tokens: won, 2019 -> doc 2 wins won (1/2); 2019 came from the context-free stream
    sources = [(0,), (1,), (), (), (0,), (), (), (2,), (), (), ()]
    first, second = sentence_citations(PIECES, sources, threshold=0.5)
    assert first.text == "Ilsa Brenn is the mayor." and (first.start, first.end) == (0, 6)
    assert first.documents == (0,) and first.shares == pytest.approx({0: 2 / 3, 1: 1 / 3})
    assert second.documents == (2,) and second.shares == pytest.approx({2: 0.5})
    lower = sentence_citations(PIECES, sources, threshold=0.3)
    assert lower[0].documents == (0, 1)  # largest share first
    assert cited_documents(lower) == [0, 1, 2]
    none = sentence_citations(PIECES, [()] * len(PIECES))
    assert all(c.documents == () for c in none)


def test_a_sentence_without_content_tokens_is_judged_on_all_its_tokens():
    (citation,) = sentence_citations(["Yes", "."], [(1,), ()], threshold=0.5)
    assert citation.documents == (1,) and citation.shares == {1: 0.5}


def test_sentence_citations_refuses_mismatched_input():
    with pytest.raises(InvalidOptionError, match="token texts"):
        sentence_citations(["a"], [])
    with pytest.raises(InvalidOptionError, match="threshold"):
        sentence_citations(["a"], [()], threshold=0)


def _trace(documents, ids=None):
    return [TraceStep(100 + i if ids is None else ids[i], d, 0.0) for i, d in enumerate(documents)]


def test_token_sources_per_mode():
    assert token_sources(_trace([0, None, 2]), 3, {}) == [(0,), (), (2,)]
    rapid = {"drafted_tokens": [True, False, True], "chunks": [{"document": 2}, {"document": 0}, {"document": 2}]}
    assert token_sources(_trace([None] * 3), 3, rapid) == [(0, 2), (), (0, 2)]
    assert token_sources(_trace([None] * 2), 3, {"attribution": "context"}) == [(0, 1, 2)] * 2


def test_answer_citations_decode_with_the_tokenizer():
    tokenizer = embedded_tokenizer()
    ids = tokenizer("Ilsa Brenn is the mayor. She won.", add_special_tokens=False)["input_ids"]
    docs = [Document("a", id="a"), Document("b", id="b")]
    answer = Answer("Ilsa Brenn is the mayor. She won.", ids, _trace([0] * len(ids), ids), {}, docs, "pced")
    citations = answer.citations(tokenizer)
    assert [c.text for c in citations] == ["Ilsa Brenn is the mayor.", "She won."]
    assert all(c.documents == (0,) for c in citations)
    ippd = Answer(answer.text, ids, _trace([None] * len(ids), ids), {}, docs, "ippd", extra={"attribution": "context"})
    assert cited_documents(ippd.citations(tokenizer)) == [0, 1]


def test_document_mass_sums_the_merged_attention_per_block():
    # 1 batch, 1 KV head, 2 query heads (groups), q_len 2; 6 document keys in blocks [0, 2) and [2, 6).
    p = torch.zeros(1, 1, 4, 6)
    p[0, 0, 1] = torch.tensor([0.5, 0.5, 0, 0, 0, 0])  # group 0, last query: all on block 0
    p[0, 0, 3] = torch.full((6,), 1 / 6)  # group 1, last query: uniform
    p[0, 0, 0] = p[0, 0, 2] = torch.tensor([0, 0, 0, 0, 0, 1.0])  # first query rows: ignored
    weight = torch.tensor([1.0, 1.0, 1.0, 0.5]).reshape(1, 1, 4, 1)  # group 1's documents weigh 0.5 in the merge
    mass = document_mass(p, weight, (2, 6), groups=2, q_len=2)
    # block 0: (1 + 0.5 * 2/6) / 2, block 1: (0 + 0.5 * 4/6) / 2
    assert mass.tolist() == pytest.approx([(1 + 0.5 * 2 / 6) / 2, (0.5 * 4 / 6) / 2])


def test_ape_attribution_names_a_document_per_token_without_changing_the_answer():
    engine = Engine(tiny_loaded("llama", seed=2))
    docs = ["The vault code is 4721.", "Paris is the capital of France and a large city.", "Bread is baked daily."]
    plain = engine.generate("What is the code?", docs, mode="ape", max_new_tokens=6, attribution=False)
    traced = engine.generate("What is the code?", docs, mode="ape", max_new_tokens=6, attribution=True)
    assert traced.token_ids == plain.token_ids and len(traced.token_ids) == 6
    assert all(step.document is None for step in plain.trace) and "attention_mass" not in plain.extra
    masses = traced.extra["attention_mass"]
    assert len(masses) == len(traced.trace)
    for step, shares in zip(traced.trace, masses):
        assert sum(shares) == pytest.approx(1, abs=1e-3) and len(shares) == 3
        assert step.document == max(range(3), key=shares.__getitem__)
        assert step.score == pytest.approx(shares[step.document], abs=1e-3)
