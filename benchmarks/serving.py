"""Load generator for the serving path: concurrent clients against the engine in-process or over HTTP.

Closed loop: K clients (``--clients 1,2,4,8``) each send their next request as soon as the previous
answer is complete. Open loop: Poisson arrivals at each ``--rates`` (requests per second), whatever
the server's progress. Every cell is measured twice in the same run, against the same engine (or
server): concurrently, and one at a time (the load generator serialises requests with an
``asyncio.Semaphore(1)``: the engine a user without a scheduler gets). The ratios are taken
between those two.

Workloads: the shipped demo corpus (``cli.load_demo_corpus``: each question with ``--documents``
passages) and the PCED paper's synthetic access-key set (``benchmarks/synthetic.py``: N documents of
L tokens, one holds a code). Modes: ``pced``, ``concat`` and ``mix`` (pced / concat / soft_nbce in
turn). Document caches are warmed first, so the numbers are serving numbers, not prefill numbers.

TTFT and latency are the client's view: time from sending a request to its first streamed token /
to its final Answer (queueing included).

``--remote-cache auto`` (a ``redis-server`` started for the run) or ``--remote-cache redis://HOST:PORT/DB``
measures the KV tier shared by replicas instead (issue 60): on one repeated-document workload (the demo corpus,
each request ``--documents`` passages, consecutive requests sharing half of them), sent round-robin to the
replicas as a balancer without document affinity would, in the same run: 1 replica with the remote tier, 2
replicas with private tiers, 2 replicas sharing the remote tier (each replica its own copy of the model, one
torch thread, starting cold), as answers/s and cache hit rate; then, per document, the bytes/s the remote tier
delivers an entry at (GET, checks, decode) against recomputing it on this machine.

    python -m benchmarks.serving --quick
    python -m benchmarks.serving --modes pced --clients 1,2,4,8 --documents 8 --corpus demo
    python -m benchmarks.serving --url http://127.0.0.1:8000 --url http://127.0.0.1:8001 --clients 1,2,4
    python -m benchmarks.serving --remote-cache auto --requests 24 --documents 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_results

MIXES = {"mix": ("pced", "concat", "soft_nbce"),
         # the five methods' serving mix (issue: pced, ape, rapid, concat, ippd), one after another
         "methods": ("pced", "ape", "rapid", "concat", "ippd")}
COLUMNS = ("target", "corpus", "mode", "load", "requests", "answers_per_s", "ttft_p50_s", "ttft_p95_s",
           "latency_p50_s", "latency_p95_s", "tokens_per_s", "serial_answers_per_s", "speedup_vs_serial",
           "ttft_p95_vs_serial", "rows_per_step", "forward_share", "exclusive_share", "overhead_ms_per_step")
STEP_COUNTERS = ("steps", "forward_s", "exclusive_s", "busy_s", "rows_stepped")
REPLICA_CASES = (("1 replica, remote tier", 1, True), ("2 replicas, private tiers", 2, False),
                 ("2 replicas, shared remote tier", 2, True))
REPLICA_COLUMNS = ("case", "replicas", "requests", "answers_per_s", "hit_rate", "hits", "remote_hits", "misses",
                   "latency_p50_s", "latency_p95_s")
TRANSFER_COLUMNS = ("documents", "tokens_per_document", "entry_bytes", "remote_s", "remote_mb_per_s", "recompute_s",
                    "recompute_vs_remote")


@dataclass
class Job:
    query: str
    documents: list[Any]
    mode: str


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    tokens: int


Send = Callable[[Job], Awaitable[Sample]]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- workloads -----------------------------------------------------------------------------------------
def demo_jobs(n_documents: int) -> list[tuple[str, list[Any]]]:
    """Each demo question with ``n_documents`` passages of the demo corpus (a fixed rotation, gold not forced)."""
    from ctx_integrations.cli import load_demo_corpus

    docs, questions = load_demo_corpus()
    n = min(n_documents, len(docs))
    return [(q["question"], [docs[(i + k) % len(docs)] for k in range(n)]) for i, q in enumerate(questions)]


def synthetic_jobs(layout: Any, n_documents: int, length: int, count: int) -> list[tuple[str, list[Any]]]:
    from benchmarks.synthetic import secret_code_example

    examples = [secret_code_example(layout, n_documents, length, seed=s) for s in range(count)]
    return [(e.question, e.documents) for e in examples]


def repeated_jobs(n_documents: int, count: int) -> list[tuple[str, list[Any]]]:
    """``count`` requests over the demo corpus, each with ``n_documents`` passages, consecutive requests sharing
    half of theirs (request i starts at passage i * n/2): every passage is asked several times."""
    from ctx_integrations.cli import load_demo_corpus

    docs, questions = load_demo_corpus()
    n, step = min(n_documents, len(docs)), max(1, n_documents // 2)
    return [(questions[i % len(questions)]["question"], [docs[(i * step + k) % len(docs)] for k in range(n)])
            for i in range(count)]


def with_modes(pairs: list[tuple[str, list[Any]]], mode: str, total: int) -> list[Job]:
    modes = MIXES.get(mode, (mode,))
    return [Job(pairs[i % len(pairs)][0], pairs[i % len(pairs)][1], modes[i % len(modes)]) for i in range(total)]


# -- senders -------------------------------------------------------------------------------------------
def engine_sender(engine: Any, max_new_tokens: int) -> Send:
    async def send(job: Job) -> Sample:
        started = time.perf_counter()
        first = None
        stream = engine.astream(job.query, job.documents, mode=job.mode, max_new_tokens=max_new_tokens)
        async for _ in stream:
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return Sample((first or end) - started, end - started, len(stream.answer.token_ids))

    return send


def http_sender(client: Any, url: str, max_new_tokens: int) -> Send:
    """Stream ``POST /v1/answer`` (SSE) and time the first token event and the final answer event."""

    async def send(job: Job) -> Sample:
        documents = [d if isinstance(d, str) else {"text": d.text, "id": d.id} for d in job.documents]
        body = {"query": job.query, "documents": documents, "mode": job.mode, "max_new_tokens": max_new_tokens,
                "stream": True}
        started = time.perf_counter()
        first, tokens, event = None, 0, None
        async with client.stream("POST", f"{url}/v1/answer", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                    if event == "token" and first is None:
                        first = time.perf_counter()
                elif line.startswith("data:") and event == "answer":
                    tokens = len(json.loads(line[5:])["token_ids"])
        end = time.perf_counter()
        return Sample((first or end) - started, end - started, tokens)

    return send


# -- load patterns ---------------------------------------------------------------------------------------
async def closed_loop(send: Send, jobs: list[Job], clients: int, serial: bool) -> tuple[list[Sample], float]:
    gate = asyncio.Semaphore(1) if serial else None
    queue = list(reversed(jobs))
    samples: list[Sample] = []

    async def client() -> None:
        while queue:
            job = queue.pop()
            if gate is None:
                samples.append(await send(job))
            else:
                queued = time.perf_counter()
                async with gate:
                    sample = await send(job)
                wait = time.perf_counter() - queued - sample.latency_s
                samples.append(Sample(sample.ttft_s + wait, sample.latency_s + wait, sample.tokens))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return samples, time.perf_counter() - started


async def open_loop(send: Send, jobs: list[Job], rate: float, serial: bool, seed: int = 0) -> tuple[list[Sample],
                                                                                                    float]:
    gate = asyncio.Semaphore(1) if serial else None
    rng = random.Random(seed)

    async def one(job: Job) -> Sample:
        if gate is None:
            return await send(job)
        queued = time.perf_counter()
        async with gate:
            sample = await send(job)
        wait = time.perf_counter() - queued - sample.latency_s
        return Sample(sample.ttft_s + wait, sample.latency_s + wait, sample.tokens)

    started = time.perf_counter()
    tasks = []
    for job in jobs:
        tasks.append(asyncio.create_task(one(job)))
        await asyncio.sleep(rng.expovariate(rate))
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - started


def summarise(samples: list[Sample], wall_s: float) -> dict[str, float]:
    ttft = [s.ttft_s for s in samples]
    latency = [s.latency_s for s in samples]
    return {"requests": len(samples), "answers_per_s": len(samples) / wall_s,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": percentile(ttft, 0.95),
            "latency_p50_s": statistics.median(latency), "latency_p95_s": percentile(latency, 0.95),
            "tokens_per_s": sum(s.tokens for s in samples) / wall_s, "wall_s": wall_s}


def step_split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Where the scheduler's time went during a cell, from two ``engine.stats()`` readings."""
    # an older library (a "before" run: this script copied into an older checkout) may lack some counters
    delta = {key: after.get(key, float("nan")) - before.get(key, float("nan")) for key in STEP_COUNTERS}
    busy, steps = delta["busy_s"] or float("nan"), delta["steps"] or float("nan")
    return {"rows_per_step": delta["rows_stepped"] / steps, "forward_share": delta["forward_s"] / busy,
            "exclusive_share": delta["exclusive_s"] / busy,
            "overhead_ms_per_step": 1000 * (delta["busy_s"] - delta["forward_s"] - delta["exclusive_s"]) / steps}


