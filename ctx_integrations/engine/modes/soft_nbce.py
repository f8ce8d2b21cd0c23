"""Soft-NBCE mode and its named limits, hard NBCE and PCW (the Soft-NBCE paper, Algorithm 1).

One stream per chunk (``prefix + chunk + question``) plus a query-only prior (row 0), decoded in
lockstep by the same job shape as PCED (:func:`expert_streams_job`); only the per-step rule
differs (:class:`SoftNBCEFusion`, :class:`NBCEFusion`, :class:`PCWFusion` below). The default rule is the
paper's Algorithm 1 (``rule="paper"``); NBCE's reference-code behaviour is the named variant ``rule="nbce_code"``.

Chunks: every document is split on its own into pieces of at most ``chunk_tokens`` tokens, so one
long document beyond the model's window becomes many chunk streams, and a chunk never spans two
documents. A document that fits in one chunk is used verbatim, so its KV cache from ingestion is a
hit. ``chunk_tokens=None`` uses the documents as they are (one stream each).

Citations: the fusion rule's trace names a chunk (a stream row); this module maps it back to the
chunk's source document, so ``Answer.trace[i].document`` indexes ``Answer.documents`` as in every
mode. The chunk index per token is kept in ``Answer.extra["trace_chunks"]``, and
``extra["chunk_documents"][c]`` is the source document of chunk c.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ctx_integrations.engine.core.decoding import (
    FIRST_STEP,
    DecodeResult,
    FusedBatch,
    FusedStep,
    FusionState,
    padded_streams,
)
from ctx_integrations.engine.core.experts import expert_streams_job
from ctx_integrations.engine.core.jobs import FusedJob
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.validation import real_number
from ctx_integrations.engine.modes.priors import check_query_likelihood, likelihood_prior, log_prior
from ctx_integrations.engine.modes.specs import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_FLOOR,
    DEFAULT_PRIOR,
    DEFAULT_TAU,
    MIN_TAU,
    NBCE,
    PAPER_RHO,
    PCW,
    RULES,
    SOFT_NBCE,
)
from ctx_integrations.engine.modes.specs import SOFT_NBCE_GAMMA as PRIOR_GAMMA
from ctx_integrations.engine.modes.specs import SOFT_NBCE_MAX_BETA as MAX_BETA
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError

TINY = torch.finfo(torch.float32).tiny  # floor of chunk weights before their log (citation evidence)
# Re-tokenising a chunk's text can move a boundary token and the layout appends a newline.
_RETOKENIZE_SLACK = 4


# A request's rho = 1 among a batch's other rhos: above the mass before any token (at most 1 plus fp32 rounding), so
# every token is kept, as :func:`nucleus_mask` keeps them for rho = 1 alone.
WHOLE_NUCLEUS = 2.0

# The ``nbce_code`` variant's clip value: a token outside a chunk's top-p nucleus scores as if its
# log-prob were -100. Nucleus log-probs are always above log(0.1 / V) (about -13 for a 50k vocabulary),
# so a floored token can never outrank a kept one, yet the weighted sum stays finite.
FILTERED_LOGPROB = -100.0

# The mode's defaults where the retriever ranks the chunks (PRIOR_GAMMA and PAPER_RHO: engine/modes/specs.py). Where
# the scores rank them, that softmax prior also takes the question's log-likelihood given each chunk, of weight
# QUERY_LIKELIHOOD (PCED's option's value; held-out NQ-open questions, seeds 3 and 4: +19 / -4 answers against the
# prior alone, docs/evaluation.md).
QUERY_LIKELIHOOD = 0.2


def check_gamma(gamma: float) -> None:
    real_number("gamma", gamma, minimum=0.0, maximum=MAX_BETA, hint=" (weight of the retrieval prior; 0: none)")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise InvalidOptionError(f"rule must be one of {', '.join(map(repr, RULES))} ('paper': Algorithm 1 of "
                                 f"the Soft-NBCE paper; 'nbce_code': NBCE's reference code), got {rule!r}")


def nucleus_mask(logprobs: torch.Tensor, rho: float | torch.Tensor) -> torch.Tensor:
    """Top-p nucleus of each row of ``logprobs`` ([..., V]): the smallest head of the sorted distribution
    whose mass reaches ``rho``; the top token is always kept, so no row is ever empty. ``rho=1`` keeps
    every token (fp32 rounding would otherwise drop a tail whose cumulative sum already reads 1.0).
    ``rho`` may be a tensor broadcasting against ``logprobs`` (each request of a batch its own, ``[J, 1, 1]``;
    :class:`Knobs` holds a request's ``rho=1`` as 2, above any mass before a token, so it keeps every token too)."""
    if not isinstance(rho, torch.Tensor) and rho >= 1:
        return torch.ones_like(logprobs, dtype=torch.bool)
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True)
    probs = sorted_logprobs.exp()
    keep_sorted = torch.cumsum(probs, -1) - probs < rho
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def nucleus_logprobs(logprobs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log P_k of Algorithm 1 (lines 6-7): logits masked to -inf outside the nucleus, then renormalised.

    Log-probs and logits differ by a constant per row, so this is ``log_softmax`` of the masked logits.
    """
    return torch.log_softmax(torch.where(keep, logprobs, torch.full_like(logprobs, -math.inf)), -1)


def nucleus_entropy(masked_logprobs: torch.Tensor) -> torch.Tensor:
    """H_k of Algorithm 1 (line 7): the entropy of the renormalised top-p distribution (0 log 0 = 0)."""
    terms = masked_logprobs.exp() * masked_logprobs
    return -torch.where(torch.isfinite(masked_logprobs), terms, torch.zeros_like(terms)).sum(-1)


def paper_contrast(prior: torch.Tensor, chunks: torch.Tensor, beta: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """S_k = (1 + beta) L_k - beta L_prior (Algorithm 1, line 10), with L_k -inf outside chunk k's nucleus
    and the prior unfiltered. Where the prior itself is -inf (a model that masks tokens) the contrast term
    is dropped, S_k = (1 + beta) L_k, so the score is never +inf or NaN (-inf + inf). ``prior`` broadcasts against
    ``chunks`` (chunk axis -2); ``beta`` is each request's (:class:`Knobs`) and ``scale`` its ``1 + beta``, rounded
    once from the Python float, as ``(1 + beta) * x`` rounds it."""
    penalty = torch.where(torch.isfinite(prior), beta * prior, torch.zeros_like(prior))
    return scale * chunks - penalty


def chunk_sum(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over the chunk axis ``dim`` (kept, size 1) in a pairwise order fixed by the axis alone: padded with
    -0.0 to a power of two, then the two halves added until one is left.

    Written by hand because torch's own sums order their additions by the axis' length (vectorised blocks of
    rows), so a request padded to a wider batch would round its sums differently than alone. Here a request's
    values padded with zeros (-0.0, the exact identity of ``+``) to any wider axis meet the same partial sums:
    each doubling adds a half of zeros to the half that holds them.
    """
    size, dim = values.shape[dim], dim % values.dim()
    width = 1 << (size - 1).bit_length()
    if width > size:  # F.pad lists (before, after) per axis from the last one back
        values = torch.nn.functional.pad(values, [0, 0] * (values.dim() - 1 - dim) + [0, width - size], value=-0.0)
    while width > 1:
        width //= 2
        values = values.narrow(dim, 0, width) + values.narrow(dim, width, width)
    return values


def chunk_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``softmax`` over the last axis (the chunks) with :func:`chunk_sum`'s order, so that a request's weights do
    not depend on the padding beside it (a padded chunk's logit is -inf: exp gives 0)."""
    exps = torch.exp(logits - logits.amax(-1, keepdim=True))
    return exps / chunk_sum(exps, -1)


def paper_fusion(weights: torch.Tensor, scores: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """sum_k w_k S_k(v) (Algorithm 1, line 10) with -inf outside the nuclei, made total.

    Read literally, w_k * -inf = -inf for any w_k > 0, so a token survives only if it lies in the nucleus
    of every chunk, and the paper leaves two cases open. Our rule (documented in docs/soft_nbce.md):
    - a chunk whose weight is exactly 0 (underflow at small tau; hard NBCE's losers) neither contributes
      nor restricts the support (the w_k -> 0 limit, and 0 * -inf would be NaN);
    - if the nuclei share no token (every token -inf), chunks are taken in increasing entropy (the
      order of decreasing weight, whatever tau, so the tau -> 0 and tau -> inf limits still hold) and a
      chunk whose nucleus shares no token with the support of those taken so far is left out, its
      weight dropped and the rest renormalised. The most confident chunk is always taken, so the
      support is never empty, and whenever the paper's support is not empty this is the paper's sum.
    ``weights`` [..., K], ``scores`` [..., K, V], ``entropy`` [..., K]; returns [..., V] (each leading index on its
    own). With a retrieval prior (``gamma`` > 0) ``entropy`` is the negated routing logit instead
    (:meth:`SoftNBCEFusion.support_order`): still the order of decreasing weight.

    Nothing is read back to the host (on an accelerator every read would wait for the device): the chunks are
    ranked on the device, and each of the K ranks (K from the shape) takes or skips its chunk with ``torch.where``.
    """
    finite = torch.isfinite(scores)
    order = torch.argsort(entropy, dim=-1, stable=True)
    ranked_finite = finite.gather(-2, order.unsqueeze(-1).expand_as(finite))
    ranked_weighted = weights.gather(-1, order) > 0
    support = torch.ones_like(finite[..., 0, :])
    taken = []
    for rank in range(finite.shape[-2]):
        narrowed = support & ranked_finite[..., rank, :]
        take = ranked_weighted[..., rank] & narrowed.any(-1)
        support = torch.where(take.unsqueeze(-1), narrowed, support)
        taken.append(take)
    used = torch.zeros_like(ranked_weighted).scatter(-1, order, torch.stack(taken, -1))
    kept = torch.where(used, weights, torch.full_like(weights, -0.0))
    kept = (kept / chunk_sum(kept, -1)).unsqueeze(-1)
    terms = torch.where(used.unsqueeze(-1) & support.unsqueeze(-2), kept * scores, torch.full_like(scores, -0.0))
    return torch.where(support, chunk_sum(terms, -2).squeeze(-2), torch.full_like(scores[..., 0, :], -math.inf))


def truncated_entropy(logprobs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``nbce_code``: NBCE's entropy of a top-p filtered distribution, -sum over kept v of p(v) log p(v),
    not renormalised (keeps a confident chunk's entropy strictly positive and distinct from another's)."""
    terms = logprobs.exp() * logprobs.clamp_min(FILTERED_LOGPROB)
    return -torch.where(keep, terms, torch.zeros_like(terms)).sum(-1)


def contrast_chunks(prior: torch.Tensor, chunks: torch.Tensor, prior_keep: torch.Tensor, chunk_keep: torch.Tensor,
                    beta: float | torch.Tensor, scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """``nbce_code``: S_k = (1 + beta) L~_k - beta L_prior, with L~_k floored at -100 outside chunk k's nucleus.

    Where the prior filtered a token the contrast is dropped and S_k = L~_k (NBCE's fallback): the
    prior's log-prob is only trusted on its own nucleus. ``prior`` broadcasts against ``chunks`` (chunk axis 0, or
    -2 with a batch axis); ``beta`` and ``scale`` as in :func:`paper_contrast`.
    """
    kept = torch.where(chunk_keep, chunks, torch.full_like(chunks, FILTERED_LOGPROB))
    contrast = (1 + beta if scale is None else scale) * kept - beta * prior.clamp_min(FILTERED_LOGPROB)
    return torch.where(prior_keep, contrast, kept)


@dataclass(frozen=True)
class Knobs:
    """The knobs of J requests' rules, one row each, as float32 tensors on the logits' device that broadcast
    against the batch's ``[J, W]`` chunk values and ``[J, W, V]`` scores (W chunk columns: every request's
    chunks, padded to the widest request's count).

    They are built from the Python floats in one tensor and one transfer (:meth:`of`), so each value is the
    float32 the float itself rounds to in ``x * float``: a request gets in a batch exactly what it gets alone
    (``scale`` is ``1 + beta`` computed in Python, as ``(1 + beta) * x`` computes it). A request alone is a
    batch of one, with the same tensors.
    """

    rule: str  # "paper" or "nbce_code", the batch's
    tau: torch.Tensor  # [J, 1]
    beta: torch.Tensor  # [J, 1, 1]
    scale: torch.Tensor  # [J, 1, 1]: 1 + beta
    rho: torch.Tensor | float  # [J, 1, 1], 2.0 for rho = 1 (every token); 1.0 when every request keeps every token
    share: torch.Tensor  # [J, W]: 1 / K_j on request j's chunks, 0 on its padding (PCW's weights)
    chunks: torch.Tensor | None  # [J, W] bool: request j's K_j chunks; None when no request is padded
    gamma: torch.Tensor | None  # [J, 1]; None when no request routes by a prior
    log_prior: torch.Tensor | None  # [J, W]: each chunk's log-prior where gamma > 0 (its measured_prior if any), else 0

    @classmethod
    def of(cls, rules: Sequence[SoftNBCEFusion], counts: Sequence[int], device: torch.device) -> Knobs:
        """The knobs of ``rules``, request j with ``counts[j]`` chunks (each rule checks its own count first)."""
        width, routed = max(counts), any(rule.gamma > 0 for rule in rules)
        rows = []
        for rule, count in zip(rules, counts, strict=True):
            pad = [0.0] * (width - count)
            logs = rule.log_prior_values if rule.gamma > 0 else (0.0,) * count
            rho = WHOLE_NUCLEUS if rule.rho >= 1 else rule.rho
            share = [1.0 / count] * count
            rows.append([rule.tau, rule.beta, 1 + rule.beta, rho, rule.gamma, *share, *pad, *logs, *pad])
        table = torch.tensor(rows, dtype=torch.float32).to(device)
        for j, (rule, count) in enumerate(zip(rules, counts, strict=True)):
            if rule.measured_prior is not None:  # already on the device: written there, not read back
                table[j, 5 + width:5 + width + count] = rule.measured_prior
        share = table[:, 5:5 + width]
        whole = all(rule.rho >= 1 for rule in rules)
        return cls(rule=rules[0].rule, tau=table[:, 0:1], beta=table[:, 1:2].unsqueeze(2),
                   scale=table[:, 2:3].unsqueeze(2), rho=1.0 if whole else table[:, 3:4].unsqueeze(2), share=share,
                   chunks=None if min(counts) == width else share > 0, gamma=table[:, 4:5] if routed else None,
                   log_prior=table[:, 5 + width:] if routed else None)


class SoftNBCEFusion:
    """Soft-NBCE: fuse chunk experts with entropy weights w_k = softmax_k(-H_k / tau).

    Rows of the step's logits: 0 = the prior (query only), 1..K = chunks.

    ``rule="paper"`` (default, the paper's Algorithm 1): each chunk's distribution is top-p masked with
    ``rho`` (-inf outside its nucleus) and renormalised, H_k is the entropy of that renormalised
    distribution, the prior is unfiltered, fused(v) = sum_k w_k ((1 + beta) L_k(v) - beta L_prior(v)),
    so a token survives only inside every weighted chunk's nucleus (the empty case: :func:`paper_fusion`).

    ``rule="nbce_code"`` (the variant of NBCE's reference code): H_k is the truncated, not renormalised
    entropy; a chunk that filtered v contributes -100 instead of -inf; the prior's contrast applies only
    on the prior's own nucleus; the support is the union of the chunks' nuclei.

    Evidence (the citation trace) is log w_k + S_k(v): the chunk that gives the chosen token the most
    weighted support. ``tau=math.inf`` is exactly the uniform average (:class:`PCWFusion`).

    ``gamma`` > 0 (our variant; the paper routes by entropy alone, ``gamma=0``) adds a retrieval prior to the
    routing: w_k = softmax_k(-H_k / tau + gamma * log_prior_k), where ``log_prior`` holds each chunk's
    log-prior (its document's, from :func:`~ctx_integrations.engine.modes.priors.log_prior`), so a chunk the
    retriever ranked low cannot take the weight with a confident (low-entropy) wrong token.

    ``query_likelihood`` > 0 (our variant, as PCED's; it needs gamma > 0 and each chunk's score, ``relevance``) makes
    that log-prior log softmax_k(r_k / prior_tau + query_likelihood * log p(q | chunk_k)) once the job has measured
    the question's log-likelihood on each chunk stream's prefill (:meth:`given_likelihood`, before the first token),
    so a chunk the model finds explains the question better gains weight (:func:`~.priors.likelihood_prior`).
    """

    # structured output masks the streams before this rule, so each nucleus is taken among the tokens the format
    # allows (masking the fused scores afterwards could leave none: a JSON brace outside every nucleus)
    format_masks_streams = True

    def __init__(self, *, tau: float = 0.1, beta: float = 0.25, rho: float = PAPER_RHO, rule: str = "paper",
                 gamma: float = 0.0, log_prior: Sequence[float] | torch.Tensor | None = None,
                 relevance: Sequence[float] | torch.Tensor | None = None, prior_tau: float = DEFAULT_TAU,
                 query_likelihood: float = 0.0):
        real_number("tau", tau, minimum=MIN_TAU, allow_inf=True,
                    hint=" (math.inf = uniform average; mode='nbce' is the tau -> 0 limit)")
        self.tau = tau
        real_number("beta", beta, minimum=0.0, maximum=MAX_BETA)
        real_number("rho", rho, minimum=0.0, maximum=1.0, min_inclusive=False, hint=" (each chunk's top-p)")
        check_rule(rule)
        check_gamma(gamma)
        if gamma > 0 and log_prior is None:
            raise InvalidOptionError("gamma > 0 needs each chunk's log-prior (log_prior=...)")
        self.beta, self.rho, self.rule, self.gamma = beta, rho, rule, gamma
        self.log_prior = None if log_prior is None else torch.as_tensor(log_prior, dtype=torch.float32)
        # the priors as Python floats (float32 values, exact), read once here: a step's knobs read no tensor back
        self.log_prior_values = () if self.log_prior is None else tuple(self.log_prior.tolist())
        check_query_likelihood(query_likelihood)
        if query_likelihood > 0 and (gamma == 0 or relevance is None):
            raise InvalidOptionError(f"query_likelihood={query_likelihood} needs gamma > 0 and each chunk's score "
                                     "(relevance=...): the likelihood reaches the weights through the retrieval prior")
        self.relevance = None if relevance is None else torch.as_tensor(relevance, dtype=torch.float32)
        if self.relevance is not None and self.log_prior is not None and self.relevance.shape != self.log_prior.shape:
            raise InvalidOptionError(f"got {self.relevance.numel()} chunk scores for {self.log_prior.numel()} priors")
        self.prior_tau, self.query_likelihood = prior_tau, query_likelihood
        self.measured_prior: torch.Tensor | None = None  # the prior with the likelihood (given_likelihood), on device

    @property
    def wants_likelihood(self) -> bool:
        """Whether the job should measure the question's log-likelihood on each stream (:meth:`given_likelihood`)."""
        return self.query_likelihood > 0

    def given_likelihood(self, likelihood: torch.Tensor) -> SoftNBCEFusion:
        """This rule with its chunks' log-prior re-ranked by the question's log-likelihood on each stream (``[1 + K]``,
        the query-only prior's first and unused), as a new rule: one built for a request keeps its scores-only prior.

        The new prior stays on the likelihood's device (``measured_prior``, which :meth:`Knobs.of` writes into the
        step's knobs there), so the step still reads the device once."""
        self._check_chunks(likelihood.shape[0] - 1)
        rule = copy.copy(self)
        rule.measured_prior = likelihood_prior(self.relevance, likelihood[1:], tau=self.prior_tau,
                                               weight=self.query_likelihood)
        return rule

    @staticmethod
    def routing(entropy: torch.Tensor, knobs: Knobs) -> torch.Tensor:
        """The chunks' routing logits ``[J, W]``, -H_k / tau (+ gamma * log_prior_k with a prior), -inf on a request's
        padding; the weights are their softmax."""
        logits = -entropy / knobs.tau
        if knobs.gamma is not None:
            logits = logits + knobs.gamma * knobs.log_prior
        return logits if knobs.chunks is None else logits.masked_fill(~knobs.chunks, -math.inf)

    @classmethod
    def weights(cls, entropy: torch.Tensor, knobs: Knobs) -> torch.Tensor:
        """Weights ``[J, W]`` over each request's chunks from their entropies (and, with gamma > 0, their priors);
        exactly 0 on its padding."""
        return chunk_softmax(cls.routing(entropy, knobs))

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        """This rule's weights over the chunk axis (0) of one step's entropies ``[K]``: :meth:`weights`, alone."""
        self._check_chunks(entropy.shape[0])
        return type(self).weights(entropy.unsqueeze(0), Knobs.of([self], [entropy.shape[0]], entropy.device))[0]

    @classmethod
    def support_order(cls, entropy: torch.Tensor, knobs: Knobs) -> torch.Tensor:
        """What :func:`paper_fusion` takes chunks in, ascending: the entropy (the paper's order of decreasing
        weight), or with a prior the negated routing logit, so the support follows the weights the prior set.
        (A request's padding has weight 0, so wherever it ranks it is never taken.)"""
        if knobs.gamma is None:
            return entropy
        return torch.where(knobs.gamma > 0, -cls.routing(entropy, knobs), entropy)

    def _check_chunks(self, count: int) -> None:
        """Refuse a step without a chunk stream, or with a prior per chunk that are not one per stream."""
        if count < 1:
            raise InvalidOptionError("Soft-NBCE needs the prior stream plus at least one chunk stream")
        if self.gamma > 0 and len(self.log_prior_values) != count:
            raise InvalidOptionError(f"got {count} chunk streams for {len(self.log_prior_values)} priors")

    @classmethod
    def fuse(cls, logits: torch.Tensor, knobs: Knobs) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused scores ``[J, V]`` and evidence ``[J, W, V]`` (``-inf`` on a request's padding) of J requests'
        streams ``logits`` ``[J, 1 + W, V]`` (each request's prior, then its chunks, then copies of its prior up to
        W); the rules share the class and ``knobs.rule``. One request alone is a batch of one (:meth:`__call__`),
        so one formula serves both, and every operation is per request: a padded chunk has weight exactly 0, so it
        neither contributes nor restricts the support (the rule's own treatment of a zero weight), and its nucleus
        is left out of ``nbce_code``'s union.
        """
        logprobs = torch.log_softmax(logits.float(), -1)
        prior, chunk_rows = logprobs[:, :1], logprobs[:, 1:]
        if knobs.rule == "paper":
            chunks = nucleus_logprobs(chunk_rows, nucleus_mask(chunk_rows, knobs.rho))
            scores = paper_contrast(prior, chunks, knobs.beta, knobs.scale)
            entropy = nucleus_entropy(chunks)
            weights = cls.weights(entropy, knobs)
            fused = paper_fusion(weights, scores, cls.support_order(entropy, knobs))
        else:
            keep = nucleus_mask(logprobs, knobs.rho)
            scores = contrast_chunks(prior, chunk_rows, keep[:, :1], keep[:, 1:], knobs.beta, knobs.scale)
            weights = cls.weights(truncated_entropy(chunk_rows, keep[:, 1:]), knobs)
            # a padded chunk adds 0 * S = +-0.0, which leaves any sum but -0.0 as it is, and no request's is: its
            # heaviest chunk (w > 0) adds w * S, S a contrast of log_softmax values, none of them -0.0
            fused = chunk_sum(weights.unsqueeze(-1) * scores, -2).squeeze(-2)
            nuclei = keep[:, 1:] if knobs.chunks is None else keep[:, 1:] & knobs.chunks.unsqueeze(-1)
            fused = torch.where(nuclei.any(-2), fused, torch.full_like(fused, -math.inf))
        evidence = torch.log(weights.clamp_min(TINY)).unsqueeze(-1) + scores
        if knobs.chunks is not None:
            evidence = evidence.masked_fill(~knobs.chunks.unsqueeze(-1), -math.inf)
        return fused, evidence

    def __call__(self, logits: torch.Tensor, state: FusionState = FIRST_STEP) -> FusedStep:
        self._check_chunks(logits.shape[0] - 1)
        knobs = Knobs.of([self], [logits.shape[0] - 1], logits.device)
        fused, evidence = type(self).fuse(logits.unsqueeze(0), knobs)
        return FusedStep(fused[0], evidence[0])

    def batch_key(self) -> tuple[type, str]:
        """Rules with equal keys are evaluated together by :meth:`fuse_batch`: one class (Soft-NBCE, hard NBCE or
        PCW: their weights differ) and one ``rule``; any chunk count, tau, beta, rho, gamma and prior."""
        return (type(self), self.rule)

    @classmethod
    def fuse_batch(cls, rules: Sequence[SoftNBCEFusion], rows: Sequence[Sequence[torch.Tensor]],
                   states: Sequence[FusionState]) -> FusedBatch:
        """One step of several requests in one evaluation of :meth:`fuse`: what each rule's ``__call__`` gives
        alone (its scores and evidence), for a number of tensor operations that does not grow with the requests.

        ``rows``: per request its streams' logits (``[V]`` each, the prior first); the rules share a
        :meth:`batch_key`. Requests with fewer chunks than the widest are padded with copies of their prior row
        (finite, so no NaN reaches a sum), whose weight is exactly 0 and whose evidence is ``-inf``: a padded
        chunk never takes weight, never restricts the support and never wins a token or a citation.
        """
        logits, counts = padded_streams(rows)
        for rule, count in zip(rules, counts, strict=True):
            rule._check_chunks(count)
        fused, evidence = cls.fuse(logits, Knobs.of(rules, counts, logits.device))
        return FusedBatch(fused, evidence, [None] * len(rows))


class NBCEFusion(SoftNBCEFusion):
    """Hard NBCE, the tau -> 0 limit: all weight on the lowest-entropy chunk (the first one on a tie)."""

    def __init__(self, *, beta: float = 0.25, rho: float = PAPER_RHO, rule: str = "paper"):
        super().__init__(tau=1.0, beta=beta, rho=rho, rule=rule)

    @classmethod
    def weights(cls, entropy: torch.Tensor, knobs: Knobs) -> torch.Tensor:
        if knobs.chunks is not None:
            entropy = entropy.masked_fill(~knobs.chunks, math.inf)
        return torch.nn.functional.one_hot(torch.argmin(entropy, dim=-1), entropy.shape[-1]).float()


class PCWFusion(SoftNBCEFusion):
    """The tau -> infinity limit, the uniform average of the chunks; ``beta=0`` by default, the paper's PCW
    baseline (Ratner et al., 2023: uniform chunk averaging, no prior contrast)."""

    def __init__(self, *, beta: float = 0.0, rho: float = PAPER_RHO, rule: str = "paper"):
        super().__init__(tau=math.inf, beta=beta, rho=rho, rule=rule)

    @classmethod
    def weights(cls, entropy: torch.Tensor, knobs: Knobs) -> torch.Tensor:
        return knobs.share


@dataclass(frozen=True)
class Chunk:
    """A piece of one document: its text and the index of the document it came from."""

    text: str
    document: int


def check_chunk_tokens(chunk_tokens: int | None) -> None:
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise InvalidOptionError(f"chunk_tokens must be None or an int >= 1, got {chunk_tokens!r}")


def split_documents(tokenizer: object, texts: list[str], chunk_tokens: int | None) -> list[Chunk]:
    """Cut each text into consecutive pieces of at most ``chunk_tokens`` tokens (``None``: no cutting).

    Pieces are cut on token boundaries and decoded back to text, so a chunk is cached and looked up
    like any document; a text that fits in one chunk is returned unchanged. Each text's pieces are
    remembered (:func:`_pieces`), so a document asked about again is not tokenised again.
    """
    check_chunk_tokens(chunk_tokens)
    return [Chunk(piece, index) for index, text in enumerate(texts) for piece in _pieces(tokenizer, text, chunk_tokens)]


@functools.lru_cache(maxsize=1024)
def _pieces(tokenizer: object, text: str, chunk_tokens: int | None) -> tuple[str, ...]:
    """One text's chunks (the text itself when it fits one), memoised per tokenizer, text and size."""
    if chunk_tokens is None:
        return (text,)
    ids = tokenizer(text.strip(), add_special_tokens=False)["input_ids"]
    if len(ids) <= chunk_tokens:
        return (text,)
    pieces = (tokenizer.decode(ids[start:start + chunk_tokens]) for start in range(0, len(ids), chunk_tokens))
    return tuple(piece for piece in pieces if piece.strip())


def fitting_chunk_tokens(ctx: DecodeContext, chunk_tokens: int | None) -> int | None:
    """``chunk_tokens``, lowered so that prefix + chunk + question + answer fits the model's window.

    Splitting beyond the window is this mode's job, so a chunk size the model cannot hold is
    clamped rather than refused; ``extra["chunk_tokens"]`` reports the size used.
    """
    check_chunk_tokens(chunk_tokens)
    if chunk_tokens is None:
        return None
    fixed = len(ctx.engine.layout.prefix_ids) + len(ctx.suffix_ids) + ctx.stop.max_new_tokens
    room = ctx.engine.loaded.max_positions - fixed - _RETOKENIZE_SLACK
    if room < 1:
        raise DocumentTooLongError(
            f"the prompt without any context already needs {fixed} of the model's {ctx.engine.loaded.max_positions} "
            "positions: shorten the question or lower max_new_tokens")
    return min(chunk_tokens, room)


def support_rho(rho: float | None, ranked: bool) -> float:
    """The top-p each chunk is cut to: ``rho`` when given; by default the paper's 0.9 when nothing ranks the chunks,
    and 1.0 (every token) when a retrieval prior does.

    The paper's support, a token inside every weighted chunk's nucleus, is its consensus among chunks that nobody
    ranked (one long document cut into pieces): there ``rho=1.0`` measured lower. Among retrieved passages it drops
    the answer that only the passage ranked first holds, and the prior already keeps a low-ranked chunk's confident
    wrong token out (docs/soft_nbce.md, "The retrieval prior").
    """
    if rho is not None:
        return rho
    return 1.0 if ranked else PAPER_RHO


def scores_rank(chunk_log_prior: torch.Tensor) -> bool:
    """Whether the chunks' log-priors ``[K]`` tell them apart: not all equal (one chunk never is ranked)."""
    return chunk_log_prior.numel() > 1 and bool(chunk_log_prior.max() > chunk_log_prior.min())


def routed_rule(chunk_log_prior: torch.Tensor, *, tau: float = 0.1, beta: float = 0.25, rho: float | None = None,
                rule: str = "paper", gamma: float = PRIOR_GAMMA, relevance: torch.Tensor | None = None,
                prior_tau: float = DEFAULT_TAU, query_likelihood: float = 0.0) -> SoftNBCEFusion:
    """The soft_nbce mode's rule for chunks with these log-priors ``[K]``: routed by the prior (weight ``gamma``) only
    when it ranks them (not all equal, or two chunks or more whose question likelihoods will rank them), with
    :func:`support_rho`'s top-p; the paper's rule otherwise, exactly (one chunk: nothing to rank, nothing measured)."""
    check_gamma(gamma)  # here too: a rule nothing ranks is built with gamma 0, so its own check would not see it
    measured = query_likelihood > 0 and chunk_log_prior.numel() > 1
    ranked = gamma > 0 and (measured or scores_rank(chunk_log_prior))
    return SoftNBCEFusion(tau=tau, beta=beta, rho=support_rho(rho, ranked), rule=rule, gamma=gamma if ranked else 0.0,
                          log_prior=chunk_log_prior if ranked else None, relevance=relevance if ranked else None,
                          prior_tau=prior_tau, query_likelihood=query_likelihood if ranked else 0.0)


def default_query_likelihood(chunk_log_prior: torch.Tensor, *, gamma: float, prior: str) -> float:
    """``query_likelihood``'s default for chunks with these log-priors ``[K]``: :data:`QUERY_LIKELIHOOD` where their
    scores rank them through a softmax prior that routes them (``gamma`` > 0, log-priors not all equal); 0 where
    nothing ranks them (no scores, equal scores, one document's chunks, one chunk), so there the rule stays the
    paper's exactly and nothing is measured."""
    return QUERY_LIKELIHOOD if gamma > 0 and prior == "softmax" and scores_rank(chunk_log_prior) else 0.0


def run_chunk_fusion(ctx: DecodeContext, rule: SoftNBCEFusion | Callable[[list[int]], SoftNBCEFusion],
                     chunk_tokens: int | None) -> FusedJob:
    """A job decoding with ``rule`` over the prior plus one stream per chunk; the trace names source documents.
    ``rule`` may be built from the chunks' source documents (a callable given their indices). A rule that
    :attr:`~SoftNBCEFusion.wants_likelihood` gets the question's log-likelihood on each stream, and the answer's
    ``extra["query_loglik"]`` holds each chunk's."""
    size = fitting_chunk_tokens(ctx, chunk_tokens)
    chunks = split_documents(ctx.engine.loaded.tokenizer, [d.text for d in ctx.documents], size)
    prepared = ctx.engine.texts.prepare_all([c.text for c in chunks])  # whole documents: ctx.prepared's, memoised
    ctx.check_streams(len(chunks) + 1, ctx.stream_tokens(prepared), "the chunk streams")
    sources = [c.document for c in chunks]
    if not isinstance(rule, SoftNBCEFusion):
        rule = rule(sources)

    def finish(result: DecodeResult) -> DecodeResult:
        result.extra["trace_chunks"] = [step.document for step in result.trace]
        result.trace = [replace(step, document=None if step.document is None else sources[step.document])
                        for step in result.trace]
        result.extra.update(chunk_documents=sources, chunk_tokens=size, n_chunks=len(chunks), rho=rule.rho,
                            gamma=rule.gamma)
        if job.likelihood is not None:
            result.extra["query_loglik"] = [round(v, 4) for v in job.likelihood[1:].tolist()]
        return result

    span = ctx.engine.layout.question_span(ctx.suffix_ids) if rule.wants_likelihood else None
    job = expert_streams_job(ctx, rule, contexts=prepared, with_context_free=True, finish=finish,
                             likelihood_span=span)
    return job


@register_mode(SOFT_NBCE)
def run_soft_nbce(ctx: DecodeContext, *, tau: float = 0.1, beta: float = 0.25, rho: float | None = None,
                  chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, rule: str = "paper", gamma: float = PRIOR_GAMMA,
                  prior: str = DEFAULT_PRIOR, prior_tau: float = DEFAULT_TAU,
                  prior_floor: float = DEFAULT_FLOOR, query_likelihood: float | None = None) -> FusedJob:
    """Soft-NBCE: chunk experts weighted per token by softmax(-entropy / tau), contrasted with a query-only prior.

    tau: temperature of the entropy weights (-> 0: hard NBCE, math.inf: uniform average, PCW).
    beta: contrast with the prior, (1 + beta) L_chunk - beta L_prior (0: no contrast).
    rho: top-p of each chunk before fusion; ``None`` (default): the paper's 0.9 when nothing ranks the chunks, 1.0
    (every token) when the retrieval prior does (:func:`support_rho`).
    chunk_tokens: split documents into chunks of at most this many tokens (None: one stream per document).
    rule: "paper" (Algorithm 1) or "nbce_code" (NBCE's reference code); see :class:`SoftNBCEFusion`.
    gamma: weight of a retrieval prior in the chunk weights (our variant, the default 10.0; 0 is the paper's: entropy
    alone). Chunks whose priors are all equal (no scores, equal scores, one document's chunks) are routed by entropy
    alone whatever gamma is: the prior would add the same number to each, so the rule is then the paper's, exactly.
    prior, prior_tau, prior_floor: how the documents' scores become that log-prior, as PCED's (see :mod:`.priors`);
    every chunk of a document gets the document's.
    query_likelihood: weight of the question's log-likelihood given each chunk in the softmax prior (our variant, as
    PCED's; it needs gamma > 0 and prior="softmax"); ``extra["query_loglik"]`` holds each chunk's. ``None`` (the
    default): 0.2 where the scores rank the chunks (:func:`default_query_likelihood`), off where nothing ranks them;
    0: off. A weight given routes the chunks by the prior even when their scores are equal.
    The paper's rule on every input: ``gamma=0`` (``rho`` is then 0.9, and the likelihood's default off).
    """
    # the declaration checked each value (check_mode, before planning); log_prior and routed_rule check them again
    if query_likelihood is not None:
        check_query_likelihood(query_likelihood, prior)
        if query_likelihood > 0 and gamma == 0:
            raise InvalidOptionError(f"query_likelihood={query_likelihood} needs gamma > 0: the likelihood reaches "
                                     "the chunks' weights through the retrieval prior, which gamma=0 leaves out")
    scores = torch.tensor([d.score for d in ctx.documents], dtype=torch.float32)
    logs = log_prior(scores, prior, tau=prior_tau, floor=prior_floor)

    def chunks_rule(sources: list[int]) -> SoftNBCEFusion:
        weight = query_likelihood if query_likelihood is not None else \
            default_query_likelihood(logs[sources], gamma=gamma, prior=prior)
        return routed_rule(logs[sources], tau=tau, beta=beta, rho=rho, rule=rule, gamma=gamma,
                           relevance=scores[sources], prior_tau=prior_tau, query_likelihood=weight)

    return run_chunk_fusion(ctx, chunks_rule, chunk_tokens)


@register_mode(NBCE)
def run_nbce(ctx: DecodeContext, *, beta: float = 0.25, rho: float = PAPER_RHO,
             chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, rule: str = "paper") -> FusedJob:
    """Hard NBCE (Soft-NBCE's tau -> 0 limit, the paper's Vanilla NBCE): each token from the lowest-entropy chunk."""
    return run_chunk_fusion(ctx, NBCEFusion(beta=beta, rho=rho, rule=rule), chunk_tokens)


@register_mode(PCW)
def run_pcw(ctx: DecodeContext, *, beta: float = 0.0, rho: float = PAPER_RHO,
            chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, rule: str = "paper") -> FusedJob:
    """Uniform chunk average (Soft-NBCE's tau -> infinity limit with beta = 0, the paper's PCW baseline)."""
    return run_chunk_fusion(ctx, PCWFusion(beta=beta, rho=rho, rule=rule), chunk_tokens)
