"""Disk formats of the KV cache (``Engine(disk_format=...)``): bytes per cached token, load time per tier, and
the answers decoded from entries read back from disk in each format.

Formats (``ctx_integrations/engine/core/kv_codec.py``): ``native`` (the model's dtype, exact), ``fp16``, ``bf16``
and ``int8`` (KIVI-style, keys per channel, values per token, fp16 scales). One model at a time (``--model``,
repeatable; default the embedded SmolLM2-135M), one engine per format on the same loaded model (they share its
scheduler) and one temporary cache root (lossy formats keep a folder of their own under it).

Tables (one JSON file holds all rows, each with its ``table``):

* ``tiers``: ``--load-documents`` documents of exactly ``--load-tokens`` tokens (the access-key set's filler
  text). *Bytes per token*: the disk tier's (the documents' entry files, safetensors headers and token ids
  included, the shared prefix's entry left out) and the memory tier's (``store.memory_used``: entries there
  are decoded to the model's dtype, whatever the disk holds), each also over native's, next to
  ``kv_codec.bytes_per_token`` (``theory``: KV values and int8's per-token value scales only). *Load time*,
  one document at a time through the store (``store.document_tokens``): ``compute`` is a miss (prefill after
  the shared prefix, then encoding and writing the entry in the format; formats alternate per document),
  ``disk`` a read back after ``store.clear_memory()`` (the files were just written: the OS page cache is
  warm, so this is decoding and copying, not the device's read speed), ``memory`` a hit in the memory tier;
  per document (median) and per 1k tokens (total time / tokens), formats alternating per repeat (``--repeats``
  of disk and memory; compute once). ``kv_rel_rms`` / ``kv_max_abs``: the entries read back against the
  exact ones computed on the miss (native: 0, checked).
* ``accuracy``: the library's evaluation (``ctx_integrations.evaluation``: ``load_set``, ``default_systems``,
  ``evaluate``, as ``ctx-experts eval`` runs them) on the ``world`` and ``secret_code`` sets, modes
  ``--modes`` (default ``pced``), with every answer decoded from entries READ BACK FROM DISK in the format:
  the documents' exact caches are computed once (``engine.warm`` on the native engine) and written into
  every format's folder by its disk tier (``store.disk.save``, the path a miss takes), then, before each
  (set, mode, format) pass, ``store.clear_memory()``; ``evaluate(..., warm=False)``. Every answer's
  ``cache_hits_by_tier`` is checked: no miss, and every document of the pass read from disk exactly once
  (later hits on it are memory hits of the entry read from disk); a pass that fails this raises
  :class:`NotFromDiskError` (its answers would measure the memory tier, not the format). Per format: EM, F1,
  answers whose text differs from native's, and whether EM stayed within one question of native's
  (``|dEM| x questions <= 1``).

    python -m benchmarks.kv_formats --quick --output /tmp/kv_formats_quick.json
    python -m benchmarks.kv_formats --threads 1 --model qwen2.5-coder-0.5b --world 24 --secret-code 24
    python -m benchmarks.kv_formats --threads 1 --formats int8          # native (the reference) and int8 only
    python -m benchmarks.kv_formats --threads 1 --model smollm2 --model qwen2.5-coder-0.5b \\
        --output benchmarks/results/kv_formats.json

``--model smollm2`` (or no ``--model``) is the embedded SmolLM2-135M; any other value is what
``Engine.from_pretrained`` takes (a fetched alias, an HF id, a folder, a ``.gguf``). Measured tables:
docs/scaling.md#bytes-per-cached-token.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median, print_table, write_results  # noqa: E402

FORMATS = ("native", "fp16", "bf16", "int8")  # native first: the reference of every ratio and comparison
EMBEDDED = "smollm2"
SETS = ("world", "secret_code")
TIERS_BYTES_COLUMNS = ("model", "format", "dtype", "theory_B_per_token", "disk_B_per_token", "disk_vs_native",
                       "memory_B_per_token", "memory_vs_native")
TIERS_TIME_COLUMNS = ("model", "format", "docs", "doc_tokens", "compute_ms_per_doc", "disk_ms_per_doc",
                      "memory_ms_per_doc", "compute_ms_per_1k", "disk_ms_per_1k", "memory_ms_per_1k",
                      "disk_vs_compute", "kv_rel_rms", "kv_max_abs", "repeats")
ACCURACY_COLUMNS = ("model", "set", "mode", "format", "questions", "em", "f1", "differ_vs_native", "delta_em",
                    "em_within_one_question", "disk_hits", "memory_hits", "misses")


class NotFromDiskError(RuntimeError):
    """An evaluation pass whose answers did not decode entries read back from disk (so it measured no format)."""


# -- machine -------------------------------------------------------------------------------------------
def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the vector / matrix extensions that decide fp32 vs bf16 speed (Linux)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine()):
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    return {"cpu": name, "cpu_flags": [flag for flag in wanted if flag in flags]}


def uptime() -> str:
    """``uptime``'s line (the load of a shared machine), or the load averages where there is no ``uptime``."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- engines -------------------------------------------------------------------------------------------
