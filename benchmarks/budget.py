"""A wall-clock budget for a benchmark run: skip what would not fit, and stop hard at the end regardless.

Two parts, because an estimate can be wrong and a CUDA call cannot be interrupted from Python:

- :class:`Budget` decides, before each case, whether the case's estimated seconds fit in what is left.
  Estimates are priors (seconds on a reference machine) scaled by how much slower this run has been so
  far than its priors said (never scaled below 1: a faster machine just finishes early). A case that does
  not fit is skipped with the reason recorded, and the run goes on to the next (smaller) one.
- :class:`Watchdog` is the backstop: at the deadline it calls ``on_deadline`` (which records what was
  running and rewrites the results file) and then ends the process (``os._exit``), so a command given
  ``--budget S`` never outlives S seconds, whatever a case does.

Written by hand: a timer thread and a ratio, no library does this for a benchmark script.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

INTERRUPTED_EXIT = 124  # the status `timeout` uses for a command it stopped


class Budget:
    """``seconds`` of wall clock from ``started``; ``reserve_s`` of them kept for writing results and exiting.

    ``margin``: estimates are multiplied by it (how wrong a prior may be before a case overruns).
    """

    def __init__(self, seconds: float, started: float | None = None, *, margin: float = 1.25, reserve_s: float = 5.0,
                 clock: Callable[[], float] = time.perf_counter):
        if not seconds > 0:
            raise ValueError(f"a budget must be > 0 seconds, got {seconds}")
        self.seconds, self.margin, self.reserve_s, self.clock = float(seconds), margin, reserve_s, clock
        self.started = clock() if started is None else started
        self.deadline = self.started + self.seconds
        self.prior_s = 0.0  # priors of the cases run so far
        self.actual_s = 0.0  # and what they took

    def left(self) -> float:
        return self.deadline - self.clock()

    def slowdown(self) -> float:
        """Measured over estimated seconds of the cases run so far, at least 1."""
        return max(1.0, self.actual_s / self.prior_s) if self.prior_s > 0 else 1.0

    def estimate(self, prior_s: float) -> float:
        return prior_s * self.slowdown() * self.margin

    def refusal(self, prior_s: float) -> str | None:
        """Why a case of ``prior_s`` reference seconds must be skipped now, or None when it fits."""
        needed, usable = self.estimate(prior_s), self.left() - self.reserve_s
        if needed <= usable:
            return None
        return (f"over budget: needs ~{needed:.0f} s (estimate {prior_s:.0f} s x slowdown {self.slowdown():.2f} "
                f"x margin {self.margin}), {max(usable, 0.0):.0f} s left of {self.seconds:.0f} s")

    def record(self, prior_s: float, actual_s: float) -> None:
        self.prior_s += prior_s
        self.actual_s += actual_s


class Watchdog:
    """At ``deadline`` (a ``clock`` time): ``on_deadline()``, then ``exit(INTERRUPTED_EXIT)`` from a timer thread.

    ``exit`` is ``os._exit``: it ends the process even while the main thread waits in a CUDA call (a
    ``sys.exit`` from this thread would only end the thread). Tests pass another callable.
    """

    def __init__(self, deadline: float, on_deadline: Callable[[], None], *,
                 exit: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.perf_counter):
        self.on_deadline, self.exit, self.fired = on_deadline, exit, False
        self.timer = threading.Timer(max(deadline - clock(), 0.0), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        self.fired = True
        try:
            self.on_deadline()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self.exit(INTERRUPTED_EXIT)

    def cancel(self) -> None:
        self.timer.cancel()
