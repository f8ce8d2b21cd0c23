"""Run processes that exit while the model's thread works, many times, and count aborts at exit.

CPython ends a daemon thread that takes the GIL back during finalisation with pthread_exit; inside
torch's C++ frames that calls std::terminate ("terminate called without an active exception"), so a
process that printed its answer could still abort. The scheduler joins its thread at exit (see
``Scheduler.stop``); this script checks it under load, which a single test run cannot:

    python tools/exit_soak.py --runs 50                  # exit mid-decode, tiny random model
    python tools/exit_soak.py --runs 20 --cli            # `ctx-experts ask` on a fresh store (embedded model)

It prints one line per run and a summary (runs, aborted, failed otherwise); exit status 1 on any abort.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MID_STEP = textwrap.dedent("""
    import threading, time
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded
    from tests.test_scheduler_exit import DOCS, slow_forwards

    engine = Engine(tiny_loaded("llama", seed=8))
    entered = slow_forwards(engine.loaded.model, {step})
    threading.Thread(target=engine.generate, args=("Who is the mayor?", DOCS), daemon=True,
                     kwargs=dict(mode="pced", max_new_tokens=50)).start()
    entered.wait(30)
    time.sleep({delay})
""")


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--cli", action="store_true", help="run `ctx-experts ask` instead of the mid-step script")
    parser.add_argument("--step-seconds", type=float, default=0.3,
                        help="how long each forward of the mid-step script takes (the old 10 s join aborted past it)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    aborted = failed = 0
    with tempfile.TemporaryDirectory() as folder:
        if args.cli:
            docs = Path(folder) / "docs"
            docs.mkdir()
            (docs / "harbour.txt").write_text("The harbour master of Quillby is Orla Venn.")
            (docs / "bakery.txt").write_text("The oldest bakery in Quillby sells rye bread since 1820.")
            store = str(Path(folder) / "store")
            env["CTX_CACHE_DIR"] = str(Path(folder) / "cache")
            done = _run([sys.executable, "-m", "ctx_integrations.cli", "ingest", str(docs), "--store", store], env)
            assert done.returncode == 0, done.stderr[-2000:]
        for run in range(args.runs):
            if args.cli:
                command = [sys.executable, "-m", "ctx_integrations.cli", "ask", "Who is the harbour master?",
                           "--store", store, "--max-new-tokens", "8"]
            else:
                command = [sys.executable, "-c", MID_STEP.format(delay=0.05 * (run % 5), step=args.step_seconds)]
            started = time.perf_counter()
            done = _run(command, env)
            abort = "terminate called" in done.stderr or done.returncode in (-6, 134)
            aborted += abort
            failed += done.returncode != 0 and not abort
            print(f"run {run + 1}: exit {done.returncode}{' ABORT' if abort else ''} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"runs {args.runs}, aborted {aborted}, failed otherwise {failed}")
    return 1 if aborted else 0


if __name__ == "__main__":
    sys.exit(main())
