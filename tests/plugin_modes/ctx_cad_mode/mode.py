"""CAD's plan and per-step rule, built from the library's pieces as its built-in modes are.

Two rows: the documents concatenated after the prompt's prefix, then the question (``concat``'s prompt, prefilled
sequentially), and the question alone after the cached prefix (PCED's context-free stream). Each step
:class:`CADFusion` turns their two logit rows into ``(1 + alpha) * with - alpha * without``, and the request's own
sampler picks the token, which both rows then take.
"""

from __future__ import annotations

import torch

from ctx_cad_mode import CAD, PAPER_ALPHA
from ctx_integrations.engine.core.decoding import FIRST_STEP, FusedStep, FusionState
from ctx_integrations.engine.core.jobs import FusedJob, Stream
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.rows import Piece
from ctx_integrations.engine.modes.baselines import concatenated_ids


class CADFusion:
    """Context-aware decoding's rule over ``[2, V]`` logits (with the documents, then without): a pure function."""

    def __init__(self, alpha: float):
        self.alpha = float(alpha)

    def __call__(self, logits: torch.Tensor, state: FusionState = FIRST_STEP) -> FusedStep:
        with_context, without = logits[0].float(), logits[1].float()
        return FusedStep((1.0 + self.alpha) * with_context - self.alpha * without)


@register_mode(CAD)
def run_cad(ctx: DecodeContext, *, alpha: float = PAPER_ALPHA) -> FusedJob:
    """Context-aware decoding over the concatenated documents (alpha checked by the declaration before planning)."""
    layout = ctx.engine.layout
    ids = concatenated_ids(ctx, [prepared.ids for prepared in ctx.prepared])
    ctx.check_streams(2, len(ids) + ctx.stop.max_new_tokens, "CAD's two streams (with and without the documents)")
    prefix = ctx.engine.store.prefix(layout)
    prefix_len = len(layout.prefix_ids)
    streams = [Stream((), tuple(ids), 0), Stream((Piece(prefix.kv, 0),), tuple(ctx.suffix_ids), prefix_len)]
    return FusedJob(ctx, streams, CADFusion(alpha))