def load(model: str) -> Any:
    """The loaded model ``--model`` names (``smollm2``: the embedded one) on CPU."""
    from ctx_integrations.engine.core.model import load_model

    return load_model(None if model == EMBEDDED else model, device="cpu")


def format_engines(loaded: Any, cache_root: Path, threads: int | None,
                   formats: Sequence[str] = FORMATS) -> dict[str, Any]:
    """One engine per format on ``loaded`` (one shared scheduler), all under ``cache_root``; native first."""
    from ctx_integrations import Engine

    return {fmt: Engine(loaded, cache_dir=cache_root, disk_format=fmt, threads=threads) for fmt in formats}


def theory_bytes_per_token(loaded: Any, fmt: str) -> float:
    from ctx_integrations.engine.core.kv_codec import bytes_per_token
    from ctx_integrations.engine.core.kv_shape import kv_shape

    shape = kv_shape(loaded.model.config)
    return bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, fmt, loaded.dtype)


# -- tiers: bytes and load time ------------------------------------------------------------------------
def load_documents(engine: Any, n: int, tokens: int, seed: int = 7) -> list[list[int]]:
    """``n`` documents of exactly ``tokens`` tokens (the access-key set's filler), as the layout's token ids."""
    from ctx_integrations.evaluation.sets import secret_code_documents

    texts, _, _ = secret_code_documents(engine.layout, n, tokens, seed=seed)
    return [engine.layout.context_ids(text) for text in texts]


def _kv_error(read: Any, exact: Any) -> tuple[float, float]:
    """(relative RMS error, max absolute error) of an entry read back against the exact one."""
    diff = (read.float() - exact.float())
    return float(diff.norm() / exact.float().norm().clamp(min=1e-30)), float(diff.abs().max())


