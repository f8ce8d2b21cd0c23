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


EXIT_AFTER_COMPILED_STEPS = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, {repo!r})
    from ctx_integrations import Engine
    from ctx_integrations.engine.core import compiled_step, runner
    from tests.helpers import tiny_loaded

    runner.compiled_decode_step = lambda mode: compiled_step.compiled_decode_step(mode, backend="eager")
    engine = Engine(tiny_loaded("llama", seed=3), compile_mode="default")
    docs = [[f"Request {{r}} document {{d}}: " + " ".join(f"w{{(r * 7 + d * 3 + i) % 97}}" for i in range(60))
             for d in range(4)] for r in range(32)]

    async def together(n):
        await asyncio.gather(*(engine.agenerate(f"Question {{r}}?", docs[r], mode="pced", max_new_tokens=16)
                               for r in range(n)))

    asyncio.run(together(16))
    asyncio.run(together(32))
    assert not engine.scheduler.runner.step.failed
    print("answered", flush=True)
""")


def test_the_process_exits_cleanly_after_compiled_steps_on_the_schedulers_thread():
    """The compiled step prepares CUDA graph trees' thread state in the scheduler's thread; stashed in torch's C++
    thread-local state (what torch's own ``_initialize_tls`` does), the thread's exit at interpreter shutdown
    aborted the process in 3 runs of 4. Two runs, so a return of that abort is caught with high probability."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", EXIT_AFTER_COMPILED_STEPS.format(repo=str(REPO))],
                              capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert "answered" in done.stdout, done.stderr[-2000:]
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]


def test_an_idle_scheduler_gives_freed_memory_back_and_a_stopping_one_does_not(monkeypatch):
    """glibc keeps the heap a burst of requests grew (RSS stayed ~0.4-1.5 GB above baseline after rounds of 32
    concurrent requests); the thread trims it when it goes idle. Catches a trim that is never called, or one
    called at every step (it would cost every step a walk of the heap)."""
    from ctx_integrations.engine.core import scheduler as scheduler_module

    calls: list[float] = []
    monkeypatch.setattr(scheduler_module, "IDLE_EXIT_S", 0.05)
    monkeypatch.setattr(scheduler_module, "release_freed_memory", lambda: calls.append(time.perf_counter()))
    engine = Engine(tiny_loaded("llama", seed=9))
    engine.generate("Who is the mayor?", DOCS, mode="pced", max_new_tokens=6)
    assert calls == []  # not while it decodes: the answer came back before the thread went idle
    deadline = time.time() + 5
    while scheduler_for(engine.loaded)._thread is not None and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.05)
    assert len(calls) == 1
    scheduler_for(engine.loaded).stop()  # an exit's stop does not trim
    assert len(calls) == 1


def test_release_freed_memory_returns_heap_to_the_system_on_glibc():
    import platform

    import pytest

    from ctx_integrations.engine.core.heap import release_freed_memory

    if platform.libc_ver()[0] != "glibc":
        assert release_freed_memory() is False
        pytest.skip("malloc_trim is glibc's")
    rss = _rss_bytes()
    blocks = [bytearray(4096) for _ in range(50_000)]  # ~200 MB of small blocks: heap, not mmap
    kept = blocks[::64]  # one live block in 64: free() alone cannot give back the holes between them
    del blocks
    grown = _rss_bytes()
    release_freed_memory()
    assert grown - _rss_bytes() > 100 * 2**20, (rss, grown, _rss_bytes())
    assert len(kept) == 782


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