async def measure(send: Send, jobs: list[Job], load: tuple[str, float],
                  engine: Any = None) -> tuple[dict[str, float], dict[str, float]]:
    """One cell: concurrently (with the scheduler's time split, in-process only), then one at a time."""
    kind, value = load
    before = engine.stats() if engine is not None else None
    if kind == "clients":
        concurrent = summarise(*await closed_loop(send, jobs, int(value), serial=False))
    else:
        concurrent = summarise(*await open_loop(send, jobs, value, serial=False))
    if engine is not None:
        concurrent.update(step_split(before, engine.stats()))
    if kind == "clients":
        serial = summarise(*await closed_loop(send, jobs, int(value), serial=True))
    else:
        serial = summarise(*await open_loop(send, jobs, value, serial=True))
    return concurrent, serial


def row(target: str, corpus: str, mode: str, load: tuple[str, float], concurrent: dict[str, float],
        serial: dict[str, float]) -> dict[str, Any]:
    kind, value = load
    return {"target": target, "corpus": corpus, "mode": mode,
            "load": f"K={int(value)}" if kind == "clients" else f"{value:g}/s", **concurrent,
            "serial_answers_per_s": serial["answers_per_s"], "serial_ttft_p95_s": serial["ttft_p95_s"],
            "serial_latency_p95_s": serial["latency_p95_s"],
            "speedup_vs_serial": concurrent["answers_per_s"] / serial["answers_per_s"],
            "ttft_p95_vs_serial": concurrent["ttft_p95_s"] / serial["ttft_p95_s"]}


