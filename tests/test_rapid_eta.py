"""RAPID's eta through the public verification step (``speculative.verify``), for either tail rule.

Both the tail rule of the NBCE-era code (only the drafter's head is shifted) and the paper's Eq. 9
(the shift everywhere, then tokens below 0.1 * max p^ keep their target probability) start from the
paper's Eq. 8, p^ = softmax(z / T + eta (q - p)). The cases here are built so that both rules agree
on what is tested (the argmax of p^; the shift applied to z / T), and the greedy case checks that
agreement first, so these tests hold whichever rule is the default.
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations.engine.modes.speculative import Verdict, verify

TAIL = 0.1


def head_only_p_hat(scaled: torch.Tensor, q: torch.Tensor, eta: float) -> torch.Tensor:
    """The head-only tail rule: the shift only where q >= 0.1 * max q."""
    p = torch.softmax(scaled, -1)
    head = q >= TAIL * q.amax(-1, keepdim=True)
    return torch.softmax(torch.where(head, scaled + eta * (q - p), scaled), -1)


def paper_p_hat(scaled: torch.Tensor, q: torch.Tensor, eta: float) -> torch.Tensor:
    """Paper Eq. 8-9 (not renormalised: only its argmax is used here)."""
    p = torch.softmax(scaled, -1)
    shifted = torch.softmax(scaled + eta * (q - p), -1)
    return torch.where(shifted < TAIL * shifted.amax(-1, keepdim=True), p, shifted)


# rows: the target's logits z for draft 0, draft 1 and the bonus position; q: the drafter's distributions
TARGET = torch.tensor([[2.0, 1.4, 0.0, -1.0, -1.5, -2.0],
                       [2.0, 0.5, 1.2, 1.0, -1.0, -2.0],
                       [0.0, 0.0, 0.0, 0.0, 3.0, 0.0]])
DRAFTER = torch.tensor([[0.02, 0.90, 0.04, 0.02, 0.01, 0.01],
                        [0.02, 0.02, 0.90, 0.03, 0.02, 0.01]])
ETA = 5.0


def test_the_case_separates_p_hat_from_p_under_both_rules():
    for rule in (head_only_p_hat, paper_p_hat):
        assert rule(TARGET[:2], DRAFTER, ETA).argmax(-1).tolist() == [1, 2]
    assert torch.softmax(TARGET[:2], -1).argmax(-1).tolist() == [0, 0]


def test_greedy_verification_and_correction_follow_argmax_p_hat():
    """Greedy: a draft is accepted iff it is argmax p^ (not argmax p), a rejected one is replaced by
    argmax p^ (not argmax p), and the bonus after full acceptance is argmax p."""
    common = dict(eta=ETA, temperature=0.0, top_p=1.0, generator=None)
    assert verify(TARGET, DRAFTER, [1, 3], **common) == Verdict(1, 2, False)
    assert verify(TARGET, DRAFTER, [0, 2], **common) == Verdict(0, 1, False)
    assert verify(TARGET, DRAFTER, [1, 2], **common) == Verdict(2, 4, True)
    # eta = 0 is plain greedy verification of the target
    assert verify(TARGET, DRAFTER, [1, 3], **common | dict(eta=0.0)) == Verdict(0, 0, False)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_verification_shifts_the_tempered_logits(top_p):
    """p^ = softmax(z / T + eta (q - p)): verifying logits z at temperature T = 0.5 must give, seed for seed,
    the verdicts of logits z / T at temperature 1. Fails if eta's shift is added to the raw z."""
    generator = torch.Generator().manual_seed(0)
    vocab, g = 12, 3
    target = torch.randn(g + 1, vocab, generator=generator) * 1.5
    q = torch.softmax(torch.randn(g, vocab, generator=generator) * 2.0, -1)
    verdicts, accepted = [], []
    for seed in range(120):
        drafts = [int(t) for t in torch.multinomial(q, 1, generator=torch.Generator().manual_seed(1000 + seed))]
        tempered = verify(target, q, drafts, eta=3.0, temperature=0.5, top_p=top_p,
                          generator=torch.Generator().manual_seed(seed))
        rescaled = verify(target / 0.5, q, drafts, eta=3.0, temperature=1.0, top_p=top_p,
                          generator=torch.Generator().manual_seed(seed))
        verdicts.append((tempered, rescaled))
        accepted.append(tempered.accepted)
    assert all(a == b for a, b in verdicts), [(a, b) for a, b in verdicts if a != b][:3]
    assert 0 in accepted and any(a > 0 for a in accepted)  # both acceptance and rejection happen
