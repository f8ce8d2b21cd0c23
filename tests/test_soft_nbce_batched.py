"""Soft-NBCE's, hard NBCE's and PCW's rule over a batch of requests (``fuse_batch``) against each request's rule alone.

The scheduler chooses the tokens of all greedy requests of a step whose rules share a batch key (one class, one
``rule``) in one batched evaluation; every value a request reads back (token, winning chunk, score, checked score)
must be bit for bit what its own ``rule(logits)`` and ``propose_token`` give. Requests differ in chunk count (padded
to the widest with copies of their prior row), tau, beta, rho, gamma and prior. Bugs these catch: a padded chunk
that takes weight, restricts the support, joins ``nbce_code``'s union of nuclei or wins a citation; one request's
tau, beta, rho, gamma or prior used for another; sums over the chunks whose rounding depends on the padding.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations.engine.core.decoding import FIRST_STEP, TokenSampler, batch_proposals, propose_token
from ctx_integrations.engine.modes.soft_nbce import RULES, Knobs, NBCEFusion, PCWFusion, SoftNBCEFusion
from ctx_integrations.errors import InvalidOptionError

VOCAB = 40
# chunk counts of one batch: 1 to 11, so sums over the chunks meet paddings of 0 to 10 columns
CHUNKS = [3, 1, 11, 6, 2, 6]
# per request: tau (math.inf: the uniform average), beta (0.18 and 0.43: 1 + beta in float32 is not 1 + float32(beta)),
# rho (1: every token, so every chunk is in the support and the sums over the chunks hold many terms; the first
# request's, so that no other request follows it), gamma (0: no prior)
SOFT = [(0.1, 0.25, 1.0, 0.0), (0.5, 0.0, 0.6, 2.0), (1e-3, 0.7, 0.9, 0.0), (math.inf, 1.3, 1.0, 0.5),
        (0.3, 0.18, 0.3, 0.0), (2.0, 0.43, 0.8, 7.0)]
HARD = [(0.25, 1.0), (0.0, 0.6), (0.7, 0.9), (1.3, 1.0), (0.18, 0.3), (0.43, 0.8)]  # (beta, rho)


def step_logits(seed: int, chunks: int) -> list[torch.Tensor]:
    """A step's rows, prior first: the prior is sure of a token the chunks doubt, so a padded chunk (a copy of the
    prior: the lowest entropy of the batch, its nucleus that one token) would take the weight, restrict the support
    to that token and win it if its weight were not exactly 0."""
    generator = torch.Generator().manual_seed(seed)
    prior = torch.randn(VOCAB, generator=generator)
    prior[seed % VOCAB] += 12.0
    return [prior, *(torch.randn(VOCAB, generator=generator) * (1 + k % 3) for k in range(chunks))]


def log_priors(seed: int, chunks: int) -> list[float]:
    """Log-priors, the last -inf (a document the paper's prior gives r = 0): 0 * -inf is NaN where gamma is 0."""
    values = (torch.randn(chunks, generator=torch.Generator().manual_seed(100 + seed)) - 1).tolist()
    return values[:-1] + [-math.inf] if chunks > 1 and seed % 2 == 0 else values


def batch(kind: type, rule: str) -> list[SoftNBCEFusion]:
    if kind is SoftNBCEFusion:
        # request 0 has no prior; 2 and 4 have one and gamma 0 (as the mode gives them): theirs must not count
        return [SoftNBCEFusion(tau=tau, beta=beta, rho=rho, rule=rule, gamma=gamma,
                               log_prior=None if j == 0 else log_priors(j, chunks))
                for j, (chunks, (tau, beta, rho, gamma)) in enumerate(zip(CHUNKS, SOFT, strict=True))]
    return [kind(beta=beta, rho=rho, rule=rule) for beta, rho in HARD]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 values' bits: ``torch.equal`` on them also tells -0.0 from 0.0."""
    return tensor.contiguous().view(torch.int32)


def assert_batch_equals_alone(rules: list[SoftNBCEFusion], rows: list[list[torch.Tensor]]) -> None:
    fused = type(rules[0]).fuse_batch(rules, rows, [FIRST_STEP] * len(rules))
    batched = batch_proposals(fused, [TokenSampler()] * len(fused.carries))
    assert fused.carries == [None] * len(rules)
    for j, (rule, streams) in enumerate(zip(rules, rows, strict=True)):
        alone = rule(torch.stack(streams))
        count = len(streams) - 1
        assert torch.equal(bits(fused.scores[j]), bits(alone.scores)), j
        assert torch.equal(bits(fused.evidence[j, :count]), bits(alone.evidence)), j
        assert bool((fused.evidence[j, count:] == -math.inf).all())  # a padded chunk never wins a citation
        values, _ = propose_token(rule, torch.stack(streams), FIRST_STEP, TokenSampler())
        assert torch.equal(batched[j], values), (j, batched[j].tolist(), values.tolist())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", [SoftNBCEFusion, NBCEFusion, PCWFusion])
@pytest.mark.parametrize("seed", range(3))
def test_a_batch_of_requests_gets_what_each_gets_alone(kind, rule, seed):
    rows = [step_logits(10 * seed + j, chunks) for j, chunks in enumerate(CHUNKS)]
    assert_batch_equals_alone(batch(kind, rule), rows)


@pytest.mark.parametrize("rule", RULES)
def test_the_papers_settings_batch_too(rule):
    """Requests that share every knob (the defaults) and differ only in chunk count: the knobs' common path."""
    rules = [SoftNBCEFusion(rule=rule) for _ in CHUNKS]
    assert_batch_equals_alone(rules, [step_logits(50 + j, chunks) for j, chunks in enumerate(CHUNKS)])
    assert_batch_equals_alone(rules[:1], [step_logits(60, 4)])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", [SoftNBCEFusion, NBCEFusion, PCWFusion])
def test_a_one_chunk_request_beside_a_wide_one_ignores_its_padding(kind, rule):
    """A one-chunk request's answer is its chunk's alone (beta 0: its scores are its chunk's log-probs, within its
    nucleus); its ten padded columns copy a prior sure of another token, which would take the weight and the token."""
    rules = [kind(beta=0.0, rule=rule), kind(beta=0.0, rule=rule)]
    rows = [step_logits(3, 1), step_logits(4, 11)]
    fused = type(rules[0]).fuse_batch(rules, rows, [FIRST_STEP, FIRST_STEP])
    assert int(fused.scores[0].argmax()) == int(rows[0][1].argmax()) != 3
    assert_batch_equals_alone(rules, rows)


def test_a_request_without_a_prior_builds_its_support_in_entropy_order_beside_one_with_a_prior():
    """The paper's support order is the entropy; a prior's is the routing logit, which at tau = inf is 0 for every
    chunk. Chunk 0 spreads over tokens 10-13, chunk 1 is sure of token 5: nuclei with no token in common, so the
    order decides which chunk is left out (the spread one, ranked second by entropy, not first by its index)."""
    logits = torch.full((3, VOCAB), -8.0)
    logits[0] = 0.0
    logits[1, 10:14] = 4.0
    logits[2, 5] = 12.0
    rules = [SoftNBCEFusion(tau=math.inf), SoftNBCEFusion(gamma=1.0, log_prior=[0.0, -1.0, -2.0])]
    alone = rules[0](logits)
    assert torch.isfinite(alone.scores).nonzero().flatten().tolist() == [5]
    assert_batch_equals_alone(rules, [list(logits), step_logits(7, 3)])


def test_the_knobs_are_what_the_rules_python_floats_give_an_operation():
    """A request alone computes with its knobs as the Python floats they are (``(1 + beta) * x``, ``x / tau``,
    ``x < rho``): each knob in the batch's tensors must round to what the float does in that operation, 1 + beta
    included (computed from the float32 beta on the device it rounds differently for 0.18 and 0.43)."""
    rules = [SoftNBCEFusion(tau=0.3, beta=0.18, rho=0.57, gamma=0.7, log_prior=[-0.1, -2.3]),
             SoftNBCEFusion(tau=0.07, beta=0.43, rho=0.83), SoftNBCEFusion(tau=math.inf, beta=1.91, rho=0.66)]
    knobs = Knobs.of(rules, [2, 1, 3], torch.device("cpu"))
    x = torch.randn(3, 3, VOCAB, generator=torch.Generator().manual_seed(0))
    for j, rule in enumerate(rules):
        assert torch.equal(bits(knobs.scale[j] * x[j]), bits((1 + rule.beta) * x[j])), j
        assert torch.equal(bits(knobs.beta[j] * x[j]), bits(rule.beta * x[j])), j
        assert torch.equal(bits(x[j] / knobs.tau[j]), bits(x[j] / rule.tau)), j
        assert torch.equal(x[j] < knobs.rho[j], x[j] < rule.rho), j
    assert torch.equal(bits(knobs.gamma[0] * knobs.log_prior[0, :2]), bits(0.7 * torch.tensor([-0.1, -2.3])))
    assert knobs.log_prior[0, 2] == 0 and knobs.gamma[1:].eq(0).all() and knobs.log_prior[1:].eq(0).all()
    assert knobs.chunks.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert torch.equal(knobs.share, torch.tensor([[0.5, 0.5, 0], [1, 0, 0], [1 / 3] * 3]))  # PCW's 1 / K alone
    assert Knobs.of(rules[1:2], [4], torch.device("cpu")).chunks is None  # nothing padded: no mask
    assert Knobs.of([SoftNBCEFusion(rho=1.0)] * 2, [1, 2], torch.device("cpu")).rho == 1.0  # every token: no sort


@pytest.mark.parametrize("rule", RULES)
def test_the_rule_computes_on_the_logits_device(rule):
    """The knobs go where the logits are (an accelerator's), alone and batched: on the meta device (shapes only) a
    knob left on the CPU would meet a meta tensor and raise."""
    meta = torch.device("meta")
    prior = SoftNBCEFusion(gamma=1.0, log_prior=[0.0, -1.0], rule=rule)
    assert prior(torch.empty(3, VOCAB, device=meta)).scores.device == meta
    rows = [list(torch.empty(3, VOCAB, device=meta)), list(torch.empty(2, VOCAB, device=meta))]
    fused = SoftNBCEFusion.fuse_batch([prior, SoftNBCEFusion(rule=rule)], rows, [FIRST_STEP] * 2)
    assert fused.scores.device == fused.evidence.device == meta
    assert SoftNBCEFusion().chunk_weights(torch.empty(3, device=meta)).device == meta


def test_a_batch_key_is_a_class_and_a_rule():
    assert SoftNBCEFusion().batch_key() == SoftNBCEFusion(tau=2.0, beta=0.0, rho=0.5, gamma=1.0,
                                                           log_prior=[0.0]).batch_key()
    assert SoftNBCEFusion().batch_key() != SoftNBCEFusion(rule="nbce_code").batch_key()
    assert len({SoftNBCEFusion().batch_key(), NBCEFusion().batch_key(), PCWFusion().batch_key()}) == 3
    assert NBCEFusion(beta=0.9).batch_key() == NBCEFusion(rho=0.5).batch_key()


def test_a_request_the_rule_refuses_alone_is_refused_in_a_batch():
    good = [SoftNBCEFusion(), step_logits(0, 2)]
    with pytest.raises(InvalidOptionError, match="3 chunk streams for 2 priors"):
        SoftNBCEFusion.fuse_batch([good[0], SoftNBCEFusion(gamma=1.0, log_prior=[0.0, -1.0])],
                                  [good[1], step_logits(1, 3)], [FIRST_STEP] * 2)
    with pytest.raises(InvalidOptionError, match="at least one chunk stream"):
        SoftNBCEFusion.fuse_batch([good[0], SoftNBCEFusion()], [good[1], step_logits(1, 0)], [FIRST_STEP] * 2)
