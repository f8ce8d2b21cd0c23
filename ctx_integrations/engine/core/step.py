"""What passes between the scheduler and the model runner: one typed step, its output, and the row table.

The scheduler decides; the runner computes. Like vLLM v1's ``SchedulerOutput`` and nano-vllm's
``ModelRunner.run``, the scheduler hands the runner one :class:`ScheduledStep` per step (the tokens
every running row takes, and the rows that join with their cached pieces and prompts) and gets back
one :class:`StepOutput` (per request, the values its job chose on the device, read back once; the runner
hands each request's rows to its job, :mod:`~ctx_integrations.engine.core.choice`). Nothing in here touches a
model, so the scheduler can be driven by a fake runner in tests.

:class:`RowTable` is the one place that knows which rows of the batch belong to which request: the
scheduler never walks row offsets by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from ctx_integrations.engine.core.choice import ScheduledRequest
from ctx_integrations.engine.core.rows import Piece, Run


@dataclass(frozen=True)
class ScheduledStep:
    """One step as the scheduler decided it.

    ``decode``: per row of the running batch (in its order), the runs it takes this step (a row with
    no run takes nothing; the runner pads it). ``joining``: per new row, its cached pieces;
    ``joining_runs``: per new row, its first runs (the prompt's uncached suffix);
    ``joining_attention``: per new row, its own attention rule (``row_attention.py``; APE's merge) or
    ``None`` (empty: none has one). Joining rows are prefilled in a forward of their own and appended
    after the running rows (docs/scheduler.md says why). ``rewind``: running rows (batch index) whose
    columns at virtual positions ``>=`` the given one are dropped before the decode forward (a
    speculative row's rejected drafts). ``decode_requests`` / ``joining_requests``: the step keyed by
    request id (vLLM v1's ``SchedulerOutput``): each request's id, how many consecutive rows it has and what
    chooses its tokens from their logits (its job), in batch order.
    """

    decode: Sequence[Sequence[Run]] = ()
    joining: Sequence[Sequence[Piece]] = ()
    joining_runs: Sequence[Sequence[Run]] = ()
    joining_attention: Sequence[object | None] = ()
    rewind: Mapping[int, int] = field(default_factory=dict)
    decode_requests: Sequence[ScheduledRequest] = ()  # in batch order: whose rows are which, who chooses for them
    joining_requests: Sequence[ScheduledRequest] = ()


@dataclass
class StepForwards:
    """A step's forwards: a forward that raised leaves its error here (a failed decode fails the running requests, a
    failed prefill the joining ones, whose rows then never join), and what they cost."""

    decode_error: Exception | None = None
    join_error: Exception | None = None
    forwards: int = 0
    forward_s: float = 0.0
    rows: int = 0  # the most rows one of the step's forwards carried


@dataclass
class StepOutput(StepForwards):
    """What the runner returns: per request id, the values its job chose on the device (read back in one transfer
    for the step), or the error its rule raised; a request whose forward raised chooses nothing."""

    chosen: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)


@dataclass
class StepLogits(StepForwards):
    """What the runner's forwards computed for a step: per row, the logits after each of its runs (``[runs, V]``,
    fp32), before any request chose from them (``ModelRunner.forward``; tests read them)."""

    decoded: list[torch.Tensor] | None = None
    joined: list[torch.Tensor] | None = None

    def chose(self, chosen: dict[str, list[float]], failed: dict[str, BaseException]) -> StepOutput:
        """The step's output once its requests chose from these logits."""
        return StepOutput(decode_error=self.decode_error, join_error=self.join_error, forwards=self.forwards,
                          forward_s=self.forward_s, rows=self.rows, chosen=chosen, failed=failed)


class Runner(Protocol):
    """What the scheduler needs of a model runner (:class:`~ctx_integrations.engine.core.runner.ModelRunner`,
    or a fake in tests)."""

    attention_kernel: str  # "eager" or "flex": which attention the batch runs (modes ask, e.g. APE)

    def execute(self, step: ScheduledStep) -> StepOutput: ...

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only these rows of the running batch (in this order); an empty list frees the batch."""


J = TypeVar("J")
S = TypeVar("S")


@dataclass
class RowTable(Generic[J, S]):
    """The running batch's rows in order, grouped by request: ``(job, submission, rows)`` per request.

    Jobs expose ``runs()`` (per row), ``rewinds()`` and ``take_finished_rows()``; the table turns them into the
    batch's per-row lists and back, so row offsets are computed here only.
    """

    entries: list[tuple[J, S, int]] = field(default_factory=list)

    def requests(self) -> list[ScheduledRequest]:
        """Each request's id, row count and chooser (its job; ``None`` once the request is over), in batch order:
        the step keyed by request id."""
        return [ScheduledRequest(str(getattr(request, "request_id", request)), rows,
                                 None if getattr(request, "over", False) else job)
                for job, request, rows in self.entries]

    def runs(self) -> list[list[Run]]:
        """Every row's runs this step, in batch order."""
        return [list(row) for job, _, _ in self.entries for row in job.runs()]

    def rewinds(self) -> dict[int, int]:
        """The rows that drop columns before this step's runs (batch index: first dropped virtual position)."""
        rewind, offset = {}, 0
        for job, _, rows in self.entries:
            rewind.update({offset + row: position for row, position in job.rewinds().items()})
            offset += rows
        return rewind

    def extend(self, other: RowTable[J, S]) -> None:
        """Append joining requests after the running ones (their rows were appended the same way)."""
        self.entries.extend(other.entries)

    def retire(self, leaves: Callable[[J, S], bool]) -> tuple[list[int] | None, list[tuple[J, S]]]:
        """Drop the requests for which ``leaves(job, submission)`` holds, and the rows the others finished with.

        Returns the batch rows to keep (``None`` when every row stays) and the requests that left.
        """
        kept: list[tuple[J, S, int]] = []
        keep: list[int] = []
        left: list[tuple[J, S]] = []
        offset = 0
        for job, submission, rows in self.entries:
            if leaves(job, submission):
                left.append((job, submission))
            else:
                gone = set(job.take_finished_rows())
                kept.append((job, submission, rows - len(gone)))
                keep.extend(offset + row for row in range(rows) if row not in gone)
            offset += rows
        changed = len(keep) != offset
        self.entries = kept
        return (keep if changed else None), left
