"""Leaving the interpreter while the model's thread is inside a forward.

CPython ends a daemon thread that takes the GIL back during finalisation with pthread_exit; unwound
through torch's C++ frames, that calls std::terminate ("terminate called without an active
exception", the process aborts after printing its answer). The scheduler's thread must therefore be
joined at exit however long its current step takes: a bounded join aborted runs on a loaded machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.scheduler import scheduler_for
from tests.helpers import tiny_loaded

DOCS = ["Marrowgate is the capital of Veloria.", "The mayor of Marrowgate is Ilsa Brenn."]
REPO = Path(__file__).resolve().parents[1]


def slow_forwards(model: torch.nn.Module, seconds: float) -> threading.Event:
    """Make each forward of ``model`` spend ``seconds`` in torch kernels; the event is set when one starts."""
    entered = threading.Event()

    def busy(module, args):
        entered.set()
        until, x = time.perf_counter() + seconds, torch.randn(256, 256)
        while time.perf_counter() < until:
            x = torch.tanh(x @ x)  # kernels that release the GIL, like a real forward's

    model.register_forward_pre_hook(busy)
    return entered


def test_stop_waits_for_a_step_longer_than_its_notice_time(capfd):
    """A stop during a 1.5 s step returns only once the thread is gone (a 0.2 s bound left it running in torch)."""
    engine = Engine(tiny_loaded("llama", seed=7))
    entered = slow_forwards(engine.loaded.model, 1.5)
    caller = threading.Thread(target=lambda: _ignore_errors(engine), daemon=True)
    caller.start()
    assert entered.wait(30)
    scheduler = scheduler_for(engine.loaded)
    thread = scheduler._thread
    started = time.perf_counter()
    scheduler.stop(notice_after=0.2)
    assert thread is not None and not thread.is_alive()
    assert time.perf_counter() - started > 0.5  # it really waited for the step
    assert "waiting for the model's current step to end" in capfd.readouterr().err


def _ignore_errors(engine: Engine) -> None:
    try:
        engine.generate("Who is the mayor?", DOCS, mode="pced", max_new_tokens=50)
    except Exception:  # noqa: BLE001 - the request is abandoned by the stop; only the thread's exit matters
        pass


EXIT_MID_STEP = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded
    from tests.test_scheduler_exit import DOCS, slow_forwards

    engine = Engine(tiny_loaded("llama", seed=8))
    entered = slow_forwards(engine.loaded.model, 1.0)
    threading.Thread(target=engine.generate, args=("Who is the mayor?", DOCS), daemon=True,
                     kwargs=dict(mode="pced", max_new_tokens=50)).start()
    entered.wait(30)
    time.sleep(0.2)
    print("answered", flush=True)
""")


def test_the_process_exits_cleanly_while_a_request_is_mid_step():
    """The abort of the issue: the interpreter exits while the scheduler's thread is inside a forward."""
    done = subprocess.run([sys.executable, "-c", EXIT_MID_STEP.format(repo=str(REPO))], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "answered" in done.stdout
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
