"""The retriever's recall@k on every question of the ``manuals`` set, per kind, with the library's default embedder.

    python tools/manuals_recall.py                 # store in $CTX_CACHE_DIR/eval/manuals-<corpus hash> (reused)
    python tools/manuals_recall.py --store DIR --top-k 4

Prints how long building (or reopening) the store took, how long retrieving every question took, and recall@1..k
per kind and over the kinds with gold support (the runner's rule: a two_doc question counts at k only when both
its gold passages are in the top k). Decodes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ctx_integrations.evaluation.manuals import DEFAULT_TOP_K, MANUALS_KINDS, manuals_set, read_manuals  # noqa: E402
from ctx_integrations.evaluation.nq import build_store  # noqa: E402
from ctx_integrations.evaluation.runner import retrieval_recall  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default=None, help="store folder (default: the set's own under the cache)")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    args = parser.parse_args(argv)
    from ctx_integrations.retrieval.retriever import ScoredRetriever

    passages, _ = read_manuals()
    started = time.perf_counter()
    store = build_store(passages, args.store, set_name="manuals")
    built = time.perf_counter() - started
    started = time.perf_counter()
    examples = manuals_set(None, None, top_k=args.top_k, retriever=ScoredRetriever(store))
    retrieved = time.perf_counter() - started
    print(f"store: {len(passages)} passages in {built:.1f} s; {len(examples)} questions retrieved in {retrieved:.1f} s")
    for kind in (*MANUALS_KINDS[:2], "single+two_doc"):
        mine = [e for e in examples if e.kind in kind.split("+")]
        recall = retrieval_recall(mine) or {}
        print(f"{kind} ({len(mine)}): " + ", ".join(f"{k} {v:.3f}" for k, v in recall.items()))
    partial = [e for e in examples if e.kind == "two_doc" and any(r is not None for r in e.meta["gold_ranks"])
               and not e.meta["all_gold_retrieved"]]
    print(f"two_doc with only one of its two gold passages in the top {args.top_k}: {len(partial)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
