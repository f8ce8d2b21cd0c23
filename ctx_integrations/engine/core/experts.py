"""Run a fusion rule over cached expert streams: the decode path PCED and Soft-NBCE share.

Streams are ``[context-free stream] + one stream per context``, each ``prefix + context + suffix``;
the contexts' KV caches come from the store (computed once, reused), the suffix is prefilled for
all streams in one batched forward pass, then ``decode_fused`` runs the lockstep loop.
"""

from __future__ import annotations

import time

import torch

from ctx_integrations.engine.core.cache import batch_streams
from ctx_integrations.engine.core.registry import DecodeContext
from ctx_integrations.engine.core.streams import DecodeResult, FusionRule, decode_fused, forward_streams


def run_expert_streams(ctx: DecodeContext, rule: FusionRule, contexts: list[str] | None = None,
                       with_context_free: bool = True) -> DecodeResult:
    """Decode with ``rule`` over one stream per context (default: the documents), plus a context-free one."""
    engine, layout = ctx.engine, ctx.engine.layout
    texts = [d.text for d in ctx.documents] if contexts is None else contexts
    suffix = layout.suffix_ids(ctx.query)
    prefix_len = len(layout.prefix_ids)
    token_ids = [layout.context_ids(text) for text in texts]
    for i, ids in enumerate(token_ids):
        ctx.check_window(prefix_len + len(ids) + len(suffix), f"document {i}")
    prefix = engine.store.prefix(layout)
    caches = engine.store.documents_tokens(layout, token_ids)
    streams = batch_streams(prefix, ([None] if with_context_free else []) + caches)
    ctx.timings["cache_s"] = time.perf_counter() - ctx.started
    suffix_ids = torch.tensor([suffix], device=engine.loaded.device).expand(len(caches) + with_context_free, -1)
    first_logits = forward_streams(engine.loaded.model, streams, suffix_ids)
    ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
    return decode_fused(engine.loaded.model, engine.loaded.tokenizer, streams, first_logits, rule, ctx.sampler,
                        ctx.stop, ctx.on_token, ctx.started)
