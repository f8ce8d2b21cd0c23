"""PCED fusion rule against hand-written references on random tensors."""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations.engine.modes.pced import PCEDFusion, jensen_shannon
from ctx_integrations.errors import InvalidOptionError


def reference_jsd(p_logits, q_logits):
    p, q = torch.softmax(p_logits.double(), -1), torch.softmax(q_logits.double(), -1)
    m = (p + q) / 2
    return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)


def reference_pced(logits, relevance, beta, gamma, space, aggregation):
    """METHODS.md's formulas written out expert by expert, in float64."""
    logits = logits.double()
    s = torch.log_softmax(logits, -1) if space == "logprobs" else logits
    r = torch.tensor(relevance, dtype=torch.float64)
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
def test_fused_scores_equal_reference(space, aggregation, beta):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 50, generator=generator) * 3
    relevance = [0.9, 0.2, 0.55, 0.7]
    rule = PCEDFusion(relevance, beta=beta, gamma=2.5, score_space=space, aggregation=aggregation)
    fused = rule(logits)
    betas = reference_jsd(logits[1:], logits[0].expand(4, -1)).tolist() if beta is None else [beta] * 4
    expected = reference_pced(logits, relevance, betas, 2.5, space, aggregation)
    torch.testing.assert_close(fused.scores.double(), expected, rtol=1e-5, atol=1e-5)
    assert fused.evidence.shape == (4, 50)


def test_dynamic_beta_is_computed_once_then_fixed():
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(3, 20, generator=generator), torch.randn(3, 20, generator=generator)
    rule = PCEDFusion([0.5, 0.5])
    rule(first)
    beta_after_first = rule.beta.clone()
    rule(second)
    assert torch.equal(rule.beta, beta_after_first)
    torch.testing.assert_close(beta_after_first.double(), reference_jsd(first[1:], first[0].expand(2, -1)))


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
