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

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ctx_integrations.engine.core.decoding import FIRST_STEP, DecodeResult, FusedStep, FusionState
from ctx_integrations.engine.core.experts import expert_streams_job
from ctx_integrations.engine.core.jobs import FusedJob
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.validation import real_number
from ctx_integrations.engine.modes.priors import DEFAULT_FLOOR, DEFAULT_PRIOR, DEFAULT_TAU, check_prior, log_prior
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError

DEFAULT_CHUNK_TOKENS = 2048
TINY = torch.finfo(torch.float32).tiny  # floor of chunk weights before their log (citation evidence)
# Re-tokenising a chunk's text can move a boundary token and the layout appends a newline.
_RETOKENIZE_SLACK = 4


RULES = ("paper", "nbce_code")
# Knob ranges that keep float32 finite: beta scales log-probs ((1 + beta) L - beta L_prior overflows to inf - inf
# = NaN near 1e36, and past ~1e8 rounds every token to one score, so greedy emits token id 0), and the entropy
# weights divide by tau (all -inf, then NaN, below ~1e-37; at 1e-9 they are already hard NBCE's one-hot).
MAX_BETA = 100.0
MIN_TAU = 1e-9

# The ``nbce_code`` variant's clip value: a token outside a chunk's top-p nucleus scores as if its
# log-prob were -100. Nucleus log-probs are always above log(0.1 / V) (about -13 for a 50k vocabulary),
# so a floored token can never outrank a kept one, yet the weighted sum stays finite.
FILTERED_LOGPROB = -100.0


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise InvalidOptionError(f"rule must be one of {', '.join(map(repr, RULES))} ('paper': Algorithm 1 of "
                                 f"the Soft-NBCE paper; 'nbce_code': NBCE's reference code), got {rule!r}")


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


