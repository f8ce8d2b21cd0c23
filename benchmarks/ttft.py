"""Time to first token: PCED over cached documents vs concatenation (PCED paper's latency setting).

Synthetic set: N documents of exactly L tokens, one holds a secret code, the query asks for it.
For each (N, L): ``concat`` (sequential prefill of all documents), ``pced`` cold (caches computed
during the query) and ``pced`` warm (caches computed at ingestion: the intended use), same inputs,
same run. N=64 x 512 exceeds the 8k window for concatenation, which is reported as not runnable.

    python benchmarks/ttft.py                       # default grid on the embedded model
    python benchmarks/ttft.py --grid 8x128 --examples 1 --repeats 1   # quick smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median, print_table, substring_match, write_results  # noqa: E402
from benchmarks.synthetic import secret_code_example  # noqa: E402
from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.errors import DocumentTooLongError  # noqa: E402

COLUMNS = ["mode", "N", "L", "context_tokens", "ttft_s", "total_s", "accuracy", "ttft_speedup_vs_concat",
           "total_speedup_vs_concat"]


def parse_grid(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def run_case(engine: Engine, n: int, length: int, examples: int, repeats: int, max_new_tokens: int) -> list[dict]:
    rows: dict[str, dict] = {m: {"mode": m, "N": n, "L": length, "context_tokens": n * length, "ttft": [],
                                 "total": [], "correct": []} for m in ("concat", "pced (cold)", "pced (warm)")}
    for seed in range(examples):
        example = secret_code_example(engine.layout, n, length, seed=seed)
        engine.store.clear_memory()  # cold means nothing cached, in memory or on disk (the store is memory-only)
        plan = [("pced (cold)", "pced", 1), ("pced (warm)", "pced", repeats), ("concat", "concat", repeats)]
        for label, mode, times in plan:
            for _ in range(times):
                try:
                    answer = engine.generate(example.question, example.documents, mode=mode,
                                             max_new_tokens=max_new_tokens)
                except DocumentTooLongError:
                    rows[label]["skipped"] = "exceeds the model window"
                    break
                rows[label]["ttft"].append(answer.timings["ttft_s"])
                rows[label]["total"].append(answer.timings["total_s"])
                rows[label]["correct"].append(substring_match(answer.text, example.answers))
    out = []
    concat = rows["concat"]
    for row in rows.values():
        result = {k: row[k] for k in ("mode", "N", "L", "context_tokens")}
        result["ttft_s"] = median(row["ttft"]) if row["ttft"] else None
        result["total_s"] = median(row["total"]) if row["total"] else None
        result["accuracy"] = sum(row["correct"]) / len(row["correct"]) if row["correct"] else None
        result["runs"] = len(row["ttft"])
        if row.get("skipped"):
            result["note"] = row["skipped"]
        if concat["ttft"] and row["ttft"]:
            result["ttft_speedup_vs_concat"] = median(concat["ttft"]) / result["ttft_s"]
            result["total_speedup_vs_concat"] = median(concat["total"]) / result["total_s"]
        out.append(result)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF id, local dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--grid", default="8x512,16x256,32x192,64x512", help="comma-separated NxL cases")
    parser.add_argument("--examples", type=int, default=2, help="examples (needle positions/codes) per case")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats of warm pced and concat per example")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(args.model)
    rows = []
    for n, length in parse_grid(args.grid):
        print(f"N={n} L={length} ...", flush=True)
        rows += run_case(engine, n, length, args.examples, args.repeats, args.max_new_tokens)
    print_table(rows, COLUMNS)
    write_results("ttft", rows, {**vars(args), "output": str(args.output), "model": engine.loaded.name,
                                 "device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype)}, args.output)


if __name__ == "__main__":
    main()
