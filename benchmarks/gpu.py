"""The GPU benchmark: every method at the papers' settings, on random-weight models of real shapes, in one command.

Models: Llama-3.1-8B and Llama-3.2-1B shapes (``transformers.LlamaConfig`` built here, weights random,
bf16 on CUDA). Timings do not depend on weight values, except where a method's control flow does
(RAPID's acceptance rate, answer lengths: both are reported). The tokenizer is the embedded SmolLM2
one (its ids are all below Llama's vocabulary; ids the model emits beyond it decode to nothing).
``max_position_embeddings`` is raised to 256k so the concatenation baseline can run at 64 x 2048
tokens plus the prompt (random weights: the RoPE range changes no timing).

Sections (``--only a,b``), each against the strongest baseline a user would run, in the same run:

- ``pced``: PCED (caches cold, i.e. computed in the call, and warm) vs ``concat``: TTFT and end to end
  at N x 2048 tokens for N in 8..64 (the paper's 64 x 2048), and each mode's decode rate against the
  memory-bandwidth limit (``benchmarks/roofline.py``: weights + cached KV bytes per step / measured bandwidth);
- ``ape``: APE prefill (cold: documents encoded in the call; warm: from cache, FlexAttention and
  eager attention) vs ``concat`` prefill at 32k-128k tokens; each mode is timed apart, so one failing
  kernel leaves the others' rows;
- ``ippd``: IPPD answers/s for 16-64 questions over one 2048-token context vs prefix-cached batching
  (the context's KV computed once, copied into one row per question, all decoded as one batch);
- ``rapid``: RAPID (self-speculation, drafter over 1024 retrieved tokens) vs the long-context target
  alone (``concat``) at 16k-64k tokens: decode tokens/s and end to end;
- ``soft_nbce``: peak GPU memory and time of Soft-NBCE (2048-token chunks) vs ``concat``;
- ``scheduler``: answers/s of K concurrent ``Engine.agenerate`` requests (asyncio) vs the same K
  requests one at a time, K = 1..32;
- ``cache``: load time of 64 x 2048-token caches from each tier: device memory, pinned host memory
  (``engine/core/transfer.py``), pageable host memory, disk (safetensors; the files were just written,
  so this reads the OS page cache);
- ``decode``: decode steps/s of N cached streams (1 + N documents, PCED's batch) with
  the pool's eager step vs its compiled step (``Engine(compile_mode=...)``: CUDA graphs on CUDA; its
  one-off compile time is its own column); in the table also ``concat``'s one row;
- ``peer``: plain transformers ``generate`` (greedy, the model's default SDPA attention, ``DynamicCache``)
  over the same concatenated prompt the engine's ``concat`` reads: TTFT, total, decode tokens/s;
- ``bandwidth``: the device's memory bandwidth, measured by a large same-device copy, beside its datasheet
  figure when the device name is known;
- ``table`` (not part of the default run): the headline rows in priority order, on the 8B shape: the
  bandwidth; PCED warm vs ``concat`` at 64 x 2048 (TTFT, batch-1 ``concat`` decode and PCED's 65-row
  decode against the roofline); 16 and 32 concurrent PCED requests vs serial (the serial rate measured
  once over 8 requests); IPPD vs prefix-cached batching at 16 and 64 questions; PCED and ``concat`` at
  8 x 2048 and the transformers peer there; APE prefill at 32k and 128k; the peer at 64 x 2048; last, the
  pool's compiled decode step (CUDA graphs) against its eager step on PCED's 65 rows and on ``concat``'s one
  row at 8 x 2048 (the compiled step is an opt-in until these rows show it winning).

``--budget SECONDS`` runs the table (or the ``--only`` sections) within that much wall clock, counted
from the process's start (``benchmarks/budget.py``): before each case, its estimated seconds (reference
costs fitted to the first H200 run, scaled up when this run has been slower than they said) must fit in
what is left, else the case becomes a row with the reason it was skipped; at the deadline a watchdog
records the case in flight, rewrites the JSON and ends the process (exit status 124). Under a budget
each case runs one warm-up and one timed call unless ``--repeats`` says otherwise.

Each case's rows are printed and the JSON (``--out DIR/gpu.json``) rewritten as soon as it finishes; a
summary table of the headline rows closes the run (and is in the JSON as ``summary``).

Times are wall clock around ``torch.cuda.synchronize()``; TTFT is the engine's own (its first token is
chosen on the CPU, which waits for the GPU). Each case runs once to warm up, then ``repeats`` times
(median). On a GPU a failing case (e.g. out of memory) is recorded with its error and the run goes on;
``--dry-run`` (tiny shapes, whatever device, what CI runs on CPU) lets every error through.

    python benchmarks/gpu.py --budget 540 --out DIR         # the headline table, within 9 minutes
    python benchmarks/gpu.py --out DIR                      # everything (~20 min on one H100)
    python benchmarks/gpu.py --only pced,ape --models llama-3.1-8b --out DIR
    python benchmarks/gpu.py --dry-run                      # tiny shapes on CPU, < 3 minutes
    python benchmarks/gpu.py --dry-run --budget 60          # the table at tiny shapes, under a budget
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import roofline  # noqa: E402
from benchmarks.budget import INTERRUPTED_EXIT, Budget, Watchdog  # noqa: E402
from benchmarks.common import RESULTS, print_table, write_results  # noqa: E402
from ctx_integrations import Answer, Engine  # noqa: E402
from ctx_integrations.engine.core.cache import batch_sequences  # noqa: E402
from ctx_integrations.engine.core.compiled_step import resolve_compile_mode  # noqa: E402
from ctx_integrations.engine.core.decoding import forward_sequences  # noqa: E402
from ctx_integrations.engine.core.layout import PromptLayout  # noqa: E402
from ctx_integrations.engine.core.model import (  # noqa: E402
    LoadedModel,
    default_device,
    default_dtype,
    load_tokenizer,
    model_identity,
)
from ctx_integrations.engine.core.runner import guarded_step  # noqa: E402
from ctx_integrations.engine.core.transfer import prefetch, to_host  # noqa: E402

SECTIONS = ("pced", "ape", "ippd", "rapid", "soft_nbce", "scheduler", "cache", "decode", "peer", "bandwidth")
TABLE = "table"  # the headline rows (--only table; what --budget runs when --only is not given)

# Published shapes (config.json of meta-llama/Llama-3.1-8B and Llama-3.2-1B); weights are random.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=262144),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=262144),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=8192),
}


@dataclass(frozen=True)
class Shapes:
    """Sizes of one run: the papers' settings, or tiny ones for the dry run."""

    models: tuple[str, ...]
    doc_tokens: int  # every section's documents have exactly this many tokens
    pced_docs: tuple[int, ...]
    ape_contexts: tuple[int, ...]
    ippd_questions: tuple[int, ...]
    ippd_context: int
    rapid_contexts: tuple[int, ...]
    rapid_draft_tokens: int
    rapid_chunk_tokens: int
    soft_nbce_contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    scheduler_docs: int
    scheduler_doc_tokens: int
    cache_docs: int
    decode_streams: tuple[int, ...]
    new_tokens: int  # answer length everywhere (random weights rarely end early; lengths are reported)
    rapid_new_tokens: int
    repeats: int
    peer_docs: tuple[int, ...]
    bandwidth_megabytes: int
    # the headline table: its model, its sizes, and how many serial requests give the serial answers/s
    table_models: tuple[str, ...]
    table_concurrency: tuple[int, ...]
    table_ape_contexts: tuple[int, ...]
    table_ippd_questions: tuple[int, ...]
    serial_requests: int


