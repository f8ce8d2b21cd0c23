"""PCED's rule over a batch of requests (``PCEDFusion.fuse_batch``) against each request's rule alone.

The scheduler chooses the tokens of all greedy PCED requests of a step in one batched evaluation; every value a
request reads back (token, winning document, score, checked score) and the beta it carries must be bit for bit
what its own ``rule(logits, state)`` and ``propose_token`` give. Requests differ in document count (padded to the
widest), prior, gamma, beta (dynamic, fixed, carried) and score space. Bugs these catch: a padded document that
wins a token (its scores not ``-inf``), one request's prior or gamma used for another, one request's dynamic beta
(its JSD at the first step) replacing or leaking into another's.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations.engine.core.decoding import FIRST_STEP, FusionState, TokenSampler, batch_proposals, propose_token
from ctx_integrations.engine.modes.pced import PCEDFusion

VOCAB = 40

# (scores, options): 1 to 5 documents, every prior, gammas 0 to 7, dynamic and fixed betas
REQUESTS = [
    ([0.9, 0.2, 0.6], dict(prior="paper")),
    ([0.7], dict(beta=0.4, gamma=7.0)),
    ([0.3, 0.8, 0.5, 0.1, 0.9], dict(prior="softmax", gamma=0.0)),
    ([0.6, 0.4], dict(prior="rank", beta=0.0, gamma=1.0)),
    ([0.2, 0.9, 0.5], dict(prior="minmax", gamma=3.0)),
]


def step_logits(seed: int, experts: int) -> list[torch.Tensor]:
    """A step's rows, amateur first: the amateur sure of a token the experts doubt, so a padded document (a copy
    of the amateur, whose contrast leaves it as it is) would win that token if its scores were not ``-inf``."""
    generator = torch.Generator().manual_seed(seed)
    amateur = torch.randn(VOCAB, generator=generator)
    amateur[seed % VOCAB] += 12.0
    return [amateur, *(torch.randn(VOCAB, generator=generator) * 3 for _ in range(experts))]


def rules(space: str) -> list[PCEDFusion]:
    return [PCEDFusion(scores, score_space=space, **options) for scores, options in REQUESTS]


def assert_batch_equals_alone(rules_: list[PCEDFusion], rows: list[list[torch.Tensor]],
                              states: list[FusionState]) -> list[torch.Tensor]:
    fused = PCEDFusion.fuse_batch(rules_, rows, states)
    batched = batch_proposals(fused, [TokenSampler()] * len(fused.carries))
    sampler = TokenSampler()
    for j, (rule, streams, state) in enumerate(zip(rules_, rows, states, strict=True)):
        alone = rule(torch.stack(streams), state)
        count = len(streams) - 1
        assert torch.equal(fused.scores[j], alone.scores)
        assert torch.equal(fused.evidence[j, :count], alone.evidence)
        assert bool((fused.evidence[j, count:] == -math.inf).all())  # a padded document never wins
        assert torch.equal(fused.carries[j], alone.carry)
        values, _ = propose_token(rule, torch.stack(streams), state, sampler)
        assert torch.equal(batched[j], values), (j, batched[j].tolist(), values.tolist())
    return fused.carries


@pytest.mark.parametrize("space", ["logprobs", "logits"])
def test_a_batch_of_requests_gets_what_each_gets_alone_step_after_step(space):
    batch = rules(space)
    first = [step_logits(j, len(scores)) for j, (scores, _) in enumerate(REQUESTS)]
    carries = assert_batch_equals_alone(batch, first, [FIRST_STEP] * len(batch))
    # the next step: every request carries its own beta (the dynamic ones their JSD of the first step)
    second = [step_logits(10 + j, len(scores)) for j, (scores, _) in enumerate(REQUESTS)]
    carried = [FusionState(0, 0, carry) for carry in carries]
    assert_batch_equals_alone(batch, second, carried)


def test_a_request_at_its_first_step_beside_requests_carrying_their_beta():
    """A request joining the batch computes its JSD while the others keep theirs: no beta moves between them."""
    batch = rules("logprobs")
    rows = [step_logits(20 + j, len(scores)) for j, (scores, _) in enumerate(REQUESTS)]
    carries = [torch.full((len(scores),), 0.1 * (j + 1)) for j, (scores, _) in enumerate(REQUESTS)]
    states = [FIRST_STEP if j in (0, 4) else FusionState(1, 0, carries[j]) for j in range(len(REQUESTS))]
    used = assert_batch_equals_alone(batch, rows, states)
    assert torch.equal(used[2], carries[2])  # request 2 is dynamic, but carries its beta: no new JSD
    assert not torch.equal(used[0][:1], used[4][:1])


def test_every_padded_document_loses_even_where_it_would_win():
    """One-document requests beside a five-document one: their four padded columns copy the amateur, which is sure
    of the token its expert doubts; with gamma 0 no prior pushes them down either."""
    batch = [PCEDFusion([0.5], gamma=0.0, beta=0.0), PCEDFusion([0.1] * 5, gamma=0.0, beta=0.0)]
    rows = [step_logits(3, 1), step_logits(4, 5)]
    assert_batch_equals_alone(batch, rows, [FIRST_STEP, FIRST_STEP])


def test_a_request_with_the_wrong_number_of_streams_is_refused_as_alone():
    from ctx_integrations.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="2 expert streams for 3 scores"):
        PCEDFusion.fuse_batch(rules("logprobs")[:1], [step_logits(0, 2)], [FIRST_STEP])


def test_only_the_papers_max_rule_batches_and_by_score_space():
    assert PCEDFusion([0.5]).batch_key() == PCEDFusion([0.9, 0.1], beta=0.3, gamma=1.0, prior="rank").batch_key()
    assert PCEDFusion([0.5]).batch_key() != PCEDFusion([0.5], score_space="logits").batch_key()
    assert PCEDFusion([0.5], aggregation="mixture").batch_key() is None
    assert PCEDFusion([0.5], aggregation="product").batch_key() is None
    assert PCEDFusion([0.5], switch="word", word_pieces=object()).batch_key() is None


def test_a_batch_whose_dynamic_count_equals_its_stream_count_keeps_the_fixed_betas():
    """Three one-document requests, two of them at their first step with a dynamic beta: the dynamic count (2)
    equals the batch's streams per request (1 + 1), so a shortcut taken on that count instead of the request
    count would give the fixed-beta request its JSD too."""
    batch = [PCEDFusion([0.8]), PCEDFusion([0.6], beta=0.3), PCEDFusion([0.9])]
    carries = assert_batch_equals_alone(batch, [step_logits(seed, 1) for seed in (3, 4, 5)], [FIRST_STEP] * 3)
    assert carries[1].tolist() == pytest.approx([0.3])


def test_a_batch_of_one_is_the_request_alone():
    assert_batch_equals_alone([PCEDFusion([0.8, 0.3], beta=0.2)], [step_logits(7, 2)], [FIRST_STEP])
