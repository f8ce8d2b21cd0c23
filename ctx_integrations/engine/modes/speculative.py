"""The pure math of RAPID's speculative step (the RAPID paper, Algorithm 1 and Eq. 6-10), as small tensor functions.

Kept apart from the decode loop so every rule can be checked against its closed form:

- ``p = softmax(z / T)`` is the target over the long context, ``q`` the drafter's distribution;
- the retrieval-augmented target (paper Eq. 6): ``p^ = softmax(z / T + eta * (q - p))``;
- the tail rule (paper Eq. 9, ``tail_rule="paper"``, the default): tokens whose ``p^`` is below
  ``0.1 * max(p^)`` keep their target probability, ``p^(v) = p(v)``, "to prevent distortion in the
  tail"; as in the paper the result is not renormalised (the acceptance ratio reads it token by
  token and the residual is normalised anyway). ``tail_rule="draft_head"`` is our earlier variant,
  not the paper's: the shift ``eta * (q - p)`` is applied only where ``q >= 0.1 * max(q)`` (a
  head computed on the drafter's q, not on p^) and the result is renormalised;
- a drafted token ``x`` is accepted while ``U <= p^(x) / q(x)``;
- on the first rejection the token is drawn from ``norm(max(p - q, p - p^, 0))``;
- when every draft is accepted a bonus token is drawn from ``p``.

With ``eta = 0`` we get ``p^ = p`` and this is exactly standard speculative sampling, whose output
is distributed as ``p``. Greedy decoding (``temperature = 0``) is not defined by the paper; ours:
accept a draft iff it equals ``argmax p^``, otherwise emit ``argmax p^``; the bonus is ``argmax p``.
With ``eta = 0`` that is token for token plain greedy decoding of the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ctx_integrations.engine.core.decoding import TokenSampler, check_finite_scores, race_noise, race_winner
from ctx_integrations.engine.modes.specs import TAIL_RULES
from ctx_integrations.errors import InvalidOptionError

TAIL = 0.1  # the paper's cut-off (Eq. 9): tokens with p^ < 0.1 * max(p^) keep their target probability


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the top-p nucleus (over the last dimension) to -inf; the top token always stays."""
    if top_p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop[..., 0] = False  # a top_p below float32's smallest number compares as 0 and would drop every token
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def scaled_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``z / T`` restricted to the nucleus; greedy (``T = 0``) uses ``T = 1`` and no nucleus (argmax is in it).

    NaN logits are refused here (every draft and verification passes through): argmax over them is token 0.
    """
    check_finite_scores(float(logits.max()))
    if temperature == 0:
        return logits.float()
    return nucleus(logits.float() / temperature, top_p)


def check_tail_rule(tail_rule: str) -> None:
    if tail_rule not in TAIL_RULES:
        raise InvalidOptionError(f"tail_rule must be one of {', '.join(map(repr, TAIL_RULES))} ('paper': Eq. 9 on "
                                 f"p^; 'draft_head': the shift only where q >= 0.1 max q), got {tail_rule!r}")


def augmented_target(scaled: torch.Tensor, p: torch.Tensor, q: torch.Tensor, eta: float) -> torch.Tensor:
    """Paper Eq. 6: ``p^ = softmax(z / T + eta * (q - p))`` (``scaled`` is ``z / T``), no tail rule."""
    return torch.softmax(scaled + eta * (q - p), dim=-1)


def tail_adjusted(scaled: torch.Tensor, p: torch.Tensor, q: torch.Tensor, eta: float,
                  tail: float = TAIL, rule: str = "paper") -> torch.Tensor:
    """The retrieval-augmented target ``p^`` (rows over the last dimension) with a tail rule.

    ``rule="paper"`` (Eq. 9): ``p^`` from Eq. 6, then every token with ``p^(v) < tail * max(p^)``
    takes back ``p(v)``; not renormalised, as written in the paper. ``rule="draft_head"`` (variant):
    the shift applies only where ``q >= tail * max(q)``, then softmax. ``eta = 0`` gives ``p`` in both.
    """
    check_tail_rule(rule)
    if eta == 0:
        return p
    if rule == "draft_head":
        head = q >= tail * q.amax(dim=-1, keepdim=True)
        return torch.softmax(torch.where(head, scaled + eta * (q - p), scaled), dim=-1)
    p_hat = augmented_target(scaled, p, q, eta)
    return torch.where(p_hat < tail * p_hat.amax(dim=-1, keepdim=True), p, p_hat)


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
           temperature: float, top_p: float, generator: torch.Generator | None, tail_rule: str = "paper") -> Verdict:
    """Accept or reject ``drafts`` (g tokens) against the target: the rule as the paper writes it, on the host (the
    first rejection read back), the reference the device forms the engine runs (:func:`greedy_verdict`,
    :func:`sampled_verdict`) are tested against.

    ``target_logits`` is ``[g + 1, V]``: row i scores the position of draft i, row g the bonus position.
    ``draft_q`` is ``[g, V]``: the distributions the drafts were drawn from (for greedy, the drafter's
    softmax). ``generator`` (CPU) draws the uniforms and the replacement token when sampling.
    """
    g = len(drafts)
    scaled = scaled_logits(target_logits, temperature, top_p)
    p = torch.softmax(scaled, dim=-1)
    p_hat = tail_adjusted(scaled[:g], p[:g], draft_q, eta, rule=tail_rule)
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


def greedy_verdict(target_logits: torch.Tensor, draft_q: torch.Tensor, drafts: torch.Tensor, *, eta: float,
                   tail_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify`'s greedy branch on the device, reading nothing back: ``(accepted, token)``.

    Same rule (accept while the draft is ``argmax p^``; the first rejected position takes ``argmax p^``;
    all accepted: the bonus ``argmax p``), so a batch can read every request's verdict in one transfer.
    ``target_logits`` ``[..., g + 1, V]``, ``draft_q`` ``[..., g, V]``, ``drafts`` ``[..., g]`` (long, on the logits'
    device): leading dimensions are requests verified together (0-d results for one, ``[J]`` for J); the caller
    checks the logits are finite.
    """
    g = drafts.shape[-1]
    scaled = target_logits.float()
    p = torch.softmax(scaled, dim=-1)
    p_hat = tail_adjusted(scaled[..., :g, :], p[..., :g, :], draft_q, eta, rule=tail_rule)
    best = p_hat.argmax(dim=-1)
    accepted = (best == drafts).long().cumprod(-1).sum(-1)
    choices = torch.cat([best, p[..., g, :].argmax(dim=-1, keepdim=True)], dim=-1)
    return accepted, choices.gather(-1, accepted.unsqueeze(-1)).squeeze(-1)