FULL = Shapes(models=("llama-3.2-1b", "llama-3.1-8b"), doc_tokens=2048, pced_docs=(8, 16, 32, 64),
              ape_contexts=(32768, 65536, 131072), ippd_questions=(16, 32, 64), ippd_context=2048,
              rapid_contexts=(16384, 32768, 65536), rapid_draft_tokens=1024, rapid_chunk_tokens=512,
              soft_nbce_contexts=(16384, 65536), concurrency=(1, 2, 4, 8, 16, 32), scheduler_docs=4,
              scheduler_doc_tokens=512, cache_docs=64, decode_streams=(1, 8, 32), new_tokens=32, rapid_new_tokens=128,
              repeats=2, peer_docs=(8, 64), bandwidth_megabytes=4096, table_models=("llama-3.1-8b",),
              table_concurrency=(16, 32), table_ape_contexts=(32768, 131072), table_ippd_questions=(16, 64),
              serial_requests=8)
DRY = Shapes(models=("tiny",), doc_tokens=40, pced_docs=(2, 4), ape_contexts=(80, 160), ippd_questions=(2, 4),
             ippd_context=40, rapid_contexts=(160,), rapid_draft_tokens=32, rapid_chunk_tokens=16,
             soft_nbce_contexts=(160,), concurrency=(1, 2, 4), scheduler_docs=2, scheduler_doc_tokens=24,
             cache_docs=4, decode_streams=(1, 3), new_tokens=4, rapid_new_tokens=8, repeats=1, peer_docs=(2, 4),
             bandwidth_megabytes=16, table_models=("tiny",), table_concurrency=(2, 4), table_ape_contexts=(80, 160),
             table_ippd_questions=(2, 4), serial_requests=2)

DECODE_COLUMNS = ["decode_tokens_per_s", "rows", "gb_per_step", "roofline_fraction"]
COLUMNS = {
    "pced": ["model", "mode", "documents", "doc_tokens", "ttft_s", "total_s", "new_tokens", "ttft_speedup_vs_concat",
             "total_speedup_vs_concat", *DECODE_COLUMNS],
    "ape": ["model", "mode", "context_tokens", "ttft_s", "total_s", "prefill_speedup_vs_concat"],
    "ippd": ["model", "method", "questions", "context_tokens", "seconds", "answers_per_s", "vs_prefix_cached",
             "same_answers"],
    "rapid": ["model", "mode", "context_tokens", "total_s", "decode_tokens_per_s", "acceptance_rate",
              "decode_speedup_vs_concat", "total_speedup_vs_concat"],
    "soft_nbce": ["model", "mode", "context_tokens", "peak_extra_mb", "ttft_s", "total_s", "memory_vs_concat"],
    "scheduler": ["model", "concurrent", "serial_requests", "serial_s", "concurrent_s", "serial_answers_per_s",
                  "concurrent_answers_per_s", "speedup"],
    "cache": ["model", "tier", "entries", "megabytes", "seconds", "gb_per_s"],
    "decode": ["model", "method", "documents", "doc_tokens", "steps", "first_call_s", "steps_per_s", "speedup"],
    "peer": ["model", "mode", "documents", "doc_tokens", "prompt_tokens", "ttft_s", "total_s", "new_tokens",
             "decode_tokens_per_s"],
    "bandwidth": ["model", "device", "measured_gb_per_s", "spec_gb_per_s", "measured_vs_spec"],
}
QUESTION = "What is the secret code? Answer with the code only."
_WORDS = ("the river town market people water city day year time house school road field work light tree hill "
          "stone wind rain bridge north south east west small large old new green blue red morning evening night "
          "week summer winter garden table window door street wall farm village").split()


