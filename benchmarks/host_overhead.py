"""What a warm request costs the host, measured where the model costs nothing: a tiny 2-layer random model.

On a GPU the model's work is fast and the host's is not: a warm PCED answer over 64 x 2048-token documents
took 0.85 s on an H200 where the paper reports 0.14 s. With a 2-layer random model (hidden size 64) on the
CPU the forwards cost almost nothing, so what is left of a warm answer is the host's own work: tokenising
and hashing documents, laying out rows, the Python of each step, detokenising the answer. This script
counts and times it, for this checkout and, in the same run, for a baseline checkout (``--baseline PATH``:
a folder holding another commit's files, e.g. ``git worktree add /tmp/base 23c3a65``), run in a
subprocess with that folder first on ``sys.path``.

Per case (``--documents`` x ``--tokens``, PCED, ``--new-tokens`` greedy tokens, caches warm: the same
documents were answered once before, untimed): host seconds of the warm answer (median of ``--repeats``),
its TTFT, tokenizer calls (``PromptLayout._encode``, the one place both checkouts tokenise through), token
ids handed to the tokenizer's decoder, per answer and per generated token, and the bytes the runner's
forwards copy during the warm request's first step (its join) per byte of its documents' KV
(``copied_per_kv_byte``: what a GPU pays in memory traffic before the first token; :func:`copied_bytes`).

    python -m benchmarks.host_overhead --documents 32,64 --tokens 2048 --baseline /tmp/base
    python -m benchmarks.host_overhead --quick       # 4 x 256 tokens: the CI smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

WORDS = ("river harbour council bridge market winter tower library school garden railway museum festival "
         "mountain island treaty founder painter engineer merchant lantern quarry orchard ferry").split()


def _documents(count: int, tokens: int, seed: int) -> list[str]:
    """``count`` documents of about ``tokens`` tokens each (one word ~ one token for these words)."""
    rng = random.Random(seed)
    return [f"Record {d}. " + " ".join(rng.choice(WORDS) for _ in range(tokens - 4)) + "." for d in range(count)]


# Operations that move or write bytes, as a ``TorchDispatchMode`` sees them (composite ones such as ``reshape``
# arrive whole): the bytes written are an in-place one's source (its output is the whole destination), a view-or-copy
# one's output when it is a copy, and the output of the others.
SOURCE_ARGUMENT = {"index_copy": 3, "index_copy_": 3, "index_put": 2, "index_put_": 2, "_unsafe_index_put": 2}
COPY_WHEN_NEW = {"reshape", "contiguous", "to", "_to_copy", "flatten"}
COPYING = {"copy_", "cat", "pad", "constant_pad_nd", "clone", "index", "index_select", "repeat", "repeat_interleave",
           "fill_", "zero_", "zeros", "zeros_like", "full", "full_like", "new_zeros", "new_full", "slice_scatter",
           "select_scatter", *SOURCE_ARGUMENT, *COPY_WHEN_NEW}


def copied_bytes(run):
    """``(run(), bytes)``: what ``run`` returns and the bytes written by the operations of :data:`COPYING` it
    dispatches (in this thread). Written by hand: torch's profiler counts no bytes on the CPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def storage(t):
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None

    class Count(TorchDispatchMode):
        written = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in COPYING and not (name in COPY_WHEN_NEW and storage(out) == storage(args[0])):
                what = args[SOURCE_ARGUMENT[name]] if name in SOURCE_ARGUMENT else out
                tensors = what if isinstance(what, (tuple, list)) else (what,)
                self.written += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return out

    with Count() as count:
        result = run()
    return result, count.written


def first_step_copies(engine, question: str, texts: list[str], new_tokens: int) -> int:
    """Bytes the runner's forwards copy during the first step of a warm PCED answer over ``texts`` (its join:
    the documents' cached KV laid out in rows, the question's prefill, the rows added to the running pool)."""
    from ctx_integrations.engine.core.runner import ModelRunner

    forward, counted = ModelRunner.forward, []

    def counted_forward(self, step):
        if counted:
            return forward(self, step)
        result, written = copied_bytes(lambda: forward(self, step))
        counted.append(written)
        return result

    ModelRunner.forward = counted_forward
    try:
        engine.generate(question, texts, mode="pced", max_new_tokens=new_tokens)
    finally:
        ModelRunner.forward = forward
    return counted[0]