def sampled_verdict(target_logits: torch.Tensor, draft_q: torch.Tensor, drafts: torch.Tensor, *, eta: float,
                    temperature: float, top_p: float, noise: tuple[torch.Tensor, torch.Tensor],
                    tail_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify`'s sampling branch on the device, reading nothing back: ``(accepted, token)``.

    The same rule with the same draws: ``noise`` is what :func:`verdict_noise` drew from the request's generator, in
    :func:`verify`'s order (the ``g`` uniforms that accept or reject the drafts, then the exponential race of one draw
    over ``V`` tokens, ``multinomial``'s own algorithm: :func:`~ctx_integrations.engine.core.decoding.race_winner`),
    from the residual after the first rejected draft or from ``p`` at the bonus position when
    every draft is accepted. Instead of reading back where the first rejection is, every row's residual is computed
    and the draw's row is picked on the device. Shapes as :func:`greedy_verdict`'s (leading dimensions: requests
    verified together, each with its own noise, ``[..., g]`` and ``[..., V]``); the caller checks the logits are
    finite (:func:`verify` reads them to refuse NaN).
    """
    uniforms, race = noise
    g = drafts.shape[-1]
    scaled = nucleus(target_logits.float() / temperature, top_p)
    p = torch.softmax(scaled, dim=-1)
    p_hat = tail_adjusted(scaled[..., :g, :], p[..., :g, :], draft_q, eta, rule=tail_rule)
    at_drafts = drafts.unsqueeze(-1)
    ratio = (p_hat.gather(-1, at_drafts) / draft_q.gather(-1, at_drafts)).squeeze(-1)
    ok = uniforms.to(p.device, non_blocking=True) <= ratio
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.cat([residual(p[..., :g, :], draft_q, p_hat), p[..., g:, :]], dim=-2)  # i < g: after rejecting draft i
    drawn_from = rows.gather(-2, accepted[..., None, None].expand(*accepted.shape, 1, rows.shape[-1])).squeeze(-2)
    return accepted, race_winner(drawn_from, race)


def verdict_noise(generator: torch.Generator, drafts: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled verdict's draws from its request's generator (on the CPU), in :func:`verify`'s order: ``drafts``
    uniforms, then the noise of one draw over ``width`` tokens (:func:`sampled_verdict`'s ``noise``)."""
    uniforms = torch.rand(drafts, generator=generator)
    return uniforms, race_noise(generator, width, torch.float32)


def verdict_noises(samplers: Sequence[TokenSampler], drafts: int, width: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """J sampled verdicts' noise on ``device``, ``([J, drafts], [J, width])``: a seeded request's from its own
    generator (:func:`verdict_noise`: what :func:`verify` draws, on every device, alone or batched), the unseeded
    requests' in one draw on the device from its default generator, as
    :func:`~ctx_integrations.engine.core.decoding.race_noises` draws every other mode's (no host draw for them).
    Each seeded row is drawn in place, in :func:`verdict_noise`'s order (no copy per request)."""
    seeded = [j for j, sampler in enumerate(samplers) if sampler.seeded]
    own_uniforms, own_race = torch.empty(len(seeded), drafts), torch.empty(len(seeded), width)
    for uniforms, race, j in zip(own_uniforms.unbind(), own_race.unbind(), seeded):
        uniforms.uniform_(generator=samplers[j].generator)
        race.exponential_(generator=samplers[j].generator)
    own_uniforms, own_race = own_uniforms.to(device, non_blocking=True), own_race.to(device, non_blocking=True)
    if len(seeded) == len(samplers):
        return own_uniforms, own_race
    uniforms = torch.rand(len(samplers), drafts, device=device)
    race = torch.empty(len(samplers), width, device=device).exponential_()
    if seeded:
        uniforms[seeded], race[seeded] = own_uniforms, own_race
    return uniforms, race


def _choose(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(probs.argmax())
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
