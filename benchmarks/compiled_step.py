"""The pool's compiled decode step against its eager step, on the CPU: PCED's decode steps per second, per checkout.

On an H200 the compiled step (CUDA graphs) decoded PCED's 65 rows at 15.1 steps/s, the eager step at 41.3
(docs/gpu-benchmark.md). The CPU shows the same loss with Inductor's C++ code and no CUDA graphs at all: a
random model with the Llama-3 head grouping (8 query heads, 2 key/value heads, head dim 64; 2 layers, hidden
512), PCED over ``--documents`` documents of ~700 tokens (one row each and the no-context row), ``--new-tokens``
greedy tokens, caches warm. The cause was transformers' SDPA copying every layer's keys and values once per query
head of a key/value head under compile (``grouped_attention.grouped_sdpa``). ``--baseline PATH`` measures another
checkout in the same run (a folder holding its files, e.g. ``git worktree add /tmp/base bd434a6``), in a
subprocess with that folder first on ``sys.path``. One torch thread.

Per checkout and step: decode steps/s of one PCED answer (median of ``--repeats`` after a first, compiling,
call), the first call's seconds, and whether its tokens equal the eager step's.

    python -m benchmarks.compiled_step --baseline /tmp/base
    python -m benchmarks.compiled_step --quick --backend eager   # the CI smoke run: Dynamo's tracing only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MODEL = dict(family="llama", seed=3, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1024, num_hidden_layers=2)


def measure(documents: int, new_tokens: int, repeats: int, backend: str) -> list[dict[str, Any]]:
    """Both steps of one case in this process (whichever checkout is first on ``sys.path``)."""
    import torch

    from ctx_integrations import Engine
    from ctx_integrations.engine.core import compiled_step
    from ctx_integrations.engine.core import runner as runner_module
    from tests.helpers import tiny_loaded

    built = runner_module.compiled_decode_step
    runner_module.compiled_decode_step = lambda mode: compiled_step.compiled_decode_step(mode, backend=backend)
    texts = [f"Document {d}. " + " ".join(WORDS[(d * 7 + j) % len(WORDS)] for j in range(700))
             for d in range(documents)]
    rows, eager_tokens = [], None
    try:
        for step, mode in (("eager", None), (f"compiled ({backend})", "default")):
            engine = Engine(tiny_loaded(**MODEL), compile_mode=mode)
            engine.warm(texts)
            rates, first_s = [], 0.0
            for call in range(1 + repeats):
                started = time.perf_counter()
                answer = engine.generate("What is the code?", texts, mode="pced", max_new_tokens=new_tokens)
                if call == 0:
                    first_s = time.perf_counter() - started
                    continue
                rates.append((len(answer.token_ids) - 1) / (answer.timings["total_s"] - answer.timings["ttft_s"]))
            eager_tokens = answer.token_ids if eager_tokens is None else eager_tokens
            fell_back = getattr(engine.scheduler.runner.step, "failed", False)
            rows.append({"step": step, "documents": documents, "new_tokens": len(answer.token_ids),
                         "steps_per_s": statistics.median(rates), "first_call_s": first_s,
                         "tokens_equal_eager": answer.token_ids == eager_tokens, "fell_back": bool(fell_back)})
    finally:
        runner_module.compiled_decode_step = built
        torch._dynamo.reset()
    for row in rows:
        row["vs_eager"] = row["steps_per_s"] / rows[0]["steps_per_s"]
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from benchmarks.common import print_table, run_in_checkout, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=31, help="PCED's documents: its rows less one (default 31)")
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens each answer decodes (default 40)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend of the compiled step (default inductor; eager: tracing only)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a folder with another commit's files (git worktree add DIR COMMIT), measured too")
    parser.add_argument("--quick", action="store_true", help="3 documents, 6 new tokens, 1 repeat")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.documents, args.new_tokens, args.repeats = 3, 6, 1
    rows = []
    for label, path in (("this checkout", REPO), ("baseline", args.baseline)):
        if path is None:
            continue
        case = (args.documents, args.new_tokens, args.repeats, args.backend)
        # this checkout in this process (one import less); another one in a process whose imports are its own
        for row in measure(*case) if path == REPO else run_in_checkout(path.resolve(), __file__, "measure", *case):
            rows.append({"checkout": label, **row})
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, ["checkout", "step", "documents", "new_tokens", "steps_per_s", "vs_eager", "first_call_s",
                       "tokens_equal_eager", "fell_back"])
    write_results("compiled_step", rows, vars(args) | {"baseline": str(args.baseline)}, args.output)
    return rows


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    main()
