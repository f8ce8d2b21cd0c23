"""Shared benchmark utilities: the evaluation data, timing, table and JSON output.

Answer metrics come from the package (``ctx_integrations.evaluation.metrics``), re-exported here for the scripts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ctx_integrations.evaluation.metrics import best_f1, normalize_answer, substring_match, token_f1  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MUSIQUE = Path(os.environ["CTX_MUSIQUE"]) if os.environ.get("CTX_MUSIQUE") else None  # not shipped with the repo


def load_musique(limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of ``{"id", "question", "answers", "documents"}`` from the MuSiQue dev file (``$CTX_MUSIQUE``)."""
    if MUSIQUE is None:
        raise FileNotFoundError("set CTX_MUSIQUE to the MuSiQue dev jsonl (rows of id, question, answers, documents)")
    if not MUSIQUE.is_file():
        raise FileNotFoundError(f"{MUSIQUE} not found; set CTX_MUSIQUE to the musique_dev.jsonl path")
    rows = [json.loads(line) for line in MUSIQUE.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def timed(function: Callable[[], Any], repeats: int = 1) -> tuple[Any, list[float]]:
    """Run ``function`` ``repeats`` times; return the last result and the wall times."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return result, times


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "threads": torch.get_num_threads()}


def add_engine_arguments(parser: Any) -> None:
    """``--model``, ``--threads`` and ``--output``, which every benchmark takes alike."""
    parser.add_argument("--model", default=None, help="HF id, local dir, .gguf or fetched alias (default: the "
                                                      "embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=None)


def engine_from_arguments(args: Any) -> Any:
    """Set torch's threads from ``args.threads`` (when given) and load ``args.model``."""
    from ctx_integrations import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    return Engine.from_pretrained(args.model)


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """Print (and return) a Markdown table of ``rows`` restricted to ``columns``."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    table = "\n".join(lines)
    print(table)
    return table


def write_results(name: str, rows: list[dict[str, Any]], settings: dict[str, Any], output: Path | None = None,
                  extra: dict[str, Any] | None = None) -> Path:
    """Write ``{"benchmark", "settings", "environment", "rows", **extra}`` JSON and return its path.

    The file is written whole to a temporary name and renamed over the old one, so a reader (or a run stopped
    in the middle of a write) sees the previous version or the new one, never half of one.
    """
    path = output or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "settings": settings, "environment": environment(), "rows": rows, **(extra or {})}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2, default=str))
    partial.replace(path)
    print(f"wrote {path}")
    return path


def run_in_checkout(path: Path, script: str, function: str, *args: int | float | str) -> Any:
    """``function(*args)`` of ``script`` (a benchmark file of this checkout), run in a subprocess whose package and
    tests are imported from the checkout at ``path`` (another commit's files: ``git worktree add DIR COMMIT``), one
    torch thread; its JSON result. The function imports the package itself, so the baseline is measured by this
    checkout's measurement code."""
    code = (f"import json, runpy, sys, torch; torch.set_num_threads(1); sys.path.insert(0, {str(path)!r})\n"
            f"namespace = runpy.run_path({script!r})\n"
            f"print('RESULT ' + json.dumps(namespace[{function!r}](*{args!r})))\n")
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(path))
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the measurement in {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))
