"""First query vs warm query through LlamaIndex's ``ContextOfExpertsQueryEngine``.

A ``VectorStoreIndex`` (in memory) over the demo corpus that ships with the package, the embedded
SmolLM2 decoder, PCED. Three ways to meet the first query:

- ``cold``: nothing cached, the retrieved nodes' KV caches are computed inside the query;
- ``repeat``: the same question again (every retrieved node is a cache hit);
- ``ingested``: a fresh engine whose ``IngestionPipeline`` ended with ``KVCacheWarmer``, so the
  first query already finds every cache (the intended use).

Each of the demo questions is asked once per way; the medians are reported with the ratio to
``cold`` measured in the same run.

    python benchmarks/llama_index_warm.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import median, print_table, write_results  # noqa: E402
from ctx_integrations import Document, Engine  # noqa: E402
from ctx_integrations.cli import load_demo_corpus  # noqa: E402

COLUMNS = ["query", "questions", "ttft_s", "total_s", "wall_s", "cache_misses", "ttft_ratio_vs_cold",
           "wall_ratio_vs_cold"]


def build_index(corpus: list[Document], engine: Engine, warm: bool):
    from llama_index.core import Document as LlamaDocument
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline

    from ctx_integrations.llama_index import KVCacheWarmer, default_embedding

    documents = [LlamaDocument(text=doc.text, id_=doc.id, metadata=doc.metadata) for doc in corpus]
    transformations = [default_embedding()] + ([KVCacheWarmer(engine)] if warm else [])
    nodes = IngestionPipeline(transformations=transformations).run(documents=documents)
    return VectorStoreIndex(nodes, embed_model=default_embedding())


def ask(query_engine, question: str) -> dict:
    start = time.perf_counter()
    response = query_engine.query(question)
    wall = time.perf_counter() - start
    return {"ttft": response.metadata["timings"]["ttft_s"], "total": response.metadata["timings"]["total_s"],
            "wall": wall, "misses": response.metadata["cache"]["misses"], "text": response.response}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top-k", type=int, default=8, help="similarity_top_k of the query engine")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=None, help="ask only the first N demo questions")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is faster on a busy CPU)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ctx_integrations.llama_index import ContextOfExpertsQueryEngine

    corpus, demo_questions = load_demo_corpus()
    questions = [item["question"] for item in demo_questions][:args.questions]
    engine = Engine.from_pretrained()
    settings = dict(engine=engine, similarity_top_k=args.top_k, max_new_tokens=args.max_new_tokens)
    plain = ContextOfExpertsQueryEngine.from_index(build_index(corpus, engine, warm=False), **settings)
    runs: dict[str, list[dict]] = {"cold": [], "repeat": [], "ingested": []}
    for question in questions:
        engine.store.clear_memory()  # the embedded engine's store is memory-only: this makes it cold
        runs["cold"].append(ask(plain, question))
        runs["repeat"].append(ask(plain, question))
        engine.store.clear_memory()
        warmed = ContextOfExpertsQueryEngine.from_index(build_index(corpus, engine, warm=True), **settings)
        runs["ingested"].append(ask(warmed, question))
        print(f"{question!r}: " + " | ".join(f"{k}={v[-1]['text'][:40]!r} misses={v[-1]['misses']}"
                                             for k, v in runs.items()), flush=True)

    table = []
    for label, items in runs.items():
        table.append({"query": label, "questions": len(items), "ttft_s": median([i["ttft"] for i in items]),
                      "total_s": median([i["total"] for i in items]), "wall_s": median([i["wall"] for i in items]),
                      "cache_misses": sum(i["misses"] for i in items)})
    cold = table[0]
    for row in table:
        row["ttft_ratio_vs_cold"] = cold["ttft_s"] / row["ttft_s"]
        row["wall_ratio_vs_cold"] = cold["wall_s"] / row["wall_s"]
    print_table(table, COLUMNS)
    write_results("llama_index_warm", table, vars(args), args.output)


if __name__ == "__main__":
    main()
