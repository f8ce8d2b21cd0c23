"""What a GPU would wait for, counted on the CPU: host reads per scheduler step for every mode, and the tensor
operations of IPPD's token choice as its questions grow.

A read of a device tensor on the host (``tolist``, ``item``, ``bool``, ``cpu``, ``nonzero`` ...) stalls a GPU's
stream until the step's kernels are done; every operation is a kernel launch. Both are exact counts, stable on a
noisy machine (the timings of the same steps are not): the runner's step (its forwards and the requests' choice,
``ModelRunner.execute``) and the jobs taking their values (``Scheduler._consume``) are counted for each case
alone, and IPPD's choice in ``StackedJob.propose``. The script runs unchanged against an older checkout (it
patches only those three methods), so a count can be compared before and after a change.

    python -m benchmarks.host_reads                    # the embedded model, every case
    python -m benchmarks.host_reads --quick            # three cases, few questions (CI smoke)
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import add_engine_arguments, engine_from_arguments, print_table, write_results

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "equal",
         "masked_select", "unique", "argwhere", "allclose", "__array__"}
DOCS = ["The vault code is 4721.", "Paris is the capital of France and a large city.", "Bread is baked daily."]
QUESTION = "What is the code?"
SCHEMA = {"type": "object", "properties": {"code": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["code"], "additionalProperties": False}


class Reads(TorchFunctionMode):
    """Counts the tensor functions that read a tensor's values on the host."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in READS
        return func(*args, **(kwargs or {}))


class Operations(TorchDispatchMode):
    """Counts the tensor operations dispatched, views apart (they launch no kernel)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_steps() -> Iterator[list[dict[str, int]]]:
    """Per scheduler step with rows, its host reads: the runner's step and the jobs taking their values."""
    from ctx_integrations.engine.core.runner import ModelRunner
    from ctx_integrations.engine.core.scheduler import Scheduler

    steps: list[dict[str, int]] = []
    execute, consume = ModelRunner.execute, Scheduler._consume

    def counted_execute(self, step):
        with Reads() as reads:
            out = execute(self, step)
        steps.append({"rows": len(step.decode) + len(step.joining), "reads": reads.count})
        return out

    def counted_consume(self, output, joining):
        with Reads() as reads:
            consume(self, output, joining)
        steps[-1]["reads"] += reads.count

    ModelRunner.execute, Scheduler._consume = counted_execute, counted_consume
    try:
        yield steps
    finally:
        ModelRunner.execute, Scheduler._consume = execute, consume


def cases(engine: Any, quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    from ctx_integrations import SamplingParams
    from ctx_integrations.engine.core.structured import StructuredOutput

    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1)
    every = [
        ("pced, greedy", lambda: engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=6)),
        ("pced, sampled", lambda: engine.generate(QUESTION, DOCS, mode="pced", sampling=sampled)),
        ("ape (citations on)", lambda: engine.generate(QUESTION, DOCS, mode="ape", max_new_tokens=6)),
        ("soft_nbce, sampled", lambda: engine.generate(QUESTION, DOCS, mode="soft_nbce", sampling=sampled)),
        ("concat, sampled", lambda: engine.generate(QUESTION, DOCS, mode="concat", sampling=sampled)),
        ("pced, JSON schema", lambda: engine.generate(QUESTION, DOCS, mode="pced", sampling=SamplingParams(
            max_tokens=6, structured=StructuredOutput(json=SCHEMA)))),
        ("rapid, greedy", lambda: engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=6)),
        ("rapid, sampled", lambda: engine.generate(QUESTION, DOCS, mode="rapid", sampling=sampled)),
        ("ippd, 2 questions", lambda: engine.generate_many([QUESTION, "Where is Paris?"], DOCS, max_new_tokens=6)),
        ("ippd, 2 questions, sampled", lambda: engine.generate_many([QUESTION, "Where is Paris?"], DOCS,
                                                                     sampling=sampled)),
    ]
    return every[:3] if quick else every


def ippd_choice_operations(engine: Any, questions: int) -> int:
    """The fewest operations one IPPD request's choice of a step (``StackedJob.propose``, which every version has)
    dispatched while ``questions`` greedy questions took a token."""
    from ctx_integrations.engine.modes.ippd import StackedJob

    counts: list[int] = []
    propose = StackedJob.propose

    def counted(self, logits):
        with Operations() as operations:
            values = propose(self, logits)
        counts.append(operations.count)
        return values

    StackedJob.propose = counted
    try:
        engine.generate_many([f"Question number {i}?" for i in range(questions)], DOCS, max_new_tokens=3)
    finally:
        StackedJob.propose = propose
    return min(counts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="three cases and IPPD at 1 and 4 questions")
    args = parser.parse_args(argv)
    engine = engine_from_arguments(args)
    rows: list[dict[str, Any]] = []
    for name, run in cases(engine, args.quick):
        with counted_steps() as steps:
            run()
        reads = collections.Counter(step["reads"] for step in steps if step["rows"])
        rows.append({"case": name, "steps": sum(reads.values()), "reads_per_step_min": min(reads),
                     "reads_per_step_max": max(reads)})
    print_table(rows, ["case", "steps", "reads_per_step_min", "reads_per_step_max"])
    ippd = [{"questions": n, "choice_operations": ippd_choice_operations(engine, n)}
            for n in ((1, 4) if args.quick else (1, 2, 16, 64))]
    print_table(ippd, ["questions", "choice_operations"])
    write_results("host_reads", rows, {"quick": args.quick, "model": engine.loaded.name}, args.output,
                  extra={"ippd_choice": ippd})


if __name__ == "__main__":
    main()
