"""Kernels whose per-row results do not depend on the batch (``Engine(batch_invariant=True)``, CPU).

The row pool keeps every shape a row sees its own (:mod:`~ctx_integrations.engine.core.rows`: columns, key
blocks, one forward per token count). Two CPU kernels still round a row by what is beside it, measured with
torch 2.13 on AVX-512 in fp32 (bf16 showed neither):

- **GEMM height.** MKL picks its kernel by the matrix's shape: an fp32 row comes out differently when the
  matrix has 1, 2-3, 5-7 or 9-11 rows than with 4, 8 or 12 and more (~3e-5 on SmolLM2's logits), so a
  request alone in the pool (one or two slots) rounds unlike the same request beside others.
- **Flash attention's thread split.** torch's CPU flash kernel in fp32 gives a row other bits when the batch
  is split differently over the threads (one query per row, two threads, batch 2 vs 4); the math kernel
  (``aten._scaled_dot_product_attention_math``: one matmul per batch entry) gives every row the same bits.

While :class:`batch_invariant_kernels` is active (the runner's forwards, when asked), ``F.linear`` on the CPU
pads its rows up to the smallest height *measured* on this machine (per weight shape and dtype, once per
process) to round like a tall matrix, and drops the padding from the result; a height that already rounds
like a tall one is left alone, so a library without such kernels pays nothing. ``F.scaled_dot_product_attention``
on the CPU runs the math kernel. This is vLLM's batch-invariant mode for the CPU (vLLM's replaces CUDA kernels;
nothing offers it for CPU kernels, hence this module). Its cost, measured in docs/scheduler.md#batch-invariance:
the padded rows' compute and the math kernel's score matrix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Heights probed against a tall matrix; a taller matrix is taken as rounding like a tall one (measured with MKL
# up to 300 rows; tests/test_batch_invariant_kernels.py checks heights up to 40 on the machine that runs it).
PROBED_ROWS = 16
_TALL_ROWS = 64
# Outputs compared per probed height: a bf16 row of a one-row matrix with a bias was seen to differ in 1 output
# of 576, so a narrow weight is probed with more rows (up to the tall matrix's 64) than a wide one (2).
_PROBED_OUTPUTS = 1 << 16

_heights: dict[tuple, tuple[int, ...]] = {}
_heights_lock = threading.Lock()


def padded_heights(weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[int, ...]:
    """For ``F.linear`` with this weight's (and bias's) shape and dtype on the CPU, with this thread's torch
    thread count: entry ``m`` (1..:data:`PROBED_ROWS`) is the smallest height >= ``m`` whose rows come out bit
    for bit as in a tall matrix (entry 0 unused).

    Measured once per (shape, dtype, bias, threads) and process: random rows through matrices of each height,
    compared with the same rows inside one :data:`_TALL_ROWS`-row matrix (consecutive windows of the
    height, so rows at every place in a window are compared). A height none reaches maps to the tallest probed."""
    threads = torch.get_num_threads()  # MKL's choice of kernel for a short fp32 matrix depends on it (measured)
    key = (*weight.shape, weight.dtype, bias is not None, threads)
    with _heights_lock:
        known = _heights.get(key)
        if known is not None:
            return known
        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(_TALL_ROWS, weight.shape[1], generator=generator).to(weight.dtype)
        rows = min(_TALL_ROWS, max(2, _PROBED_OUTPUTS // weight.shape[0]))
        with torch.no_grad(), torch._C.DisableTorchFunction():
            tall = F.linear(probe, weight, bias)

            def exact(m: int) -> bool:
                return all(torch.equal(F.linear(probe[start:start + m], weight, bias), tall[start:start + m])
                           for start in range(0, max(1, rows - m + 1), m))

            heights, target = [0] * (PROBED_ROWS + 1), PROBED_ROWS
            for m in range(PROBED_ROWS, 0, -1):
                target = m if exact(m) else target
                heights[m] = target
        _heights[key] = known = tuple(heights)
        return known


def linear_rows_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with at least the height :func:`padded_heights` names for ``x``'s
    rows (zero rows appended, their outputs dropped)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or rows == 0 or rows > PROBED_ROWS:
        return F.linear(x, weight, bias)
    height = padded_heights(weight, bias)[rows]
    if height == rows:
        return F.linear(x, weight, bias)
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, height - rows))
    return F.linear(flat, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one the math kernel takes (what SDPA does first with a bool)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def attention_batch_invariant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through the math kernel on the CPU (the flash kernel elsewhere)."""
    if query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = additive_mask(attn_mask, query.dtype)
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
