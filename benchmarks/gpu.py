"""The GPU benchmark: every method at the papers' settings, on random-weight models of real shapes, in one command.

Models: Llama-3.1-8B and Llama-3.2-1B shapes (``transformers.LlamaConfig`` built here, weights random,
bf16 on CUDA). Timings do not depend on weight values, except where a method's control flow does
(RAPID's acceptance rate, answer lengths: both are reported). The tokenizer is the embedded SmolLM2
one (its ids are all below Llama's vocabulary; ids the model emits beyond it decode to nothing).
``max_position_embeddings`` is raised to 256k so the concatenation baseline can run at 64 x 2048
tokens plus the prompt (random weights: the RoPE range changes no timing).

Sections (``--only a,b``), each against the strongest baseline a user would run, in the same run:

- ``pced``: PCED (caches cold, i.e. computed in the call, and warm) vs ``concat``: TTFT and end to end
  at N x 2048 tokens for N in 8..64 (the paper's 64 x 2048);
- ``ape``: APE prefill (cold: documents encoded in parallel in the call; warm: from cache, FlexAttention
  and eager attention) vs ``concat`` prefill at 32k-128k tokens;
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
- ``decode``: decode steps/s of N cached streams (1 + N documents, PCED's batch) with the growing
  ``DynamicCache`` vs ``engine/core/static_decode.py``'s fixed-shape step (CUDA graphs on CUDA; its
  one-off compile time is its own column).

Times are wall clock around ``torch.cuda.synchronize()``; TTFT is the engine's own (its first token is
chosen on the CPU, which waits for the GPU). Each case runs once to warm up, then ``repeats`` times
(median). On a GPU a failing case (e.g. out of memory) is recorded with its error and the run goes on;
``--dry-run`` (tiny shapes, whatever device, what CI runs on CPU) lets every error through.

    python benchmarks/gpu.py --out DIR                      # everything (~20 min on one H100)
    python benchmarks/gpu.py --only pced,ape --models llama-3.1-8b --out DIR
    python benchmarks/gpu.py --dry-run                      # tiny shapes on CPU, < 3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, write_results  # noqa: E402
from ctx_integrations import Answer, Engine  # noqa: E402
from ctx_integrations.engine.core.cache import batch_sequences  # noqa: E402
from ctx_integrations.engine.core.decoding import forward_sequences  # noqa: E402
from ctx_integrations.engine.core.layout import PromptLayout  # noqa: E402
from ctx_integrations.engine.core.model import (  # noqa: E402
    LoadedModel,
    default_device,
    default_dtype,
    load_tokenizer,
    model_identity,
)
from ctx_integrations.engine.core.static_decode import StaticSequences  # noqa: E402
from ctx_integrations.engine.core.transfer import prefetch, to_host  # noqa: E402

SECTIONS = ("pced", "ape", "ippd", "rapid", "soft_nbce", "scheduler", "cache", "decode")

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


FULL = Shapes(models=("llama-3.2-1b", "llama-3.1-8b"), doc_tokens=2048, pced_docs=(8, 16, 32, 64),
              ape_contexts=(32768, 65536, 131072), ippd_questions=(16, 32, 64), ippd_context=2048,
              rapid_contexts=(16384, 32768, 65536), rapid_draft_tokens=1024, rapid_chunk_tokens=512,
              soft_nbce_contexts=(16384, 65536), concurrency=(1, 2, 4, 8, 16, 32), scheduler_docs=4,
              scheduler_doc_tokens=512, cache_docs=64, decode_streams=(1, 8, 32), new_tokens=32, rapid_new_tokens=128,
              repeats=2)
DRY = Shapes(models=("tiny",), doc_tokens=40, pced_docs=(2, 4), ape_contexts=(80, 160), ippd_questions=(2, 4),
             ippd_context=40, rapid_contexts=(160,), rapid_draft_tokens=32, rapid_chunk_tokens=16,
             soft_nbce_contexts=(160,), concurrency=(1, 2, 4), scheduler_docs=2, scheduler_doc_tokens=24,
             cache_docs=4, decode_streams=(1, 3), new_tokens=4, rapid_new_tokens=8, repeats=1)

COLUMNS = {
    "pced": ["model", "mode", "documents", "doc_tokens", "ttft_s", "total_s", "new_tokens", "ttft_speedup_vs_concat",
             "total_speedup_vs_concat"],
    "ape": ["model", "mode", "context_tokens", "ttft_s", "total_s", "prefill_speedup_vs_concat"],
    "ippd": ["model", "method", "questions", "context_tokens", "seconds", "answers_per_s", "vs_prefix_cached",
             "same_answers"],
    "rapid": ["model", "mode", "context_tokens", "total_s", "decode_tokens_per_s", "acceptance_rate",
              "decode_speedup_vs_concat", "total_speedup_vs_concat"],
    "soft_nbce": ["model", "mode", "context_tokens", "peak_extra_mb", "ttft_s", "total_s", "memory_vs_concat"],
    "scheduler": ["model", "concurrent", "serial_s", "concurrent_s", "serial_answers_per_s",
                  "concurrent_answers_per_s", "speedup"],
    "cache": ["model", "tier", "entries", "megabytes", "seconds", "gb_per_s"],
    "decode": ["model", "method", "documents", "doc_tokens", "steps", "first_call_s", "steps_per_s", "speedup"],
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


# -- timing -----------------------------------------------------------------------------------------
class Bench:
    """One model's context for every section: device, sizes, and the strict / lenient error policy."""

    def __init__(self, loaded: LoadedModel, shapes: Shapes, strict: bool):
        self.loaded, self.shapes, self.strict = loaded, shapes, strict
        self.device = loaded.device
        self.model_name = loaded.name.removeprefix("random-")
        self.corpus = Corpus(Engine(loaded).layout)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def clock(self, function: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        start = time.perf_counter()
        result = function()
        self.sync()
        return result, time.perf_counter() - start

    def repeat(self, function: Callable[[], Any], before: Callable[[], Any] | None = None) -> tuple[Any, float]:
        """Warm-up run, then the median of ``repeats`` runs (``before`` runs untimed ahead of each)."""
        times, result = [], None
        for _ in range(1 + self.shapes.repeats):
            if before is not None:
                before()
            result, seconds = self.clock(function)
            times.append(seconds)
        return result, statistics.median(times[1:])

    def case(self, rows: list[dict], section: str, label: dict, function: Callable[[], list[dict]]) -> None:
        """Run one case; on a GPU an error becomes a row (the run goes on), in the dry run it is raised."""
        try:
            for row in function():
                rows.append({"section": section, "model": self.model_name, **label, **row})
        except Exception as error:  # noqa: BLE001 - a benchmark records, for example, an out-of-memory case
            if self.strict:
                raise
            traceback.print_exc()
            rows.append({"section": section, "model": self.model_name, **label, "error": repr(error)[:300]})
        finally:
            release(self.device)

    def engine(self, **options: Any) -> Engine:
        return Engine(self.loaded, memory_bytes=64 << 30, **options)  # every entry of a section stays in memory


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def answer_row(mode: str, answer: Answer, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"mode": mode, "ttft_s": answer.timings["ttft_s"], "total_s": seconds,
            "new_tokens": len(answer.token_ids), **extra}


# -- sections ---------------------------------------------------------------------------------------
def bench_pced(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    for n in s.pced_docs:
        def run(n: int = n) -> list[dict]:
            docs = bench.corpus.documents(n, s.doc_tokens, seed=n)
            engine = bench.engine()
            generate = lambda mode: engine.generate(QUESTION, docs, mode=mode, max_new_tokens=s.new_tokens)  # noqa: E731
            concat, concat_s = bench.repeat(lambda: generate("concat"))
            cold, cold_s = bench.repeat(lambda: generate("pced"), before=engine.store.clear_memory)
            warm, warm_s = bench.repeat(lambda: generate("pced"))
            out = [answer_row("concat", concat, concat_s), answer_row("pced cold", cold, cold_s),
                   answer_row("pced warm", warm, warm_s)]
            for row in out:
                row.update(ttft_speedup_vs_concat=ratio(out[0]["ttft_s"], row["ttft_s"]),
                           total_speedup_vs_concat=ratio(out[0]["total_s"], row["total_s"]))
            return out

        bench.case(rows, "pced", {"documents": n, "doc_tokens": s.doc_tokens}, run)
    return rows


def bench_ape(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    for context in s.ape_contexts:
        def run(context: int = context) -> list[dict]:
            docs = bench.corpus.documents(context // s.doc_tokens, s.doc_tokens, seed=context)
            engine = bench.engine()
            generate = lambda mode, **o: engine.generate(QUESTION, docs, mode=mode, max_new_tokens=1, **o)  # noqa: E731
            concat, concat_s = bench.repeat(lambda: generate("concat"))
            cold, cold_s = bench.repeat(lambda: generate("ape"), before=engine.store.clear_memory)
            flex, flex_s = bench.repeat(lambda: generate("ape", attention_kernel="flex"))
            # attribution off: compare the kernels alone (the eager kernel would otherwise record attention mass)
            eager, eager_s = bench.repeat(lambda: generate("ape", attention_kernel="eager", attribution=False))
            out = [answer_row("concat", concat, concat_s), answer_row("ape cold (auto kernel)", cold, cold_s),
                   answer_row("ape warm (flex)", flex, flex_s), answer_row("ape warm (eager)", eager, eager_s)]
            for row in out:
                row["prefill_speedup_vs_concat"] = ratio(out[0]["ttft_s"], row["ttft_s"])
            return out

        bench.case(rows, "ape", {"context_tokens": context}, run)
    return rows


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


def bench_ippd(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    for count in s.ippd_questions:
        def run(count: int = count) -> list[dict]:
            docs = bench.corpus.documents(1, s.ippd_context, seed=count)
            questions = bench.corpus.questions(count)
            engine = bench.engine()
            engine.warm(docs)
            ippd, ippd_s = bench.repeat(lambda: engine.generate_many(questions, docs, mode="ippd",
                                                                      max_new_tokens=s.new_tokens))
            batched, batched_s = bench.repeat(lambda: prefix_cached_batch(engine, docs, questions, s.new_tokens))
            same = sum(a.token_ids == b for a, b in zip(ippd, batched))
            return [{"method": "ippd", "seconds": ippd_s, "answers_per_s": count / ippd_s,
                     "vs_prefix_cached": batched_s / ippd_s, "same_answers": f"{same}/{count}"},
                    {"method": "prefix-cached batch", "seconds": batched_s, "answers_per_s": count / batched_s,
                     "vs_prefix_cached": 1.0}]

        bench.case(rows, "ippd", {"questions": count, "context_tokens": s.ippd_context}, run)
    return rows


def bench_rapid(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    for context in s.rapid_contexts:
        def run(context: int = context) -> list[dict]:
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
                decode_s = max(seconds - answer.timings.get("prefill_s", answer.timings["ttft_s"]), 1e-9)
                out.append({"mode": mode, "total_s": seconds, "new_tokens": len(answer.token_ids),
                            "decode_tokens_per_s": len(answer.token_ids) / decode_s,
                            "acceptance_rate": answer.timings.get("acceptance_rate")})
            for row in out:
                row.update(decode_speedup_vs_concat=ratio(row["decode_tokens_per_s"], out[0]["decode_tokens_per_s"]),
                           total_speedup_vs_concat=ratio(out[0]["total_s"], row["total_s"]))
            return out

        bench.case(rows, "rapid", {"context_tokens": context}, run)
    return rows


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


def bench_soft_nbce(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    for context in s.soft_nbce_contexts:
        def run(context: int = context) -> list[dict]:
            docs = bench.corpus.documents(context // s.doc_tokens, s.doc_tokens, seed=context)
            engine = bench.engine()
            out = []
            for mode, options in (("concat", {}), ("soft_nbce", {"chunk_tokens": s.doc_tokens})):
                call = lambda: engine.generate(QUESTION, docs, mode=mode, max_new_tokens=s.new_tokens, **options)  # noqa: B023, E731
                bench.repeat(call)  # caches warm, kernels loaded
                (answer, peak), seconds = bench.clock(lambda: peak_extra_bytes(bench.device, call))  # noqa: B023
                out.append(answer_row(mode, answer, seconds,
                                      peak_extra_mb=None if peak is None else peak / 2**20))
            for row in out:
                row["memory_vs_concat"] = ratio(row["peak_extra_mb"], out[0]["peak_extra_mb"])
            return out

        bench.case(rows, "soft_nbce", {"context_tokens": context}, run)
    return rows


def bench_scheduler(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    docs = bench.corpus.documents(s.scheduler_docs, s.scheduler_doc_tokens, seed=1)
    questions = bench.corpus.questions(max(s.concurrency))
    for k in s.concurrency:
        def run(k: int = k) -> list[dict]:
            engine = bench.engine()
            engine.warm(docs)
            options = dict(mode="pced", max_new_tokens=s.new_tokens)

            def serial() -> list[Answer]:
                return [engine.generate(q, docs, **options) for q in questions[:k]]

            async def together() -> list[Answer]:
                return await asyncio.gather(*(engine.agenerate(q, docs, **options) for q in questions[:k]))

            _, serial_s = bench.repeat(serial)
            _, concurrent_s = bench.repeat(lambda: asyncio.run(together()))
            return [{"serial_s": serial_s, "concurrent_s": concurrent_s, "serial_answers_per_s": k / serial_s,
                     "concurrent_answers_per_s": k / concurrent_s, "speedup": serial_s / concurrent_s}]

        bench.case(rows, "scheduler", {"concurrent": k}, run)
    return rows


def bench_cache(bench: Bench) -> list[dict]:
    rows: list[dict] = []
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

    bench.case(rows, "cache", {}, run)
    return rows


def bench_decode(bench: Bench) -> list[dict]:
    rows: list[dict] = []
    s = bench.shapes
    steps = 4 * s.new_tokens
    for n in s.decode_streams:
        def run(n: int = n) -> list[dict]:
            docs = bench.corpus.documents(n, s.doc_tokens, seed=100 + n)
            engine = bench.engine()
            layout, store, model = engine.layout, engine.store, engine.loaded.model
            suffix = torch.tensor([layout.suffix_ids(QUESTION)] * (n + 1), device=bench.device)

            def streams():
                batch = batch_sequences(store.prefix(layout), [None] + store.documents(layout, docs))
                return batch, forward_sequences(model, batch, suffix).argmax(-1, keepdim=True)

            def decode(step, tokens) -> None:
                for _ in range(steps):
                    tokens = step(tokens).argmax(-1, keepdim=True)

            out = []
            for method in ("dynamic cache", "static cache (compiled on CUDA)"):
                times = []
                for _ in range(1 + s.repeats):  # the first call pays the compile / graph capture
                    batch, tokens = streams()
                    if method.startswith("dynamic"):
                        step = lambda t, batch=batch: forward_sequences(model, batch, t)  # noqa: E731
                    else:
                        step = StaticSequences(model, batch, max_new_tokens=steps).step
                    times.append(bench.clock(lambda step=step, tokens=tokens: decode(step, tokens))[1])
                seconds = statistics.median(times[1:])
                out.append({"method": method, "steps": steps, "first_call_s": times[0], "steps_per_s": steps / seconds})
            for row in out:
                row["speedup"] = row["steps_per_s"] / out[0]["steps_per_s"]
            return out

        bench.case(rows, "decode", {"documents": n, "doc_tokens": s.doc_tokens}, run)
    return rows


RUNNERS: dict[str, Callable[[Bench], list[dict]]] = {
    "pced": bench_pced, "ape": bench_ape, "ippd": bench_ippd, "rapid": bench_rapid, "soft_nbce": bench_soft_nbce,
    "scheduler": bench_scheduler, "cache": bench_cache, "decode": bench_decode,
}


# -- command line -----------------------------------------------------------------------------------
def parse_sections(text: str | None) -> list[str]:
    if not text:
        return list(SECTIONS)
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return chosen


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU CI), every error raised")
    parser.add_argument("--only", help=f"comma-separated sections among {', '.join(SECTIONS)}")
    parser.add_argument("--models", help=f"comma-separated model shapes among {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--repeats", type=int, help="timed runs per case after one warm-up (median)")
    parser.add_argument("--device", help="torch device (default: cuda when available)")
    parser.add_argument("--out", type=Path, help=f"folder for gpu.json (default {RESULTS})")
    parser.add_argument("--tokenizer", default=os.environ.get("CTX_TOKENIZER_DIR"),
                        help="a saved tokenizer folder (default $CTX_TOKENIZER_DIR, else the embedded SmolLM2 one)")
    args = parser.parse_args(argv)

    sections = parse_sections(args.only)
    shapes = DRY if args.dry_run else FULL
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in MODEL_SHAPES]
        if unknown:
            raise SystemExit(f"unknown model shape(s) {', '.join(unknown)}; choose from {', '.join(MODEL_SHAPES)}")
        shapes = replace(shapes, models=tuple(args.models.split(",")))
    if args.repeats is not None:
        shapes = replace(shapes, repeats=max(1, args.repeats))
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cpu" and not args.dry_run:
        print("warning: no GPU; the full shapes on CPU would take hours (use --dry-run)", file=sys.stderr)
    dtype = default_dtype(device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_tokenizer()

    started = time.perf_counter()
    rows: list[dict] = []
    settings: dict[str, Any] = {"dry_run": args.dry_run, "sections": sections, "device": str(device),
                                "dtype": str(dtype), "shapes": asdict(shapes), "model_build_s": {}}
    output = (args.out / "gpu.json") if args.out else None

    def save(complete: bool) -> None:
        # rewritten after every section: a run cut off at a time limit still leaves what it measured
        write_results("gpu", rows, {**settings, "complete": complete, "seconds": time.perf_counter() - started},
                      output)

    for name in shapes.models:
        build_s = time.perf_counter()
        loaded = build_model(name, tokenizer, device, dtype)
        settings["model_build_s"][name] = time.perf_counter() - build_s
        print(f"\n## {name}: built in {settings['model_build_s'][name]:.1f} s on {device} ({dtype})", flush=True)
        bench = Bench(loaded, shapes, strict=args.dry_run)
        for section in sections:
            section_start = time.perf_counter()
            section_rows = RUNNERS[section](bench)
            print(f"\n### {section} ({name}, {time.perf_counter() - section_start:.1f} s)")
            print_table(section_rows, COLUMNS[section] + (["error"] if any("error" in r for r in section_rows) else []))
            rows.extend(section_rows)
            save(complete=False)
        del bench, loaded
        release(device)
    save(complete=True)
    return rows

if __name__ == "__main__":
    main()
