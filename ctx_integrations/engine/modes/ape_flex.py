"""APE's attention on FlexAttention: two masked kernel calls and the log-sum-exp merge, no score matrix.

Same rule as :func:`ctx_integrations.engine.modes.ape.ape_attention` (the eager reference):

    C = every document key, scores s / T;   O = prefix + the queries' own keys, causal, scores s
    out = softmax([S * T * LSE_C, LSE_O]) . [out_C, out_O]

Each set is one ``flex_attention`` call over the *whole* key tensor with a block mask that selects
the set (no key is copied or concatenated, and blocks of the other set are skipped), returning its
log-sum-exp; the merge is done in fp32. This module does not import ``ape.py`` (``ape.py``
dispatches here), so the layout is read by attribute: any object with ``context_start``,
``context_end``, ``temperature`` and ``scale``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from ctx_integrations.engine.core.flex import BlockMask, block_mask, run_flex
from ctx_integrations.errors import InvalidOptionError

APE_FLEX_ATTENTION = "ctx_ape_flex"


@functools.lru_cache(maxsize=4)
def ape_block_masks(q_len: int, kv_len: int, start: int, end: int, device: str) -> tuple[BlockMask, BlockMask]:
    """The documents' mask and the prefix-plus-own-causal mask for ``q_len`` queries over ``kv_len`` keys.

    Cached: every layer of one forward pass asks for the same pair (a decode step changes ``kv_len``).
    The bounds live in a tensor, not in Python ints: the compiled kernel treats a captured tensor as an
    input, but specialises (recompiles) on a captured int, and ``kv_len`` changes every step.
    """
    target = torch.device(device)
    bounds = torch.tensor([start, end, kv_len - q_len], device=target)  # own_start: key of the first query's token

    def documents(b, h, q, k):
        return (k >= bounds[0]) & (k < bounds[1])

    def outside(b, h, q, k):
        return (k < bounds[0]) | ((k >= bounds[1]) & (k <= bounds[2] + q))

    return block_mask(documents, None, q_len, kv_len, target), block_mask(outside, None, q_len, kv_len, target)


def check_call(ape_layout: object | None, key: torch.Tensor, kwargs: dict) -> None:
    """What both APE kernels refuse: a call outside mode='ape', soft-capping, keys beyond a sliding window."""
    if ape_layout is None:
        raise InvalidOptionError("the APE attention ran without an ApeLayout: it is only valid inside mode='ape'")
    if kwargs.get("softcap") is not None:
        raise InvalidOptionError("APE does not support attention logit soft-capping (e.g. Gemma 2)")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise InvalidOptionError(f"APE does not support sliding-window attention over {key.shape[2]} keys "
                                 f"(window {window})")


def ape_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       ape_layout: object | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """APE attention for ``query`` [B, H, q, d] over ``key``/``value`` [B, Hkv, K, d]; returns ([B, q, H, d], None)."""
    check_call(ape_layout, key, kwargs)
    q_len, dim = query.shape[2], query.shape[3]
    start, end = ape_layout.context_start, ape_layout.context_end
    temperature, scale = ape_layout.temperature, ape_layout.scale
    scaling = dim ** -0.5 if scaling is None else scaling
    documents, outside = ape_block_masks(q_len, key.shape[2], start, end, str(query.device))
    out_context, lse_context = run_flex(query, key, value, documents, scaling / temperature, return_lse=True,
                                        score_mod=_bias_mod(ape_layout, key.shape[2], query.device))
    out_outside, lse_outside = run_flex(query, key, value, outside, scaling, return_lse=True)
    weights = torch.softmax(torch.stack([scale * temperature * lse_context.float(), lse_outside.float()]), dim=0)
    out = weights[0].unsqueeze(-1) * out_context.float() + weights[1].unsqueeze(-1) * out_outside.float()
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def _bias_mod(ape_layout: object, kv_len: int, device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The retrieval prior (``ape_layout.document_bias``, one value per document, over the columns that
    ``document_ends`` give) as a ``score_mod`` adding each key column's bias; ``None`` without a prior."""
    bias = getattr(ape_layout, "document_bias", ())
    if not bias:
        return None
    lengths = torch.diff(torch.tensor(ape_layout.document_ends), prepend=torch.zeros(1, dtype=torch.long))
    columns = torch.zeros(kv_len, dtype=torch.float32)
    start = ape_layout.context_start
    columns[start:start + int(lengths.sum())] = torch.repeat_interleave(torch.tensor(bias, dtype=torch.float32),
                                                                        lengths)
    columns = columns.to(device)

    def add_bias(score, b, h, q, k):
        return score + columns[k]

    return add_bias


AttentionInterface.register(APE_FLEX_ATTENTION, ape_flex_attention)
