"""The shape of one token's keys and values in a model, and the bytes it takes: the one place that reads it
from a transformers config (the request budget, the row pool, the disk tier's entry checks and the
benchmarks all ask here, so they never disagree about a model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """Per token: ``layers`` x (key, value) x ``kv_heads`` x ``head_dim`` numbers."""

    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take in every layer at ``dtype``."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype.itemsize


def kv_shape(config: object, shards: int = 1) -> KVShape:
    """The KV shape of a transformers config (a multimodal config's text model; GQA's fewer KV heads).

    ``shards``: the tensor-parallel world size; each rank holds ``kv_heads / shards`` of every token's heads
    (transformers' plans split the key/value projections by head), so its caches and rows are that share."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return KVShape(int(text.num_hidden_layers), kv_heads // shards, head_dim)