def nucleus_logprobs(logprobs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log P_k of Algorithm 1 (lines 6-7): logits masked to -inf outside the nucleus, then renormalised.

    Log-probs and logits differ by a constant per row, so this is ``log_softmax`` of the masked logits.
    """
    return torch.log_softmax(torch.where(keep, logprobs, torch.full_like(logprobs, -math.inf)), -1)


def nucleus_entropy(masked_logprobs: torch.Tensor) -> torch.Tensor:
    """H_k of Algorithm 1 (line 7): the entropy of the renormalised top-p distribution (0 log 0 = 0)."""
    terms = masked_logprobs.exp() * masked_logprobs
    return -torch.where(torch.isfinite(masked_logprobs), terms, torch.zeros_like(terms)).sum(-1)


def paper_contrast(prior: torch.Tensor, chunks: torch.Tensor, beta: float) -> torch.Tensor:
    """S_k = (1 + beta) L_k - beta L_prior (Algorithm 1, line 10), with L_k -inf outside chunk k's nucleus
    and the prior unfiltered. Where the prior itself is -inf (a model that masks tokens) the contrast term
    is dropped, S_k = (1 + beta) L_k, so the score is never +inf or NaN (-inf + inf)."""
    penalty = torch.where(torch.isfinite(prior), beta * prior, torch.zeros_like(prior))
    return (1 + beta) * chunks - penalty


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
    kept = torch.where(used, weights, torch.zeros_like(weights))
    kept = (kept / kept.sum(-1, keepdim=True)).unsqueeze(-1)
    terms = torch.where(used.unsqueeze(-1) & support.unsqueeze(-2), kept * scores, torch.zeros_like(scores))
    return torch.where(support, terms.sum(-2), torch.full_like(scores[..., 0, :], -math.inf))


def truncated_entropy(logprobs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``nbce_code``: NBCE's entropy of a top-p filtered distribution, -sum over kept v of p(v) log p(v),
    not renormalised (keeps a confident chunk's entropy strictly positive and distinct from another's)."""
    terms = logprobs.exp() * logprobs.clamp_min(FILTERED_LOGPROB)
    return -torch.where(keep, terms, torch.zeros_like(terms)).sum(-1)


def contrast_chunks(prior: torch.Tensor, chunks: torch.Tensor, prior_keep: torch.Tensor, chunk_keep: torch.Tensor,
                    beta: float) -> torch.Tensor:
    """``nbce_code``: S_k = (1 + beta) L~_k - beta L_prior, with L~_k floored at -100 outside chunk k's nucleus.

    Where the prior filtered a token the contrast is dropped and S_k = L~_k (NBCE's fallback): the
    prior's log-prob is only trusted on its own nucleus. ``prior`` broadcasts against ``chunks`` (chunk axis 0).
    """
    kept = torch.where(chunk_keep, chunks, torch.full_like(chunks, FILTERED_LOGPROB))
    contrast = (1 + beta) * kept - beta * prior.clamp_min(FILTERED_LOGPROB)
    return torch.where(prior_keep, contrast, kept)


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
    """

    # structured output masks the streams before this rule, so each nucleus is taken among the tokens the format
    # allows (masking the fused scores afterwards could leave none: a JSON brace outside every nucleus)
    format_masks_streams = True

    def __init__(self, *, tau: float = 0.1, beta: float = 0.25, rho: float = 0.9, rule: str = "paper",
                 gamma: float = 0.0, log_prior: Sequence[float] | torch.Tensor | None = None):
        real_number("tau", tau, minimum=MIN_TAU, allow_inf=True,
                    hint=" (math.inf = uniform average; mode='nbce' is the tau -> 0 limit)")
        self.tau = tau
        real_number("beta", beta, minimum=0.0, maximum=MAX_BETA)
        real_number("rho", rho, minimum=0.0, maximum=1.0, min_inclusive=False, hint=" (each chunk's top-p)")
        check_rule(rule)
        real_number("gamma", gamma, minimum=0.0, maximum=MAX_BETA, hint=" (weight of the retrieval prior; 0: none)")
        if gamma > 0 and log_prior is None:
            raise InvalidOptionError("gamma > 0 needs each chunk's log-prior (log_prior=...)")
        self.beta, self.rho, self.rule, self.gamma = beta, rho, rule, gamma
        self.log_prior = None if log_prior is None else torch.as_tensor(log_prior, dtype=torch.float32)

    def routing(self, entropy: torch.Tensor) -> torch.Tensor:
        """The chunks' routing logits, -H_k / tau (+ gamma * log_prior_k with a prior); weights are their softmax."""
        logits = -entropy / self.tau
        if self.gamma > 0:
            if self.log_prior.shape[0] != entropy.shape[0]:
                raise InvalidOptionError(f"got {entropy.shape[0]} chunk streams for {self.log_prior.shape[0]} priors")
            logits = logits + self.gamma * self.log_prior.to(entropy.device)
        return logits

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        """Weights over the chunk axis (0) from the chunks' entropies (and, with gamma > 0, their priors)."""
        return torch.softmax(self.routing(entropy), dim=0)

    def support_order(self, entropy: torch.Tensor) -> torch.Tensor:
        """What :func:`paper_fusion` takes chunks in, ascending: the entropy (the paper's order of decreasing
        weight), or with a prior the negated routing logit, so the support follows the weights the prior set."""
        return entropy if self.gamma == 0 else -self.routing(entropy)

    def __call__(self, logits: torch.Tensor, state: FusionState = FIRST_STEP) -> FusedStep:
        if logits.shape[0] < 2:
            raise InvalidOptionError("Soft-NBCE needs the prior stream plus at least one chunk stream")
        logprobs = torch.log_softmax(logits.float(), -1)
        if self.rule == "paper":
            chunks = nucleus_logprobs(logprobs[1:], nucleus_mask(logprobs[1:], self.rho))
            scores = paper_contrast(logprobs[0], chunks, self.beta)
            entropy = nucleus_entropy(chunks)
            weights = self.chunk_weights(entropy)
            fused = paper_fusion(weights, scores, self.support_order(entropy))
        else:
            keep = nucleus_mask(logprobs, self.rho)
            scores = contrast_chunks(logprobs[0], logprobs[1:], keep[0], keep[1:], self.beta)
            weights = self.chunk_weights(truncated_entropy(logprobs[1:], keep[1:]))
            fused = (weights.unsqueeze(1) * scores).sum(0)
            fused = torch.where(keep[1:].any(0), fused, torch.full_like(fused, -math.inf))
        return FusedStep(fused, torch.log(weights.clamp_min(TINY)).unsqueeze(1) + scores)


class NBCEFusion(SoftNBCEFusion):
    """Hard NBCE, the tau -> 0 limit: all weight on the lowest-entropy chunk (the first one on a tie)."""

    def __init__(self, *, beta: float = 0.25, rho: float = 0.9, rule: str = "paper"):
        super().__init__(tau=1.0, beta=beta, rho=rho, rule=rule)

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.argmin(entropy, dim=0), entropy.shape[0]).movedim(-1, 0).float()


