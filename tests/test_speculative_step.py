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


def test_a_greedy_rejection_takes_the_residuals_argmax_every_time():
    # p = (0.1, 0.5, 0.4), the draft put everything on token 0: greedy verification rejects it, and the correction is
    # argmax of the residual norm(max(p - q, 0)) = (0, 5/9, 4/9): token 1, never a draw from the residual.
    target = torch.log(torch.tensor([[0.1, 0.5, 0.4], [1 / 3, 1 / 3, 1 / 3]]))
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(30):
        verdict = verify(target, q, [0], eta=0.0, temperature=0.0, top_p=1.0,
                         generator=torch.Generator().manual_seed(seed))
        assert (verdict.accepted, verdict.token, verdict.bonus) == (0, 1, False)


def test_the_paper_tail_rule_works_per_row():
    # A [g + 1, V] batch: each row's threshold is 0.1 of its own max p^ (a max over the whole batch would restore
    # row 1's second token, whose p^ is above 0.1 of its row's max but below 0.1 of row 0's).
    from ctx_integrations.engine.modes.speculative import augmented_target, tail_adjusted

    z = torch.tensor([[6.0, 0.0, -2.0], [0.0, -1.5, -2.6]])  # row 1, token 2: p^ = 0.081, between 0.053 and 0.099
    p, q = torch.softmax(z, -1), torch.tensor([[0.8, 0.1, 0.1], [0.3, 0.6, 0.1]])
    p_hat = augmented_target(z, p, q, 2.0)
    expected = torch.stack([torch.where(row < 0.1 * row.max(), p_row, row) for row, p_row in zip(p_hat, p)])
    assert not torch.equal(expected, torch.where(p_hat < 0.1 * p_hat.max(), p, p_hat))  # the per-row max matters
    torch.testing.assert_close(tail_adjusted(z, p, q, 2.0), expected)


def test_a_greedy_bonus_is_argmax_p_every_time():
    # The draft is argmax p^ and is accepted; the bonus is argmax of the last row's p = (0.3, 0.4, 0.3), token 1,
    # never a draw from it (a draw, with the caller's generator or the global one, is another token for some seeds).
    target = torch.log(torch.tensor([[0.1, 0.8, 0.1], [0.3, 0.4, 0.3]]))
    q = torch.tensor([[0.2, 0.6, 0.2]])
    for seed in range(30):
        verdict = verify(target, q, [1], eta=0.0, temperature=0.0, top_p=1.0,
                         generator=torch.Generator().manual_seed(seed))
        assert (verdict.accepted, verdict.token, verdict.bonus) == (1, 1, True)
