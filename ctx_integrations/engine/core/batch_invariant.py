"""Kernels whose per-row results do not depend on the batch (``Engine(batch_invariant=True)``, CPU).

The row pool keeps every shape a row sees its own (:mod:`~ctx_integrations.engine.core.rows`: columns, key
blocks, one forward per token count). Two CPU kernels still round a row by what is beside it:

- **GEMM height.** MKL and oneDNN pick their kernel by the matrix's shape, so a row comes out with other bits
  in a matrix of another height. Measured with torch 2.13: on an AMD EPYC (AVX-512) in fp32, 1-3, 5-7 and 9-11
  rows unlike 4, 8 or 12 and more (~3e-5 on SmolLM2's logits); on an Intel Xeon with AMX, fp32 1-15 rows
  unlike 16-56 and, on two threads, 57-81 unlike either, and bf16 5-36 rows unlike 1-4 and 37 and more. No
  height rounds "like a tall matrix" on every CPU, so none is guessed: every row goes through GEMMs of one
  fixed height, :data:`ROW_BLOCK` rows (zero rows pad the last block), where a row's bits depend neither on
  its place in the block nor on the other rows (checked on the CPU that runs the tests).
- **Flash attention's thread split.** torch's CPU flash kernel in fp32 gives a row other bits when the batch
  is split differently over the threads (one query per row, two threads, batch 2 vs 4); the math kernel
  (``aten._scaled_dot_product_attention_math``: one matmul per batch entry) gives every row the same bits.

While :class:`batch_invariant_kernels` is active (the runner's forwards, when asked), ``F.linear`` on the CPU
runs in blocks of :data:`ROW_BLOCK` rows and ``F.scaled_dot_product_attention`` on the CPU runs the math
kernel. This is vLLM's batch-invariant mode for the CPU (vLLM's fixes the tiling of CUDA kernels; nothing
offers it for CPU kernels, hence this module). Its cost, measured in docs/scheduler.md#batch-invariance: a
decode step's few rows computed as 16, one GEMM call per 16 rows of a prefill, and the math kernel's score
matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The height of every GEMM a row goes through: enough for a decode step's slots (one block), small enough that
# a lone request's one row costs 16 rows' compute.
ROW_BLOCK = 16


def linear_rows_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row of ``x`` computed in a GEMM of exactly :data:`ROW_BLOCK` rows
    (zero rows appended to the last block, their outputs dropped), so a row's bits do not depend on how many
    rows are beside it. Off the CPU, and for no rows, plain ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or rows == 0:
        return F.linear(x, weight, bias)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % ROW_BLOCK))
    blocks = [F.linear(flat[start:start + ROW_BLOCK], weight, bias) for start in range(0, flat.shape[0], ROW_BLOCK)]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one the math kernel takes (what SDPA does first with a bool)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def attention_batch_invariant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through the math kernel on the CPU (the flash kernel elsewhere); a boolean
    ``attn_mask`` was made additive by the caller (:class:`batch_invariant_kernels`, once per forward)."""
    if query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                             scale=scale, enable_gqa=enable_gqa)[0]


class batch_invariant_kernels(TorchFunctionMode):  # noqa: N801 - a context manager, like torch's own modes
    """While active: ``F.linear`` is :func:`linear_rows_invariant`, ``F.scaled_dot_product_attention`` is
    :func:`attention_batch_invariant`; every other function runs as it is.

    One mode per forward (the runner enters one around each): every layer gets the same boolean mask, which is
    made additive once, for the first layer, and reused by identity for the others (a mask is never changed in
    place during a forward).
    """

    def __init__(self) -> None:
        super().__init__()
        self._mask: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None  # (bool mask, dtype, additive)

    def _additive(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._mask is None or self._mask[0] is not mask or self._mask[1] != dtype:
            self._mask = (mask, dtype, additive_mask(mask, dtype))
        return self._mask[2]

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_rows_invariant(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if attn_mask is not None and attn_mask.dtype == torch.bool and query.device.type == "cpu":
            attn_mask = self._additive(attn_mask, query.dtype)
        return attention_batch_invariant(query, key, value, attn_mask, *args, **kwargs)
