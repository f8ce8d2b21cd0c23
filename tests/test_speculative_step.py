"""RAPID's verification step and its nucleus, at the edges mutation testing found untested (``make mutate``)."""

from __future__ import annotations

import math

import torch

from ctx_integrations.engine.modes.speculative import nucleus, verify


def test_top_p_one_keeps_a_tail_whose_cumulative_mass_already_reads_one():
    """In fp32 the mass before each tail token is exactly 1.0 here; top_p = 1 must still keep every token."""
    logits = torch.tensor([0.0, -30.0, -30.0, -30.0])
    assert torch.equal(nucleus(logits, 1.0), logits)


def test_the_nucleus_is_the_smallest_head_that_reaches_top_p():
    """Mass exactly top_p after the first token: that head is the nucleus (">=", not ">")."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    kept = nucleus(logits, 0.5)
    assert torch.isfinite(kept).tolist() == [True, False, False] and kept[1] == -math.inf


def test_sampled_verification_uses_the_targets_nucleus():
    """With top_p = 0.5 the target's nucleus is token 0 alone (p = 0.64): a draft outside it is always
    rejected and the replacement always comes from the nucleus, whatever the seed."""
    target = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.05, 0.05, 0.05, 0.8, 0.05]])
    verdicts = [verify(target, q, [3], eta=0.0, temperature=1.0, top_p=0.5,
                       generator=torch.Generator().manual_seed(seed)) for seed in range(200)]
    assert all(v.accepted == 0 and v.token == 0 and v.bonus is False for v in verdicts)


def test_the_bonus_token_is_drawn_from_the_callers_generator():
    """Seeded sampling must be reproducible: with every draft accepted (q = p, eta = 0) the bonus token
    comes from the given generator, not from torch's global one."""
    target = torch.zeros(2, 50)
    q = torch.softmax(target[:1], -1)
    for seed in range(20):
        tokens = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            verdict = verify(target, q, [7], eta=0.0, temperature=1.0, top_p=1.0,
                             generator=torch.Generator().manual_seed(seed))
            assert verdict.accepted == 1 and verdict.bonus
            tokens.append(verdict.token)
        assert tokens[0] == tokens[1]
