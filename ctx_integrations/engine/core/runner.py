"""The model runner: turns the scheduler's :class:`~ctx_integrations.engine.core.step.ScheduledStep` into forwards.

Shaped like vLLM v1's ``GPUModelRunner`` / nano-vllm's ``ModelRunner``: it owns the running batch's
KV buffers (the :class:`~ctx_integrations.engine.core.rows.RowPool`), runs one forward over the
running rows and one over the joining rows, appends the joining rows after the running ones, and
hands each request's rows to its job to choose its tokens on the device, read back once for the step
(vLLM v1's runner samples too). It decides nothing about requests: which rows run, join or leave is the
scheduler's. It holds the model weakly, like the scheduler, so a model nobody uses any more is freed.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from ctx_integrations.engine.core.batch_invariant import batch_invariant_kernels
from ctx_integrations.engine.core.choice import choose, per_request
from ctx_integrations.engine.core.compiled_step import GuardedStep, compiled_decode_step
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.rows import GROW_COLUMNS, TIGHT_COLUMNS, RowPool, Run
from ctx_integrations.engine.core.step import ScheduledStep, StepForwards, StepLogits, StepOutput


def guarded_step(loaded: LoadedModel, compile_mode: str | None, attention_kernel: str = "eager"
                 ) -> GuardedStep | None:
    """The pool's decode step compiled with ``compile_mode`` (resolved: ``None`` or a torch mode) on
    ``attention_kernel`` (resolved: ``"eager"`` or ``"flex"``), guarded by its eager fallback; ``None`` without a
    mode, or for a model whose attention is not its own SDPA / eager (the fallback passes it a boolean mask)."""
    if compile_mode is None or loaded.model.config._attn_implementation not in ("sdpa", "eager"):
        return None
    return GuardedStep(compiled_decode_step(compile_mode), compile_mode, attention_kernel)


class ModelRunner:
    """One loaded model's batched forwards over the row pool (eager boolean mask or FlexAttention block mask)."""

    def __init__(self, loaded: LoadedModel, attention_kernel: str, compile_mode: str | None = None,
                 batch_invariant: bool = False):
        self._loaded = weakref.ref(loaded)
        # forwards under kernels whose rows round alike in any batch (engine/core/batch_invariant.py)
        self.batch_invariant = batch_invariant
        self.attention_kernel = attention_kernel  # resolved by flex.resolve_kernel: "eager" or "flex"
        self.compile_mode = compile_mode  # resolved by compiled_step.resolve_compile_mode: None or a torch mode
        self.pad_token = min(loaded.eos_token_ids) if loaded.eos_token_ids else 0
        self.pool: RowPool | None = None
        # the decode step of the running pool, compiled (CUDA graphs per bucket on a GPU); None: the eager forward
        self.step = guarded_step(loaded, compile_mode, attention_kernel)

    @property
    def loaded(self) -> LoadedModel:
        loaded = self._loaded()
        assert loaded is not None, "a runner runs only while an engine holds its model"
        return loaded

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Run the step's forwards (:meth:`forward`), then let each request's job choose its tokens from its own
        rows' logits on the device, read back in one transfer (:func:`~ctx_integrations.engine.core.choice.choose`)."""
        computed = self.forward(step)
        taking = []
        if computed.decoded is not None:
            taking += per_request(step.decode_requests, computed.decoded)
        if computed.joined is not None:
            taking += per_request(step.joining_requests, computed.joined)
        return computed.chose(*choose(taking))

    def forward(self, step: ScheduledStep) -> StepLogits:
        """Decode the running rows, then prefill the joining rows and append them (a forward per token count each)."""
        computed = StepLogits()
        if self.pool is not None and step.decode:
            self.pool.rewind(dict(step.rewind))
            try:
                computed.decoded = self._run(self.pool, step.decode, computed, self.step)
            except Exception as error:  # noqa: BLE001 - the scheduler fails the requests this forward held
                computed.decode_error = error
        if step.joining:
            loaded = self.loaded
            shape = loaded.kv_shape
            try:
                # whole flash key blocks where rows must round alike or a compiled step wants few shapes; tight
                # otherwise (attention costs per column of capacity)
                grow = GROW_COLUMNS if self.batch_invariant or self.step is not None else TIGHT_COLUMNS
                joining = RowPool.build([list(pieces) for pieces in step.joining],
                                        (shape.layers, shape.kv_heads, shape.head_dim), loaded.device, loaded.dtype,
                                        attention=list(step.joining_attention) or None, grow_columns=grow,
                                        padded_slots=self.step is not None,  # buckets only for a compiled step
                                        room=max((sum(len(run.ids) for run in row) for row in step.joining_runs),
                                                 default=0))
                computed.joined = self._run(joining, step.joining_runs, computed)
            except Exception as error:  # noqa: BLE001 - the joining requests fail; their rows never join
                computed.join_error = error
            else:
                if self.pool is None:
                    joining.resize_slots(joining.bucket(joining.rows))
                    self.pool = joining
                else:
                    self.pool.merge(joining)
        return computed

    def keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.pool = None
        elif self.pool is not None:
            self.pool.keep_rows(keep)

    def _run(self, pool: RowPool, runs: Sequence[Sequence[Run]], out: StepForwards,
             step: Callable[..., torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The rows' forwards: one per distinct number of tokens the rows take this step (batch invariance).

        A row's tokens always go through a forward whose query length is its own token count, never padded
        to a longer row's: the attention kernels block the queries of a forward, and a row's last query
        block computed beside padding rounds differently (one bf16 ulp in a layer, then a different greedy
        token ~20 tokens on, measured on SmolLM2). With each row at its own columns (:class:`RowPool`) a
        row's logits are then bit for bit those it gets alone. The group with the most rows runs in place
        (the other rows take no token in that forward); every other group (RAPID's verifications, IPPD's
        stacks, prompts of other lengths joining together) runs on a copy of its rows
        (:meth:`RowPool.select`), whose new columns are brought back after. ``step``: the compiled decode step
        the in-place forward runs, whatever its width, when no row in it has its own attention rule (the running
        pool only: its shapes are the arena's, fixed within a bucket).
        """
        tokens = [sum(len(run.ids) for run in row) for row in runs]
        groups: dict[int, list[int]] = {}
        for b, count in enumerate(tokens):
            if count:
                groups.setdefault(count, []).append(b)
        if len(groups) <= 1:
            return self._forward(pool, runs, out, step)
        in_place = max(groups, key=lambda count: (len(groups[count]), -count))
        logits = self._forward(pool, [list(row) if count == in_place else [] for row, count in zip(runs, tokens)],
                               out, step)
        for count, rows in groups.items():
            if count == in_place:
                continue
            selected = pool.select(rows)
            for b, row_logits in zip(rows, self._forward(selected, [runs[b] for b in rows], out)):
                logits[b] = row_logits
            pool.take_columns(rows, selected)
        return logits

    def _forward(self, pool: RowPool, runs: Sequence[Sequence[Run]], out: StepForwards,
                 step: Callable[..., torch.Tensor] | None = None) -> list[torch.Tensor]:
        started = time.perf_counter()
        with batch_invariant_kernels() if self.batch_invariant else nullcontext():
            logits = pool.forward(self.loaded.model, [list(row) for row in runs], self.pad_token,
                                  self.attention_kernel, step)
        out.forward_s += time.perf_counter() - started
        out.forwards += 1
        out.rows = max(out.rows, pool.rows)
        return logits

