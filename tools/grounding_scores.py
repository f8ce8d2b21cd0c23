"""Does an answer's grounding separate answerable questions from unanswerable ones? Issue 61's measurement.

    python tools/grounding_scores.py --set manuals --kinds single,unanswerable --questions 60 --seed 2 \
        --model qwen2.5-coder-0.5b --output results/grounding          # answers + per-token readings
    python tools/grounding_scores.py --analyse results/grounding/grounding.json      # the tables again, no model

For every question of the seeded sample (the one ``ctx-experts eval`` draws with these flags) it answers with
``soft_nbce`` (its defaults), then scores the answer's tokens teacher-forced on the context-free stream and on each
passage's stream (:func:`ctx_integrations.evaluation.diagnosis.grounding`). An answer's grounding score is the mean,
over its content tokens (the citations' rule, :func:`is_content`), of the best passage's log-probability minus the
context-free one, over the first k content tokens (k = 4, 8) or all of them; ``answer`` leaves out the words of the
question and of the usual opening ("Based on the information provided", ``tools/diagnose_fusion.py``'s list). It
prints, per score, the AUC of answerable against unanswerable (the probability that an answerable question's answer
scores above an unanswerable one's; ties count half) and, at a few thresholds, how many of each kind fall below
(would abstain), with the right answerable ones among them. Writes every reading to ``OUT/grounding.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from diagnose_fusion import PREAMBLE  # noqa: E402

from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.engine.core.citations import is_content  # noqa: E402
from ctx_integrations.evaluation import load_set  # noqa: E402
from ctx_integrations.evaluation.diagnosis import grounding  # noqa: E402
from ctx_integrations.evaluation.metrics import normalize_answer  # noqa: E402
from ctx_integrations.evaluation.runner import score_answer  # noqa: E402


def scores(row: dict) -> dict[str, float | None]:
    """The per-answer grounding scores of one reading (``None`` where the answer has no such token)."""
    gains, pieces = row["gains"], row["pieces"]
    content = [g for g, p in zip(gains, pieces) if is_content(p)]
    asked = set(normalize_answer(row["question"]).split()) | PREAMBLE
    proper = [g for g, p in zip(gains, pieces) if is_content(p) and normalize_answer(p) not in asked]

    def mean(values):
        return statistics.fmean(values) if values else None

    return {"content first 4": mean(content[:4]), "content first 8": mean(content[:8]),
            "content all": mean(content), "answer first 4": mean(proper[:4]), "answer first 8": mean(proper[:8]),
            "answer all": mean(proper), "all tokens": mean(gains)}


def auc(positive: list[float], negative: list[float]) -> float:
    pairs = [(p > n) + 0.5 * (p == n) for p in positive for n in negative]
    return sum(pairs) / len(pairs) if pairs else float("nan")


def analyse(rows: list[dict]) -> str:
    table = [scores(r) for r in rows]
    lines = ["| score | AUC (answerable above unanswerable) | median answerable / unanswerable (nats) |",
             "|---|---|---|"]
    for name in table[0]:
        pos = [s[name] for s, r in zip(table, rows) if r["kind"] != "unanswerable" and s[name] is not None]
        neg = [s[name] for s, r in zip(table, rows) if r["kind"] == "unanswerable" and s[name] is not None]
        lines.append(f"| {name} | {auc(pos, neg):.3f} | {statistics.median(pos):.2f} / {statistics.median(neg):.2f} |")
    for name in table[0]:
        lines += ["", f"{name}: below the threshold (would abstain)", "",
                  "| threshold | answerable below | ... of them right (EM 1) | unanswerable below |", "|---|---|---|---|"]
        values = sorted(s[name] for s in table if s[name] is not None)
        cuts = sorted({round(statistics.quantiles(values, n=10)[i], 2) for i in (1, 3, 4, 5, 7)})
        for cut in cuts:
            below = [(r, s) for s, r in zip(table, rows) if s[name] is None or s[name] < cut]
            ans = [r for r, _ in below if r["kind"] != "unanswerable"]
            lines.append(f"| {cut} | {len(ans)}/{sum(r['kind'] != 'unanswerable' for r in rows)} | "
                         f"{sum(r['em'] for r in ans):g}/{sum(r['em'] for r in rows if r['kind'] != 'unanswerable'):g}"
                         f" | {len(below) - len(ans)}/{sum(r['kind'] == 'unanswerable' for r in rows)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="manuals")
    parser.add_argument("--kinds", default="single,unanswerable")
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="grounding")
    parser.add_argument("--analyse", default=None, help="a grounding.json already written: print its tables")
    args = parser.parse_args()
    if args.analyse:
        print(analyse(json.loads(Path(args.analyse).read_text())["rows"]))
        return
    settings = {"threads": args.threads} if args.threads else {}
    engine = Engine.from_pretrained(args.model, **settings) if args.model else Engine.from_pretrained(**settings)
    examples = load_set(args.set, engine, n_questions=args.questions, seed=args.seed, kinds=args.kinds)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rows, started = [], time.perf_counter()
    for example in examples:
        docs = list(example.documents)
        engine.warm(docs)
        answer = engine.generate(example.question, docs, mode="soft_nbce", max_new_tokens=args.max_new_tokens)
        reading = grounding(engine, example.question, docs, answer.token_ids)
        rows.append({"example": example.id, "kind": example.kind, "question": example.question, "text": answer.text,
                     "em": score_answer(example, answer.text), "gains": [round(g, 4) for g in reading.gains()],
                     "context_free": [round(v, 4) for v in reading.context_free], "pieces": reading.pieces})
        print(json.dumps({k: rows[-1][k] for k in ("example", "kind", "em")} | {"score": scores(rows[-1])}),
              flush=True)
        (out / "grounding.json").write_text(json.dumps({"rows": rows, "elapsed_s": time.perf_counter() - started,
                                                       "argv": sys.argv[1:]}))
    print(analyse(rows))


if __name__ == "__main__":
    main()