def measure_tiers(engines: dict[str, Any], documents: list[list[int]], repeats: int,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The ``tiers`` rows: bytes per token per tier and load time per tier, formats alternating."""
    loaded = next(iter(engines.values())).loaded
    tokens = sum(len(ids) for ids in documents)
    compute: dict[str, list[float]] = {fmt: [] for fmt in engines}
    exact: dict[str, list[Any]] = {fmt: [] for fmt in engines}
    for engine in engines.values():
        engine.store.prefix(engine.layout)  # the shared prefix: computed (and written) outside the timings
    for ids in documents:  # one miss per document and format, formats alternating per document
        for fmt, engine in engines.items():
            misses = engine.store.stats.misses
            start = time.perf_counter()
            entry = engine.store.document_tokens(engine.layout, ids)
            compute[fmt].append(time.perf_counter() - start)
            if engine.store.stats.misses != misses + 1:
                raise RuntimeError(f"{fmt}: the compute timing was not a miss")
            exact[fmt].append(entry.kv)
    disk: dict[str, list[list[float]]] = {fmt: [] for fmt in engines}
    memory: dict[str, list[list[float]]] = {fmt: [] for fmt in engines}
    bytes_row: dict[str, dict[str, float]] = {}
    errors: dict[str, tuple[float, float]] = {}
    for repeat in range(repeats):
        for fmt, engine in engines.items():
            store, layout = engine.store, engine.layout
            store.clear_memory()
            store.prefix(layout)  # read back outside the timings (not counted as a document hit)
            before, disk_hits = store.memory_used, store.stats.disk_hits
            times, read = [], []
            for ids in documents:
                start = time.perf_counter()
                read.append(store.document_tokens(layout, ids).kv)
                times.append(time.perf_counter() - start)
            if store.stats.disk_hits - disk_hits != len(documents):
                raise NotFromDiskError(f"{fmt}: {store.stats.disk_hits - disk_hits} of {len(documents)} documents "
                                       "came from disk in the disk timing")
            disk[fmt].append(times)
            memory_bytes = store.memory_used - before
            memory_hits = store.stats.memory_hits
            times = []
            for ids in documents:
                start = time.perf_counter()
                store.document_tokens(layout, ids)
                times.append(time.perf_counter() - start)
            if store.stats.memory_hits - memory_hits != len(documents):
                raise RuntimeError(f"{fmt}: the memory timing was not all memory hits")
            memory[fmt].append(times)
            if repeat == 0:
                files = sum(store.disk.path(store.entry_key(layout, ids)).stat().st_size for ids in documents)
                bytes_row[fmt] = {"disk": files / tokens, "memory": memory_bytes / tokens}
                pairs = [_kv_error(r, e) for r, e in zip(read, exact[fmt])]
                rms = (sum(p[0] ** 2 for p in pairs) / len(pairs)) ** 0.5
                errors[fmt] = (rms, max(p[1] for p in pairs))
        log(f"  tiers repeat {repeat + 1}/{repeats} done")
    rows = []
    base = bytes_row["native"]
    dtype = str(loaded.dtype).removeprefix("torch.")
    for fmt in engines:
        per_doc = {"compute": median(compute[fmt]), "disk": median([t for run in disk[fmt] for t in run]),
                   "memory": median([t for run in memory[fmt] for t in run])}
        per_1k = {"compute": sum(compute[fmt]) / tokens * 1e6,
                  "disk": median([sum(run) for run in disk[fmt]]) / tokens * 1e6,
                  "memory": median([sum(run) for run in memory[fmt]]) / tokens * 1e6}
        sizes = bytes_row[fmt]
        rows.append({"table": "tiers", "model": loaded.name, "format": fmt, "dtype": dtype, "docs": len(documents),
                     "doc_tokens": len(documents[0]), "repeats": repeats,
                     "theory_B_per_token": theory_bytes_per_token(loaded, fmt),
                     "disk_B_per_token": sizes["disk"], "disk_vs_native": sizes["disk"] / base["disk"],
                     "memory_B_per_token": sizes["memory"], "memory_vs_native": sizes["memory"] / base["memory"],
                     **{f"{tier}_ms_per_doc": value * 1e3 for tier, value in per_doc.items()},
                     **{f"{tier}_ms_per_1k": value for tier, value in per_1k.items()},
                     "disk_vs_compute": per_1k["disk"] / per_1k["compute"],
                     "kv_rel_rms": errors[fmt][0], "kv_max_abs": errors[fmt][1]})
    if errors["native"] != (0.0, 0.0):
        raise RuntimeError(f"native entries read back differ from the computed ones: {errors['native']}")
    return rows


# -- accuracy: answers decoded from entries read back from disk ----------------------------------------
class _Recorder:
    """An engine whose ``generate`` also keeps every answer with its documents' texts (for the tier check)."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.answers: list[tuple[frozenset[str], Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, query: str, documents: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        answer = self._engine.generate(query, documents, *args, **kwargs)
        self.answers.append((frozenset(getattr(d, "text", d) for d in documents), answer))
        return answer


def check_from_disk(answers: Sequence[Any], distinct_documents: int, label: str) -> dict[str, int]:
    """The tiers that served ``answers``; raise :class:`NotFromDiskError` unless every one of the pass's
    ``distinct_documents`` was read from disk exactly once and nothing was computed (no miss)."""
    tiers: Counter[str] = Counter()
    for answer in answers:
        tiers.update(answer.cache_hits_by_tier)
    misses = sum(answer.cache_misses for answer in answers)
    counts = {"disk_hits": tiers["disk"], "memory_hits": tiers["memory"], "host_hits": tiers["host"],
              "misses": misses}
    if misses or tiers["host"] or tiers["disk"] != distinct_documents:
        raise NotFromDiskError(
            f"{label}: {tiers['disk']} of {distinct_documents} documents read from disk, {tiers['memory']} memory "
            f"hits, {tiers['host']} host hits, {misses} misses: these answers did not decode entries read back "
            "from disk, so they measure nothing about the disk format (clear the memory tier before the pass)")
    return counts


def evaluate_from_disk(engine: Any, examples: Sequence[Any], mode: str, max_new_tokens: int, *,
                       clear_memory: bool = True, label: str = "") -> tuple[Any, dict[str, int]]:
    """The library's evaluation of ``mode`` on ``examples``, every document's cache read back from ``engine``'s
    disk tier (``clear_memory=False`` is for tests: a pass served from memory is refused)."""
    from ctx_integrations.evaluation import default_systems, evaluate

    if clear_memory:
        engine.store.clear_memory()
    recorder = _Recorder(engine)
    systems = default_systems([mode], baselines=False, pced_ablation=False)
    report = evaluate(recorder, examples, [mode], max_new_tokens=max_new_tokens, warm=False, systems=systems)
    texts = {d.text for example in examples for d in example.documents}
    mine = [answer for documents, answer in recorder.answers if documents <= texts]  # not the warm-up answer
    return report, check_from_disk(mine, len(texts), label or f"{engine.store.disk_format} {mode}")


def write_formats(engines: dict[str, Any], texts: Sequence[str]) -> None:
    """Every document's exact cache computed once (the native engine) and written into every format's folder by
    that format's disk tier, as a miss would write it; nothing stays in any memory tier."""
    native = engines["native"]
    native.warm(list(texts))
    layout = native.layout
    for fmt, engine in engines.items():
        engine.store.prefix(layout)
        if fmt == "native":
            continue
        for text in texts:
            ids = layout.context_ids(text)
            entry = native.store.document_tokens(layout, ids)
            engine.store.disk.save(entry.key, entry.token_ids, entry.kv)
    for engine in engines.values():
        engine.store.clear_memory()


def accuracy_rows(model: str, set_name: str, mode: str, reports: dict[str, tuple[Any, dict[str, int]]]
                  ) -> list[dict[str, Any]]:
    """One row per format: EM, F1, answers whose text differs from native's, EM within one question of native's."""
    native = {r["example"]: r["text"] for r in reports["native"][0].records}
    native_em = reports["native"][0].rows[0]["substring_em"]
    rows = []
    for fmt, (report, counts) in reports.items():
        row, n = report.rows[0], len(report.records)
        delta = row["substring_em"] - native_em
        rows.append({"table": "accuracy", "model": model, "set": set_name, "mode": mode, "format": fmt,
                     "questions": n, "em": row["substring_em"], "f1": row["f1"],
                     "differ_vs_native": sum(r["text"] != native[r["example"]] for r in report.records),
                     "delta_em": delta, "em_within_one_question": abs(delta) * n <= 1 + 1e-9, **counts,
                     "answers": [r["text"] for r in report.records]})
    return rows


def measure_accuracy(engines: dict[str, Any], questions: dict[str, int], modes: Sequence[str], max_new_tokens: int,
                     log: Callable[[str], None]) -> list[dict[str, Any]]:
    from ctx_integrations.evaluation import load_set

    native = engines["native"]
    sets = {name: load_set(name, native, n_questions=n) for name, n in questions.items() if n > 0}
    write_formats(engines, list(dict.fromkeys(d.text for examples in sets.values() for e in examples
                                              for d in e.documents)))
    rows = []
    for set_name, examples in sets.items():
        for mode in modes:
            reports = {}
            for fmt, engine in engines.items():
                start = time.perf_counter()
                reports[fmt] = evaluate_from_disk(engine, examples, mode, max_new_tokens,
                                                  label=f"{set_name} {mode} {fmt}")
                log(f"  {set_name} {mode} {fmt}: EM {reports[fmt][0].rows[0]['substring_em']:.3f} "
                    f"({time.perf_counter() - start:.0f} s)")
            rows += accuracy_rows(native.loaded.name, set_name, mode, reports)
    return rows


# -- main ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None,
                        help=f"repeatable; {EMBEDDED} (the embedded SmolLM2-135M, default), a fetched alias, an HF id, "
                             "a folder or a .gguf")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (the engines' and this thread's)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--load-documents", type=int, default=8, help="documents of the tiers table (default 8)")
    parser.add_argument("--load-tokens", type=int, default=256, help="tokens per document there (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="disk and memory loads per format (default 3)")
    parser.add_argument("--world", default="24", help="world questions (default 24; 0 skips the set); comma-"
                                                       "separated: one per --model, in order (the last one repeats)")
    parser.add_argument("--secret-code", default="24", help="secret_code questions (default 24; 0 skips), as --world")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="comma-separated disk formats (default all; native, the reference, is always run)")
    parser.add_argument("--modes", default="pced", help="comma-separated modes to score (default pced)")
    parser.add_argument("--max-new-tokens", type=int, default=20, help="answer length limit (default 20, as eval)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke size (tests): 2 documents of 32 tokens, "
                                                             "1 repeat, 2 questions per set, 4 new tokens")
    args = parser.parse_args(argv)
    args.model = args.model or [EMBEDDED]
    if args.quick:
        args.load_documents, args.load_tokens, args.repeats = 2, 32, 1
        args.world, args.secret_code, args.max_new_tokens = 2, 2, 4
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    asked = {f.strip() for f in args.formats.split(",") if f.strip()}
    if asked - set(FORMATS):
        parser.error(f"unknown formats {sorted(asked - set(FORMATS))}: choose from {', '.join(FORMATS)}")
    args.formats = [f for f in FORMATS if f in asked | {"native"}]
    args.world, args.secret_code = _per_model(args.world, args.model), _per_model(args.secret_code, args.model)
    return args


