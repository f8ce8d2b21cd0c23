"""IPPD's visibility rule as a FlexAttention block mask: no ``[B, 1, Q, K]`` boolean tensor per step.

Same rule as :func:`ctx_integrations.engine.modes.ippd.visibility` (the eager reference), evaluated
by FlexAttention's ``mask_mod`` from the per-column virtual positions and ids:

    vpos(q) >= vpos(k)  and  (ctx(q) = ctx(k) or ctx(k) = 0)  and  (qid(q) = qid(k) or qid(k) = 0)

The block mask records which 128 x 128 tiles are empty (another question's answer, another
context), so the kernel skips them; on CUDA the attention runs compiled (``flex.run_flex``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctx_integrations.engine.modes.flex import BlockMask, block_mask


def ippd_mask_mod(q_pos: torch.Tensor, q_ctx: torch.Tensor, q_qid: torch.Tensor, k_pos: torch.Tensor,
                  k_ctx: torch.Tensor, k_qid: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The conjunction rule as a ``mask_mod(b, h, q, k)`` over ``[B, Q]`` query and ``[B, K]`` key tensors."""

    def visible(b, h, q, k):
        later = q_pos[b, q] >= k_pos[b, k]
        same_context = (q_ctx[b, q] == k_ctx[b, k]) | (k_ctx[b, k] == 0)
        same_question = (q_qid[b, q] == k_qid[b, k]) | (k_qid[b, k] == 0)
        return later & same_context & same_question

    return visible


def ippd_block_mask(q_pos: torch.Tensor, q_ctx: torch.Tensor, q_qid: torch.Tensor, k_pos: torch.Tensor,
                    k_ctx: torch.Tensor, k_qid: torch.Tensor) -> BlockMask:
    """The block mask of :func:`ippd_mask_mod` for every row of the batch (heads share it)."""
    rule = ippd_mask_mod(q_pos, q_ctx, q_qid, k_pos, k_ctx, k_qid)
    return block_mask(rule, q_pos.shape[0], q_pos.shape[1], k_pos.shape[1], q_pos.device)
