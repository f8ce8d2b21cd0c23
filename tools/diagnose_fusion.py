"""Why PCED answers what it answers on a set: the diagnosis table of docs/evaluation.md, per question kind.

    python tools/diagnose_fusion.py --set manuals --questions 36 --model qwen2.5-coder-0.5b --store DIR --output OUT

For every question of the set's seeded sample (the same sample ``ctx-experts eval`` draws with these flags), it
answers with PCED (default options, or ``--option KEY=VALUE``), with ``single`` (the top passage from its cache) and
with ``concat`` over that top passage alone, and replays PCED's answer through its rule
(:func:`ctx_integrations.evaluation.diagnosis.replay_pced`). It prints, per kind: how often ``single`` and
``concat`` over the same passage answer alike (the cached layout's share of the loss); which document won the first
token of PCED's answer proper (past the opening "Based on the information provided..." and the question's words:
the top-ranked one, a gold one) and by what margin; the prior's lead of the top document over
the gold one where the gold one is not first, against the retrieval scores' spread; how often PCED's answer opens
with a passage's first line (copying); and how often the question's likelihood given a document, or the dense
score, ranks a gold passage first. Writes every question's reading to ``OUT/diagnosis.json``.
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

from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.engine.core.citations import is_content  # noqa: E402
from ctx_integrations.evaluation import load_set  # noqa: E402
from ctx_integrations.evaluation.diagnosis import replay_pced  # noqa: E402
from ctx_integrations.evaluation.metrics import normalize_answer  # noqa: E402
from ctx_integrations.evaluation.runner import score_answer  # noqa: E402


def _first_line(text: str) -> str:
    line = next((part for part in text.strip().splitlines() if part.strip()), "")
    return normalize_answer(line)[:40]


def _copies(answer: str, documents) -> int | None:
    """The document whose first line the answer opens with (normalised, 40 characters), else None."""
    start = normalize_answer(answer)[:40]
    if len(start) < 12:
        return None
    for i, d in enumerate(documents):
        line = _first_line(d.text)
        if len(line) >= 12 and (start.startswith(line[:len(start)]) or line.startswith(start)):
            return i
    return None


# words of the answers' usual opening ("Based on the information provided in the given documents, ..."): a step
# that writes one of them, or a word of the question, is not where the answer is decided
PREAMBLE = frozenset("based information provided given documents document text documentation context above "
                     "according option options command".split())


def _answer_step(replay, question: str):
    """The first step whose token is content (citations' rule) and not a word of the question or of the usual
    opening: where the answer itself starts (an option, a number), as near as the pieces tell."""
    asked = set(normalize_answer(question).split()) | PREAMBLE
    return next((step for step, piece in zip(replay.steps, replay.pieces)
                 if is_content(piece) and normalize_answer(piece) not in asked), None)


def diagnose(engine: Engine, example, tokens: int, options: dict) -> dict:
    docs = list(example.documents)
    scores = [d.score for d in docs]
    top = max(range(len(docs)), key=lambda k: scores[k])  # what single reads
    pced = engine.generate(example.question, docs, mode="pced", max_new_tokens=tokens, **options)
    single = engine.generate(example.question, docs, mode="single", max_new_tokens=tokens)
    concat_one = engine.generate(example.question, [docs[top]], mode="concat", max_new_tokens=tokens)
    replay = replay_pced(engine, example.question, docs, pced.token_ids, **options) if pced.token_ids else None
    gold = set(example.gold)
    row = {"example": example.id, "kind": example.kind, "question": example.question, "gold": sorted(gold),
           "scores": [round(s, 4) for s in scores], "score_spread": round(max(scores) - min(scores), 4),
           "pced": pced.text, "single": single.text, "concat_top1": concat_one.text,
           "pced_em": score_answer(example, pced.text), "single_em": score_answer(example, single.text),
           "concat_top1_em": score_answer(example, concat_one.text),
           "single_equals_concat_top1": single.text.strip() == concat_one.text.strip(),
           "pced_equals_single": pced.text.strip() == single.text.strip(),
           "copies_first_line_of": _copies(pced.text, docs), "single_copies": _copies(single.text, docs)}
    if replay is not None:
        if gold and top not in gold:  # the prior's lead of the passage single reads over the best-scored gold one
            best_gold = max(gold, key=lambda k: scores[k])
            row["prior_lead_over_gold_nats"] = round(replay.prior[top] - replay.prior[best_gold], 3)
        step = _answer_step(replay, example.question) or replay.steps[0]
        at = replay.steps.index(step)
        row.update(agreement=round(replay.agreement, 3), answer_piece=replay.pieces[at], answer_step=at,
                   answer_winner=step.winner, answer_winner_is_top=step.winner == top,
                   answer_margin=round(step.margin, 3),
                   winners=[s.winner for s in replay.steps], pieces=replay.pieces,
                   margins=[round(s.margin, 3) for s in replay.steps],
                   best=[[round(v, 3) for v in s.best] for s in replay.steps], beta=[round(b, 4) for b in replay.beta],
                   question_loglik=[round(v, 3) for v in replay.question_loglik])
        if gold and step.winner not in gold:  # how far the best gold expert was behind the one that won
            row["gold_behind_winner_nats"] = round(step.best[step.winner] - max(step.best[g] for g in gold), 3)
        if gold:
            likeliest = max(range(len(docs)), key=lambda k: replay.question_loglik[k])
            row["likelihood_top_is_gold"] = likeliest in gold
            row["dense_top_is_gold"] = top in gold
    return row


def _share(rows, key, value=True) -> str:
    defined = [r for r in rows if key in r and r[key] is not None]
    if not defined:
        return "-"
    return f"{sum(r[key] == value for r in defined)}/{len(defined)}"


def _median(rows, key) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def table(rows: list[dict]) -> str:
    lines = ["| kind | n | single = concat(top 1) | EM single / concat(top 1) / pced | pced = single | answer's first "
             "token won by the top-scored doc | ... by a gold doc | median margin (nats) | gold behind winner "
             "(median nats) | prior's lead of the top doc over gold (median nats) | median score spread | pced copies "
             "a first line | single copies | likelihood ranks gold first | dense ranks gold first | replay agreement |",
             "|" + "---|" * 16]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        won_gold = [r for r in mine if r["gold"] and "answer_winner" in r]
        lines.append(
            f"| {kind} | {len(mine)} | {_share(mine, 'single_equals_concat_top1')} | "
            f"{sum(r['single_em'] for r in mine):g} / {sum(r['concat_top1_em'] for r in mine):g} / "
            f"{sum(r['pced_em'] for r in mine):g} | {_share(mine, 'pced_equals_single')} | "
            f"{sum(bool(r.get('answer_winner_is_top')) for r in mine)}/{len(mine)} | "
            f"{sum(r['answer_winner'] in r['gold'] for r in won_gold)}/{len(won_gold)} | "
            f"{_median(mine, 'answer_margin')} | {_median(mine, 'gold_behind_winner_nats')} | "
            f"{_median(mine, 'prior_lead_over_gold_nats')} | {_median(mine, 'score_spread')} | "
            f"{sum(r['copies_first_line_of'] is not None for r in mine)}/{len(mine)} | "
            f"{sum(r['single_copies'] is not None for r in mine)}/{len(mine)} | "
            f"{_share(mine, 'likelihood_top_is_gold')} | {_share(mine, 'dense_top_is_gold')} | "
            f"{_median(mine, 'agreement')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="manuals")
    parser.add_argument("--questions", type=int, default=36)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=None)
    parser.add_argument("--data", nargs="+", default=None)
    parser.add_argument("--store", default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--option", action="append", default=[], help="PCED option KEY=VALUE (JSON value)")
    parser.add_argument("--output", default="diagnosis")
    args = parser.parse_args()
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    engine = Engine.from_pretrained(args.model) if args.model else Engine.from_pretrained()
    extra = {k: v for k, v in {"path": args.data, "store_dir": args.store, "top_k": args.top_k,
                                "kinds": args.kinds}.items() if v is not None}
    examples = load_set(args.set, engine, n_questions=args.questions, seed=args.seed, **extra)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rows, started = [], time.perf_counter()
    for example in examples:
        engine.warm(list(example.documents))
        rows.append(diagnose(engine, example, args.max_new_tokens, options))
        print(json.dumps({k: rows[-1][k] for k in ("example", "kind", "pced_em", "single_em", "concat_top1_em")}),
              flush=True)
    (out / "diagnosis.json").write_text(json.dumps({"options": options, "rows": rows,
                                                   "elapsed_s": time.perf_counter() - started}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
