"""Per-row attention rules in the shared batch: the batch runs the model's own attention, and a row that
brings its own rule (APE's merge of two softmaxes) gets that rule's output instead.

A rule is a callable ``rule(query, key, value, visible, documents, scaling, last_query) -> out`` over one
row: ``query`` ``[1, H, q, d]``, ``key`` / ``value`` ``[1, Hkv, K, d]``, ``visible`` the row's boolean
mask ``[1, 1, q, K]`` (the pool's visibility rule), ``documents`` ``[1, K]`` the document index each key
column carries (0: none; :attr:`~ctx_integrations.engine.core.rows.Piece.document`), ``last_query`` the
row's last real query column this forward; it returns ``[1, q, H, d]`` like transformers' attention
functions. Every other row goes through the model's own attention function (SDPA or eager), so rows
without a rule compute exactly what they compute in a batch without any rule.

transformers has no per-row attention choice; this module adds it through its ``AttentionInterface``
(the model is switched to :data:`ROW_ATTENTION` for the forwards that hold such rows only).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ROW_ATTENTION = "ctx_row_attention"

RowRule = Callable[..., torch.Tensor]


def base_attention(module: torch.nn.Module, implementation: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function ``module`` runs under ``implementation``: a registered one, or its model's eager one
    (transformers' eager attention lives in each model's own module)."""
    if implementation != "eager":
        return ALL_ATTENTION_FUNCTIONS[implementation]
    return sys.modules[type(module).__module__].eager_attention_forward


def row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0, *,
                  row_base: str, row_rules: Sequence[tuple[int, RowRule, int]],
                  row_documents: torch.Tensor, row_visible: dict[int, torch.Tensor] | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Every row through the model's own attention (``row_base``), then each ``(row, rule, last_query)`` of
    ``row_rules`` replaced by its rule's output (cast to the batch's dtype by the assignment). ``row_visible``:
    each rule row's boolean mask when the batch's mask is a FlexAttention block mask (no rows to slice)."""
    out, weights = base_attention(module, row_base)(module, query, key, value, attention_mask, scaling=scaling,
                                                    dropout=dropout, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    for row, rule, last_query in row_rules:
        one = slice(row, row + 1)
        visible = row_visible[row] if row_visible is not None else attention_mask[one]
        out[one] = rule(query[one], key[one], value[one], visible, row_documents[one], scaling, last_query)
    return out, weights


AttentionInterface.register(ROW_ATTENTION, row_attention)