def measure(documents: int, tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """One case in this process (whichever checkout is first on ``sys.path``)."""
    import torch

    from ctx_integrations import Engine
    from ctx_integrations.engine.core.layout import PromptLayout
    from ctx_integrations.engine.core.registry import kv_bytes_per_token
    from tests.helpers import tiny_loaded

    torch.set_num_threads(1)
    loaded = tiny_loaded("llama", seed=0, max_position_embeddings=max(8192, tokens + 512))
    loaded.model.generation_config.eos_token_id = []  # answers run to new_tokens: every case decodes as much
    engine = Engine(loaded)
    texts = _documents(documents, tokens, seed=documents * 7919 + tokens)
    encode_calls = [0]
    encode = PromptLayout._encode

    def counted_encode(self, text, **kwargs):
        encode_calls[0] += 1
        return encode(self, text, **kwargs)

    decoded = [0]
    tokenizer = loaded.tokenizer
    decode = tokenizer.decode

    def counted_decode(ids, *args, **kwargs):
        decoded[0] += len(ids) if hasattr(ids, "__len__") else 1
        return decode(ids, *args, **kwargs)

    question = "Which record names the lantern quarry?"
    engine.generate(question, texts, mode="pced", max_new_tokens=new_tokens)  # cold: caches computed, untimed
    PromptLayout._encode = counted_encode
    tokenizer.decode = counted_decode
    times, ttfts = [], []
    try:
        for _ in range(repeats):
            encode_calls[0] = decoded[0] = 0
            started = time.perf_counter()
            answer = engine.generate(question, texts, mode="pced", max_new_tokens=new_tokens)
            times.append(time.perf_counter() - started)
            ttfts.append(answer.timings["ttft_s"])
    finally:
        PromptLayout._encode = encode
        tokenizer.decode = decode
    generated = len(answer.token_ids)
    kv_bytes = sum(p.tokens for p in engine.texts.prepare_all(texts)) * kv_bytes_per_token(loaded)
    copied = first_step_copies(engine, question, texts, new_tokens) / kv_bytes
    return {"documents": documents, "tokens": tokens, "new_tokens": generated, "host_s": statistics.median(times),
            "ttft_s": statistics.median(ttfts), "encode_calls": encode_calls[0],
            "encode_calls_per_document": encode_calls[0] / documents, "ids_decoded": decoded[0],
            "ids_decoded_per_token": decoded[0] / max(generated, 1), "cache_misses": answer.cache_misses,
            "copied_per_kv_byte": copied}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from benchmarks.common import print_table, run_in_checkout, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", default="32,64", help="document counts, comma-separated (default 32,64)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per document (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens each answer decodes (default 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a folder with another commit's files (git worktree add DIR COMMIT), measured too")
    parser.add_argument("--quick", action="store_true", help="4 documents x 256 tokens, 4 new tokens, 1 repeat")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.documents, args.tokens, args.new_tokens, args.repeats = "4", 256, 4, 1
    cases = [(int(n), args.tokens) for n in args.documents.split(",")]
    rows = []
    for case in cases:
        for label, path in (("this checkout", REPO), ("baseline", args.baseline)):
            if path is None:
                continue
            row = {"checkout": label, **run_in_checkout(path.resolve(), __file__, "measure", *case, args.new_tokens,
                                                        args.repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.baseline is not None:
            ours, base = rows[-2], rows[-1]
            ours["host_s_vs_baseline"] = base["host_s"] / ours["host_s"]
    print_table(rows, ["checkout", "documents", "tokens", "new_tokens", "host_s", "ttft_s", "host_s_vs_baseline",
                       "encode_calls", "encode_calls_per_document", "ids_decoded_per_token", "cache_misses",
                       "copied_per_kv_byte"])
    write_results("host_overhead", rows, vars(args) | {"baseline": str(args.baseline)}, args.output)
    return rows


if __name__ == "__main__":
    main()
