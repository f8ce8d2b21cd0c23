"""Soft-NBCE mode and its named limits, hard NBCE and PCW (METHODS.md "Soft-NBCE").

One stream per chunk (``prefix + chunk + question``) plus a query-only prior (row 0), decoded in
lockstep by the same streams engine as PCED (:func:`run_expert_streams`); only the per-step rule
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

from dataclasses import dataclass

from ctx_integrations.engine.experts import run_expert_streams
from ctx_integrations.engine.fusion import NBCEFusion, PCWFusion, SoftNBCEFusion
from ctx_integrations.engine.modes import DecodeContext, register_mode
from ctx_integrations.engine.streams import DecodeResult, TraceStep
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError

DEFAULT_CHUNK_TOKENS = 2048
# Re-tokenising a chunk's text can move a boundary token and the layout appends a newline.
_RETOKENIZE_SLACK = 4


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


def run_chunk_fusion(ctx: DecodeContext, rule: SoftNBCEFusion, chunk_tokens: int | None) -> DecodeResult:
    """Decode with ``rule`` over the prior plus one stream per chunk; the trace names source documents."""
    size = fitting_chunk_tokens(ctx, chunk_tokens)
    chunks = split_documents(ctx.engine.loaded.tokenizer, [d.text for d in ctx.documents], size)
    result = run_expert_streams(ctx, rule, contexts=[c.text for c in chunks], with_context_free=True)
    sources = [c.document for c in chunks]
    result.extra["trace_chunks"] = [step.document for step in result.trace]
    result.trace = [TraceStep(step.token_id, None if step.document is None else sources[step.document], step.score)
                    for step in result.trace]
    result.extra.update(chunk_documents=sources, chunk_tokens=size, n_chunks=len(chunks))
    return result


@register_mode("soft_nbce")
def run_soft_nbce(ctx: DecodeContext, *, tau: float = 0.1, beta: float = 0.25, rho: float = 0.9,
                  chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> DecodeResult:
    """Soft-NBCE: chunk experts weighted per token by softmax(-entropy / tau), contrasted with a query-only prior.

    tau: temperature of the entropy weights (-> 0: hard NBCE, math.inf: uniform average, PCW).
    beta: contrast with the prior, (1 + beta) L_chunk - beta L_prior (0: no contrast).
    rho: top-p of each stream before fusion (filtered tokens: see ``fusion.SoftNBCEFusion``).
    chunk_tokens: split documents into chunks of at most this many tokens (None: one stream per document).
    """
    return run_chunk_fusion(ctx, SoftNBCEFusion(tau=tau, beta=beta, rho=rho), chunk_tokens)


@register_mode("nbce")
def run_nbce(ctx: DecodeContext, *, beta: float = 0.25, rho: float = 0.9,
             chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> DecodeResult:
    """Hard NBCE (Soft-NBCE's tau -> 0 limit): each token comes from the lowest-entropy chunk."""
    return run_chunk_fusion(ctx, NBCEFusion(beta=beta, rho=rho), chunk_tokens)


@register_mode("pcw")
def run_pcw(ctx: DecodeContext, *, beta: float = 0.25, rho: float = 0.9,
            chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> DecodeResult:
    """Uniform chunk average (Soft-NBCE's tau -> infinity limit, the paper's PCW-style baseline)."""
    return run_chunk_fusion(ctx, PCWFusion(beta=beta, rho=rho), chunk_tokens)