class PCWFusion(SoftNBCEFusion):
    """The tau -> infinity limit, the uniform average of the chunks; ``beta=0`` by default, the paper's PCW
    baseline (Ratner et al., 2023: uniform chunk averaging, no prior contrast)."""

    def __init__(self, *, beta: float = 0.0, rho: float = 0.9, rule: str = "paper"):
        super().__init__(tau=math.inf, beta=beta, rho=rho, rule=rule)

    def chunk_weights(self, entropy: torch.Tensor) -> torch.Tensor:
        return torch.full_like(entropy, 1.0 / entropy.shape[0])


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


def run_chunk_fusion(ctx: DecodeContext, rule: SoftNBCEFusion | Callable[[list[int]], SoftNBCEFusion],
                     chunk_tokens: int | None) -> FusedJob:
    """A job decoding with ``rule`` over the prior plus one stream per chunk; the trace names source documents.
    ``rule`` may be built from the chunks' source documents (a callable given their indices)."""
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
        result.extra.update(chunk_documents=sources, chunk_tokens=size, n_chunks=len(chunks))
        return result

    return expert_streams_job(ctx, rule, contexts=prepared, with_context_free=True, finish=finish)


@register_mode("soft_nbce")
def run_soft_nbce(ctx: DecodeContext, *, tau: float = 0.1, beta: float = 0.25, rho: float = 0.9,
                  chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, rule: str = "paper", gamma: float = 0.0,
                  prior: str = DEFAULT_PRIOR, prior_tau: float = DEFAULT_TAU,
                  prior_floor: float = DEFAULT_FLOOR) -> FusedJob:
    """Soft-NBCE: chunk experts weighted per token by softmax(-entropy / tau), contrasted with a query-only prior.

    tau: temperature of the entropy weights (-> 0: hard NBCE, math.inf: uniform average, PCW).
    beta: contrast with the prior, (1 + beta) L_chunk - beta L_prior (0: no contrast).
    rho: top-p of each chunk before fusion.
    chunk_tokens: split documents into chunks of at most this many tokens (None: one stream per document).
    rule: "paper" (Algorithm 1) or "nbce_code" (NBCE's reference code); see :class:`SoftNBCEFusion`.
    gamma: weight of a retrieval prior in the chunk weights (0, the paper's: entropy alone; our variant > 0).
    prior, prior_tau, prior_floor: how the documents' scores become that log-prior, as PCED's (see :mod:`.priors`);
    every chunk of a document gets the document's.
    """
    check_prior(prior, prior_tau, prior_floor)
    logs = log_prior([d.score for d in ctx.documents], prior, tau=prior_tau, floor=prior_floor)
    return run_chunk_fusion(ctx, lambda sources: SoftNBCEFusion(tau=tau, beta=beta, rho=rho, rule=rule, gamma=gamma,
                                                                log_prior=logs[sources]), chunk_tokens)


@register_mode("nbce")
def run_nbce(ctx: DecodeContext, *, beta: float = 0.25, rho: float = 0.9,
             chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, rule: str = "paper") -> FusedJob:
    """Hard NBCE (Soft-NBCE's tau -> 0 limit, the paper's Vanilla NBCE): each token from the lowest-entropy chunk."""
    return run_chunk_fusion(ctx, NBCEFusion(beta=beta, rho=rho, rule=rule), chunk_tokens)


@register_mode("pcw")
def run_pcw(ctx: DecodeContext, *, beta: float = 0.0, rho: float = 0.9,
            chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, rule: str = "paper") -> FusedJob:
    """Uniform chunk average (Soft-NBCE's tau -> infinity limit with beta = 0, the paper's PCW baseline)."""
    return run_chunk_fusion(ctx, PCWFusion(beta=beta, rho=rho, rule=rule), chunk_tokens)