def _per_model(text: object, models: Sequence[str]) -> list[int]:
    """``"24,12"`` -> one count per model, the last one repeated for the models after it."""
    counts = [int(x) for x in str(text).split(",") if x.strip()]
    if not counts or min(counts) < 0:
        raise SystemExit(f"question counts must be whole numbers >= 0, got {text!r}")
    return [counts[min(i, len(counts) - 1)] for i in range(len(models))]


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # this thread computes the tiers table's misses
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {text}", flush=True)

    loads = {"before": uptime()}
    log(f"uptime before: {loads['before']}")
    rows: list[dict[str, Any]] = []
    for index, model in enumerate(args.model):
        loaded = load(model)
        root = Path(tempfile.mkdtemp(prefix="kv-formats-"))
        engines = format_engines(loaded, root, args.threads, args.formats)
        try:
            log(f"{loaded.name} ({loaded.dtype}): tiers")
            documents = load_documents(engines["native"], args.load_documents, args.load_tokens)
            rows += measure_tiers(engines, documents, args.repeats, log)
            log(f"{loaded.name}: accuracy")
            questions = {"world": args.world[index], "secret_code": args.secret_code[index]}
            rows += measure_accuracy(engines, questions, args.modes, args.max_new_tokens, log)
        finally:
            for engine in engines.values():
                engine.close()
            shutil.rmtree(root, ignore_errors=True)
    loads["after"] = uptime()
    log(f"uptime after: {loads['after']}")
    report(args, rows, loads, time.perf_counter() - started)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], loads: dict[str, str], wall_s: float) -> None:
    """Print the three tables and write the JSON (date, CPU, threads, uptime before and after, torch version)."""
    import torch

    tiers = [r for r in rows if r["table"] == "tiers"]
    print("\nbytes per cached token (disk: entry files incl. headers and token ids; memory: the decoded entries)")
    print_table(tiers, TIERS_BYTES_COLUMNS)
    print("\nload time per tier (one document at a time; disk: OS page cache warm)")
    print_table([{**r, "kv_rel_rms": f"{r['kv_rel_rms']:.1e}", "kv_max_abs": f"{r['kv_max_abs']:.1e}"} for r in tiers],
                TIERS_TIME_COLUMNS)
    print("\naccuracy, answers decoded from entries read back from disk")
    print_table([r for r in rows if r["table"] == "accuracy"], ACCURACY_COLUMNS)
    settings = {**{k: v for k, v in vars(args).items() if k != "output"}, "date": time.strftime("%Y-%m-%d %H:%M"),
                **cpu_description(), "threads": args.threads or torch.get_num_threads(),
                "load": loads, "wall_s": wall_s,
                "page_cache": "warm (entries read right after they were written)"}
    write_results("kv_formats", rows, settings, args.output)


if __name__ == "__main__":
    main()
