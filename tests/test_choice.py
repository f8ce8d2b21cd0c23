"""The step's choice (``engine/core/choice.py``) with hand-made choosers, no model: who proposes, with what, and how
the values come back.

Bugs caught: a batch whose values are dropped for the one-by-one path (the same values, twice the launches), a
failed batch that stops the next key's batch, a batch returning the wrong number of proposals taken anyway, one
request's error failing its batch-mates or the step, a request that is over still proposing, values handed to the
wrong request, more than one read back per step.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ctx_integrations.engine.core.choice import ScheduledRequest, choose, per_request


class Fake:
    """Proposes its rows' first logit, plus its ``offset``; ``key`` batches it; logs who proposed how."""

    log: list[tuple[str, ...]] = []

    def __init__(self, name: str, key: str | None = None, offset: float = 0.0, broken: bool = False):
        self.name, self.key, self.offset, self.broken = name, key, offset, broken

    def batch_key(self):
        return self.key

    def propose(self, logits):
        Fake.log.append(("alone", self.name))
        if self.broken:
            raise ValueError(f"{self.name}'s rule broke")
        return torch.stack([row[0] for row in logits]) + self.offset

    @classmethod
    def propose_batch(cls, choosers, logits):
        Fake.log.append(("batch", *(c.name for c in choosers)))
        if any(c.broken for c in choosers):
            raise ValueError("the batch broke")
        values = [torch.stack([row[0] for row in rows]) + c.offset for c, rows in zip(choosers, logits)]
        return values[:-1] if any(c.key == "short" for c in choosers) else values


class Other(Fake):
    """Another class: the same key batches only within its class."""


def _step(*choosers):
    requests = [ScheduledRequest(f"req-{i}", 2, c) for i, c in enumerate(choosers)]
    logits = [torch.tensor([10.0 * i + row, -1.0]) for i in range(len(choosers)) for row in range(2)]
    return per_request(requests, logits)


@pytest.fixture(autouse=True)
def clean_log():
    Fake.log = []


def test_a_batch_chooses_for_its_members_and_their_own_propose_never_runs():
    chosen, failed = choose(_step(Fake("a", "k"), Fake("b", "k", offset=0.5), Other("c", "k"), Fake("d")))
    assert chosen == {"req-0": [0.0, 1.0], "req-1": [10.5, 11.5], "req-2": [20.0, 21.0], "req-3": [30.0, 31.0]}
    assert failed == {}
    assert sorted(Fake.log) == [("alone", "d"), ("batch", "a", "b"), ("batch", "c")]  # Other's key: a class apart


def test_a_broken_batch_is_retried_alone_and_the_next_keys_batch_still_runs():
    chosen, failed = choose(_step(Fake("a", "k1", broken=True), Fake("b", "k1"), Fake("c", "k2"), Fake("d", "k2")))
    assert list(failed) == ["req-0"] and str(failed["req-0"]) == "a's rule broke"
    assert chosen == {"req-1": [10.0, 11.0], "req-2": [20.0, 21.0], "req-3": [30.0, 31.0]}
    assert Fake.log == [("batch", "a", "b"), ("batch", "c", "d"), ("alone", "a"), ("alone", "b")]


def test_a_batch_with_too_few_proposals_is_retried_alone():
    chosen, failed = choose(_step(Fake("a", "short"), Fake("b", "short", offset=1.0)))
    assert chosen == {"req-0": [0.0, 1.0], "req-1": [11.0, 12.0]} and failed == {}
    assert Fake.log == [("batch", "a", "b"), ("alone", "a"), ("alone", "b")]


def test_a_request_that_is_over_chooses_nothing_and_a_step_without_proposals_reads_nothing():
    taking = _step(Fake("a"), Fake("b"))
    taking[0] = (taking[0][0]._replace(chooser=None), taking[0][1])
    assert choose(taking) == ({"req-1": [10.0, 11.0]}, {}) and Fake.log == [("alone", "b")]
    assert choose([]) == ({}, {})
    assert choose(_step(Fake("a", broken=True))).chosen == {}


def test_the_step_reads_back_once_whatever_its_requests():
    class Reads(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Reads.count += getattr(func, "__name__", "") in ("tolist", "item", "cpu", "__float__", "__int__")
            return func(*args, **(kwargs or {}))

    with Reads():
        choose(_step(Fake("a", "k"), Fake("b", "k"), Fake("c"), Fake("d", broken=True)))
    assert Reads.count == 1
