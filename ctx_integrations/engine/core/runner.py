"""The model runner: turns the scheduler's :class:`~ctx_integrations.engine.core.step.ScheduledStep` into forwards.

Shaped like vLLM v1's ``GPUModelRunner`` / nano-vllm's ``ModelRunner``: it owns the running batch's
KV buffers (the :class:`~ctx_integrations.engine.core.rows.RowPool`), runs one forward over the
running rows and one over the joining rows, appends the joining rows after the running ones, and
returns per-row logits. It decides nothing about requests: which rows run, join or leave is the
scheduler's. It holds the model weakly, like the scheduler, so a model nobody uses any more is freed.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch

from ctx_integrations.engine.core.kv_shape import kv_shape
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.rows import RowPool, Run
from ctx_integrations.engine.core.step import ScheduledStep, StepOutput

PACK_AT_PADDING = 0.5  # left-pack the batch when more than this share of its key columns is padding
# A padding token costs a whole forward's work per token (~2 x parameters FLOPs), a copied column one token's
# KV bytes: on a CPU thread one padding token of a 135M model costs about as much time as copying a few
# hundred columns of a row, so rows taking several tokens run apart when that saves more.
COPY_COLUMNS_PER_TOKEN = 256


class ModelRunner:
    """One loaded model's batched forwards over the row pool (eager boolean mask or FlexAttention block mask)."""

    def __init__(self, loaded: LoadedModel, attention_kernel: str):
        self._loaded = weakref.ref(loaded)
        self.attention_kernel = attention_kernel  # resolved by flex.resolve_kernel: "eager" or "flex"
        self.pad_token = min(loaded.eos_token_ids) if loaded.eos_token_ids else 0
        self.pool: RowPool | None = None

    @property
    def loaded(self) -> LoadedModel:
        loaded = self._loaded()
        assert loaded is not None, "a runner runs only while an engine holds its model"
        return loaded

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Decode the running rows (one forward), then prefill the joining rows (one forward) and append them."""
        out = StepOutput()
        if self.pool is not None and step.decode:
            self.pool.rewind(dict(step.rewind))
            try:
                out.decoded = self._decode(self.pool, step.decode, out)
            except Exception as error:  # noqa: BLE001 - the scheduler fails the requests this forward held
                out.decode_error = error
            if self.pool.padding_share() > PACK_AT_PADDING:
                self.pool.pack()
        if step.joining:
            loaded = self.loaded
            shape = kv_shape(loaded.model.config)
            try:
                joining = RowPool.build([list(pieces) for pieces in step.joining],
                                        (shape.layers, shape.kv_heads, shape.head_dim), loaded.device, loaded.dtype,
                                        attention=list(step.joining_attention) or None)
                out.joined = self._forward(joining, step.joining_runs, out)
            except Exception as error:  # noqa: BLE001 - the joining requests fail; their rows never join
                out.join_error = error
            else:
                if self.pool is None:
                    self.pool = joining
                else:
                    self.pool.merge(joining)
        return out

    def keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.pool = None
        elif self.pool is not None:
            self.pool.keep_rows(keep)

    def _decode(self, pool: RowPool, runs: Sequence[Sequence[Run]], out: StepOutput) -> list[torch.Tensor]:
        """The running rows' forward. Rows taking several tokens (RAPID's verification, IPPD's stacks) while
        the others take one run apart, on a copy of their rows, when the padding that saves outweighs the copy:
        in one padded forward every other row would compute as many (padding) tokens as the longest row.
        """
        tokens = [sum(len(run.ids) for run in row) for row in runs]
        apart = [b for b, count in enumerate(tokens) if count > 1]
        saved = (len(runs) - len(apart)) * (max(tokens, default=0) - 1)  # padding tokens the others skip
        if not apart or saved * COPY_COLUMNS_PER_TOKEN <= len(apart) * pool.capacity:
            return self._forward(pool, runs, out)
        logits = self._forward(pool, [[] if count > 1 else list(row) for row, count in zip(runs, tokens)], out)
        selected = pool.select(apart)
        for b, row_logits in zip(apart, self._forward(selected, [runs[b] for b in apart], out)):
            logits[b] = row_logits
        pool.take_columns(apart, selected)
        return logits

    def _forward(self, pool: RowPool, runs: Sequence[Sequence[Run]], out: StepOutput) -> list[torch.Tensor]:
        started = time.perf_counter()
        logits = pool.forward(self.loaded.model, [list(row) for row in runs], self.pad_token, self.attention_kernel)
        out.forward_s += time.perf_counter() - started
        out.forwards += 1
        out.rows = max(out.rows, pool.rows)
        return logits

