"""Per-step fusion rules over stream scores (pure tensor functions, no model, no state but beta).

Each rule is a callable ``rule(logits) -> FusedStep`` over the logits of all streams of one step
(row 0 the context-free stream, rows 1..K the experts), like a transformers logits processor:
arguments are checked in ``__init__`` and inputs are never edited in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ctx_integrations.engine.streams import FusedStep
from ctx_integrations.errors import InvalidOptionError

SCORE_SPACES = ("logprobs", "logits")
AGGREGATIONS = ("max", "mixture", "product")
_TINY = torch.finfo(torch.float32).tiny


def jensen_shannon(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """JSD(softmax(p), softmax(q)) in nats along the last axis; in [0, ln 2]."""
    log_p, log_q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    log_m = torch.logsumexp(torch.stack([log_p, log_q]), 0) - math.log(2.0)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm)).clamp(0.0, math.log(2.0))


def relevance_weights(relevance: Sequence[float] | torch.Tensor) -> torch.Tensor:
    r = torch.as_tensor(relevance, dtype=torch.float32)
    total = r.sum()
    return r / total if total > 0 else torch.full_like(r, 1.0 / len(r))


class PCEDFusion:
    """Parallel Context-of-Experts fusion (METHODS.md "PCED").

    s^_k = (1 + beta_k) s_k - beta_k s_0 + gamma log r_k, then ``max`` over experts (default),
    or ``mixture`` (log sum_k w_k p_k) / ``product`` (sum_k w_k log p_k) with w = r / sum r and
    p_k = softmax((1 + beta_k) s_k - beta_k s_0). ``beta=None`` is AdaCAD's dynamic rule:
    beta_k = JSD(softmax(s_k), softmax(s_0)) at the first generated token, then fixed.
    ``score_space="logprobs"`` normalises each stream first so experts are comparable (raw logits
    carry a per-expert offset); ``"logits"`` is the paper's literal formula.
    """

    def __init__(self, relevance: Sequence[float], *, beta: float | None = None, gamma: float = 2.5,
                 score_space: str = "logprobs", aggregation: str = "max"):
        if len(relevance) == 0:
            raise InvalidOptionError("PCED needs at least one expert")
        if score_space not in SCORE_SPACES:
            raise InvalidOptionError(f"score_space must be one of {SCORE_SPACES}, got {score_space!r}")
        if aggregation not in AGGREGATIONS:
            raise InvalidOptionError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if beta is not None and (not math.isfinite(beta) or beta < 0):
            raise InvalidOptionError(f"beta must be None (dynamic) or a float >= 0, got {beta!r}")
        if not math.isfinite(gamma) or gamma < 0:
            raise InvalidOptionError(f"gamma must be a float >= 0, got {gamma!r}")
        self.relevance = torch.as_tensor(relevance, dtype=torch.float32)
        self.gamma, self.score_space, self.aggregation = gamma, score_space, aggregation
        self.fixed_beta = beta
        self.beta: torch.Tensor | None = None if beta is None else torch.full((len(relevance),), float(beta))

    def __call__(self, logits: torch.Tensor) -> FusedStep:
        logits = logits.float()
        amateur, experts = logits[0], logits[1:]
        if experts.shape[0] != self.relevance.shape[0]:
            raise InvalidOptionError(f"got {experts.shape[0]} expert streams for {self.relevance.shape[0]} scores")
        if self.beta is None:
            self.beta = jensen_shannon(experts, amateur.expand_as(experts)).cpu()
        beta = self.beta.to(logits.device).unsqueeze(1)
        if self.score_space == "logprobs":
            amateur, experts = torch.log_softmax(amateur, -1), torch.log_softmax(experts, -1)
        contrastive = (1 + beta) * experts - beta * amateur
        relevance = self.relevance.to(logits.device)
        if self.aggregation == "max":
            adjusted = contrastive + self.gamma * torch.log(relevance.clamp_min(_TINY)).unsqueeze(1)
            return FusedStep(adjusted.max(0).values, adjusted)
        weights = relevance_weights(relevance).to(logits.device).unsqueeze(1)
        log_p = torch.log_softmax(contrastive, -1)
        if self.aggregation == "mixture":
            weighted = torch.log(weights.clamp_min(_TINY)) + log_p
            return FusedStep(torch.logsumexp(weighted, 0), weighted)
        return FusedStep((weights * log_p).sum(0), torch.log(weights.clamp_min(_TINY)) + log_p)


# --- Soft-NBCE and its limits (METHODS.md "Soft-NBCE") ------------------------------------------

# NBCE's clip value: a token outside a chunk's top-p nucleus scores as if its log-prob were -100.
# Nucleus log-probs are always above log(0.1 / V) (about -13 for a 50k vocabulary), so a floored
# token can never outrank a kept one, yet the weighted sum stays finite (no -inf * 0 = NaN).
FILTERED_LOGPROB = -100.0


def nucleus_mask(logprobs: torch.Tensor, rho: float) -> torch.Tensor:
    """Top-p nucleus of each row of ``logprobs`` ([..., V]): the smallest head of the sorted distribution
    whose mass reaches ``rho``; the top token is always kept, so no row is ever empty. ``rho=1`` keeps
    every token (fp32 rounding would otherwise drop a tail whose cumulative sum already reads 1.0)."""
    if rho >= 1:
        return torch.ones_like(logprobs, dtype=torch.bool)
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True)
    probs = sorted_logprobs.exp()
    keep_sorted = torch.cumsum(probs, -1) - probs < rho
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def truncated_entropy(logprobs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """NBCE's entropy of a top-p filtered distribution: -sum over kept v of p(v) log p(v), not renormalised.

    Not renormalising keeps a confident chunk's entropy strictly positive and distinct from another
    confident chunk's, so hard selection rarely meets exact ties.
    """
    terms = logprobs.exp() * logprobs.clamp_min(FILTERED_LOGPROB)
    return -torch.where(keep, terms, torch.zeros_like(terms)).sum(-1)


def contrast_chunks(prior: torch.Tensor, chunks: torch.Tensor, prior_keep: torch.Tensor, chunk_keep: torch.Tensor,
                    beta: float) -> torch.Tensor:
    """Per-chunk scores S_k = (1 + beta) L~_k - beta L_prior, with L~_k floored outside chunk k's nucleus.

    Where the prior filtered a token the contrast is dropped and S_k = L~_k (NBCE's fallback): the
    prior's log-prob is only trusted on its own nucleus. ``prior`` broadcasts against ``chunks`` (chunk axis 0).
    """
    kept = torch.where(chunk_keep, chunks, torch.full_like(chunks, FILTERED_LOGPROB))
    contrast = (1 + beta) * kept - beta * prior.clamp_min(FILTERED_LOGPROB)
    return torch.where(prior_keep, contrast, kept)


class SoftNBCEFusion:
    """Soft-NBCE: fuse chunk experts with entropy weights w_k = softmax_k(-H_k / tau).

    Rows of the step's logits: 0 = the prior (query only), 1..K = chunks. Per step, log-probs L_k
    are top-p filtered with ``rho``, H_k is the truncated entropy, and
    fused(v) = sum_k w_k S_k(v) with S_k from :func:`contrast_chunks`. Filtered tokens: inside the
    union of the chunks' nuclei a chunk that filtered v contributes the floor -100 (finite, far
    below any kept token); outside that union fused(v) = -inf. The union always holds every chunk's
    top token, so the support is never empty and the scores never NaN. Evidence (the citation
    trace) is log w_k + S_k(v): the chunk that gives the chosen token the most weighted support.
    ``tau=math.inf`` is exactly the uniform average (:class:`PCWFusion`).
    """

    def __init__(self, *, tau: float = 0.1, beta: float = 0.25, rho: float = 0.9):
        if not (tau > 0):  # also refuses NaN
            raise InvalidOptionError(f"tau must be > 0 (math.inf = uniform average), got {tau!r}")
        self.tau = tau
        if not math.isfinite(beta) or beta < 0:
            raise InvalidOptionError(f"beta must be a float >= 0, got {beta!r}")
        if not 0 < rho <= 1:
            raise InvalidOptionError(f"rho (each chunk's top-p) must be in (0, 1], got {rho!r}")
        self.beta, self.rho = beta, rho

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        """Weights over the chunk axis (0) from the chunks' entropies."""
        return torch.softmax(-entropy / self.tau, dim=0)

    def __call__(self, logits: torch.Tensor) -> FusedStep:
        if logits.shape[0] < 2:
            raise InvalidOptionError("Soft-NBCE needs the prior stream plus at least one chunk stream")
        logprobs = torch.log_softmax(logits.float(), -1)
        keep = nucleus_mask(logprobs, self.rho)
        scores = contrast_chunks(logprobs[0], logprobs[1:], keep[0], keep[1:], self.beta)
        weights = self.chunk_weights(truncated_entropy(logprobs[1:], keep[1:])).unsqueeze(1)
        fused = (weights * scores).sum(0)
        fused = torch.where(keep[1:].any(0), fused, torch.full_like(fused, -math.inf))
        return FusedStep(fused, torch.log(weights.clamp_min(_TINY)) + scores)


class NBCEFusion(SoftNBCEFusion):
    """Hard NBCE, the tau -> 0 limit: all weight on the lowest-entropy chunk (the first one on a tie)."""

    def __init__(self, *, beta: float = 0.25, rho: float = 0.9):
        super().__init__(tau=1.0, beta=beta, rho=rho)

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.argmin(entropy, dim=0), entropy.shape[0]).movedim(-1, 0).float()


class PCWFusion(SoftNBCEFusion):
    """The tau -> infinity limit: the uniform average of the chunks' contrasted scores."""

    def __init__(self, *, beta: float = 0.25, rho: float = 0.9):
        super().__init__(tau=math.inf, beta=beta, rho=rho)

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        return torch.full_like(entropy, 1.0 / entropy.shape[0])
