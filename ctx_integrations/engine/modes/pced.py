"""PCED mode: an amateur stream plus one expert per document, fused per token (docs/methods.md#pced).

The per-step rule (:class:`PCEDFusion`) is a pure function over the step's stream logits, like a
transformers logits processor: arguments are checked in ``__init__`` and inputs are never edited in place.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

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
from ctx_integrations.engine.core.validation import choice, real_number
from ctx_integrations.engine.core.word_pieces import WordPieces
from ctx_integrations.engine.modes.priors import check_query_likelihood, likelihood_prior, log_prior
from ctx_integrations.engine.modes.specs import (
    AGGREGATIONS,
    DEFAULT_FLOOR,
    DEFAULT_PRIOR,
    DEFAULT_TAU,
    PCED,
    SCORE_SPACES,
    SWITCHES,
)
from ctx_integrations.engine.modes.specs import PAPER_GAMMA as PAPER_GAMMA  # the paper's rule: prior="paper"
from ctx_integrations.engine.modes.specs import PCED_GAMMA as PRIOR_GAMMA
from ctx_integrations.engine.modes.specs import PCED_MAX_BETA as MAX_BETA
from ctx_integrations.engine.modes.specs import PCED_MAX_GAMMA as MAX_GAMMA
from ctx_integrations.errors import InvalidOptionError

TINY = torch.finfo(torch.float32).tiny


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


def contrasted(logits: torch.Tensor, beta: torch.Tensor, dynamic: torch.Tensor,
               score_space: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The contrastive scores (1 + beta_k) s_k - beta_k s_0 of a batch of requests' experts, and the betas used.

    ``logits`` ``[J, 1 + K, V]`` (float32; each request's amateur, then its experts), ``beta`` ``[J, K]`` (each
    request's fixed or carried beta), ``dynamic`` ``[D]``: the requests whose beta is AdaCAD's JSD at this step
    (their rows of ``beta`` are replaced). One request is a batch of one (:meth:`PCEDFusion.__call__`), so one
    formula serves both; every operation is per row, so a request's values do not depend on what is beside it.
    """
    amateur, experts = logits[:, :1], logits[:, 1:]
    if dynamic.numel() == logits.shape[0]:  # every request starts here (one alone): no copy of the experts
        beta = jensen_shannon(experts, amateur.expand_as(experts))
    elif dynamic.numel():
        starting = experts[dynamic]
        beta = beta.index_copy(0, dynamic, jensen_shannon(starting, amateur[dynamic].expand_as(starting)))
    if score_space == "logprobs":
        amateur, experts = torch.log_softmax(amateur, -1), torch.log_softmax(experts, -1)
    scale = beta.unsqueeze(2)
    return (1 + scale) * experts - scale * amateur, beta