# -- replicas and the shared remote tier ------------------------------------------------------------------
def round_robin(sends: list[Send]) -> Send:
    """One sender spreading jobs over ``sends`` in turn (a balancer without document affinity)."""
    turn = iter(range(1 << 62))

    async def send(job: Job) -> Sample:
        return await sends[next(turn) % len(sends)](job)

    return send


def forget_remote(url: str, prefix: str) -> None:
    """Delete the entries under ``prefix`` on the server, so a case starts cold (nothing else is touched)."""
    import redis

    client = redis.Redis.from_url(url)
    for key in client.scan_iter(f"{prefix}*", count=1000):
        client.delete(key)


async def replica_cases(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of :data:`REPLICA_CASES` and the remote tier's transfer against recomputing, from one run."""
    from ctx_integrations import Engine
    from ctx_integrations.engine.core.model import load_model

    models = [load_model(args.model), load_model(args.model)]  # one copy per replica, as two processes hold
    pairs = repeated_jobs(args.documents, args.requests)
    jobs = [Job(query, docs, "pced") for query, docs in pairs]
    for loaded in models:  # first-call costs (tokenizer copies, kernels) outside the measurement
        await engine_sender(Engine(loaded, threads=1), args.max_new_tokens)(Job("Warm-up?", ["Warm-up text."], "pced"))
    rows = []
    for case, replicas, shared in REPLICA_CASES:
        engines = [Engine(loaded, threads=1, remote_cache_url=url if shared else None) for loaded in models[:replicas]]
        if shared:
            forget_remote(url, engines[0].store.remote.prefix)
        send = round_robin([engine_sender(engine, args.max_new_tokens) for engine in engines])
        summary = summarise(*await closed_loop(send, jobs, 2 * replicas, serial=False))
        stats = [engine.store.stats for engine in engines]
        hits, misses = sum(s.hits for s in stats), sum(s.misses for s in stats)
        rows.append({"case": case, "replicas": replicas, **summary, "hits": hits, "misses": misses,
                     "remote_hits": sum(s.remote_hits for s in stats), "hit_rate": hits / max(1, hits + misses)})
        print(f"  {case}: {summary['answers_per_s']:.2f} answers/s, hit rate {rows[-1]['hit_rate']:.2f}", flush=True)
        for engine in engines:
            engine.close()
    return rows, [remote_transfer(Engine(models[0], threads=1, remote_cache_url=url), pairs)]


def remote_transfer(engine: Any, pairs: list[tuple[str, list[Any]]]) -> dict[str, Any]:
    """Seconds to read each document's entry from the remote tier (GET, checks, decode) and to recompute it, on one
    torch thread as each replica runs (a second thread on a busy 2-core CPU makes the checks' kernels wait)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _transfer(engine, pairs)
    finally:
        torch.set_num_threads(threads)
        engine.close()


def _transfer(engine: Any, pairs: list[tuple[str, list[Any]]]) -> dict[str, Any]:
    import redis

    store, layout = engine.store, engine.layout
    prefix = store.prefix(layout)
    documents = list(dict.fromkeys(getattr(doc, "text", doc) for _, docs in pairs for doc in docs))
    token_lists = [tuple(layout.context_ids(doc)) for doc in documents]
    store.documents_tokens(layout, [list(ids) for ids in token_lists])  # every entry on the server
    client = redis.Redis.from_url(store.remote.url)
    keys = [store.entry_key(layout, ids) for ids in token_lists]
    sizes = [len(client.get(store.remote.name(key))) for key in keys]
    started = time.perf_counter()
    for key, ids in zip(keys, token_lists):
        assert store.remote.load(key, ids) is not None
    remote_s = (time.perf_counter() - started) / len(keys)
    started = time.perf_counter()
    for ids in token_lists:
        store._compute_batch([ids], prefix)
    recompute_s = (time.perf_counter() - started) / len(keys)
    return {"documents": len(keys), "tokens_per_document": sum(map(len, token_lists)) / len(keys),
            "entry_bytes": sum(sizes) / len(keys), "remote_s": remote_s,
            "remote_mb_per_s": sum(sizes) / len(keys) / remote_s / 1e6, "recompute_s": recompute_s,
            "recompute_vs_remote": recompute_s / remote_s}


def run_replicas(args: argparse.Namespace) -> None:
    """``--remote-cache``: the replica cases and the transfer table, printed and written as JSON."""
    import tempfile

    from benchmarks.redis_server import start_server, stop_server

    process = None
    with tempfile.TemporaryDirectory() as folder:
        url = args.remote_cache
        if url == "auto":
            process, url = start_server(folder, "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru")
        try:
            rows, transfer = asyncio.run(replica_cases(args, url))
        finally:
            if process is not None:
                stop_server(process)
    print_table(rows, REPLICA_COLUMNS)
    print_table(transfer, TRANSFER_COLUMNS)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    write_results("serving_remote", rows, settings, args.output, extra={"remote_transfer": transfer})


# -- main ----------------------------------------------------------------------------------------------
def _numbers(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF id, local dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--url", action="append", default=[],
                        help="benchmark a running server (repeatable: e.g. 1 and 2 replicas) instead of in-process")
    parser.add_argument("--corpus", default="demo,synthetic", help="demo, synthetic or both (comma-separated)")
    parser.add_argument("--modes", default="pced,concat,mix,methods",
                        help="any mode, mix (pced/concat/soft_nbce in turn) or methods (pced/ape/rapid/concat/ippd)")
    parser.add_argument("--clients", default="1,2,4,8,16", help="closed-loop client counts")
    parser.add_argument("--rates", default="", help="open-loop Poisson rates in requests/s (e.g. 0.5,1,2)")
    parser.add_argument("--requests", type=int, default=16, help="requests per cell (default 16)")
    parser.add_argument("--documents", type=int, default=8, help="documents per request (default 8)")
    parser.add_argument("--doc-tokens", type=int, default=128, help="tokens per synthetic document (default 128)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (in-process)")
    parser.add_argument("--remote-cache", default=None, metavar="URL",
                        help="compare replicas with private tiers against replicas sharing this Redis/Valkey server "
                             "(auto: start a redis-server for the run) instead of the serving cells")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke size (tests)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.corpus, args.modes, args.clients, args.rates = "demo,synthetic", "pced,methods", "1,2", "4"
        args.requests, args.documents, args.doc_tokens, args.max_new_tokens = 3, 2, 32, 2
    return args


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    loads = [("clients", float(k)) for k in _numbers(args.clients, int)] + \
            [("rate", r) for r in _numbers(args.rates, float)]
    corpora = [c.strip() for c in args.corpus.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    targets: list[tuple[str, Send]] = []
    engine = None
    client = None
    if args.url:
        import httpx

        client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256))
        targets = [(url, http_sender(client, url.rstrip("/"), args.max_new_tokens)) for url in args.url]
    else:
        from ctx_integrations import Engine

        engine = Engine.from_pretrained(args.model)
        targets = [("engine", engine_sender(engine, args.max_new_tokens))]
    layout = engine.layout if engine is not None else None
    if layout is None and "synthetic" in corpora:
        from ctx_integrations.engine.core.layout import PromptLayout
        from ctx_integrations.engine.core.model import load_tokenizer

        layout = PromptLayout(load_tokenizer(args.model))
    workloads = {}
    for corpus in corpora:
        if corpus == "demo":
            workloads[corpus] = demo_jobs(args.documents)
        elif corpus == "synthetic":
            workloads[corpus] = synthetic_jobs(layout, args.documents, args.doc_tokens, max(4, args.requests))
        else:
            raise SystemExit(f"unknown corpus {corpus!r}: use demo or synthetic")
    rows = []
    try:
        for target, send in targets:
            for corpus, pairs in workloads.items():
                if engine is not None:
                    engine.warm([d for _, docs in pairs for d in docs])
                for mode in modes:
                    jobs = with_modes(pairs, mode, args.requests)
                    await send(jobs[0])  # warm-up (caches, first-call costs) outside the measurement
                    for load in loads:
                        concurrent, serial = await measure(send, jobs, load, engine)
                        rows.append(row(target, corpus, mode, load, concurrent, serial))
                        print(f"  {target} {corpus} {mode} {rows[-1]['load']}: "
                              f"{concurrent['answers_per_s']:.2f} answers/s "
                              f"(x{rows[-1]['speedup_vs_serial']:.2f} vs one at a time)", flush=True)
    finally:
        if client is not None:
            await client.aclose()
        if engine is not None:
            engine.close()  # stop the scheduler's thread before the interpreter exits
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.remote_cache:
        return run_replicas(args)
    rows = asyncio.run(run(args))
    print_table(rows, COLUMNS)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    write_results("serving", rows, settings, args.output)


if __name__ == "__main__":
    main()
