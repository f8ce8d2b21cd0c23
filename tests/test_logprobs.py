"""Log-probabilities per token (``SamplingParams.logprobs``): the chosen token's and the most likely alternatives',
from the scores each mode picks from (softmax of its fused scores: the model's own distribution for one stream)."""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations import Engine, SamplingParams
from tests.helpers import tiny_loaded
from tests.test_core_pced import DOCS, QUESTION

MESSAGES = [{"role": "user", "content": "Name a river in Veloria."}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3))


def test_chat_logprobs_are_the_models_own(engine):
    answer = engine.chat(MESSAGES, sampling=SamplingParams(max_tokens=4, logprobs=3))
    from ctx_integrations.engine.core.chat import conversation_ids

    ids = torch.tensor([conversation_ids(engine.layout, MESSAGES)])
    with torch.inference_mode():
        expected = torch.log_softmax(engine.loaded.model(input_ids=ids).logits[0, -1].float(), -1)
    first = answer.trace[0]
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-4)
    best = torch.topk(expected, 3)
    assert [t for t, _ in first.top_logprobs] == best.indices.tolist()
    assert [lp for _, lp in first.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
    for step in answer.trace:  # greedy: the chosen token is the most likely one
        assert len(step.top_logprobs) == 3 and step.top_logprobs[0] == (step.token_id, step.logprob)
        assert step.logprob <= 0 and [lp for _, lp in step.top_logprobs] == sorted(
            (lp for _, lp in step.top_logprobs), reverse=True)
    assert answer.to_dict()["trace"][0]["top_logprobs"][0] == [first.token_id, first.logprob]


def test_logprobs_are_off_by_default_and_zero_means_the_chosen_token_only(engine):
    plain = engine.chat(MESSAGES, max_new_tokens=3)
    assert all(step.logprob is None for step in plain.trace) and "logprob" not in plain.to_dict()["trace"][0]
    chosen_only = engine.chat(MESSAGES, sampling=SamplingParams(max_tokens=3, logprobs=0))
    assert chosen_only.token_ids == plain.token_ids
    assert all(step.logprob is not None and step.top_logprobs == () for step in chosen_only.trace)


@pytest.mark.parametrize("mode", ["pced", "concat", "soft_nbce", "ape", "map_reduce"])
def test_every_one_answer_mode_reports_logprobs(engine, mode):
    plain = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4)
    answer = engine.generate(QUESTION, DOCS, mode=mode, sampling=SamplingParams(max_tokens=4, logprobs=2))
    assert answer.token_ids == plain.token_ids  # asking for them changes no token
    for step in answer.trace:
        assert step.logprob is not None and step.logprob <= 1e-6 and len(step.top_logprobs) == 2
        assert math.isclose(step.top_logprobs[0][1], max(lp for _, lp in step.top_logprobs))


def test_ippd_reports_each_questions_logprobs_as_concat_does(engine):
    questions = [QUESTION, "Where is Marrowgate?"]
    params = SamplingParams(max_tokens=4, logprobs=2)
    stacked = engine.generate_many(questions, DOCS, sampling=params)
    for question, answer in zip(questions, stacked):
        alone = engine.generate(question, DOCS, mode="concat", sampling=params)
        assert answer.token_ids == alone.token_ids
        assert [s.logprob for s in answer.trace] == pytest.approx([s.logprob for s in alone.trace], abs=1e-4)
        assert [[t for t, _ in s.top_logprobs] for s in answer.trace] == [[t for t, _ in s.top_logprobs]
                                                                           for s in alone.trace]
