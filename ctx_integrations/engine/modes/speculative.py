"""The pure math of RAPID's speculative step (METHODS.md "RAPID"), as small tensor functions.

Kept apart from the decode loop so every rule can be checked against its closed form:

- ``p = softmax(z / T)`` is the target over the long context, ``q`` the drafter's distribution;
- tail rule: ``p^ = softmax(z / T + eta * (q - p))`` where ``q >= tail * max(q)``, plain ``z / T`` elsewhere,
  so the drafter only lends mass to tokens it actually believes in;
- a drafted token ``x`` is accepted while ``U <= p^(x) / q(x)``;
- on the first rejection the token is drawn from ``norm(max(p - q, p - p^, 0))``;
- when every draft is accepted a bonus token is drawn from ``p``.

With ``eta = 0`` we get ``p^ = p`` and this is exactly standard speculative sampling, whose output
is distributed as ``p``. Greedy decoding (``temperature = 0``) is not defined by the paper; ours:
accept a draft iff it equals ``argmax p^``, otherwise emit ``argmax p^``; the bonus is ``argmax p``.
With ``eta = 0`` that is token for token plain greedy decoding of the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TAIL = 0.1  # the paper's cut-off: only tokens with q >= 0.1 * max(q) get the drafter's push


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the top-p nucleus (over the last dimension) to -inf; the top token always stays."""
    if top_p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def scaled_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``z / T`` restricted to the nucleus; greedy (``T = 0``) uses ``T = 1`` and no nucleus (argmax is in it)."""
    if temperature == 0:
        return logits.float()
    return nucleus(logits.float() / temperature, top_p)


def tail_adjusted(scaled: torch.Tensor, p: torch.Tensor, q: torch.Tensor, eta: float,
                  tail: float = TAIL) -> torch.Tensor:
    """The retrieval-augmented target ``p^`` (rows over the last dimension) by the tail rule."""
    if eta == 0:
        return p
    head = q >= tail * q.amax(dim=-1, keepdim=True)
    return torch.softmax(torch.where(head, scaled + eta * (q - p), scaled), dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, p - p^, 0))``: where the token comes from after a rejection.

    When it has no mass (``p = q`` and ``p^ = p``, where a rejection has probability zero and can only
    come from rounding) it falls back to ``p``, so the result is always a distribution.
    """
    mass = torch.clamp(torch.maximum(p - q, p - p_hat), min=0)
    total = mass.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, mass / total.clamp_min(torch.finfo(mass.dtype).tiny), p)


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: how many drafted tokens were accepted, and the token after them."""

    accepted: int
    token: int
    bonus: bool  # True when every draft was accepted and ``token`` came from p


def verify(target_logits: torch.Tensor, draft_q: torch.Tensor, drafts: list[int], *, eta: float,
           temperature: float, top_p: float, generator: torch.Generator | None) -> Verdict:
    """Accept or reject ``drafts`` (g tokens) against the target.

    ``target_logits`` is ``[g + 1, V]``: row i scores the position of draft i, row g the bonus position.
    ``draft_q`` is ``[g, V]``: the distributions the drafts were drawn from (for greedy, the drafter's
    softmax). ``generator`` (CPU) draws the uniforms and the replacement token when sampling.
    """
    g = len(drafts)
    scaled = scaled_logits(target_logits, temperature, top_p)
    p = torch.softmax(scaled, dim=-1)
    p_hat = tail_adjusted(scaled[:g], p[:g], draft_q, eta)
    index = torch.arange(g, device=p.device)
    tokens = torch.tensor(drafts, device=p.device, dtype=torch.long)
    if temperature == 0:
        ok = p_hat.argmax(dim=-1) == tokens
    else:
        ratio = p_hat[index, tokens] / draft_q[index, tokens]
        ok = torch.rand(g, generator=generator).to(p.device) <= ratio
    rejected = (~ok).nonzero()
    if len(rejected) == 0:
        return Verdict(g, _choose(p[g], temperature, generator), True)
    first = int(rejected[0])
    if temperature == 0:
        return Verdict(first, int(p_hat[first].argmax()), False)
    return Verdict(first, _choose(residual(p[first], draft_q[first], p_hat[first]), temperature, generator), False)


def _choose(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(probs.argmax())
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
