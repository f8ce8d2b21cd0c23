"""APE's T and S chosen for a model the paper's way, then scored on held-out questions.

The APE paper tunes its attention temperature T and scale S per model and task by a greedy search over
a small validation set (Sec. 4.3). This runs :func:`~ctx_integrations.engine.modes.ape.search_knobs` on
invented-world dev questions (one seed) and then scores APE with the authors' defaults (T = S = 0.9)
and with the pair found, on test questions of another seed, in the same run:

    python benchmarks/ape_search.py --model qwen2.5-coder-0.5b --threads 1          # docs/ape.md's numbers
    python benchmarks/ape_search.py --dev 1 --test 1 --grid 0.9 1.0 --max-new-tokens 2   # smoke run

Prints the search's scores and a table (one row per system on the test questions); writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_engine_arguments, engine_from_arguments, print_table, write_results  # noqa: E402
from ctx_integrations.engine.modes.ape import search_knobs  # noqa: E402
from ctx_integrations.evaluation import evaluate, world_set  # noqa: E402
from ctx_integrations.evaluation.runner import EVAL_OPTIONS, System  # noqa: E402

COLUMNS = ["system", "T", "S", "examples", "substring_em", "f1", "citation_precision", "citation_recall", "ttft_s",
           "total_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", type=int, default=6, help="dev questions (seed --dev-seed)")
    parser.add_argument("--test", type=int, default=8, help="test questions (seed --test-seed)")
    parser.add_argument("--dev-seed", type=int, default=1)
    parser.add_argument("--test-seed", type=int, default=0)
    parser.add_argument("--grid", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    engine = engine_from_arguments(args)
    started = time.perf_counter()
    dev = [(e.question, list(e.documents), list(e.answers)) for e in world_set(args.dev, seed=args.dev_seed)]
    found = search_knobs(engine, dev, grid=tuple(args.grid), max_new_tokens=args.max_new_tokens)
    search_s = time.perf_counter() - started
    print(f"search on {len(dev)} dev questions (seed {args.dev_seed}): T={found.attention_temperature} "
          f"S={found.scale} dev score {found.score:.3f} ({search_s:.0f} s)")
    for (t, s), score in sorted(found.scores.items()):
        print(f"  T={t:.1f} S={s:.1f}: {score:.3f}")
    base = dict(EVAL_OPTIONS.get("ape", {}))
    tuned_name = f"ape T={found.attention_temperature} S={found.scale}"
    systems = [System("concat", "concat"), System("ape", "ape", base),
               System(tuned_name, "ape", {**base, **found.options})]
    report = evaluate(engine, world_set(args.test, seed=args.test_seed), systems=systems,
                      max_new_tokens=args.max_new_tokens, set_name="world")
    knobs = {"concat": (None, None), "ape": (0.9, 0.9), tuned_name: (found.attention_temperature, found.scale)}
    rows = [{**row, "T": knobs[row["system"]][0], "S": knobs[row["system"]][1]} for row in report.rows]
    print_table(rows, COLUMNS)
    write_results("ape_search", rows,
                  {**vars(args), "output": str(args.output), "model": engine.loaded.name, "found": found.options,
                   "dev_score": found.score, "search_s": search_s,
                   "dev_scores": {f"T={t} S={s}": v for (t, s), v in sorted(found.scores.items())}},
                  args.output)

if __name__ == "__main__":
    main()
