"""The step's token choice on the device: every request's rule over its own rows' logits, then ONE read back.

vLLM v1's model runner samples the batch and returns token ids; here a request's rule is its mode's (PCED's
fusion, IPPD's stacks, RAPID's verdict, ...), so the runner hands each request's rows to its job
(:class:`Chooser`) and reads every job's proposal back in one transfer for the whole step. Jobs of one class
with one :meth:`Chooser.batch_key` (greedy PCED, Soft-NBCE, NBCE and PCW on an accelerator) choose together, in
one evaluation of their rule (docs/scheduler.md#the-rule-batched-across-requests). The rules read the logits in
fp32 (``rows.decode_step``'s cast, exact from bf16): measured on real logits, a bf16 rule would decide by rounding in
3 steps of 837 (the best two closer than bf16 resolves; docs/scheduler.md, "The rule's dtype"), so none runs in bf16.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

import torch


class Chooser(Protocol):
    """What chooses a request's tokens from its rows' logits (a pooled job, :class:`~.jobs.PooledJob`)."""

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Per row, the logits after each of its runs (``[runs, V]``): this step's values, a 1-D tensor on the
        device."""
        ...

    def batch_key(self) -> Hashable | None:
        """Choosers of one class with equal keys choose together (:meth:`propose_batch`); ``None``: alone."""
        ...

    @classmethod
    def propose_batch(cls, choosers: list, logits: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`propose` for several choosers of this class with one key, the very values each returns alone."""
        ...


class ScheduledRequest(NamedTuple):
    """One request of a step, in batch order: its id, its rows (consecutive), and what chooses its tokens
    (``None``: the request is over; its rows still run this step, nothing is chosen for them)."""

    request_id: str
    rows: int
    chooser: Chooser | None = None


class Choice(NamedTuple):
    """The step's choice: per request id, its proposal read back (what its job's ``accept`` takes), or the error
    its rule raised (that request fails alone)."""

    chosen: dict[str, list[float]]
    failed: dict[str, BaseException]


def per_request(requests: Sequence[ScheduledRequest],
                per_row: Sequence[torch.Tensor]) -> list[tuple[ScheduledRequest, list[torch.Tensor]]]:
    """Each request with its own rows' slice of a per-row list (the rows of a request are consecutive)."""
    if sum(request.rows for request in requests) != len(per_row):
        raise AssertionError(f"{len(per_row)} rows of output for requests of "
                             f"{sum(request.rows for request in requests)} rows")
    out, offset = [], 0
    for request in requests:
        out.append((request, list(per_row[offset:offset + request.rows])))
        offset += request.rows
    return out


def choose(taking: Sequence[tuple[ScheduledRequest, list[torch.Tensor]]]) -> Choice:
    """Every live request's proposal from its rows' logits, read back in one transfer.

    Choosers of one class with one batch key propose together; a batch that raises is proposed again chooser by
    chooser, so its error reaches only the requests it belongs to.
    """
    live = [(request, logits) for request, logits in taking if request.chooser is not None]
    groups: dict[tuple[type, Hashable], list[int]] = {}
    for index, (request, _) in enumerate(live):
        key = request.chooser.batch_key()
        if key is not None:
            groups.setdefault((type(request.chooser), key), []).append(index)
    batched: dict[int, torch.Tensor] = {}
    for (kind, _), members in groups.items():
        try:
            values = kind.propose_batch([live[i][0].chooser for i in members], [live[i][1] for i in members])
            pairs = list(zip(members, values, strict=True))  # a batch that returns too few or too many: one by one
        except Exception:  # noqa: BLE001 - retried one by one below: each request meets its own error alone
            continue
        batched.update(pairs)
    proposals: list[tuple[str, torch.Tensor]] = []
    failed: dict[str, BaseException] = {}
    for index, (request, logits) in enumerate(live):
        try:
            proposals.append((request.request_id,
                              batched[index] if index in batched else request.chooser.propose(logits)))
        except BaseException as error:  # noqa: BLE001 - a request's own failure (e.g. its rule raised)
            failed[request.request_id] = error
    values = torch.cat([proposal for _, proposal in proposals]).tolist() if proposals else []  # the step's one read
    chosen, offset = {}, 0
    for request_id, proposal in proposals:
        chosen[request_id] = values[offset:offset + proposal.numel()]
        offset += proposal.numel()
    return Choice(chosen, failed)