# -- models and inputs ------------------------------------------------------------------------------
def build_model(name: str, tokenizer: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """A random-weight Llama of shape ``name``, created directly on ``device`` in ``dtype`` (no host copy)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(MODEL_SHAPES[name])
    shape.setdefault("vocab_size", len(tokenizer))
    config = LlamaConfig(**shape, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    label = f"random-{name}"
    return LoadedModel(model=model, tokenizer=tokenizer, name=label, identity=model_identity(model, label),
                       device=device, dtype=dtype)


class Corpus:
    """Documents of exactly ``n`` tokens as the engine's layout tokenises them (single-token filler words)."""

    def __init__(self, layout: PromptLayout):
        self.layout = layout
        encode = layout.tokenizer
        self.words = [w for w in dict.fromkeys(_WORDS)
                      if len(encode(" " + w, add_special_tokens=False)["input_ids"]) == 1]

    def document(self, tokens: int, rng: random.Random) -> str:
        head = f"Note {rng.randrange(10**6)}:"
        words = [rng.choice(self.words) for _ in range(tokens)]
        count = tokens - len(self.layout.context_ids(head))
        for _ in range(4):  # filler words are one token each, so one correction normally suffices
            text = head + "".join(" " + w for w in words[:max(count, 0)])
            missing = tokens - len(self.layout.context_ids(text))
            if missing == 0:
                return text
            count += missing
        raise RuntimeError(f"could not build a document of exactly {tokens} tokens")

    def documents(self, count: int, tokens: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [self.document(tokens, rng) for _ in range(count)]

    def questions(self, count: int) -> list[str]:
        """``count`` distinct questions whose prompt suffixes all have the same number of tokens."""
        by_length: dict[int, list[str]] = {}
        for k in range(10 * count + 20):
            question = f"What is the code of locker {100 + k}? Answer with the code only."
            by_length.setdefault(len(self.layout.suffix_ids(question)), []).append(question)
        best = max(by_length.values(), key=len)
        if len(best) < count:
            raise RuntimeError(f"only {len(best)} equal-length questions, {count} needed")
        return best[:count]


# -- what a case costs, for the budget ---------------------------------------------------------------
# Reference seconds on one H200 with the Llama-3.1-8B shape in bf16, fitted to the first GPU run's logs
# (docs/gpu-benchmark.md#what-was-measured-and-on-what): concat's prefill of T tokens ~ 4e-5 T + 7.5e-10 T^2 s
# (0.74 s at 16k, 17.5 s at 131k); a decode step ~ 30 ms + 0.5 ms per row + 0.35 us per cached column of each
# row (concat 37 tok/s at 8 x 2048; PCED warm at 64 x 2048: 69 ms per step over 65 rows); loading a cached
# document ~12 ms (PCED warm TTFT 0.85 s at 64). One-off costs on CUDA: the first pooled forward compiles
# FlexAttention and its block mask (the pced section took 152.5 s for 102 s of calls), each case ~10 s of
# recompiles at new shapes, documents and setup (the ippd section: 37.5 s for 11 s of calls in 2 cases), APE's
# flex kernel ~30 s, the compiled decode step ~90 s (the H200's 64-document decode case: 170.6 s against the eager
# step's 78.1 s; 22.8 s for the exclusive path's static step before it). Other
# models scale (MODEL_SCALE). The fit errs long: 20.5 s for concat's 18.4 s at 64 x 2048, 3.5 s for PCED's 3.0.
REF_TOKEN_S = 4.0e-5
REF_TOKEN_PAIR_S = 7.5e-10
REF_STEP_S = 0.03
REF_ROW_S = 5e-4
REF_ROW_COLUMN_S = 3.5e-7
REF_DOCUMENT_S = 0.012
REF_FIRST_FORWARD_S = 45.0
REF_CASE_S = 10.0
REF_APE_COMPILE_S = 30.0
REF_STATIC_COMPILE_S = 90.0
REF_CPU_CASE_S = 1.0  # a dry-run case on CPU: documents, engine, gc (0.6-1.3 s each at tiny shapes, 2 busy cores)
REF_PEER_DECODE_SLOWER = 2.5  # transformers generate decoded at 14.8 tok/s where the engine's concat did 37
MODEL_SCALE = {"llama-3.1-8b": 1.0, "llama-3.2-1b": 0.4, "tiny": 0.5}  # 1B: 72 vs ~27 steps/s; tiny: host-bound


def prefill_s(tokens: int, sequences: int = 1) -> float:
    return sequences * (REF_TOKEN_S * tokens + REF_TOKEN_PAIR_S * tokens**2)


def decode_s(steps: int, rows: int, columns: int) -> float:
    return steps * (REF_STEP_S + REF_ROW_S * rows + REF_ROW_COLUMN_S * rows * columns)


# -- timing -----------------------------------------------------------------------------------------
@dataclass
class Case:
    """One unit of the run: a section's rows for one size, what it is estimated to cost, and how to run it."""

    section: str
    label: dict[str, Any]
    run: Callable[[], list[dict]]
    prior_s: float  # reference seconds (REF_*), before the budget's slowdown and margin


# A section's cases in order, each built when reached: its estimate depends on the one-off costs (compiles)
# that the cases before it paid.
Plan = list[Callable[[], Case]]


class Bench:
    """One model's context for every section: device, sizes, the error policy, and what cases share."""

    def __init__(self, loaded: LoadedModel, shapes: Shapes, strict: bool):
        self.loaded, self.shapes, self.strict = loaded, shapes, strict
        self.device = loaded.device
        self.model_name = loaded.name.removeprefix("random-")
        self.layout = Engine(loaded).layout
        self.corpus = Corpus(self.layout)
        self.memo: dict[Any, Any] = {}  # measurements cases share (bandwidth, the serial rate)
        self.started: set[str] = set()  # one-off costs already paid (compiles)
        self.engines: list[Engine] = []  # the running case's engines
        self.weights_per_step = roofline.weights_read_per_step(loaded.model)
        self.kv_per_token = roofline.kv_bytes_per_token(loaded.model.config.to_dict(), loaded.dtype.itemsize)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def clock(self, function: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        start = time.perf_counter()
        result = function()
        self.sync()
        return result, time.perf_counter() - start

    def repeat(self, function: Callable[[], Any], before: Callable[[], Any] | None = None,
               warm_up: bool = True) -> tuple[Any, float]:
        """A warm-up run (unless ``warm_up`` is false), then the median of ``repeats`` runs (``before`` untimed)."""
        times, result = [], None
        for _ in range(int(warm_up) + self.shapes.repeats):
            if before is not None:
                before()
            result, seconds = self.clock(function)
            times.append(seconds)
        return result, statistics.median(times[int(warm_up):])

    def attempt(self, out: list[dict], mode: str, measure: Callable[[], dict[str, Any]]) -> None:
        """One mode of a case: its row, or (on a GPU) a row with its error, so the case's other modes still run."""
        try:
            out.append({"mode": mode, **measure()})
        except Exception as error:  # noqa: BLE001 - a benchmark records, for example, an out-of-memory case
            if self.strict:
                raise
            traceback.print_exc()
            out.append({"mode": mode, "error": repr(error)[:300]})
            release(self.device)

    def engine(self, **options: Any) -> Engine:
        engine = Engine(self.loaded, memory_bytes=64 << 30, **options)  # every entry of a case stays in memory
        self.engines.append(engine)
        return engine

    def forget_engines(self) -> None:
        """After a case: its engines' memory tiers emptied (the next case gets the device memory), then freed."""
        for engine in self.engines:
            engine.store.clear_memory()
            engine.close(timeout=5.0)
        self.engines.clear()
        release(self.device)

    def first(self, what: str) -> bool:
        """True the first time ``what`` is asked (a compile that only the first case of its kind pays)."""
        fresh = what not in self.started
        self.started.add(what)
        return fresh

    def once(self, what: str, cost: float) -> float:
        """``cost`` reference seconds if ``what`` has not run yet on CUDA (a compile), else 0; nothing is marked."""
        return cost if self.device.type == "cuda" and what not in self.started else 0.0

    def prior(self, seconds: float) -> float:
        """Reference seconds of a case: its calls scaled to this model, plus the per-case overhead on CUDA."""
        overhead = REF_CASE_S if self.device.type == "cuda" else REF_CPU_CASE_S
        return seconds * MODEL_SCALE.get(self.model_name, 1.0) + overhead

    def calls(self) -> int:
        return 1 + self.shapes.repeats

    # -- the roofline ------------------------------------------------------------------------------
    def bandwidth(self) -> dict[str, Any]:
        """The device's measured copy bandwidth and datasheet figure (measured once per model's bench)."""
        if "bandwidth" not in self.memo:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            measured = roofline.measure_bandwidth(self.device, self.shapes.bandwidth_megabytes)
            self.memo["bandwidth"] = {"device": name, "measured": measured, "spec": roofline.spec_bandwidth(name)}
        return self.memo["bandwidth"]

    def decode_roofline(self, answer: Answer, rows: int, cached_tokens: int) -> dict[str, Any]:
        """``answer``'s decode rate against the bandwidth limit of a step over ``rows`` rows.

        ``cached_tokens``: the rows' tokens in cache when decoding starts (all rows together); each step adds
        one per row, so the mean step reads ``cached_tokens + rows * (new_tokens - 1) / 2`` tokens' KV.
        """
        new_tokens = len(answer.token_ids)
        rate = float(answer.timings["tokens_per_s"])  # one token per step for concat and PCED
        mean_tokens = cached_tokens + rows * max(new_tokens - 1, 0) / 2
        step_bytes = roofline.decode_step_bytes(self.weights_per_step, self.kv_per_token, [mean_tokens])
        bandwidth = self.bandwidth()
        row: dict[str, Any] = {"decode_tokens_per_s": rate, "rows": rows, "cached_tokens": cached_tokens,
                               "gb_per_step": step_bytes / 1e9,
                               "roofline_fraction": roofline.roofline_fraction(rate, step_bytes, bandwidth["measured"])}
        if bandwidth["spec"]:
            row["roofline_fraction_spec"] = roofline.roofline_fraction(rate, step_bytes, bandwidth["spec"])
        return row

    def prompt_tokens(self, question: str = QUESTION) -> int:
        """Tokens of the prompt around the documents: the shared prefix and the question's suffix."""
        return len(self.layout.prefix_ids) + len(self.layout.suffix_ids(question))


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def answer_row(answer: Answer, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"ttft_s": answer.timings["ttft_s"], "total_s": seconds, "new_tokens": len(answer.token_ids), **extra}


# -- sections: each a list of cases ------------------------------------------------------------------
def pced_case(bench: Bench, n: int, cold: bool = True) -> Case:
    """``concat``, PCED cold (``cold``) and PCED warm over ``n`` documents; decode rates against the roofline."""
    s = bench.shapes
    tokens, prompt = n * s.doc_tokens, bench.prompt_tokens()

    def run() -> list[dict]:
        docs = bench.corpus.documents(n, s.doc_tokens, seed=n)
        engine = bench.engine()
        generate = lambda mode: engine.generate(QUESTION, docs, mode=mode, max_new_tokens=s.new_tokens)  # noqa: E731

        def measure(mode: str, before: Callable[[], Any] | None = None) -> Callable[[], dict[str, Any]]:
            def timed() -> dict[str, Any]:
                answer, seconds = bench.repeat(lambda: generate(mode), before=before)
                rows, cached = (1, tokens + prompt) if mode == "concat" else (n + 1, tokens + (n + 1) * prompt)
                return answer_row(answer, seconds, **bench.decode_roofline(answer, rows, cached))
            return timed

        out: list[dict] = []
        bench.attempt(out, "concat", measure("concat"))
        if cold:
            bench.attempt(out, "pced cold", measure("pced", before=engine.store.clear_memory))
        bench.attempt(out, "pced warm", measure("pced"))  # without the cold mode, its warm-up fills the caches
        concat = out[0] if "error" not in out[0] else {}
        for row in out:
            row.update(ttft_speedup_vs_concat=ratio(concat.get("ttft_s"), row.get("ttft_s")),
                       total_speedup_vs_concat=ratio(concat.get("total_s"), row.get("total_s")))
        bench.first("pool")
        return out

    concat = prefill_s(tokens + prompt) + decode_s(s.new_tokens, 1, tokens)
    pced_cold = prefill_s(s.doc_tokens, n) + decode_s(s.new_tokens, n + 1, s.doc_tokens)
    pced_warm = REF_DOCUMENT_S * n + decode_s(s.new_tokens, n + 1, s.doc_tokens)
    calls = bench.calls() * (concat + pced_warm) + (bench.calls() * pced_cold if cold else pced_cold - pced_warm)
    return Case("pced", {"documents": n, "doc_tokens": s.doc_tokens}, run,
                bench.prior(calls) + bench.once("pool", REF_FIRST_FORWARD_S))


def plan_pced(bench: Bench) -> Plan:
    return [lambda n=n: pced_case(bench, n) for n in bench.shapes.pced_docs]


def ape_case(bench: Bench, context: int) -> Case:
    s = bench.shapes
    n = context // s.doc_tokens

    def run() -> list[dict]:
        docs = bench.corpus.documents(n, s.doc_tokens, seed=n)  # the pced case's documents at the same size
        engine = bench.engine()
        generate = lambda mode, **o: engine.generate(QUESTION, docs, mode=mode, max_new_tokens=1, **o)  # noqa: E731

        def measure(mode: str, before: Callable[[], Any] | None = None, **options: Any) -> Callable[[], dict]:
            def timed() -> dict[str, Any]:
                return answer_row(*bench.repeat(lambda: generate(mode, **options), before=before))
            return timed

        out: list[dict] = []
        bench.attempt(out, "concat", measure("concat"))
        bench.attempt(out, "ape cold (auto kernel)", measure("ape", before=engine.store.clear_memory))
        bench.attempt(out, "ape warm (flex)", measure("ape", attention_kernel="flex"))
        # attribution off: compare the kernels alone (the eager kernel would otherwise record attention mass)
        bench.attempt(out, "ape warm (eager)", measure("ape", attention_kernel="eager", attribution=False))
        concat = out[0].get("ttft_s")
        for row in out:
            row["prefill_speedup_vs_concat"] = ratio(concat, row.get("ttft_s"))
        bench.first("pool")
        bench.first("ape flex")
        return out

    calls = prefill_s(context) + prefill_s(s.doc_tokens, n) + 3 * REF_DOCUMENT_S * n
    return Case("ape", {"context_tokens": context}, run,
                bench.prior(bench.calls() * calls) + bench.once("pool", REF_FIRST_FORWARD_S)
                + bench.once("ape flex", REF_APE_COMPILE_S))


def plan_ape(bench: Bench) -> Plan:
    return [lambda c=c: ape_case(bench, c) for c in bench.shapes.ape_contexts]


def prefix_cached_batch(engine: Engine, docs: list[str], questions: list[str], new_tokens: int) -> list[list[int]]:
    """The baseline for IPPD: the context's KV from the store, one copy per question, decoded as one batch.

    Questions must have prompt suffixes of equal length (:meth:`Corpus.questions`), so no padding is needed.
    """
    layout, loaded = engine.layout, engine.loaded
    entry = engine.store.document_tokens(layout, [t for d in docs for t in layout.context_ids(d)])
    streams = batch_sequences(engine.store.prefix(layout), [entry] * len(questions))
    suffixes = torch.tensor([layout.suffix_ids(q) for q in questions], device=loaded.device)
    logits = forward_sequences(loaded.model, streams, suffixes)
    answers: list[list[int]] = [[] for _ in questions]
    finished = [False] * len(questions)
    while True:  # greedy, each row its own token; a finished row keeps stepping with the batch until all are done
        chosen = logits.argmax(-1)
        for row, token in enumerate(chosen.tolist()):
            if finished[row]:
                continue
            if token in loaded.eos_token_ids:
                finished[row] = True
            else:
                answers[row].append(token)
                finished[row] = len(answers[row]) == new_tokens
        if all(finished):
            return answers
        logits = forward_sequences(loaded.model, streams, chosen.unsqueeze(1))


def ippd_case(bench: Bench, count: int) -> Case:
    s = bench.shapes

    def run() -> list[dict]:
        docs = bench.corpus.documents(1, s.ippd_context, seed=count)
        questions = bench.corpus.questions(count)
        engine = bench.engine()
        engine.warm(docs)
        ippd, ippd_s = bench.repeat(lambda: engine.generate_many(questions, docs, mode="ippd",
                                                                  max_new_tokens=s.new_tokens))
        batched, batched_s = bench.repeat(lambda: prefix_cached_batch(engine, docs, questions, s.new_tokens))
        same = sum(a.token_ids == b for a, b in zip(ippd, batched))
        bench.first("pool")
        return [{"method": "ippd", "seconds": ippd_s, "answers_per_s": count / ippd_s,
                 "vs_prefix_cached": batched_s / ippd_s, "same_answers": f"{same}/{count}"},
                {"method": "prefix-cached batch", "seconds": batched_s, "answers_per_s": count / batched_s,
                 "vs_prefix_cached": 1.0}]

    calls = 2 * decode_s(s.new_tokens, count, s.ippd_context) + prefill_s(s.ippd_context)
    return Case("ippd", {"questions": count, "context_tokens": s.ippd_context}, run,
                bench.prior(bench.calls() * calls) + bench.once("pool", REF_FIRST_FORWARD_S))


def plan_ippd(bench: Bench) -> Plan:
    return [lambda q=q: ippd_case(bench, q) for q in bench.shapes.ippd_questions]


def rapid_case(bench: Bench, context: int) -> Case:
    s = bench.shapes

    def run() -> list[dict]:
        docs = bench.corpus.documents(context // s.doc_tokens, s.doc_tokens, seed=context)
        engine = bench.engine()
        options = dict(max_new_tokens=s.rapid_new_tokens)
        # ranked by the retrieval scores (falling with the order), as a retriever would hand them over
        scores = [1.0 - i / (2 * len(docs)) for i in range(len(docs))]
        rapid_options = dict(draft_context_tokens=s.rapid_draft_tokens, chunk_tokens=s.rapid_chunk_tokens,
                             ranking="scores")
        concat, concat_s = bench.repeat(lambda: engine.generate(QUESTION, docs, scores, mode="concat", **options))
        rapid, rapid_s = bench.repeat(lambda: engine.generate(QUESTION, docs, scores, mode="rapid", **options,
                                                              **rapid_options))
        out = []
        for mode, answer, seconds in (("concat", concat, concat_s), ("rapid warm", rapid, rapid_s)):
            decode_time = max(seconds - answer.timings.get("prefill_s", answer.timings["ttft_s"]), 1e-9)
            out.append({"mode": mode, "total_s": seconds, "new_tokens": len(answer.token_ids),
                        "decode_tokens_per_s": len(answer.token_ids) / decode_time,
                        "acceptance_rate": answer.timings.get("acceptance_rate")})
        for row in out:
            row.update(decode_speedup_vs_concat=ratio(row["decode_tokens_per_s"], out[0]["decode_tokens_per_s"]),
                       total_speedup_vs_concat=ratio(out[0]["total_s"], row["total_s"]))
        bench.first("pool")
        return out

    concat = prefill_s(context) + decode_s(s.rapid_new_tokens, 1, context)
    return Case("rapid", {"context_tokens": context}, run,
                bench.prior(bench.calls() * 3 * concat) + bench.once("pool", REF_FIRST_FORWARD_S))


def plan_rapid(bench: Bench) -> Plan:
    return [lambda c=c: rapid_case(bench, c) for c in bench.shapes.rapid_contexts]


def peak_extra_bytes(device: torch.device, function: Callable[[], Any]) -> tuple[Any, int | None]:
    """``function()`` and the most device memory it held beyond what was allocated before (None off CUDA)."""
    if device.type != "cuda":
        return function(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = function()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before


def soft_nbce_case(bench: Bench, context: int) -> Case:
    s = bench.shapes
    n = context // s.doc_tokens

    def run() -> list[dict]:
        docs = bench.corpus.documents(n, s.doc_tokens, seed=context)
        engine = bench.engine()
        out = []
        for mode, options in (("concat", {}), ("soft_nbce", {"chunk_tokens": s.doc_tokens})):
            call = lambda: engine.generate(QUESTION, docs, mode=mode, max_new_tokens=s.new_tokens, **options)  # noqa: B023, E731
            bench.repeat(call)  # caches warm, kernels loaded
            (answer, peak), seconds = bench.clock(lambda: peak_extra_bytes(bench.device, call))  # noqa: B023
            out.append({"mode": mode, **answer_row(answer, seconds,
                                                   peak_extra_mb=None if peak is None else peak / 2**20)})
        for row in out:
            row["memory_vs_concat"] = ratio(row["peak_extra_mb"], out[0]["peak_extra_mb"])
        bench.first("pool")
        return out

    calls = prefill_s(context) + decode_s(s.new_tokens, 1, context) + prefill_s(s.doc_tokens, n) \
        + decode_s(s.new_tokens, n + 1, s.doc_tokens)
    return Case("soft_nbce", {"context_tokens": context}, run,
                bench.prior((bench.calls() + 1) * calls) + bench.once("pool", REF_FIRST_FORWARD_S))


def plan_soft_nbce(bench: Bench) -> Plan:
    return [lambda c=c: soft_nbce_case(bench, c) for c in bench.shapes.soft_nbce_contexts]


def scheduler_case(bench: Bench, k: int, serial_requests: int | None = None) -> Case:
    """K concurrent PCED requests vs one at a time: the serial rate from ``serial_requests`` of them (default K).

    Serial requests are identical and independent, so answers/s one at a time does not depend on how many are
    timed (the H200 run: 1.13 answers/s for 1, 1.04 for 16); the table times 8 and reuses the rate for K = 32.
    """
    s = bench.shapes
    serial_n = min(k, serial_requests) if serial_requests else k
    docs_key = ("scheduler docs",)

    def run() -> list[dict]:
        if docs_key not in bench.memo:
            bench.memo[docs_key] = (bench.corpus.documents(s.scheduler_docs, s.scheduler_doc_tokens, seed=1),
                                    bench.corpus.questions(max(max(s.concurrency), max(s.table_concurrency))))
        docs, questions = bench.memo[docs_key]
        engine = bench.engine()
        engine.warm(docs)
        options = dict(mode="pced", max_new_tokens=s.new_tokens)

        def serial() -> list[Answer]:
            return [engine.generate(q, docs, **options) for q in questions[:serial_n]]

        async def together() -> list[Answer]:
            return await asyncio.gather(*(engine.agenerate(q, docs, **options) for q in questions[:k]))

        if ("serial", serial_n) not in bench.memo:
            bench.memo[("serial", serial_n)] = bench.repeat(serial)[1]
        serial_s = bench.memo[("serial", serial_n)]
        _, concurrent_s = bench.repeat(lambda: asyncio.run(together()))
        bench.first("pool")
        serial_rate, concurrent_rate = serial_n / serial_s, k / concurrent_s
        return [{"serial_requests": serial_n, "serial_s": serial_s, "concurrent_s": concurrent_s,
                 "serial_answers_per_s": serial_rate, "concurrent_answers_per_s": concurrent_rate,
                 "speedup": concurrent_rate / serial_rate}]

    answer = decode_s(s.new_tokens, s.scheduler_docs + 1, s.scheduler_doc_tokens)
    together = decode_s(s.new_tokens, k * (s.scheduler_docs + 1), s.scheduler_doc_tokens)
    serial = 0.0 if ("serial", serial_n) in bench.memo else serial_n * answer
    return Case("scheduler", {"concurrent": k}, run,
                bench.prior(bench.calls() * (serial + together)) + bench.once("pool", REF_FIRST_FORWARD_S))


def plan_scheduler(bench: Bench) -> Plan:
    return [lambda k=k: scheduler_case(bench, k) for k in bench.shapes.concurrency]


def cache_case(bench: Bench) -> Case:
    s = bench.shapes

    def run() -> list[dict]:
        docs = bench.corpus.documents(s.cache_docs, s.doc_tokens, seed=7)
        with tempfile.TemporaryDirectory(prefix="ctx-gpu-bench-") as folder:
            engine = bench.engine(cache_dir=folder)
            layout, store = engine.layout, engine.store
            entries = [e.kv for e in store.documents(layout, docs)]  # computed, written to disk
            megabytes = sum(kv.numel() * kv.element_size() for kv in entries) / 2**20
            pinned = [to_host(kv).wait() for kv in entries]
            pageable = [kv.to("cpu") for kv in entries]
            tiers = {
                "device memory": lambda: store.documents(layout, docs),
                "pinned host -> device": lambda: [t.wait() for t in prefetch(pinned, bench.device)],
                "pageable host -> device": lambda: [kv.to(bench.device) for kv in pageable],
                "disk (page cache) -> device": lambda: store.documents(layout, docs),
            }
            out = []
            for tier, load in tiers.items():
                before = store.clear_memory if tier.startswith("disk") else None
                _, seconds = bench.repeat(load, before=before)
                out.append({"tier": tier, "entries": len(entries), "megabytes": megabytes, "seconds": seconds,
                            "gb_per_s": megabytes / 1024 / seconds if seconds > 0 else None})
            return out

    loads = 4 * bench.calls() * s.cache_docs * bench.kv_per_token * s.doc_tokens / 5e9  # >= 5 GB/s from any tier
    return Case("cache", {}, run, bench.prior(prefill_s(s.doc_tokens, s.cache_docs) + loads))


def plan_cache(bench: Bench) -> Plan:
    return [lambda: cache_case(bench)]


def decode_case(bench: Bench, n: int, mode: str = "pced") -> Case:
    """The pool's decode step over 1 + N rows (PCED's batch: the amateur and one expert per document; ``concat``:
    one row over the N documents), eager and compiled (what ``Engine(compile_mode="auto")`` runs: CUDA graphs per
    bucket on CUDA): steps/s of one answer after its prefill. The eager row is the engine's default; on the CPU
    (the dry run) only the eager step runs (compiling there costs minutes for a tiny model)."""
    s = bench.shapes
    steps = 4 * s.new_tokens
    rows = n + 1 if mode == "pced" else 1

    def run() -> list[dict]:
        docs = bench.corpus.documents(n, s.doc_tokens, seed=100 + n)
        engine = bench.engine()
        engine.warm(docs)
        runner = engine.scheduler.runner
        default, out = runner.step, []
        compiled = guarded_step(engine.loaded, resolve_compile_mode("auto", bench.device), runner.attention_kernel)
        methods = [("eager step", None)] + ([("compiled step (CUDA graphs)", compiled)] if compiled is not None else [])
        try:
            for method, step in methods:
                runner.step = step  # the same scheduler and caches, its decode step switched
                times = []
                for _ in range(1 + s.repeats):  # the first call pays the compile / graph capture
                    answer = engine.generate(QUESTION, docs, mode=mode, max_new_tokens=steps)
                    rate = (len(answer.token_ids) - 1) / max(answer.timings["total_s"] - answer.timings["ttft_s"],
                                                              1e-9)
                    times.append((answer.timings["total_s"], rate))
                out.append({"method": method, "steps": steps, "first_call_s": times[0][0],
                            "steps_per_s": statistics.median(rate for _, rate in times[1:])})
        finally:
            runner.step = default
        for row in out:
            row["speedup"] = row["steps_per_s"] / out[0]["steps_per_s"]
        return out

    columns = s.doc_tokens * (1 if mode == "pced" else n)
    prefill = prefill_s(s.doc_tokens, n) if mode == "pced" else prefill_s(s.doc_tokens * n)
    calls = 2 * bench.calls() * (prefill + decode_s(steps, rows, columns))
    compile_s = REF_STATIC_COMPILE_S if bench.device.type == "cuda" else 0.0
    label = {"documents": n, "doc_tokens": s.doc_tokens, "answer_mode": mode}
    return Case("decode", label, run, bench.prior(calls) + compile_s)


def plan_decode(bench: Bench) -> Plan:
    return [lambda n=n: decode_case(bench, n) for n in bench.shapes.decode_streams]


class FirstTokenClock(BaseStreamer):
    """A transformers streamer that notes when ``generate`` hands over its first new token.

    ``generate`` calls ``put`` with the prompt first, then with each new token after copying it to the host
    (which waits for the GPU), so the second call's time is the time to the first token.
    """

    def __init__(self) -> None:
        self.calls, self.first_token_at = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def peer_generate(bench: Bench, docs: list[str]) -> dict[str, Any]:
    """Plain transformers ``generate`` over the prompt ``concat`` reads: greedy, exactly ``new_tokens`` new."""
    layout, model, s = bench.layout, bench.loaded.model, bench.shapes
    ids = layout.prefix_ids + [t for d in docs for t in layout.context_ids(d)] + layout.suffix_ids(QUESTION)
    prompt = torch.tensor([ids], device=bench.device)
    streamer = FirstTokenClock()
    bench.sync()
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=s.new_tokens,
                                min_new_tokens=s.new_tokens, do_sample=False, streamer=streamer,
                                pad_token_id=bench.loaded.tokenizer.eos_token_id)
    bench.sync()
    total = time.perf_counter() - started
    new_tokens = output.shape[1] - len(ids)
    ttft = (streamer.first_token_at or started + total) - started
    return {"prompt_tokens": len(ids), "ttft_s": ttft, "total_s": total, "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - 1) / (total - ttft) if new_tokens > 1 and total > ttft else None}


def peer_case(bench: Bench, n: int) -> Case:
    """transformers ``generate`` over the ``n`` documents the pced case reads (its warm-up only in the first)."""
    s = bench.shapes
    tokens = n * s.doc_tokens

    def run() -> list[dict]:
        docs = bench.corpus.documents(n, s.doc_tokens, seed=n)
        row, _ = bench.repeat(lambda: peer_generate(bench, docs), warm_up=bench.first("peer"))
        return [{"mode": "transformers generate", **row}]

    warm_up = 1 if "peer" not in bench.started else 0
    call = prefill_s(tokens) + REF_PEER_DECODE_SLOWER * decode_s(s.new_tokens, 1, tokens)
    return Case("peer", {"documents": n, "doc_tokens": s.doc_tokens}, run,
                bench.prior((warm_up + s.repeats) * call))


def plan_peer(bench: Bench) -> Plan:
    return [lambda n=n: peer_case(bench, n) for n in bench.shapes.peer_docs]


def bandwidth_case(bench: Bench) -> Case:
    def run() -> list[dict]:
        measured = bench.bandwidth()
        return [{"device": measured["device"], "measured_gb_per_s": measured["measured"] / 1e9,
                 "spec_gb_per_s": measured["spec"] / 1e9 if measured["spec"] else None,
                 "measured_vs_spec": ratio(measured["measured"], measured["spec"])}]

    return Case("bandwidth", {}, run, bench.prior(1.0))


def plan_bandwidth(bench: Bench) -> Plan:
    return [lambda: bandwidth_case(bench)]


def plan_table(bench: Bench) -> Plan:
    """The headline rows, most wanted first, so a short budget keeps the head (see the module's docstring)."""
    s = bench.shapes
    most, fewest = max(s.pced_docs), min(s.peer_docs)
    return [
        lambda: bandwidth_case(bench),
        lambda: pced_case(bench, most, cold=False),
        *[lambda k=k: scheduler_case(bench, k, s.serial_requests) for k in s.table_concurrency],
        *[lambda q=q: ippd_case(bench, q) for q in s.table_ippd_questions],
        lambda: pced_case(bench, fewest, cold=False),
        lambda: peer_case(bench, fewest),
        *[lambda c=c: ape_case(bench, c) for c in s.table_ape_contexts],
        *[lambda n=n: peer_case(bench, n) for n in s.peer_docs if n != fewest],
        lambda: decode_case(bench, most),
        lambda: decode_case(bench, fewest, mode="concat"),
    ]


PLANNERS: dict[str, Callable[[Bench], Plan]] = {
    "pced": plan_pced, "ape": plan_ape, "ippd": plan_ippd, "rapid": plan_rapid, "soft_nbce": plan_soft_nbce,
    "scheduler": plan_scheduler, "cache": plan_cache, "decode": plan_decode, "peer": plan_peer,
    "bandwidth": plan_bandwidth, TABLE: plan_table,
}


# -- the headline summary ----------------------------------------------------------------------------
def kilo(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def summary(rows: list[dict], shapes: Shapes) -> list[dict[str, Any]]:
    """The table's headline rows, read from whatever case rows exist (a skipped or failed case says so)."""
    out: list[dict[str, Any]] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        def find(section: str, **label: Any) -> tuple[dict[str, dict], str | None]:
            """The case's rows by mode / method, and why it has none (skipped, failed) or None."""
            found = [r for r in rows if r["model"] == model and r["section"] == section  # noqa: B023
                     and all(r.get(k) == v for k, v in label.items())]
            for r in found:
                if "skipped" in r or ("error" in r and "mode" not in r and "method" not in r):
                    return {}, r.get("skipped") or f"error: {r['error']}"
            return {r.get("mode") or r.get("method") or "": r for r in found}, (None if found else "")

        def add(row: str, value: str, versus: str = "") -> None:
            out.append({"model": model, "row": row, "value": value, "versus": versus})  # noqa: B023

        def missing(row: str, why: str | None, mode: dict | None = None) -> None:
            """Add a row saying why ``row`` has no number (nothing when its case was not planned: ``why == ""``)."""
            if why == "":
                return
            reason = why or (f"error: {mode['error']}" if mode and "error" in mode else "not measured")
            add(row, "skipped" if reason.startswith("over budget") else "-", reason)

        def roofline_text(r: dict) -> str:
            text = f"{r['roofline_fraction']:.2f} of the bandwidth limit ({r['gb_per_step']:.1f} GB per step"
            spec = r.get("roofline_fraction_spec")
            return text + (f"; {spec:.2f} of the datasheet's)" if spec is not None else ")")

        n = max(shapes.pced_docs)
        pced, why = find("pced", documents=n)
        concat, warm = pced.get("concat", {}), pced.get("pced warm", {})
        name = f"PCED warm TTFT, {n} x {shapes.doc_tokens}"
        if "ttft_s" in warm:
            add(name, f"{warm['ttft_s']:.3f} s", f"{warm.get('ttft_speedup_vs_concat') or 0:.1f}x concat's TTFT"
                + (f" ({concat['ttft_s']:.3f} s)" if "ttft_s" in concat else ""))
        else:
            missing(name, why, warm)
        name = f"concat decode, batch 1, {n} x {shapes.doc_tokens}"
        if "roofline_fraction" in concat:
            add(name, f"{concat['decode_tokens_per_s']:.1f} tok/s", roofline_text(concat))
        else:
            missing(name, why, concat)
        name = f"PCED decode, {n + 1} rows x ~{shapes.doc_tokens} columns"
        if "roofline_fraction" in warm:
            add(name, f"{warm['decode_tokens_per_s']:.1f} steps/s", roofline_text(warm))
        else:
            missing(name, why, warm)
        for k in shapes.table_concurrency:
            case, why = find("scheduler", concurrent=k)
            name = f"{k} concurrent PCED requests"
            r = case.get("", {})
            if "speedup" in r:
                add(name, f"{r['concurrent_answers_per_s']:.2f} answers/s",
                    f"{r['speedup']:.1f}x serial ({r['serial_answers_per_s']:.2f} answers/s over "
                    f"{r['serial_requests']} requests)")
            else:
                missing(name, why)
        for q in shapes.table_ippd_questions:
            case, why = find("ippd", questions=q)
            name, r, base = f"IPPD, {q} questions", case.get("ippd", {}), case.get("prefix-cached batch", {})
            if "answers_per_s" in r:
                add(name, f"{r['answers_per_s']:.1f} answers/s", f"{r['vs_prefix_cached']:.2f}x prefix-cached "
                    f"batching ({base.get('answers_per_s', 0):.1f} answers/s)")
            else:
                missing(name, why)
        for context in shapes.table_ape_contexts:
            case, why = find("ape", context_tokens=context)
            concat_s = case.get("concat", {}).get("ttft_s")
            for mode in ("ape cold (auto kernel)", "ape warm (flex)"):
                name, r = f"APE prefill, {kilo(context)} tokens, {mode.removeprefix('ape ')}", case.get(mode, {})
                if "ttft_s" in r:
                    add(name, f"{r['ttft_s']:.3f} s", f"{r.get('prefill_speedup_vs_concat') or 0:.1f}x concat's "
                        "prefill" + (f" ({concat_s:.3f} s)" if concat_s else ""))
                else:
                    missing(name, why, r)
        for docs in shapes.peer_docs:
            case, why = find("peer", documents=docs)
            r = case.get("transformers generate", {})
            name = f"transformers generate, {docs} x {shapes.doc_tokens}"
            if "ttft_s" in r:
                ours, _ = find("pced", documents=docs)
                concat, warm = ours.get("concat", {}), ours.get("pced warm", {})
                versus = "; ".join(part for part in (
                    f"engine concat TTFT {concat['ttft_s']:.3f} s, {concat['decode_tokens_per_s']:.1f} tok/s"
                    if "decode_tokens_per_s" in concat else "",
                    f"PCED warm TTFT {warm['ttft_s']:.3f} s" if "ttft_s" in warm else "") if part)
                rate = r.get("decode_tokens_per_s")
                add(name, f"TTFT {r['ttft_s']:.3f} s, total {r['total_s']:.3f} s"
                    + (f", {rate:.1f} tok/s" if rate else ""), versus)
            else:
                missing(name, why, r)
        for docs, mode in ((max(shapes.pced_docs), "pced"), (min(shapes.peer_docs), "concat")):
            case, why = find("decode", documents=docs, answer_mode=mode)
            shape = f"PCED, {docs + 1} rows" if mode == "pced" else f"concat, batch 1, {docs} x {shapes.doc_tokens}"
            name, eager, compiled = f"compiled decode step, {shape}", case.get("eager step", {}), \
                case.get("compiled step (CUDA graphs)", {})
            if "steps_per_s" in compiled:
                add(name, f"{compiled['steps_per_s']:.1f} steps/s", f"{compiled['speedup']:.2f}x the eager step "
                    f"({eager.get('steps_per_s', 0):.1f} steps/s); first call {compiled['first_call_s']:.1f} s")
            else:
                missing(name, why if why is not None or not eager else "the eager step only: not on CUDA")
        case, why = find("bandwidth")
        r = case.get("", {})
        if "measured_gb_per_s" in r:
            spec = r.get("spec_gb_per_s")
            add(f"memory bandwidth ({r.get('device', 'device')})", f"{r['measured_gb_per_s']:.0f} GB/s measured",
                f"datasheet {spec:.0f} GB/s" if spec else "datasheet figure unknown for this device")
        else:
            missing("memory bandwidth", why)
    return out


# -- command line -----------------------------------------------------------------------------------
def parse_sections(text: str | None, default: list[str]) -> list[str]:
    if not text:
        return default
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    known = (*SECTIONS, TABLE)
    unknown = [part for part in chosen if part not in known]
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return chosen


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; 0.0 where that cannot be read)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def hard_exit(status: int) -> None:
    """How the watchdog ends the process at the deadline (tests replace it)."""
    os._exit(status)


def main(argv: list[str] | None = None, started: float | None = None) -> list[dict]:
    """Run the chosen sections; ``started``: the ``time.perf_counter()`` the budget counts from (default: now)."""
    started = time.perf_counter() if started is None else started
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU CI), every error raised")
    parser.add_argument("--only", help=f"comma-separated sections among {', '.join((*SECTIONS, TABLE))}")
    parser.add_argument("--models", help=f"comma-separated model shapes among {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--repeats", type=int, help="timed runs per case after one warm-up (median; 1 under --budget)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run from the process's start: cases "
                                                     "that would not fit are skipped (default sections: table)")
    parser.add_argument("--device", help="torch device (default: cuda when available)")
    parser.add_argument("--out", type=Path, help=f"folder for gpu.json (default {RESULTS})")
    parser.add_argument("--tokenizer", default=os.environ.get("CTX_TOKENIZER_DIR"),
                        help="a saved tokenizer folder (default $CTX_TOKENIZER_DIR, else the embedded SmolLM2 one)")
    args = parser.parse_args(argv)

    if args.budget is not None and not args.budget > 0:
        raise SystemExit(f"--budget must be a number of seconds > 0, got {args.budget}")
    sections = parse_sections(args.only, [TABLE] if args.budget else list(SECTIONS))
    shapes = DRY if args.dry_run else FULL
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in MODEL_SHAPES]
        if unknown:
            raise SystemExit(f"unknown model shape(s) {', '.join(unknown)}; choose from {', '.join(MODEL_SHAPES)}")
        shapes = replace(shapes, models=tuple(args.models.split(",")))
    elif sections == [TABLE]:
        shapes = replace(shapes, models=shapes.table_models)
    if args.repeats is not None or args.budget:
        shapes = replace(shapes, repeats=max(1, args.repeats or 1))
    budget = Budget(args.budget, started) if args.budget else None

    rows: list[dict] = []
    settings: dict[str, Any] = {"dry_run": args.dry_run, "sections": sections, "budget_s": args.budget,
                                "shapes": asdict(shapes), "model_build_s": {}, "cases": []}
    output = (args.out / "gpu.json") if args.out else None
    lock = threading.Lock()  # rows, settings and the file: the main thread and the watchdog
    doing: dict[str, Any] = {"what": "setup", "case": None}

    def save(complete: bool) -> None:
        # rewritten after every case: a run cut off at a time limit still leaves what it measured
        try:
            table = summary(rows, shapes)
        except Exception as error:  # noqa: BLE001 - on a GPU a summary bug must not cost the measured rows
            if args.dry_run:
                raise
            table = [{"error": repr(error)[:300]}]
        write_results("gpu", rows, {**settings, "complete": complete, "seconds": time.perf_counter() - started},
                      output, extra={"summary": table})

    def on_deadline() -> None:
        if not lock.acquire(timeout=5):
            return
        try:
            if doing["case"] is not None:
                rows.append({**doing["case"], "error": f"interrupted: the budget of {args.budget:g} s ran out"})
            settings["interrupted"] = f"the budget of {args.budget:g} s ran out during {doing['what']}"
            print(f"\n{settings['interrupted']}: stopping (exit status {INTERRUPTED_EXIT})", flush=True)
            save(complete=False)
        finally:
            lock.release()

    watchdog = Watchdog(budget.deadline, on_deadline, exit=hard_exit) if budget else None
    try:
        device = torch.device(args.device) if args.device else default_device()
        if device.type == "cpu" and not args.dry_run:
            print("warning: no GPU; the full shapes on CPU would take hours (use --dry-run)", file=sys.stderr)
        dtype = default_dtype(device)
        settings.update(device=str(device), dtype=str(dtype))
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_tokenizer()
        for name in shapes.models:
            doing["what"] = f"building {name}"
            build_s = time.perf_counter()
            loaded = build_model(name, tokenizer, device, dtype)
            settings["model_build_s"][name] = time.perf_counter() - build_s
            print(f"\n## {name}: built in {settings['model_build_s'][name]:.1f} s on {device} ({dtype})", flush=True)
            bench = Bench(loaded, shapes, strict=args.dry_run)
            for section in sections:
                for build_case in PLANNERS[section](bench):
                    run_case(bench, build_case(), budget, rows, settings, lock, doing, save)
            del bench, loaded
            release(device)
        with lock:
            doing["what"] = "the end"
            save(complete=True)
    finally:
        if watchdog is not None:
            watchdog.cancel()
    table = json.loads(output.read_text())["summary"] if output else summary(rows, shapes)
    if table:
        print("\n## Summary")
        print_table(table, ["model", "row", "value", "versus"])
    return rows


def compile_counts() -> dict[str, int]:
    """Dynamo's graphs compiled and Inductor's CUDA-graph skips so far in this process: per case, where first-call
    compile time went and whether the compiled steps ran as CUDA graphs (the H200 run of 2026-11-27 showed neither
    in its table; only the log said "skipping cudagraphs due to mutated inputs")."""
    from torch._dynamo.utils import counters

    return {"graphs_compiled": int(counters["stats"]["unique_graphs"]),
            "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}


def run_case(bench: Bench, case: Case, budget: Budget | None, rows: list[dict], settings: dict[str, Any],
             lock: threading.Lock, doing: dict[str, Any], save: Callable[[bool], None]) -> None:
    """Run ``case`` (or skip it when the budget says it would not fit); its rows printed and saved at once."""
    label = {"section": case.section, "model": bench.model_name, **case.label}
    refusal = budget.refusal(case.prior_s) if budget is not None else None
    seconds, compiles = 0.0, {key: 0 for key in compile_counts()}
    if refusal is not None:
        case_rows = [{**label, "skipped": refusal}]
    else:
        estimate = budget.estimate(case.prior_s) if budget is not None else None
        doing.update(what=f"{case.section} {case.label}", case=label)
        compiled_before = compile_counts()
        begun = time.perf_counter()
        try:
            case_rows = [{**label, **row} for row in case.run()]
        except Exception as error:  # noqa: BLE001 - a benchmark records, for example, an out-of-memory case
            if bench.strict:
                raise
            traceback.print_exc()
            case_rows = [{**label, "error": repr(error)[:300]}]
        finally:
            bench.forget_engines()
        seconds = time.perf_counter() - begun
        compiles = {key: value - compiled_before[key] for key, value in compile_counts().items()}
        if budget is not None:
            budget.record(case.prior_s, seconds)
    where = ", ".join(f"{k}={v}" for k, v in case.label.items())
    if refusal:
        print(f"\n### {case.section} ({bench.model_name}{', ' + where if where else ''}): skipped, {refusal}")
    else:
        guess = f", estimated {estimate:.0f} s" if estimate is not None else ""
        guess += f", {compiles['graphs_compiled']} graphs compiled, {compiles['cudagraph_skips']} CUDA-graph skips"
        print(f"\n### {case.section} ({bench.model_name}{', ' + where if where else ''}: {seconds:.1f} s{guess})")
        print_table(case_rows, COLUMNS[case.section] + [c for c in ("error",) if any(c in r for r in case_rows)])
    sys.stdout.flush()
    status = "skipped" if refusal else "error" if any("error" in r for r in case_rows) else "done"
    with lock:
        rows.extend(case_rows)
        settings["cases"].append({"section": case.section, "model": bench.model_name, **case.label, "status": status,
                                  "prior_s": case.prior_s, "seconds": seconds, **compiles})
        doing.update(what="between cases", case=None)
        save(False)


if __name__ == "__main__":
    main(started=time.perf_counter() - process_age())
