"""Sliding-window attention in the row pool: which layers of a model slide, how far, and the masks that say so.

transformers applies a model's sliding window (Mistral; Gemma 2 / 3, Qwen2 with ``use_sliding_window`` and others
whose ``layer_types`` mix full and sliding layers) inside its mask functions, and those return a 4D mask they are
given unchanged. The pool gives its own 4D mask (the visibility rule of ``rows.py``), so without this module every
layer would see every key of its row: past the window the answer silently differed from the model's own (a tiny
Mistral with an 8-token window answered other tokens than transformers' ``generate`` on the same 247-token prompt).
Each sliding layer's mask adds the window's rule on the virtual positions, which are each row's own sequence
positions: a query at position q sees a key at position k only if q - k < window (transformers'
``sliding_window_overlay``), on the boolean masks of the eager kernel and the block masks of the flex kernel alike.
transformers has no hook for a caller's own mask, so the rule is written here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types


def in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, size: int, real: torch.Tensor) -> torch.Tensor:
    """The window's rule itself, elementwise (inputs broadcast): a real query sees the keys less than ``size``
    positions behind it; a padding query (``real`` False) keeps what the visibility rule lets it see, so no query
    row is left without a key. The eager kernel's boolean masks and the flex kernel's block masks both use it."""
    return (q_pos - k_pos < size) | ~real


@dataclass(frozen=True)
class Windows:
    """A model's sliding window: ``size`` keys (``None``: no layer slides); ``mixed``: some layers attend fully,
    so the model takes one mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``)."""

    size: int | None = None
    mixed: bool = False

    def per_layer_type(self, build: Callable[[int | None], T]) -> T | dict[str, T]:
        """The ``attention_mask`` to give the model, of any kind: ``build(window)`` makes one mask (``None``: no
        window); one without a window, one with it, or both by layer type when only some layers slide."""
        if self.size is None:
            return build(None)
        return {FULL: build(None), SLIDING: build(self.size)} if self.mixed else build(self.size)

    def masks(self, full: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              real: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """:meth:`per_layer_type` for the eager kernel's boolean masks: ``full`` (``[B, 1, Q, K]``, the pool's
        visibility) as it is, or narrowed by :func:`in_window` for ``q_pos`` ``[B, Q]``, ``k_pos`` ``[B, K]`` and
        ``real`` ``[B, Q]`` (the queries that are not padding)."""

        def build(window: int | None) -> torch.Tensor:
            if window is None:
                return full
            return full & in_window(q_pos.unsqueeze(2), k_pos.unsqueeze(1), window, real.unsqueeze(2)).unsqueeze(1)

        return self.per_layer_type(build)


def windows(config: object) -> Windows:
    """The sliding window of a transformers config (its text model's), as its own mask functions apply it; none
    for ``None`` (a stand-in for a model, without a config)."""
    text = getattr(config, "get_text_config", lambda: config)()
    size = getattr(text, "sliding_window", None)
    if size is None or getattr(text, "use_sliding_window", True) is False:
        return Windows()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:  # Mistral: every layer slides
        return Windows(int(size))
    if SLIDING not in layer_types:
        return Windows()
    return Windows(int(size), mixed=any(kind != SLIDING for kind in layer_types))
