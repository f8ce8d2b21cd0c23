"""PCED fusion rule against hand-written references on random tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ctx_integrations.engine.core.decoding import FusionState
from ctx_integrations.engine.modes.pced import PCEDFusion, jensen_shannon, relevance_weights
from ctx_integrations.errors import InvalidOptionError


def reference_jsd(p_logits, q_logits):
    p, q = torch.softmax(p_logits.double(), -1), torch.softmax(q_logits.double(), -1)
    m = (p + q) / 2
    return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)


def reference_pced(logits, relevance, beta, gamma, space, aggregation, prior="paper", tau=0.05):
    """docs/methods.md's formulas written out expert by expert, in float64. ``prior``: the paper's log r, or
    the softmax calibration log softmax(r / tau) (then "r" below is softmax(r / tau), which sums to 1)."""
    logits = logits.double()
    s = torch.log_softmax(logits, -1) if space == "logprobs" else logits
    r = torch.tensor(relevance, dtype=torch.float64)
    if prior == "softmax":
        r = torch.exp(r / tau) / torch.exp(r / tau).sum()
    rows = []
    for k in range(1, logits.shape[0]):
        b = beta[k - 1]
        rows.append((1 + b) * s[k] - b * s[0])
    contrastive = torch.stack(rows)
    if aggregation == "max":
        return (contrastive + gamma * r.log().unsqueeze(1)).max(0).values
    w = (r / r.sum()).unsqueeze(1)
    log_p = torch.log_softmax(contrastive, -1)
    if aggregation == "mixture":
        return (w * log_p.exp()).sum(0).log()
    return (w * log_p).sum(0)


@pytest.mark.parametrize("space", ["logprobs", "logits"])
@pytest.mark.parametrize("aggregation", ["max", "mixture", "product"])
@pytest.mark.parametrize("beta", [None, 0.0, 0.7])
@pytest.mark.parametrize("prior", ["paper", "softmax"])
def test_fused_scores_equal_reference(space, aggregation, beta, prior):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 50, generator=generator) * 3
    relevance = [0.9, 0.75, 0.8, 0.7]  # a dense retriever's narrow band: the softmax prior spreads it
    rule = PCEDFusion(relevance, beta=beta, gamma=2.5, score_space=space, aggregation=aggregation, prior=prior)
    fused = rule(logits)
    betas = reference_jsd(logits[1:], logits[0].expand(4, -1)).tolist() if beta is None else [beta] * 4
    expected = reference_pced(logits, relevance, betas, 2.5, space, aggregation, prior)
    torch.testing.assert_close(fused.scores.double(), expected, rtol=1e-5, atol=1e-5)
    assert fused.evidence.shape == (4, 50)


@pytest.mark.parametrize("aggregation", ["max", "mixture", "product"])
def test_dynamic_beta_is_computed_once_then_carried_in_the_state(aggregation):
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(3, 20, generator=generator), torch.randn(3, 20, generator=generator)
    rule = PCEDFusion([0.5, 0.5], gamma=0.0, aggregation=aggregation)
    step = rule(first)
    torch.testing.assert_close(step.carry.double(), reference_jsd(first[1:], first[0].expand(2, -1)))
    carried = rule(second, FusionState(0, 0, step.carry))
    assert torch.equal(carried.carry, step.carry)
    expected = reference_pced(second, [0.5, 0.5], step.carry.tolist(), 0.0, "logprobs", aggregation)
    torch.testing.assert_close(carried.scores.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_rule_keeps_no_answer_state_on_itself():
    """One rule object may serve several answers: a new answer's first step computes its own beta."""
    generator = torch.Generator().manual_seed(1)
    first, other = torch.randn(3, 20, generator=generator), torch.randn(3, 20, generator=generator)
    rule = PCEDFusion([0.5, 0.5])
    rule(first)
    torch.testing.assert_close(rule(other).carry, PCEDFusion([0.5, 0.5])(other).carry)


def test_jensen_shannon_bounds():
    a = torch.tensor([[10.0, -10.0]])
    assert float(jensen_shannon(a, a)) == pytest.approx(0.0, abs=1e-7)
    disjoint = jensen_shannon(torch.tensor([[50.0, -50.0]]), torch.tensor([[-50.0, 50.0]]))
    assert float(disjoint) == pytest.approx(math.log(2), abs=1e-6)


def test_max_winner_is_the_expert_with_highest_adjusted_score():
    logits = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 6.0, 0.0]])
    fused = PCEDFusion([1.0, 1.0], beta=0.0, gamma=0.0, score_space="logits")(logits)
    token = int(fused.scores.argmax())
    assert token == 1 and int(fused.evidence[:, token].argmax()) == 1


def test_document_with_vanishing_relevance_never_wins():
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        logits = torch.randn(4, 100, generator=generator) * 5
        fused = PCEDFusion([0.8, 1e-30, 0.4])(logits)
        token = int(fused.scores.argmax())
        assert int(fused.evidence[:, token].argmax()) != 1


def test_zero_relevance_is_finite():
    fused = PCEDFusion([0.0, 0.5], beta=0.0)(torch.randn(3, 10))
    assert torch.isfinite(fused.scores).all()


def test_expert_order_does_not_change_fused_scores():
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 30, generator=generator)
    relevance = [0.3, 0.9, 0.6]
    order = [2, 0, 1]
    a = PCEDFusion(relevance)(logits)
    b = PCEDFusion([relevance[i] for i in order])(logits[[0] + [i + 1 for i in order]])
    torch.testing.assert_close(a.scores, b.scores)


def test_inputs_are_not_modified():
    logits = torch.randn(3, 10)
    copy = logits.clone()
    PCEDFusion([0.5, 0.5])(logits)
    assert torch.equal(logits, copy)


