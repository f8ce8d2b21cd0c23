"""The row pool's attention over the arena's own key/value heads: no per-query-head copy of the keys and values.

transformers' ``"sdpa"`` attention repeats every key/value head once per query head of its group (``repeat_kv``)
whenever it is given a mask and the query has more than one token (one-token queries it packs itself, and only
outside ``torch.compile``). The pool always passes a mask, so a joining request's prefill over a grouped-query
model copied each layer's whole slice of the arena ``groups`` times, and the compiled step did so at every step.
:func:`grouped_sdpa` folds each group's query heads into queries of their key/value head instead;
:func:`step_attention` is the attention the pool swaps in for a forward (eager or compiled) on a kernel.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ctx_integrations.engine.core.attention_swap import can_swap
from ctx_integrations.engine.core.flex import FLEX_ATTENTION

GROUPED_SDPA = "ctx_grouped_sdpa"


def step_attention(model: torch.nn.Module, kernel: str) -> str | None:
    """The attention the pool's forwards swap in for a model whose own is transformers' SDPA: FlexAttention on the
    ``"flex"`` kernel (the pool's on CUDA: a split-key decoding kernel, each query head over its own key/value head,
    the tiles nobody sees skipped; compiled into the step's graph), :func:`grouped_sdpa` on ``"eager"``. ``None``
    (the model's own attention over the boolean mask) for any other model: a soft-capped one's eager attention, or
    one that does not look its attention up in transformers' ``AttentionInterface`` (a swap would not reach it)."""
    config = getattr(model, "config", None)
    if config is None or config._attn_implementation != "sdpa" or not can_swap(model):
        return None
    return FLEX_ATTENTION if kernel == "flex" else GROUPED_SDPA


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with every query head attending to its own key/value head in place.

    The ``groups`` query heads of key/value head ``j`` become ``groups x q`` queries of head ``j``, each with its
    token's row of the mask (the same for every head), so no key or value is copied (the copies cost the compiled
    step ~9x the arena's bytes per step on an H200, docs/gpu-benchmark.md). Anything it does not cover (no mask, a
    mask per head, no grouping, a soft cap SDPA cannot apply) goes to transformers' ``"sdpa"``.
    Written by hand: transformers packs only one-token queries and only outside compile, and SDPA's own
    ``enable_gqa`` with a mask takes the math kernel on CUDA.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    foldable = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    if not foldable or heads == kv_heads or kwargs.get("softcap") is not None:  # transformers' sdpa refuses a cap
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    batch, _, q_len, dim = query.shape
    groups = heads // kv_heads
    mask = attention_mask
    if q_len > 1:  # [B, 1, q, K] -> [B, 1, groups x q, K]: each packed query keeps its token's row
        mask = mask[:, :, None].expand(mask.shape[0], 1, groups, q_len, mask.shape[-1]).reshape(
            mask.shape[0], 1, groups * q_len, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, groups * q_len, dim), key, value, attn_mask=mask, dropout_p=dropout,
        scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
