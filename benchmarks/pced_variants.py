"""PCED ablation: score space (log-probs vs raw logits), aggregation and beta, against concat and single.

Runs on MuSiQue dev questions (``$CTX_MUSIQUE``; documents scored by their order,
r = 1 - i / (2N), since the set ships no retrieval scores) and on the synthetic secret-code set.
This is the measurement behind PCED's default ``score_space``.

    python benchmarks/pced_variants.py                         # 12 MuSiQue + 6 synthetic examples
    python benchmarks/pced_variants.py --musique 40 --synthetic 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_f1, load_musique, print_table, substring_match, write_results  # noqa: E402
from benchmarks.synthetic import secret_code_example  # noqa: E402
from ctx_integrations import Engine  # noqa: E402

VARIANTS: dict[str, tuple[str, dict]] = {
    "pced logprobs max": ("pced", {"score_space": "logprobs"}),
    "pced logits max": ("pced", {"score_space": "logits"}),
    "pced logprobs mixture": ("pced", {"aggregation": "mixture"}),
    "pced logprobs product": ("pced", {"aggregation": "product"}),
    "pced logprobs beta=0": ("pced", {"beta": 0.0}),
    "single": ("single", {}),
    "concat": ("concat", {}),
}


def evaluate(engine: Engine, dataset: str, examples: list[tuple[str, list[str], list[float], list[str]]],
             max_new_tokens: int) -> list[dict]:
    rows = []
    for name, (mode, options) in VARIANTS.items():
        f1, em, ttft = [], [], []
        for question, documents, scores, answers in examples:
            answer = engine.generate(question, documents, scores=scores, mode=mode, max_new_tokens=max_new_tokens,
                                     **options)
            f1.append(best_f1(answer.text, answers))
            em.append(substring_match(answer.text, answers))
            ttft.append(answer.timings["ttft_s"])
        rows.append({"dataset": dataset, "variant": name, "examples": len(examples), "f1": sum(f1) / len(f1),
                     "substring_em": sum(em) / len(em), "mean_ttft_s": sum(ttft) / len(ttft)})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--musique", type=int, default=12, help="number of MuSiQue questions (0 to skip)")
    parser.add_argument("--synthetic", type=int, default=6, help="number of secret-code examples (0 to skip)")
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(args.model)
    rows = []
    if args.synthetic:
        examples = []
        for seed in range(args.synthetic):
            ex = secret_code_example(engine.layout, args.n_docs, args.doc_tokens, seed=seed)
            examples.append((ex.question, ex.documents, [0.5] * args.n_docs, ex.answers))
        rows += evaluate(engine, "secret-code", examples, 12)
    if args.musique:
        examples = []
        for row in load_musique(args.musique):
            n = len(row["documents"])
            examples.append((row["question"], row["documents"], [1 - i / (2 * n) for i in range(n)], row["answers"]))
        rows += evaluate(engine, "musique", examples, args.max_new_tokens)
    print_table(rows, ["dataset", "variant", "examples", "f1", "substring_em", "mean_ttft_s"])
    write_results("pced_variants", rows, {**vars(args), "output": str(args.output)}, args.output)


if __name__ == "__main__":
    main()
