"""APE over cached documents vs concatenation (sequential prefill) vs PCED, and APE's sensitivity to T and S.

Two sets, one run:
- the PCED paper's synthetic secret-code set (N documents of exactly L tokens, one holds the code);
- MuSiQue dev questions (``$CTX_MUSIQUE``, 10 passages each, about 6k tokens).
For each example: ``concat`` (all documents prefilled in one prompt), ``ape`` and ``pced`` cold (the
documents' caches computed inside the call) and warm (computed beforehand, as at ingestion).
Columns: prefill time (until the question's logits), TTFT, total time, substring exact match and
token F1 against the gold answers, and the ratios to ``concat`` on the same examples.
Then a T x S grid of APE (warm) on the MuSiQue examples.

    python benchmarks/ape.py                                  # default sizes on the embedded model
    python benchmarks/ape.py --grid 4x128 --musique 1 --temperatures 1.0 --scales 1.0   # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_f1, load_musique, median, print_table, substring_match, write_results  # noqa: E402
from benchmarks.synthetic import secret_code_example  # noqa: E402
from ctx_integrations import Engine  # noqa: E402

COLUMNS = ["set", "mode", "examples", "prefill_s", "ttft_s", "total_s", "match", "f1", "ttft_vs_concat",
           "total_vs_concat"]
GRID_COLUMNS = ["T", "S", "examples", "match", "f1", "ttft_s"]
RUNS = (("concat", "concat", False), ("ape cold", "ape", False), ("ape warm", "ape", True),
        ("pced cold", "pced", False), ("pced warm", "pced", True))


def examples(engine: Engine, grid: list[tuple[int, int]], per_case: int, musique: int) -> dict[str, list]:
    """``{set name: [(question, documents, answers)]}``."""
    sets: dict[str, list] = {}
    for n, length in grid:
        sets[f"synthetic {n}x{length}"] = [
            (e.question, e.documents, e.answers)
            for e in (secret_code_example(engine.layout, n, length, seed=s) for s in range(per_case))]
    if musique:
        sets["musique"] = [(r["question"], r["documents"], r["answers"]) for r in load_musique(musique)]
    return sets


def run_set(engine: Engine, name: str, items: list, max_new_tokens: int) -> list[dict]:
    measured: dict[str, dict[str, list[float]]] = {label: {k: [] for k in ("prefill", "ttft", "total", "match", "f1")}
                                                   for label, _, _ in RUNS}
    for question, documents, answers in items:
        for label, mode, warm in RUNS:
            engine.store.clear_memory()  # memory-only store: cold means nothing cached
            if warm:
                engine.warm(documents)
            answer = engine.generate(question, documents, mode=mode, max_new_tokens=max_new_tokens)
            values = measured[label]
            values["prefill"].append(answer.timings["prefill_s"])
            values["ttft"].append(answer.timings["ttft_s"])
            values["total"].append(answer.timings["total_s"])
            values["match"].append(substring_match(answer.text, answers))
            values["f1"].append(best_f1(answer.text, answers))
    rows, concat = [], measured["concat"]
    for label, values in measured.items():
        row = {"set": name, "mode": label, "examples": len(items), "prefill_s": median(values["prefill"]),
               "ttft_s": median(values["ttft"]), "total_s": median(values["total"]),
               "match": sum(values["match"]) / len(items), "f1": sum(values["f1"]) / len(items)}
        row["ttft_vs_concat"] = median(concat["ttft"]) / row["ttft_s"]
        row["total_vs_concat"] = median(concat["total"]) / row["total_s"]
        rows.append(row)
    return rows


def knob_grid(engine: Engine, items: list, temperatures: list[float], scales: list[float],
              max_new_tokens: int) -> list[dict]:
    for _, documents, _ in items:
        engine.warm(documents)
    rows = []
    for t in temperatures:
        for s in scales:
            answers = [(engine.generate(q, docs, mode="ape", attention_temperature=t, scale=s,
                                        max_new_tokens=max_new_tokens), gold) for q, docs, gold in items]
            rows.append({"T": t, "S": s, "examples": len(items),
                         "match": sum(substring_match(a.text, g) for a, g in answers) / len(items),
                         "f1": sum(best_f1(a.text, g) for a, g in answers) / len(items),
                         "ttft_s": median([a.timings["ttft_s"] for a, _ in answers])})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF id, local dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--grid", default="8x256,16x256", help="synthetic NxL cases (comma-separated)")
    parser.add_argument("--examples", type=int, default=3, help="synthetic examples per case")
    parser.add_argument("--musique", type=int, default=6, help="MuSiQue questions (0 = skip)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.8, 0.9, 1.0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.8, 0.9, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model)
    grid = [tuple(int(x) for x in case.split("x")) for case in args.grid.split(",") if case]
    sets = examples(engine, grid, args.examples, args.musique)
    rows = []
    for name, items in sets.items():
        print(f"{name}: {len(items)} examples ...", flush=True)
        rows += run_set(engine, name, items, args.max_new_tokens)
    print_table(rows, COLUMNS)
    knobs = knob_grid(engine, sets.get("musique", []), args.temperatures, args.scales, args.max_new_tokens) \
        if "musique" in sets else []
    if knobs:
        print_table(knobs, GRID_COLUMNS)
    write_results("ape", rows + [{"set": "musique T/S grid", **row} for row in knobs],
                  {**vars(args), "output": str(args.output), "model": engine.loaded.name,
                   "device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype)}, args.output)


if __name__ == "__main__":
    main()
