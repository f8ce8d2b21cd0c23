"""Expert streams over cached contexts: the job shape PCED and Soft-NBCE (and their variants) share.

Streams are ``[context-free stream] + one stream per context``, each ``prefix + context + suffix``;
the contexts' KV caches come from the store (computed once, reused), and the question suffix is the
prompt every stream takes at its first step. Only the per-step rule differs between the modes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ctx_integrations.engine.core.decoding import DecodeResult, FusionRule
from ctx_integrations.engine.core.jobs import FusedJob, Stream
from ctx_integrations.engine.core.registry import DecodeContext
from ctx_integrations.engine.core.rows import Piece


def expert_streams_job(ctx: DecodeContext, rule: FusionRule, contexts: list[str] | None = None,
                       with_context_free: bool = True,
                       finish: Callable[[DecodeResult], DecodeResult] | None = None) -> FusedJob:
    """A job decoding with ``rule`` over one stream per context (default: the documents), plus a context-free one."""
    engine, layout = ctx.engine, ctx.engine.layout
    texts = [d.text for d in ctx.documents] if contexts is None else contexts
    suffix = tuple(layout.suffix_ids(ctx.query))
    prefix_len = len(layout.prefix_ids)
    token_ids = [layout.context_ids(text) for text in texts]
    for i, ids in enumerate(token_ids):
        ctx.check_window(prefix_len + len(ids) + len(suffix), f"document {i}")
    prefix = engine.store.prefix(layout)
    caches = engine.store.documents_tokens(layout, token_ids, stats=ctx.cache)
    ctx.timings["cache_s"] = time.perf_counter() - ctx.started
    head = Piece(prefix.kv, 0)
    streams = [Stream((head,), suffix, prefix_len)] if with_context_free else []
    streams += [Stream((head, Piece(c.kv, prefix_len)), suffix, prefix_len + c.length) for c in caches]
    return FusedJob(ctx, streams, rule, finish)
