"""APE mode: Adaptive Parallel Encoding over the cached documents (METHODS.md "APE").

One sequence ``[prefix | doc_1 | ... | doc_N | question | answer]``. The documents' KV caches come
from the store as they are: each was encoded after the shared prefix at positions ``L_p..``, so all
documents share one position range, and they are concatenated without padding. The question starts
at position ``L_p + max_i len_i`` and the answer continues sequentially.

Question and answer tokens attend to two key sets, each with its own softmax, merged by log-sum-exp:

    C = every document key, scores s / T (no causal mask: all of it lies in the past)
    O = prefix + question/answer keys, plain causal scores s
    out = softmax([S * T * LSE_C, LSE_O]) . [out_C, out_O]

With ``T = S = 1`` this is plain attention over the concatenated cache. No attention kernel exposes
this merge, so :func:`ape_attention` is written by hand (fp32 math whatever the model dtype; the
public code's bf16 LSE is one of METHODS.md's pitfalls) and registered through transformers'
``AttentionInterface``; :func:`ape_attention_swapped` switches a model to it only for one APE call.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from ctx_integrations.engine.core.cache import concatenated_stream
from ctx_integrations.engine.core.registry import DecodeContext, register_mode
from ctx_integrations.engine.core.streams import DecodeResult, TraceStep, decode_fused, forward_streams, single_stream
from ctx_integrations.errors import InvalidOptionError

APE_ATTENTION = "ctx_ape"


@dataclass(frozen=True)
class ApeLayout:
    """Where the documents sit among the cached keys, and the two knobs of the merge."""

    context_start: int  # key column of the first document token (= L_p)
    context_end: int  # key column after the last document token
    temperature: float  # T
    scale: float  # S
    # attribution=True: each document's end column (relative to context_start), and where the attention
    # calls append the merged attention mass per document of the last query position (one entry per layer).
    document_ends: tuple[int, ...] = ()
    masses: list[torch.Tensor] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_knobs(self.temperature, self.scale)
        if not 0 <= self.context_start < self.context_end:
            raise InvalidOptionError(f"APE needs a non-empty document span, got [{self.context_start}, "
                                     f"{self.context_end})")


def check_knobs(temperature: float, scale: float) -> None:
    for name, value in (("attention_temperature", temperature), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise InvalidOptionError(f"APE's {name} must be in (0, 1] (the authors use 0.6-1.0; 1 = no correction), "
                                     f"got {value!r}")


def ape_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  ape_layout: ApeLayout | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """APE attention for the question/answer queries (``query`` [B, H, q, d], ``key``/``value`` [B, Hkv, K, d]).

    The last ``q`` key columns are the queries' own tokens (causal among themselves); columns
    ``[context_start, context_end)`` are the documents; everything else is the prefix. Query heads
    are grouped by their KV head (GQA) instead of repeating keys, so no key is copied.
    """
    if ape_layout is None:
        raise InvalidOptionError("the APE attention ran without an ApeLayout: it is only valid inside mode='ape'")
    if kwargs.get("softcap") is not None:
        raise InvalidOptionError("APE does not support attention logit soft-capping (e.g. Gemma 2)")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise InvalidOptionError(f"APE does not support sliding-window attention over {key.shape[2]} keys "
                                 f"(window {window})")
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    start, end = ape_layout.context_start, ape_layout.context_end
    temperature, scale = ape_layout.temperature, ape_layout.scale
    scaling = dim ** -0.5 if scaling is None else scaling

    q = query.float().reshape(batch, kv_heads, groups * q_len, dim)  # row g * q_len + i
    k, v = key.float(), value.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G*q, K]
    context = scores[..., start:end] / temperature
    outside = torch.cat([scores[..., :start], scores[..., end:]], dim=-1)
    columns = torch.arange(outside.shape[-1], device=query.device)
    own_column = outside.shape[-1] - q_len + torch.arange(q_len, device=query.device)
    visible = (columns.unsqueeze(0) <= own_column.unsqueeze(1)).repeat(groups, 1)  # [G*q, prefix + own]
    outside = outside.masked_fill(~visible, -math.inf)

    lse_context = torch.logsumexp(context, dim=-1, keepdim=True)
    lse_outside = torch.logsumexp(outside, dim=-1, keepdim=True)
    p_context = torch.softmax(context, dim=-1)
    out_context = torch.matmul(p_context, v[:, :, start:end])
    p_outside = torch.softmax(outside, dim=-1)
    out_outside = (torch.matmul(p_outside[..., :start], v[:, :, :start])
                   + torch.matmul(p_outside[..., start:], v[:, :, end:keys]))
    weights = torch.softmax(torch.cat([scale * temperature * lse_context, lse_outside], dim=-1), dim=-1)
    out = weights[..., :1] * out_context + weights[..., 1:] * out_outside
    if ape_layout.masses is not None:
        ape_layout.masses.append(document_mass(p_context, weights[..., :1], ape_layout.document_ends, groups, q_len))
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).to(query.dtype).contiguous(), None


def document_mass(p_context: torch.Tensor, context_weight: torch.Tensor, document_ends: tuple[int, ...], groups: int,
                  q_len: int) -> torch.Tensor:
    """Merged attention mass on each document block for the last query position, averaged over heads ([N]).

    ``p_context`` [B, Hkv, G*q, C] is the softmax over the document keys, ``context_weight`` [B, Hkv, G*q, 1]
    the documents' weight in the merge, so their product is the final attention on each document key.
    """
    batch, kv_heads = p_context.shape[:2]
    merged = (context_weight * p_context).reshape(batch, kv_heads, groups, q_len, -1)[:, :, :, -1]
    per_key = merged.mean(dim=(1, 2))  # [B, C]
    ends = torch.tensor(document_ends, device=per_key.device)
    cumulative = torch.cumsum(per_key, dim=-1)[:, ends - 1]  # [B, N]
    return torch.diff(cumulative, dim=-1, prepend=torch.zeros_like(cumulative[:, :1]))[0].cpu()


AttentionInterface.register(APE_ATTENTION, ape_attention)


@contextmanager
def ape_attention_swapped(model: torch.nn.Module) -> Iterator[None]:
    """Run the model with :func:`ape_attention` inside the block, and restore its own attention after."""
    can_swap = getattr(model, "_can_set_attn_implementation", None)
    if can_swap is None or not can_swap():
        raise InvalidOptionError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, so "
            "APE's attention cannot be swapped in (custom or remote-code models often do not); use mode='pced' "
            "or 'concat' with this model")
    previous = model.config._attn_implementation
    model.set_attn_implementation(APE_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@register_mode("ape")
def run_ape(ctx: DecodeContext, *, attention_temperature: float = 0.9, scale: float = 0.9,
            attribution: bool = False) -> DecodeResult:
    """Adaptive Parallel Encoding over the documents' cached KV.

    attention_temperature: T, divides the question's attention scores over the documents (sharper
    for T < 1; named so because ``temperature`` is the sampler's). scale: S, scales the documents'
    log-sum-exp in the merge (less total weight on the documents for S < 1). Both in (0, 1];
    T = S = 1 is plain attention over the concatenated caches. Defaults 0.9 / 0.9, the authors' code.
    attribution: record, per generated token, the merged attention mass on each document (mean over
    layers and heads, ``extra["attention_mass"]``) and put the document with the most mass in the trace,
    so APE answers have citations; off by default because it adds work to every attention call.
    """
    check_knobs(attention_temperature, scale)
    engine, layout = ctx.engine, ctx.engine.layout
    suffix = layout.suffix_ids(ctx.query)
    token_ids = [layout.context_ids(d.text) for d in ctx.documents]
    prefix_len, longest = len(layout.prefix_ids), max(len(ids) for ids in token_ids)
    # Documents share positions, so only the longest one (not their sum) counts against the window.
    ctx.check_window(prefix_len + longest + len(suffix), "the longest document with the question")
    caches = engine.store.documents_tokens(layout, token_ids)
    streams = concatenated_stream(engine.store.prefix(layout), caches, next_position=prefix_len + longest)
    total = sum(c.length for c in caches)
    ends = tuple(itertools.accumulate(c.length for c in caches))
    masses: list[torch.Tensor] | None = [] if attribution else None
    streams.forward_kwargs["ape_layout"] = ApeLayout(prefix_len, prefix_len + total, attention_temperature, scale,
                                                     ends, masses)
    ctx.timings["cache_s"] = time.perf_counter() - ctx.started
    model = engine.loaded.model
    with ape_attention_swapped(model):
        first_logits = forward_streams(model, streams, torch.tensor([suffix], device=engine.loaded.device))
        ctx.timings["prefill_s"] = time.perf_counter() - ctx.started
        result = decode_fused(model, engine.loaded.tokenizer, streams, first_logits, single_stream, ctx.sampler,
                              ctx.stop, ctx.on_token, ctx.started)
    result.extra.update(context_tokens=total, query_position=prefix_len + longest)
    if masses is not None:
        _attribute(result, masses, model.config.num_hidden_layers)
    return result


def _attribute(result: DecodeResult, masses: list[torch.Tensor], layers: int) -> None:
    """Token i's logits came from forward pass i (the prefill for token 0): average its layers' masses."""
    shares = []
    for i, step in enumerate(result.trace):
        mass = torch.stack(masses[i * layers:(i + 1) * layers]).mean(0)
        share = mass / mass.sum().clamp_min(1e-12)
        winner = int(share.argmax())
        result.trace[i] = TraceStep(step.token_id, winner, float(share[winner]))
        shares.append([round(float(x), 4) for x in share])
    result.extra["attention_mass"] = shares
