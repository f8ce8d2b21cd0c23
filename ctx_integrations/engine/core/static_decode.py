"""A decode step of fixed shapes, so ``torch.compile`` can capture it once as a CUDA graph.

Decoding from a ``DynamicCache`` grows every layer's keys by one column per step (a new shape, a copy
of the whole cache). :class:`StaticSequences` copies a :class:`SequenceBatch` once into transformers'
``StaticCache`` sized for the answer budget, and keeps a ``[B, max_len]`` padding mask whose next
column is switched on before each step; every step then has the same shapes, and the model's forward
compiled with ``mode="reduce-overhead"`` replays a CUDA graph (no per-step kernel launches from
Python). transformers supplies the static cache and its compile support; this class only moves our
right-padded, per-stream-positioned streams into it.

``step(token_ids)`` is a drop-in for ``decoding.forward_sequences(model, sequences, token_ids)`` for one
token per stream: same logits (tested against it), fixed shapes.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from ctx_integrations.engine.core.cache import SequenceBatch
from ctx_integrations.engine.core.compiled_step import COMPILE_MODES, resolve_compile_mode
from ctx_integrations.errors import InvalidOptionError


def check_compile_mode(mode: object) -> None:
    """Refuse anything but ``None`` or a ``torch.compile`` mode, by name, before any work."""
    if mode not in COMPILE_MODES or mode == "auto":
        raise InvalidOptionError(f"compile_mode must be one of "
                                 f"{', '.join(repr(m) for m in COMPILE_MODES if m != 'auto')}, got {mode!r}")


def default_compile_mode(device: torch.device) -> str | None:
    """``"reduce-overhead"`` (CUDA graphs) on CUDA; ``None`` (eager) elsewhere (compiling costs more than it saves)."""
    return resolve_compile_mode("auto", device)


class StaticSequences:
    """B streams in a ``StaticCache`` of ``width + max_new_tokens`` columns, advanced one token per stream per step.

    ``compile_mode``: ``"auto"`` (:func:`default_compile_mode`), ``None`` (eager), or a ``torch.compile`` mode;
    ``backend``: the ``torch.compile`` backend (``"eager"`` checks the step traces as one graph, without codegen).
    The compiled forward is cached on the model, so later requests with the same shapes reuse the graph.
    """

    def __init__(self, model: torch.nn.Module, streams: SequenceBatch, max_new_tokens: int,
                 compile_mode: str | None = "auto", backend: str = "inductor"):
        if max_new_tokens < 1:
            raise InvalidOptionError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if streams.forward_kwargs:
            raise InvalidOptionError(f"static decoding does not support per-step model kwargs "
                                     f"({', '.join(streams.forward_kwargs)}); decode these streams eagerly")
        batch, width = streams.attention_mask.shape
        device = streams.attention_mask.device
        self.max_len = width + max_new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=self.max_len)
        for layer, source in zip(self.cache.layers, streams.cache.layers):
            layer.update(source.keys, source.values)  # allocates [B, H, max_len, D] and writes columns 0..width-1
        self.mask = torch.zeros(batch, self.max_len, dtype=torch.long, device=device)
        self.mask[:, :width] = streams.attention_mask
        self.positions = streams.positions.clone()
        self.column = width
        mode = default_compile_mode(device) if compile_mode == "auto" else compile_mode
        self._forward = model.forward if mode is None and backend == "inductor" else _compiled(model, mode, backend)

    @property
    def remaining(self) -> int:
        """How many more steps fit in the cache."""
        return self.max_len - self.column

    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append one token per stream (``[B, 1]``); return the next logits ``[B, V]`` (fp32, a fresh tensor)."""
        if self.column >= self.max_len:
            raise InvalidOptionError(f"the static cache holds {self.max_len} columns and is full; size it with a "
                                     "larger max_new_tokens")
        self.mask[:, self.column] = 1
        out = self._forward(input_ids=token_ids, attention_mask=self.mask, position_ids=self.positions.unsqueeze(1),
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.positions += 1
        self.column += 1
        # a CUDA graph overwrites its output buffer at the next replay: hand out a copy
        return out.logits[:, -1].to(torch.float32, copy=True)


def _compiled(model: torch.nn.Module, mode: str | None, backend: str):
    cache = model.__dict__.setdefault("_ctx_compiled_forward", {})
    key = (mode, backend)
    if key not in cache:
        cache[key] = torch.compile(model.forward, mode=mode, backend=backend, fullgraph=True)
    return cache[key]
