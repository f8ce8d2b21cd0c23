"""Soft-NBCE mode and its named limits, hard NBCE and PCW (METHODS.md "Soft-NBCE").

One stream per chunk (``prefix + chunk + question``) plus a query-only prior (row 0), decoded in
lockstep by the same job shape as PCED (:func:`expert_streams_job`); only the per-step rule
differs (:class:`SoftNBCEFusion`, :class:`NBCEFusion`, :class:`PCWFusion` in ``fusion.py``).

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

import math
from dataclasses import dataclass

import torch

from ctx_integrations.engine.core.experts import expert_streams_job
from ctx_integrations.engine.core.jobs import FusedJob
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.streams import DecodeResult, FusedStep, TraceStep
from ctx_integrations.engine.core.validation import real_number
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError

DEFAULT_CHUNK_TOKENS = 2048
TINY = torch.finfo(torch.float32).tiny  # floor of chunk weights before their log (citation evidence)
# Re-tokenising a chunk's text can move a boundary token and the layout appends a newline.
_RETOKENIZE_SLACK = 4


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
        real_number("tau", tau, minimum=0.0, min_inclusive=False, allow_inf=True, hint=" (math.inf = uniform average)")
        self.tau = tau
        real_number("beta", beta, minimum=0.0)
        real_number("rho", rho, minimum=0.0, maximum=1.0, min_inclusive=False, hint=" (each chunk's top-p)")
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
        return FusedStep(fused, torch.log(weights.clamp_min(TINY)) + scores)


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
    like any document; a text that fits in one chunk is returned unchanged.
    """
    check_chunk_tokens(chunk_tokens)
    chunks: list[Chunk] = []
    for index, text in enumerate(texts):
        ids = tokenizer(text.strip(), add_special_tokens=False)["input_ids"]
        if chunk_tokens is None or len(ids) <= chunk_tokens:
            chunks.append(Chunk(text, index))
            continue
        for start in range(0, len(ids), chunk_tokens):
            piece = tokenizer.decode(ids[start:start + chunk_tokens])
            if piece.strip():
                chunks.append(Chunk(piece, index))
    return chunks


def fitting_chunk_tokens(ctx: DecodeContext, chunk_tokens: int | None) -> int | None:
    """``chunk_tokens``, lowered so that prefix + chunk + question + answer fits the model's window.

    Splitting beyond the window is this mode's job, so a chunk size the model cannot hold is
    clamped rather than refused; ``extra["chunk_tokens"]`` reports the size used.
    """
    check_chunk_tokens(chunk_tokens)
    if chunk_tokens is None:
        return None
    layout = ctx.engine.layout
    fixed = len(layout.prefix_ids) + len(layout.suffix_ids(ctx.query)) + ctx.stop.max_new_tokens
    room = ctx.engine.loaded.max_positions - fixed - _RETOKENIZE_SLACK
    if room < 1:
        raise DocumentTooLongError(
            f"the prompt without any context already needs {fixed} of the model's {ctx.engine.loaded.max_positions} "
            "positions: shorten the question or lower max_new_tokens")
    return min(chunk_tokens, room)


def run_chunk_fusion(ctx: DecodeContext, rule: SoftNBCEFusion, chunk_tokens: int | None) -> FusedJob:
    """A job decoding with ``rule`` over the prior plus one stream per chunk; the trace names source documents."""
    size = fitting_chunk_tokens(ctx, chunk_tokens)
    chunks = split_documents(ctx.engine.loaded.tokenizer, [d.text for d in ctx.documents], size)
    ctx.check_streams(len(chunks) + 1, ctx.stream_tokens([c.text for c in chunks]), "the chunk streams")
    sources = [c.document for c in chunks]

    def finish(result: DecodeResult) -> DecodeResult:
        result.extra["trace_chunks"] = [step.document for step in result.trace]
        result.trace = [TraceStep(step.token_id, None if step.document is None else sources[step.document],
                                  step.score) for step in result.trace]
        result.extra.update(chunk_documents=sources, chunk_tokens=size, n_chunks=len(chunks))
        return result

    return expert_streams_job(ctx, rule, contexts=[c.text for c in chunks], with_context_free=True, finish=finish)


@register_mode("soft_nbce")
def run_soft_nbce(ctx: DecodeContext, *, tau: float = 0.1, beta: float = 0.25, rho: float = 0.9,
                  chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> FusedJob:
    """Soft-NBCE: chunk experts weighted per token by softmax(-entropy / tau), contrasted with a query-only prior.

    tau: temperature of the entropy weights (-> 0: hard NBCE, math.inf: uniform average, PCW).
    beta: contrast with the prior, (1 + beta) L_chunk - beta L_prior (0: no contrast).
    rho: top-p of each stream before fusion (filtered tokens: see ``fusion.SoftNBCEFusion``).
    chunk_tokens: split documents into chunks of at most this many tokens (None: one stream per document).
    """
    return run_chunk_fusion(ctx, SoftNBCEFusion(tau=tau, beta=beta, rho=rho), chunk_tokens)


@register_mode("nbce")
def run_nbce(ctx: DecodeContext, *, beta: float = 0.25, rho: float = 0.9,
             chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> FusedJob:
    """Hard NBCE (Soft-NBCE's tau -> 0 limit): each token comes from the lowest-entropy chunk."""
    return run_chunk_fusion(ctx, NBCEFusion(beta=beta, rho=rho), chunk_tokens)


@register_mode("pcw")
def run_pcw(ctx: DecodeContext, *, beta: float = 0.25, rho: float = 0.9,
            chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> FusedJob:
    """Uniform chunk average (Soft-NBCE's tau -> infinity limit, the paper's PCW-style baseline)."""
    return run_chunk_fusion(ctx, PCWFusion(beta=beta, rho=rho), chunk_tokens)
