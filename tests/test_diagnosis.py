"""The replay of a PCED answer (``evaluation/diagnosis.py``) is the engine's own run: on a tiny float32 model, the
rule fed with teacher-forced streams picks every token the engine picked, names the expert the engine's trace
names, and carries the engine's beta; the question's log-likelihood is the one PCED's ``query_likelihood`` reads."""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Document, Engine
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.diagnosis import grounding, replay_pced, stream_ids
from tests.helpers import tiny_loaded

QUESTION = "Which option makes the program quiet?"
DOCS = [Document("The -q option makes the program quiet and prints nothing.", score=0.9),
        Document("Use -v for verbose output; it prints every file.", score=0.8),
        Document("Exit status is 0 on success and 2 on trouble.", score=0.7)]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=11))


@pytest.mark.parametrize("options", [{}, {"prior": "paper", "gamma": 2.5}, {"beta": 0.5, "gamma": 0.0}])
def test_the_replay_reproduces_the_engines_answer_winners_and_beta(engine, options):
    answer = engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=12, query_likelihood=0.0, **options)
    replay = replay_pced(engine, QUESTION, DOCS, answer.token_ids, **options)
    assert [s.token for s in replay.steps] == answer.token_ids
    assert replay.agreement == 1.0
    assert [s.winner for s in replay.steps] == [step.document for step in answer.trace]
    assert replay.beta == pytest.approx(answer.extra["beta"], abs=1e-5)
    assert all(s.margin >= 0 for s in replay.steps) and len(replay.steps[0].best) == len(DOCS)


def test_the_question_likelihood_is_the_one_pced_weighs(engine):
    answer = engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=8, query_likelihood=0.2)
    replay = replay_pced(engine, QUESTION, DOCS, answer.token_ids, query_likelihood=0.2)
    assert replay.question_loglik == pytest.approx(answer.extra["query_loglik"], abs=1e-3)
    assert replay.agreement == 1.0 and [s.winner for s in replay.steps] == [step.document for step in answer.trace]
    plain = replay_pced(engine, QUESTION, DOCS, answer.token_ids)
    assert replay.prior != pytest.approx(plain.prior)  # the likelihood re-ranked the prior the rule added
    assert replay.amateur_question_loglik < 0


def test_streams_are_laid_out_as_the_engine_lays_them(engine):
    prompts = stream_ids(engine.layout, QUESTION, [d.text for d in DOCS])
    layout = engine.layout
    assert prompts[0] == layout.prefix_ids + layout.suffix_ids(QUESTION)
    assert prompts[2] == layout.prefix_ids + layout.context_ids(DOCS[1].text) + layout.suffix_ids(QUESTION)


def test_a_replay_needs_documents_and_an_answer(engine):
    with pytest.raises(InvalidOptionError, match="at least one document"):
        replay_pced(engine, QUESTION, [], [1])
    with pytest.raises(InvalidOptionError, match="at least one token"):
        replay_pced(engine, QUESTION, DOCS, [])


def test_grounding_scores_each_answer_token_on_the_stream_that_produced_it(engine):
    # `single` decodes greedily from the top document's stream: each of its tokens is that stream's most likely one,
    # so its teacher-forced log-probability there is the row's maximum (an answer shifted by one position, or a
    # stream laid out otherwise than the engine's, breaks that), and a gain is that minus the context-free stream's.
    answer = engine.generate(QUESTION, DOCS, mode="single", max_new_tokens=8)
    reading = grounding(engine, QUESTION, DOCS, answer.token_ids)
    prompts = stream_ids(engine.layout, QUESTION, [d.text for d in DOCS])
    ids = torch.tensor([prompts[1] + answer.token_ids])
    with torch.no_grad():
        best = torch.log_softmax(engine.loaded.model(input_ids=ids).logits[0, len(prompts[1]) - 1:-1].float(), -1)
    assert [row[0] for row in reading.per_document] == pytest.approx(best.max(-1).values.tolist(), abs=1e-5)
    assert len(reading.context_free) == len(reading.pieces) == len(answer.token_ids)
    assert reading.gains() == pytest.approx([max(r) - f for r, f in zip(reading.per_document, reading.context_free)])
    assert all(free < 0 for free in reading.context_free)
    with pytest.raises(InvalidOptionError, match="at least one document"):
        grounding(engine, QUESTION, [], [1])


def test_the_grounding_tool_scores_answer_words_and_ranks_kinds_by_auc():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "grounding_scores", Path(__file__).resolve().parents[1] / "tools" / "grounding_scores.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    row = {"question": "Which option makes grep quiet?", "gains": [5.0, 0.0, 2.0, 1.0],
           "pieces": [" grep", ",", " -q", " option"]}
    scores = tool.scores(row)  # "grep" and "option" are the question's words, "," no content
    assert scores["answer all"] == 2.0 and scores["content all"] == pytest.approx(8 / 3)
    assert scores["all tokens"] == 2.0
    assert tool.auc([3.0, 2.0], [1.0, 2.0]) == pytest.approx((1 + 1 + 1 + 0.5) / 4)
