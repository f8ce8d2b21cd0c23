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
from ctx_integrations.engine.core.prepared import PreparedText
from ctx_integrations.engine.core.registry import DecodeContext
from ctx_integrations.engine.core.rows import Piece


def expert_streams_job(ctx: DecodeContext, rule: FusionRule, contexts: list[PreparedText] | None = None,
                       with_context_free: bool = True,
                       finish: Callable[[DecodeResult], DecodeResult] | None = None,
                       likelihood_span: tuple[int, int] | None = None) -> FusedJob:
    """A job decoding with ``rule`` over one stream per context (default: the documents), plus a context-free one.

    ``contexts`` come prepared (tokens and cache keys known: :mod:`~ctx_integrations.engine.core.prepared`), so
    planning the job tokenises and hashes nothing. ``likelihood_span``: the suffix's tokens whose log-likelihood
    on each stream the rule receives (:class:`FusedJob`).
    """
    engine, layout = ctx.engine, ctx.engine.layout
    prepared = ctx.prepared if contexts is None else contexts
    suffix = ctx.suffix_ids
    prefix_len = len(layout.prefix_ids)
    for i, context in enumerate(prepared):
        ctx.check_window(prefix_len + context.tokens + len(suffix), f"document {i}")
    prefix = engine.store.prefix(layout)
    caches = engine.store.documents_prepared(layout, prepared, stats=ctx.cache)
    ctx.timings["cache_s"] = time.perf_counter() - ctx.started
    head = Piece(prefix.kv, 0)
    streams = [Stream((head,), suffix, prefix_len)] if with_context_free else []
    streams += [Stream((head, Piece(c.kv, prefix_len)), suffix, prefix_len + c.length) for c in caches]
    return FusedJob(ctx, streams, rule, finish, likelihood_span=likelihood_span)
