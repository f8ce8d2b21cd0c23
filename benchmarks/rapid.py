"""RAPID vs the long-context target alone (``concat``) vs the drafter alone over its retrieved context.

Data: the synthetic secret-code set (benchmarks/synthetic.py) with documents of ~512 tokens adding up
to ``--contexts`` tokens. Two questions per set of documents, asked in this order:

- ``code``: "What is the secret code?" (quality: the code appears in the answer);
- ``describe``: a question whose answer runs to the token budget (throughput over a full answer).

Only the first RAPID call on a set of documents computes the target's long-context KV (``long_kv`` =
cold); every later call (other eta, the second question) reuses it (warm). ``concat`` prefills the
whole prompt for every question (no reuse: that is the baseline). ``drafter`` answers from the
chunks RAPID selected for its drafter, with the same model.

Decode throughput is ``new_tokens / (total_s - prefill_s)`` for every mode: after the long prompt is
in the cache, RAPID's window includes the drafter's prefill of its short context. ``speedup`` is
RAPID's decode throughput over ``concat``'s on the same question; ``loop_tok_s`` is RAPID's throughput
without its drafter's prefill (the draft / verify rounds alone).

    python benchmarks/rapid.py                                   # 2k, 4k and ~8k context, 128 tokens
    python benchmarks/rapid.py --contexts 2048 --new-tokens 32   # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_f1, print_table, substring_match, write_results  # noqa: E402
from benchmarks.synthetic import secret_code_example  # noqa: E402
from ctx_integrations import Answer, Engine  # noqa: E402

DOC_TOKENS = 512
QUESTIONS = {
    "code": "What is the secret code? Answer with the code only.",
    "describe": "Describe the places and objects mentioned in the documents, in detail.",
}
COLUMNS = ("context", "question", "mode", "long_kv", "new_tokens", "ttft_s", "total_s", "draft_prefill_s",
           "decode_tok_s", "loop_tok_s", "speedup", "acceptance", "drafted", "accepted", "match", "f1")


def fit_documents(engine: Engine, context: int, new_tokens: int, seed: int):
    """A secret-code example of ~``context`` document tokens in ~512-token documents, within the model's window."""
    overhead = len(engine.layout.prefix_ids) + 64  # prefix + question suffix, generously
    total = min(context, engine.loaded.max_positions - overhead - new_tokens)
    n_documents = max(1, round(total / DOC_TOKENS))
    return secret_code_example(engine.layout, n_documents, total // n_documents, seed=seed)


def drafter_context(engine: Engine, documents: list[str], answer: Answer) -> str:
    """The text of the chunks RAPID gave its drafter, in their original order."""
    ids = [t for d in documents for t in engine.layout.context_ids(d)]
    return engine.loaded.tokenizer.decode([t for c in answer.extra["chunks"] for t in ids[c["start"]:c["start"]
                                                                                          + c["tokens"]]])


def row(context: int, question: str, mode: str, answer: Answer, gold: list[str] | None, **extra: Any) -> dict:
    timings = answer.timings
    window = timings["total_s"] - timings.get("prefill_s", timings["ttft_s"])
    result = {"context": context, "question": question, "mode": mode, "new_tokens": len(answer.token_ids),
              "ttft_s": timings["ttft_s"], "total_s": timings["total_s"],
              "decode_tok_s": len(answer.token_ids) / window if window > 0 else float("nan"),
              "answer": answer.text, **extra}
    if gold is not None:
        result.update(match=substring_match(answer.text, gold), f1=best_f1(answer.text, gold))
    if mode.startswith("rapid"):
        loop = window - timings["draft_prefill_s"]
        result.update(loop_tok_s=len(answer.token_ids) / loop if loop > 0 else float("nan"),
                      long_context_s=timings["long_context_s"])
        result.update(acceptance=timings["acceptance_rate"], draft_prefill_s=timings["draft_prefill_s"],
                      drafted=int(timings["drafted"]), accepted=int(timings["accepted"]),
                      draft_context_tokens=answer.extra["draft_context_tokens"],
                      long_context_tokens=answer.extra["long_context_tokens"])
    return result


def run(args: argparse.Namespace) -> list[dict]:
    engine = Engine.from_pretrained()
    generation = dict(max_new_tokens=args.new_tokens)
    rapid_options = dict(gamma=args.gamma, draft_context_tokens=args.draft_context_tokens,
                         chunk_tokens=args.chunk_tokens, ranking=args.ranking)
    rows = []
    for context in args.contexts:
        for seed in range(args.examples):
            example = fit_documents(engine, context, args.new_tokens, seed)
            for name, question in QUESTIONS.items():
                gold = example.answers if name == "code" else None
                rapids = []
                for eta, rule in [(e, r) for e in args.eta for r in (args.tail_rules if e else ["paper"])]:
                    before = engine.store.stats.hits
                    answer = engine.generate(question, example.documents, mode="rapid", eta=eta, **generation,
                                             tail_rule=rule, **rapid_options)
                    warm = "warm" if engine.store.stats.hits > before else "cold"
                    label = f"rapid eta={eta:g}" + ("" if rule == "paper" else f" {rule}")
                    rapids.append(row(context, name, label, answer, gold, long_kv=warm))
                concat = engine.generate(question, example.documents, mode="concat", **generation)
                draft_text = drafter_context(engine, example.documents, answer)
                drafter = engine.generate(question, [draft_text], mode="concat", **generation)
                new = [row(context, name, "concat", concat, gold, long_kv="none"),
                       row(context, name, "drafter", drafter, gold, long_kv="-"), *rapids]
                for r in rapids:
                    r["speedup"] = r["decode_tok_s"] / new[0]["decode_tok_s"]
                for r in new:
                    print(f"[{context} {name} seed={seed}] {r['mode']}: {r['answer'][:70]!r}", flush=True)
                rows += new
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="document tokens (8192 is cut to what fits the window with the answer)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--examples", type=int, default=1, help="document sets per context length (2 questions each)")
    parser.add_argument("--gamma", type=int, default=10)
    parser.add_argument("--eta", type=float, nargs="+", default=[0.0, 10.0], help="one rapid row per value")
    parser.add_argument("--draft-context-tokens", type=int, default=1024)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--ranking", default="dense", choices=["dense", "bm25", "scores", "auto"],
                        help="how the drafter's chunks are ranked (dense: the paper's)")
    parser.add_argument("--tail-rules", nargs="+", default=["paper"], choices=["paper", "draft_head"],
                        help="tail rules for the eta > 0 rows (paper: Eq. 9; draft_head: the variant)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 avoids spin-waiting on a shared, busy machine)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args)
    print_table(rows, COLUMNS)
    write_results("rapid", rows, vars(args) | {"output": str(args.output)}, args.output)


if __name__ == "__main__":
    main()
