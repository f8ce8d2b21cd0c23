"""The replay of a PCED answer (``evaluation/diagnosis.py``) is the engine's own run: on a tiny float32 model, the
rule fed with teacher-forced streams picks every token the engine picked, names the expert the engine's trace
names, and carries the engine's beta; the question's log-likelihood is the one PCED's ``query_likelihood`` reads."""

from __future__ import annotations

import pytest

from ctx_integrations import Document, Engine
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.diagnosis import replay_pced, stream_ids
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