def max_fused(logits: torch.Tensor, experts: torch.Tensor | None, log_prior: torch.Tensor, gamma: torch.Tensor,
              beta: torch.Tensor, dynamic: torch.Tensor, score_space: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's adjusted scores s^_k = (1 + beta_k) s_k - beta_k s_0 + gamma log r_k ``[J, K, V]`` of a batch
    of requests (the fused score is their max over k), and the betas used (:func:`contrasted`).

    ``experts`` ``[J, K]`` says which of the K columns are a request's documents (the others pad it to the
    widest request's count): a padded column's scores are ``-inf``, so it never wins, whatever its prior or a
    gamma of 0; ``None``: no column is padded (one request alone: no copy of the scores to mask). ``log_prior``
    ``[J, K]`` and ``gamma`` ``[J]`` are each request's own.
    """
    contrastive, beta = contrasted(logits, beta, dynamic, score_space)
    adjusted = contrastive + (gamma.unsqueeze(1) * log_prior).unsqueeze(2)
    return (adjusted if experts is None else adjusted.masked_fill(~experts.unsqueeze(2), -math.inf)), beta


def padded_rows(values: Sequence[torch.Tensor | None], counts: Sequence[int], width: int,
                device: torch.device) -> torch.Tensor:
    """``[len(values), width]`` float32 zeros with ``values[j]`` (``counts[j]`` entries, ``None``: left zero) at
    the start of row j, on ``device``: one concatenation and one scatter whatever the number of rows (a copy per
    row would cost the batched rule an operation per request)."""
    places = [j * width + k for j, (value, count) in enumerate(zip(values, counts, strict=True)) if value is not None
              for k in range(count)]
    flat = torch.zeros(len(values) * width, device=device)
    present = [value.to(device) for value in values if value is not None]
    if present:
        flat = flat.index_copy(0, torch.tensor(places, dtype=torch.long, device=device), torch.cat(present))
    return flat.view(len(values), width)


class PCEDFusion:
    """Parallel Context-of-Experts fusion (docs/methods.md#pced).

    s^_k = (1 + beta_k) s_k - beta_k s_0 + gamma log r_k, then ``max`` over experts (default),
    or ``mixture`` (log sum_k w_k p_k) / ``product`` (sum_k w_k log p_k) with w = r / sum r and
    p_k = softmax((1 + beta_k) s_k - beta_k s_0). ``beta=None`` is AdaCAD's dynamic rule:
    beta_k = JSD(softmax(s_k), softmax(s_0)) at the first generated token, then fixed (carried from
    step to step in :class:`FusionState`, not kept on the rule: one rule may serve many answers).
    ``score_space="logprobs"`` normalises each stream first so experts are comparable (raw logits
    carry a per-expert offset); ``"logits"`` is the paper's literal formula.

    ``prior`` turns the scores into the log-prior that gamma multiplies: ``"paper"`` is log r_k as given;
    ``"softmax"`` (``prior_tau``), ``"rank"`` and ``"minmax"`` (``prior_floor``) calibrate the scores over the
    retrieved set (:mod:`~ctx_integrations.engine.modes.priors`, our variants). ``mixture`` / ``product``
    weigh experts by exp(log-prior), normalised (for the paper's prior: r / sum r).

    ``query_likelihood`` (our variant, not the paper's; 0: off) adds the question's log-likelihood given each
    document, weighted, to the softmax prior's scaled scores (:func:`~.priors.likelihood_prior`, UPR's reranking
    signal): the job measures it on the expert streams' own prefill and hands it over with
    :meth:`given_likelihood` before the first token, so the prior ranks the documents by the retriever's scores
    and by how well each one explains the question. It needs ``prior="softmax"``.

    ``switch="token"`` is the paper's rule: any expert may win any token. ``switch="word"`` (our
    variant, not the paper's) lets an expert win a token that continues an open word (a sub-word
    piece with no leading space) only if it won the word's previous token, so one invented name is
    never spelled by two documents; experts still switch freely between words. It needs ``max``
    aggregation (one winner per token) and the vocabulary's :class:`WordPieces`.
    """

    def __init__(self, relevance: Sequence[float], *, beta: float | None = None, gamma: float = PRIOR_GAMMA,
                 score_space: str = "logprobs", aggregation: str = "max", switch: str = "token",
                 word_pieces: WordPieces | None = None, prior: str = DEFAULT_PRIOR, prior_tau: float = DEFAULT_TAU,
                 prior_floor: float = DEFAULT_FLOOR, query_likelihood: float = 0.0):
        if len(relevance) == 0:
            raise InvalidOptionError("PCED needs at least one expert")
        choice("score_space", score_space, SCORE_SPACES)
        choice("aggregation", aggregation, AGGREGATIONS)
        choice("switch", switch, SWITCHES)
        if switch == "word" and aggregation != "max":
            raise InvalidOptionError(f"switch='word' needs aggregation='max' (one expert wins each token), "
                                     f"got aggregation={aggregation!r}")
        if switch == "word" and word_pieces is None:
            raise InvalidOptionError("switch='word' needs the vocabulary's word pieces (LoadedModel.word_pieces)")
        if beta is not None:
            real_number("beta", beta, minimum=0.0, maximum=MAX_BETA, hint=" (or None: dynamic)")
        real_number("gamma", gamma, minimum=0.0, maximum=MAX_GAMMA)
        check_query_likelihood(query_likelihood, prior)
        self.relevance = torch.as_tensor(relevance, dtype=torch.float32)
        self.log_prior = log_prior(self.relevance, prior, tau=prior_tau, floor=prior_floor)
        self.gamma, self.score_space, self.aggregation = gamma, score_space, aggregation
        self.fixed_beta = None if beta is None else torch.full((len(relevance),), float(beta))
        self.word_pieces = word_pieces if switch == "word" else None
        self.prior_tau, self.query_likelihood = prior_tau, query_likelihood

    @property
    def wants_likelihood(self) -> bool:
        """Whether the job should measure the question's log-likelihood on each stream (:meth:`given_likelihood`)."""
        return self.query_likelihood > 0

    def given_likelihood(self, likelihood: torch.Tensor) -> PCEDFusion:
        """This rule with its prior re-ranked by the question's log-likelihood on each stream (``[1 + K]``, the
        amateur's first and unused), as a new rule: one built for a request keeps its scores-only prior."""
        self._check_experts(likelihood.shape[0] - 1)
        rule = copy.copy(self)
        rule.log_prior = likelihood_prior(self.relevance, likelihood[1:], tau=self.prior_tau,
                                          weight=self.query_likelihood)
        return rule

    def __call__(self, logits: torch.Tensor, state: FusionState = FIRST_STEP) -> FusedStep:
        logits = logits.float()
        experts = logits.shape[0] - 1
        self._check_experts(experts)
        device = logits.device
        given = state.carry if state.carry is not None else self.fixed_beta
        beta = torch.zeros(1, experts, device=device) if given is None else given.to(device).unsqueeze(0)
        dynamic = torch.tensor([0] if given is None else [], dtype=torch.long, device=device)
        if self.aggregation == "max":
            adjusted, beta = max_fused(logits.unsqueeze(0), None, self.log_prior.to(device).unsqueeze(0),
                                       torch.tensor([self.gamma], device=device), beta, dynamic, self.score_space)
            adjusted = self._keep_words_whole(adjusted[0], state)
            return FusedStep(adjusted.max(0).values, adjusted, carry=beta[0])
        contrastive, beta = contrasted(logits.unsqueeze(0), beta, dynamic, self.score_space)
        contrastive, beta = contrastive[0], beta[0]
        weights = relevance_weights(self.log_prior.to(device).exp()).unsqueeze(1)
        log_p = torch.log_softmax(contrastive, -1)
        if self.aggregation == "mixture":
            weighted = torch.log(weights.clamp_min(TINY)) + log_p
            return FusedStep(torch.logsumexp(weighted, 0), weighted, carry=beta)
        return FusedStep((weights * log_p).sum(0), torch.log(weights.clamp_min(TINY)) + log_p, carry=beta)

    def _check_experts(self, count: int) -> None:
        """Refuse a step whose expert streams are not one per score (the rule was built for other documents)."""
        if count != self.relevance.shape[0]:
            raise InvalidOptionError(f"got {count} expert streams for {self.relevance.shape[0]} scores")

    def batch_key(self) -> tuple[type, str] | None:
        """Rules with equal keys are evaluated together by :meth:`fuse_batch` (``None``: only one by one).

        The paper's rule (``max`` over the experts, any expert may win any token) batches across requests of any
        document count, beta, gamma and prior; ``mixture`` / ``product`` and the word switch go one by one.
        """
        if self.aggregation != "max" or self.word_pieces is not None:
            return None
        return (PCEDFusion, self.score_space)

    @classmethod
    def fuse_batch(cls, rules: Sequence[PCEDFusion], rows: Sequence[Sequence[torch.Tensor]],
                   states: Sequence[FusionState]) -> FusedBatch:
        """One step of several requests in one evaluation of :func:`max_fused`: what each rule's ``__call__``
        gives alone (its scores, evidence and carried beta), for a constant number of tensor operations.

        ``rows``: per request its streams' logits (``[V]`` each, amateur first), ``states`` its state; the
        rules share a :meth:`batch_key`. Requests with fewer documents than the widest are padded with copies of
        their amateur row (finite scores, so no NaN reaches the maximum), whose evidence is then ``-inf``: a
        padded expert never wins a token or a citation. Each request keeps its own prior, gamma and beta (fixed,
        carried, or its JSD at its first step).
        """
        logits, counts = padded_streams(rows)
        for rule, count in zip(rules, counts, strict=True):
            rule._check_experts(count)
        width, device = logits.shape[1] - 1, logits.device
        experts = (torch.arange(width) < torch.tensor(counts).unsqueeze(1)).to(device)
        given = [state.carry if state.carry is not None else rule.fixed_beta for rule, state in zip(rules, states)]
        dynamic = torch.tensor([j for j, beta in enumerate(given) if beta is None], dtype=torch.long, device=device)
        # built where the priors are: on the CPU from scores (one copy over), on the device from a likelihood
        where = next((rule.log_prior.device for rule in rules if rule.log_prior.device.type != "cpu"),
                     torch.device("cpu"))
        log_prior = padded_rows([rule.log_prior for rule in rules], counts, width, where).to(device)
        gamma = torch.tensor([rule.gamma for rule in rules], device=device)
        adjusted, beta = max_fused(logits, experts, log_prior, gamma, padded_rows(given, counts, width, device),
                                   dynamic, rules[0].score_space)
        return FusedBatch(adjusted.max(1).values, adjusted, [beta[j, :count] for j, count in enumerate(counts)])

    def _keep_words_whole(self, adjusted: torch.Tensor, state: FusionState) -> torch.Tensor:
        """``switch="word"``: only the last token's winner may continue its open word (a new tensor)."""
        if self.word_pieces is None or state.last_winner is None:
            return adjusted
        continuing = self.word_pieces.continues_word(state.last_token)
        if continuing is None:
            return adjusted
        if continuing.shape[0] != adjusted.shape[1]:
            raise InvalidOptionError(f"word pieces cover {continuing.shape[0]} token ids, the logits "
                                     f"{adjusted.shape[1]}: build them for this model's vocabulary")
        others = torch.ones(adjusted.shape[0], 1, dtype=torch.bool, device=adjusted.device)
        others[state.last_winner] = False
        return adjusted.masked_fill(others & continuing.to(adjusted.device).unsqueeze(0), -math.inf)


@register_mode(PCED)
def run_pced(ctx: DecodeContext, *, beta: float | None = None, gamma: float = PRIOR_GAMMA,
             score_space: str = "logprobs", aggregation: str = "max", switch: str = "token", prior: str = DEFAULT_PRIOR,
             prior_tau: float = DEFAULT_TAU, prior_floor: float = DEFAULT_FLOOR,
             query_likelihood: float = 0.0) -> FusedJob:
    """Parallel Context-of-Experts Decoding.

    beta: None = dynamic (per-expert JSD at the first token, then fixed), or a fixed float in [0, 100].
    gamma: weight of the retrieval prior gamma * log r_k, in [0, 100] (5.0 for the default calibrated prior; the
    paper's is 2.5, with prior="paper").
    score_space: "logprobs" (default: experts comparable) or "logits" (the paper's literal rule).
    aggregation: "max" (token-level expert switching, default), "mixture" or "product".
    switch: "token" (the paper's rule) or "word" (our variant: the expert that began a word finishes it).
    prior: how the documents' scores become the log-prior gamma multiplies: "paper" (log r) or our per-query
    calibrations "softmax" (prior_tau), "rank", "minmax" (prior_floor); see :mod:`.priors`.
    query_likelihood: weight of the question's log-likelihood given each document in the softmax prior (our variant,
    UPR's reranking signal measured on the experts' own prefill; 0, the default: off); the answer's
    ``extra["query_loglik"]`` holds each document's.
    """
    pieces = ctx.engine.loaded.word_pieces if switch == "word" else None  # PCEDFusion checks switch
    rule = PCEDFusion([d.score for d in ctx.documents], beta=beta, gamma=gamma, score_space=score_space,
                      aggregation=aggregation, switch=switch, word_pieces=pieces, prior=prior, prior_tau=prior_tau,
                      prior_floor=prior_floor, query_likelihood=query_likelihood)
    ctx.check_streams(len(ctx.documents) + 1, ctx.stream_tokens(ctx.prepared), "PCED's streams")

    def finish(result: DecodeResult) -> DecodeResult:
        used = job.state.carry  # the beta the answer was decoded with (None: no step ran)
        result.extra["beta"] = [round(b, 6) for b in used.tolist()] if used is not None else None
        if job.likelihood is not None:
            result.extra["query_loglik"] = [round(v, 4) for v in job.likelihood[1:].tolist()]
        return result

    span = ctx.engine.layout.question_span(ctx.suffix_ids) if rule.wants_likelihood else None
    job = expert_streams_job(ctx, rule, finish=finish, likelihood_span=span)
    return job
