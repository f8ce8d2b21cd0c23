"""Soft-NBCE vs its limits (hard NBCE, PCW) and PCED: needle-in-a-haystack beyond the model's window,
MuSiQue F1, and peak memory per mode.

NIAH (the Soft-NBCE paper's setting, built synthetically): a haystack of real text (MuSiQue passages)
of ``length`` tokens, longer than the model's window, with the needle "The secret code is NNNNN."
at relative ``depth``. The soft_nbce / nbce / pcw modes get the haystack as one long document and
chunk it with ``chunk_tokens``; PCED gets the same chunks as its documents (same cache entries).
The needle replaces as many filler tokens as it has, so every chunk except the needle's is the same
at all depths and lengths: one prefill of the longest haystack serves the whole grid.
A row is correct when the code appears in the answer.

MuSiQue: each question's 10 passages as the documents (one stream each), token F1 / substring match.

Memory: ``peak_mb`` on CUDA is the peak allocated during the call; on CPU the peak resident set
during the call (sampled every 2 ms) above the level before it, after handing freed heap back to the
OS. ``kv_mb`` is the size of the batched stream cache the mode builds (the dominant term, exact).
Caches are warmed first, so every mode is measured on warm caches.

    python benchmarks/soft_nbce.py                       # the default grid on the embedded model
    python benchmarks/soft_nbce.py --lengths 9000 16000 32000 --depths 0 0.25 0.5 0.75 1 --musique 50
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_f1, load_musique, print_table, substring_match, write_results  # noqa: E402
from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.engine.core.registry import kv_bytes_per_token  # noqa: E402
from ctx_integrations.engine.modes.soft_nbce import split_documents  # noqa: E402

MODES = ("soft_nbce", "nbce", "pcw", "pced")
# also runnable: the paper's Truncated baseline, and the chunk modes with NBCE's reference-code rule (a variant)
CHOICES = MODES + ("truncated", "soft_nbce:nbce_code", "nbce:nbce_code", "pcw:nbce_code")
QUESTION = "What is the secret code? Answer with the code only."
_STATM = Path("/proc/self/statm")


class PeakMemory:
    """Peak memory of a block in MB: CUDA peak allocated, or CPU peak RSS above the RSS at entry."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_mb = float("nan")

    @staticmethod
    def _rss() -> int:
        import os

        return int(_STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") if _STATM.exists() else 0

    def _sample(self) -> None:
        while not self._done.is_set():
            self._peak = max(self._peak, self._rss())
            self._done.wait(0.002)

    def __enter__(self) -> PeakMemory:
        _release_freed_memory()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = self._peak = self._rss()
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        else:
            self._done.set()
            self._thread.join()
            self.peak_mb = max(self._peak, self._rss()) - self._base
            self.peak_mb /= 2**20


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so the RSS before a call is not inflated by old frees."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stream_kv_mb(engine: Engine, question: str, texts: list[str], max_new_tokens: int) -> float:
    """Size of the batched stream cache: (1 + chunks) streams x (prefix + longest chunk + question + answer)."""
    layout, per_token = engine.layout, kv_bytes_per_token(engine.loaded)
    width = (len(layout.prefix_ids) + max(len(layout.context_ids(t)) for t in texts) + len(layout.suffix_ids(question))
             + max_new_tokens)
    return (1 + len(texts)) * width * per_token / 2**20


def filler_ids(tokenizer: Any, rows: list[dict], length: int) -> list[int]:
    """``length`` tokens of real text: MuSiQue passages in file order, one after another."""
    ids: list[int] = []
    for row in rows:
        for passage in row["documents"]:
            ids.extend(tokenizer(" " + passage.strip(), add_special_tokens=False)["input_ids"])
            if len(ids) >= length:
                return ids[:length]
    raise ValueError(f"the MuSiQue file has fewer than {length} tokens of text for the haystack")


def haystack(tokenizer: Any, filler: list[int], length: int, depth: float, code: str) -> str:
    """The first ``length`` filler tokens with the needle overwriting filler at ``depth`` (0 = start, 1 = end)."""
    needle = tokenizer(f" The secret code is {code}.", add_special_tokens=False)["input_ids"]
    at = round(depth * (length - len(needle)))
    # end the needle before a word start, so re-tokenising the text cannot merge across it
    while at > 0 and at + len(needle) < length and not tokenizer.decode(filler[at + len(needle)]).startswith(" "):
        at -= 1
    return tokenizer.decode(filler[:at] + needle + filler[at + len(needle):length])


def run_mode(engine: Engine, question: str, documents: list[str], mode: str, chunk_tokens: int | None,
             max_new_tokens: int) -> dict[str, Any]:
    """One answer with ``mode``: chunk modes chunk the documents themselves; PCED gets the same chunks;
    ``truncated`` gets the documents as they are; ``name:rule`` runs a chunk mode with ``rule=``."""
    texts = [c.text for c in split_documents(engine.loaded.tokenizer, documents, chunk_tokens)]
    name, _, rule = mode.partition(":")
    if name == "pced":
        documents, options = texts, {}
    elif name == "truncated":
        options = {}
    else:
        options = {"chunk_tokens": chunk_tokens, **({"rule": rule} if rule else {})}
    with PeakMemory(engine.loaded.device) as memory:
        answer = engine.generate(question, documents, mode=name, max_new_tokens=max_new_tokens, **options)
    streams = 1 if name == "truncated" else 1 + answer.extra.get("n_chunks", len(texts))
    return {"mode": mode, "answer": answer.text, "ttft_s": answer.timings["ttft_s"],
            "total_s": answer.timings["total_s"], "new_tokens": len(answer.token_ids), "peak_mb": memory.peak_mb,
            "kv_mb": None if name == "truncated" else stream_kv_mb(engine, question, texts, max_new_tokens),
            "streams": streams, "cache_misses": answer.cache_misses}


def warm(engine: Engine, documents: list[str], chunk_tokens: int | None) -> int:
    """Compute the chunks' caches before timing; returns how many were missing (reuse across the grid)."""
    return engine.warm([c.text for c in split_documents(engine.loaded.tokenizer, documents, chunk_tokens)])["misses"]


def niah(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    tokenizer, window = engine.loaded.tokenizer, engine.loaded.max_positions
    filler = filler_ids(tokenizer, load_musique(), max(args.lengths))
    rows = []
    for length in args.lengths:
        for depth in args.depths:
            code = str(random.Random(f"{args.seed}-{length}-{depth}").randint(10000, 99999))
            text = haystack(tokenizer, filler, length, depth, code)
            misses = warm(engine, [text], args.chunk_tokens)
            for mode in args.modes:
                row = run_mode(engine, QUESTION, [text], mode, args.chunk_tokens, args.max_new_tokens)
                row.update(task="niah", length=length, window=window, depth=depth, code=code, warm_misses=misses,
                           correct=float(code in row["answer"]))
                rows.append(row)
                print(f"niah L={length} depth={depth} {mode}: {row['answer']!r} correct={row['correct']:.0f}",
                      flush=True)
    return rows


def musique(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for example in load_musique(args.musique):
        warm(engine, example["documents"], None)
        for mode in args.modes:
            row = run_mode(engine, example["question"], example["documents"], mode, None, args.max_new_tokens)
            row.update(task="musique", id=example["id"], f1=best_f1(row["answer"], example["answers"]),
                       match=substring_match(row["answer"], example["answers"]))
            rows.append(row)
        print(f"musique {example['id']}: " + " | ".join(f"{r['mode']}={r['answer'][:40]!r}"
                                                      for r in rows[-len(args.modes):]),
              flush=True)
    return rows


def summarise(rows: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    summary = []
    for mode in modes:
        needle = [r for r in rows if r["mode"] == mode and r["task"] == "niah"]
        qa = [r for r in rows if r["mode"] == mode and r["task"] == "musique"]
        mine = needle + qa
        summary.append({"mode": mode, "niah_acc": mean([r["correct"] for r in needle]),
                        "musique_f1": mean([r["f1"] for r in qa]), "musique_match": mean([r["match"] for r in qa]),
                        "niah_s": mean([r["total_s"] for r in needle]), "musique_s": mean([r["total_s"] for r in qa]),
                        "peak_mb": max((r["peak_mb"] for r in mine), default=None),
                        "kv_mb": max((r["kv_mb"] for r in mine if r["kv_mb"] is not None), default=None)})
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: the embedded model)")
    parser.add_argument("--lengths", type=int, nargs="*", default=[9000, 12000],
                        help="haystack lengths in tokens, beyond the model's window (none: skip NIAH)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--musique", type=int, default=10, help="MuSiQue questions (0 to skip)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=CHOICES,
                        help="modes to compare (default: %(default)s); also truncated and NAME:nbce_code")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is faster on a busy CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model)
    started = time.perf_counter()
    rows = (niah(engine, args) if args.lengths else []) + (musique(engine, args) if args.musique else [])
    needle = [r for r in rows if r["task"] == "niah"]
    if needle:
        print_table(needle, ["mode", "length", "window", "depth", "correct", "streams", "warm_misses", "ttft_s",
                             "total_s", "peak_mb", "kv_mb"])
    summary = summarise(rows, args.modes)
    table = print_table(summary, ["mode", "niah_acc", "musique_f1", "musique_match", "niah_s", "musique_s",
                                  "peak_mb", "kv_mb"])
    settings = {**vars(args), "output": str(args.output) if args.output else None, "model_name": engine.loaded.name,
                "window": engine.loaded.max_positions, "wall_s": time.perf_counter() - started, "table": table}
    write_results("soft_nbce", rows + [{"summary": s} for s in summary], settings, args.output)


if __name__ == "__main__":
    main()
