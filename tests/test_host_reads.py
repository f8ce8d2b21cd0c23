"""One host read per scheduler step, whatever the modes in the batch: what a GPU pays a sync for, counted on the CPU.

Every read of a device tensor on the host (``tolist``, ``item``, ``bool``, ``int``, ``cpu``, ``nonzero`` ...) stalls
a GPU's stream until the step's kernels are done; the runner reads the whole step's choices back in one transfer
(``engine/core/choice.py``) and nothing else in the step may read. Bugs caught: a rule or sampler that reads a
value mid-step (``.item()`` on a score, a Python ``if`` on a tensor; sampling did, reading its scores back to draw
on the host, and RAPID's sampled verdict, reading back its first rejection), APE's attribution reading its attention
mass back per layer per step (it did: one read per layer), a job's ``accept`` touching a tensor, a proposal read
back per request instead of once.
"""

from __future__ import annotations

import asyncio
import collections

import pytest
from torch.overrides import TorchFunctionMode

import ctx_integrations.engine.core.runner as runner_module
import ctx_integrations.engine.core.scheduler as scheduler_module
from ctx_integrations import Engine, SamplingParams
from ctx_integrations.engine.core.structured import StructuredOutput
from tests.helpers import tiny_loaded

DOCS = ["The vault code is 4721.", "Paris is the capital of France and a large city.", "Bread is baked daily."]
QUESTION = "What is the code?"
READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "equal",
         "masked_select", "unique", "argwhere", "allclose", "__array__"}
SCHEMA = {"type": "object", "properties": {"code": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["code"], "additionalProperties": False}


class Reads(TorchFunctionMode):
    """Counts the tensor functions that read a tensor's values on the host."""

    def __init__(self):
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def steps(monkeypatch) -> list[tuple[int, dict[str, int], dict[str, int]]]:
    """Per scheduler step with rows: (rows, reads in the runner's step, reads while the jobs took their values)."""
    seen: list = []
    execute, consume = runner_module.ModelRunner.execute, scheduler_module.Scheduler._consume

    def counted_execute(self, step):
        with Reads() as reads:
            out = execute(self, step)
        seen.append([len(step.decode) + len(step.joining), dict(reads.count), {}])
        return out

    def counted_consume(self, output, joining):
        with Reads() as reads:
            consume(self, output, joining)
        seen[-1][2] = dict(reads.count)

    monkeypatch.setattr(runner_module.ModelRunner, "execute", counted_execute)
    monkeypatch.setattr(scheduler_module.Scheduler, "_consume", counted_consume)
    return seen


def test_every_step_of_every_mode_reads_the_device_once_alone_and_batched(steps):
    engine = Engine(tiny_loaded("llama", seed=3))
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=1,
                             frequency_penalty=0.5, logprobs=2)
    structured = SamplingParams(max_tokens=6, structured=StructuredOutput(json=SCHEMA))
    calls = [dict(mode=mode) for mode in ("pced", "concat", "single", "ape", "soft_nbce", "nbce", "rapid",
                                          "map_reduce")]
    calls += [dict(mode="pced", sampling=sampled), dict(mode="soft_nbce", sampling=sampled),
              dict(mode="pced", sampling=structured),
              dict(mode="rapid", sampling=SamplingParams(max_tokens=8, temperature=0.8, seed=1)),  # drafts, verdicts
              dict(mode="pced", query_likelihood=0.5), dict(mode="soft_nbce", query_likelihood=0.5)]  # measured priors

    def settings(call: dict) -> dict:
        return call if "sampling" in call else dict(call, max_new_tokens=4)

    for call in calls:  # alone
        engine.generate(QUESTION, DOCS, **settings(call))
    engine.generate_many([QUESTION, "Where is Paris?"], DOCS, max_new_tokens=4)  # IPPD
    engine.chat([{"role": "user", "content": "hi"}], max_new_tokens=4)
    alone = len(steps)

    async def together():
        return await asyncio.gather(*(engine.agenerate(QUESTION, DOCS, **settings(call)) for call in calls),
                                    engine.agenerate_many([QUESTION, "Where is Paris?"], DOCS, max_new_tokens=4))

    asyncio.run(together())
    assert alone > 40 and len(steps) > alone
    assert max(rows for rows, _, _ in steps[alone:]) >= 20  # the modes' rows did share steps
    for rows, in_step, accepting in steps:
        assert rows == 0 or in_step == {"tolist": 1}, (rows, in_step)
        assert accepting == {}, accepting