@pytest.mark.parametrize("kwargs", [dict(beta=-1.0), dict(gamma=-0.1), dict(score_space="probs"),
                                    dict(aggregation="mean"), dict(beta=float("nan"))])
def test_invalid_arguments_are_refused(kwargs):
    with pytest.raises(InvalidOptionError):
        PCEDFusion([0.5], **kwargs)


@pytest.mark.parametrize("shape", [(50,), (3, 50), (2, 3, 50)])
def test_jensen_shannon_works_along_the_last_axis_of_any_shape(shape):
    generator = torch.Generator().manual_seed(len(shape))
    p, q = torch.randn(*shape, generator=generator) * 3, torch.randn(*shape, generator=generator) * 3
    torch.testing.assert_close(jensen_shannon(p, q).double(), reference_jsd(p, q), rtol=1e-5, atol=1e-6)


def test_jensen_shannon_stays_inside_its_bounds_despite_rounding():
    """Without the clamp, identical rows give about -3e-8 and very sharp disjoint ones ln 2 + 1e-7."""
    generator = torch.Generator().manual_seed(0)
    same = torch.randn(2000, 50, generator=generator) * 3
    assert (jensen_shannon(same, same) >= 0).all()
    sharp_p, sharp_q = torch.randn(2000, 50, generator=generator) * 30, torch.randn(2000, 50, generator=generator) * 30
    assert (jensen_shannon(sharp_p, sharp_q) <= math.log(2)).all()


def test_relevance_weights_normalise_and_fall_back_to_uniform():
    torch.testing.assert_close(relevance_weights([0.2, 0.3]), torch.tensor([0.4, 0.6]))
    torch.testing.assert_close(relevance_weights([3.0, 1.0]), torch.tensor([0.75, 0.25]))
    torch.testing.assert_close(relevance_weights([0.0, 0.0, 0.0, 0.0]), torch.full((4,), 0.25))
    assert relevance_weights(np.array([0.2, 0.3])).dtype == torch.float32


@pytest.mark.parametrize("aggregation", ["mixture", "product"])
def test_mixture_and_product_evidence_is_log_weight_plus_expert_log_prob(aggregation):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=generator) * 2
    relevance = [0.6, 0.1, 0.3]
    fused = PCEDFusion(relevance, beta=0.4, gamma=0.0, aggregation=aggregation, prior="paper")(logits)
    log_p = torch.log_softmax(logits.double(), -1)
    contrast = torch.log_softmax(1.4 * log_p[1:] - 0.4 * log_p[0], -1)
    expected = torch.log(torch.tensor(relevance, dtype=torch.float64)).unsqueeze(1) + contrast
    torch.testing.assert_close(fused.evidence.double(), expected, rtol=1e-5, atol=1e-5)


def test_all_zero_relevance_mixes_experts_uniformly():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 20, generator=generator)
    zero = PCEDFusion([0.0, 0.0], beta=0.0, aggregation="mixture")(logits)
    equal = PCEDFusion([0.5, 0.5], beta=0.0, aggregation="mixture")(logits)
    torch.testing.assert_close(zero.scores, equal.scores)


def test_default_gamma_is_the_papers_and_scores_stay_float32():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 20, generator=generator)
    default = PCEDFusion([0.9, 0.2], beta=0.0)(logits)
    torch.testing.assert_close(default.scores, PCEDFusion([0.9, 0.2], beta=0.0, gamma=2.5)(logits).scores)
    assert PCEDFusion(np.array([0.9, 0.2]), beta=0.0)(logits).scores.dtype == torch.float32


def test_a_stream_count_that_does_not_match_the_scores_is_named():
    with pytest.raises(InvalidOptionError, match="^got 2 expert streams for 3 scores$"):
        PCEDFusion([0.5, 0.5, 0.5])(torch.zeros(3, 10))


@pytest.mark.parametrize(("relevance", "kwargs", "message"), [
    ([], {}, "^PCED needs at least one expert$"),
    ([0.5], dict(score_space="probs"), r"^score_space must be one of logprobs, logits, got 'probs' \(str\)$"),
    ([0.5], dict(aggregation="mean"), r"^aggregation must be one of max, mixture, product, got 'mean' \(str\)$"),
    ([0.5], dict(beta=-1.0), r"^beta must be in \[0, 100\], got -1.0 \(or None: dynamic\)$"),
    ([0.5], dict(gamma=-0.1), r"^gamma must be in \[0, 100\], got -0.1$")])
def test_invalid_arguments_are_named_in_the_error(relevance, kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        PCEDFusion(relevance, **kwargs)


def test_pced_word_switch_without_word_pieces_is_refused_by_name():
    with pytest.raises(InvalidOptionError,
                       match=r"^switch='word' needs the vocabulary's word pieces \(LoadedModel\.word_pieces\)$"):
        PCEDFusion([0.9, 0.4], switch="word")


def test_pced_prior_options_reach_the_prior_in_float32():
    """``prior_tau`` and ``prior_floor`` are the rule's, not the defaults; scores given as float64 (numpy) give a
    float32 prior, the dtype the batched rule pads into."""
    from ctx_integrations.engine.modes.priors import log_prior

    scores = np.array([0.9, 0.5, 0.7])
    tempered = PCEDFusion(scores, prior="softmax", prior_tau=0.2).log_prior
    assert tempered.dtype == torch.float32
    assert torch.allclose(tempered, torch.log_softmax(torch.tensor([0.9, 0.5, 0.7]) / 0.2, 0))
    floored = PCEDFusion(scores, prior="minmax", prior_floor=0.3).log_prior
    assert torch.equal(floored, log_prior(torch.tensor([0.9, 0.5, 0.7]), "minmax", floor=0.3))
    assert not torch.equal(floored, PCEDFusion(scores, prior="minmax").log_prior)
