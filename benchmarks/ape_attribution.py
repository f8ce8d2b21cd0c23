"""What APE's default per-document attribution costs: the same warm answers with ``attribution`` on and off.

APE records attribution by default wherever its eager kernel runs (CPU), adding a per-layer reduction to
every attention call. This times that cost on the PCED paper's synthetic secret-code set, caches warm
(as at ingestion): for each case, each repetition answers once with ``attribution=True`` and once with
``attribution=False``, alternating which goes first, and checks that both give the same tokens.
Columns: median TTFT and total time of each setting and their ratio (on / off).

    OMP_NUM_THREADS=1 python benchmarks/ape_attribution.py --threads 1      # docs/ape.md's numbers
    python benchmarks/ape_attribution.py --grid 4x64 --repeats 1 --max-new-tokens 2   # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_engine_arguments, engine_from_arguments, median, print_table, write_results  # noqa: E402
from benchmarks.synthetic import secret_code_example  # noqa: E402
from ctx_integrations import Answer, Engine  # noqa: E402

COLUMNS = ["case", "repeats", "new_tokens", "ttft_off_s", "ttft_on_s", "total_off_s", "total_on_s", "ttft_ratio",
           "total_ratio"]


def measure(engine: Engine, n_documents: int, length: int, repeats: int, max_new_tokens: int) -> dict:
    example = secret_code_example(engine.layout, n_documents, length)
    engine.warm(example.documents)

    def answer(attribution: bool) -> Answer:
        return engine.generate(example.question, example.documents, mode="ape", max_new_tokens=max_new_tokens,
                               attribution=attribution)

    for flag in (True, False):  # untimed: first-call allocations
        answer(flag)
    times: dict[bool, dict[str, list[float]]] = {flag: {"ttft": [], "total": []} for flag in (False, True)}
    for repeat in range(repeats):
        order = (True, False) if repeat % 2 else (False, True)
        answers = {flag: answer(flag) for flag in order}
        if answers[True].token_ids != answers[False].token_ids:
            raise AssertionError(f"attribution changed the answer on {n_documents}x{length}")
        for flag, result in answers.items():
            times[flag]["ttft"].append(result.timings["ttft_s"])
            times[flag]["total"].append(result.timings["total_s"])
    off, on = ({k: median(v) for k, v in times[flag].items()} for flag in (False, True))
    return {"case": f"{n_documents}x{length}", "repeats": repeats, "new_tokens": len(answers[True].token_ids),
            "ttft_off_s": off["ttft"], "ttft_on_s": on["ttft"], "total_off_s": off["total"], "total_on_s": on["total"],
            "ttft_ratio": on["ttft"] / off["ttft"], "total_ratio": on["total"] / off["total"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", default="3x128,8x256,16x256", help="synthetic NxL cases (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5, help="timed answers per setting and case")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    engine = engine_from_arguments(args)
    rows = []
    for case in filter(None, args.grid.split(",")):
        n_documents, length = (int(x) for x in case.split("x"))
        print(f"{case}: {args.repeats} repetitions ...", flush=True)
        rows.append(measure(engine, n_documents, length, args.repeats, args.max_new_tokens))
    print_table(rows, COLUMNS)
    write_results("ape_attribution", rows,
                  {**vars(args), "output": str(args.output), "model": engine.loaded.name,
                   "device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype)}, args.output)


if __name__ == "__main__":
    main()
