"""Progress of a long step on stderr, fed from any thread: a tqdm bar on a terminal, plain lines elsewhere.

Why this exists: ``ctx-experts ingest`` computes KV caches on the engine's scheduler thread (one request whose
job yields after each batched forward), so the counts arrive there, not in the thread that waits. Printing from
the scheduler's thread would let a slow or blocked stderr (a full pipe, a paused terminal) stall every request
the engine runs, so :class:`Progress` only records the counts where they arrive (a lock and two integers) and
renders them on its own thread. On a terminal that is a tqdm bar; elsewhere (a log file, CI, ``2> log``) tqdm's
carriage returns would pile up into one unreadable line, so it prints a plain line when the step starts, every
``every_s`` seconds while it runs and when it ends::

    kv caches: 0/450 documents, 0 s
    kv caches: 120/450 documents, 10 s
    kv caches: 450/450 documents, 35 s

tqdm has no such line mode, so that part is written here by hand (a few lines).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

EVERY_S = 10.0  # seconds between two plain lines while a step runs
_TICK_S = 0.1  # how often the rendering thread looks at the counts


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextmanager
def terminal_only_bars(file: TextIO | None = None) -> Iterator[None]:
    """transformers' (and the hub's) progress bars, its "Loading weights" bar among them, only when ``file``
    (default stderr) is a terminal; restored as they were afterwards. Elsewhere (a log, CI, a notebook's
    captured stderr) each bar is a pile of carriage-return lines that says nothing a user needs."""
    from transformers.utils import logging as hf_logging

    hide = hf_logging.is_progress_bar_enabled() and not _is_terminal(file if file is not None else sys.stderr)
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


class Progress:
    """``done`` out of ``total`` ``unit``\\ s of the step ``desc``, shown on ``file`` (default stderr) while in a
    ``with`` block.

    ``show``: ``None`` shows a tqdm bar when ``file`` is a terminal and plain lines otherwise, ``True`` a bar
    always, ``False`` nothing. :meth:`update` (absolute counts) and :meth:`advance` (an increment) may be called
    from any thread: they never write. Nothing is shown before the first count arrives (a step that never starts
    prints nothing); ``total`` may come with it. The time shown counts from the start of the ``with`` block when
    ``total`` is given here (the step starts with the block: its first count may come after a whole batch), else
    from the first count (a step inside a longer block, which announces itself with ``update(0, total)``).
    """

    def __init__(self, desc: str, unit: str, total: int | None = None, *, show: bool | None = None,
                 every_s: float = EVERY_S, file: TextIO | None = None):
        self.desc, self.unit, self.every_s = desc, unit, every_s
        self.file = file if file is not None else sys.stderr
        self.style = "off" if show is False else "bar" if show or _is_terminal(self.file) else "lines"
        self._lock = threading.Lock()
        self._done, self._total, self._started = 0, total, None  # _started: when the first count arrived
        self._since: float | None = None  # where the time shown counts from
        self._first: tuple[int, int | None] = (0, total)  # the first counts: the start line, however short the step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None
        self._shown: tuple[int, int | None] | None = None  # the counts of the last line printed
        self._line_at = 0.0

    # -- counting (any thread; no I/O) ---------------------------------------------------------------
    def update(self, done: int, total: int | None = None) -> None:
        """``done`` of ``total`` (``None``: the total stays as it was)."""
        with self._lock:
            self._done = done
            if total is not None:
                self._total = total
            self._start()

    def advance(self, n: int = 1) -> None:
        """``n`` more done."""
        with self._lock:
            self._done += n
            self._start()

    def _start(self) -> None:
        if self._started is None:
            self._started, self._first = time.monotonic(), (self._done, self._total)
            self._since = self._started if self._since is None else self._since

    # -- rendering (its own thread) ------------------------------------------------------------------
    def __enter__(self) -> Progress:
        if self._total is not None:
            with self._lock:
                self._since = time.monotonic()
        if self.style != "off":
            self._thread = threading.Thread(target=self._run, name=f"progress {self.desc}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            self._render(final=False)
        self._render(final=True)

    def _render(self, final: bool) -> None:
        with self._lock:
            done, total, started, since = self._done, self._total, self._started, self._since
        if started is None or since is None:
            return
        if self.style == "bar":
            self._render_bar(done, total, final)
        else:
            self._render_line(done, total, started - since, since, final)

    def _render_bar(self, done: int, total: int | None, final: bool) -> None:
        from tqdm.auto import tqdm

        if self._bar is None:
            self._bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=self.file, leave=False)
        if self._bar.total != total:
            self._bar.total = total
        if self._bar.n != done:
            self._bar.update(done - self._bar.n)
        if final:
            self._bar.close()

    def _render_line(self, done: int, total: int | None, first_s: float, since: float, final: bool) -> None:
        if self._shown is None:  # the start line, even when the step is over by the first look
            self._print_line(*self._first, first_s)
        now = time.monotonic()
        finished = total is not None and done >= total
        if (finished or final) and self._shown == (done, total):
            return  # the last line said it already
        if finished or final or now - self._line_at >= self.every_s:
            self._print_line(done, total, now - since)

    def _print_line(self, done: int, total: int | None, elapsed: float) -> None:
        of = f"/{total}" if total is not None else ""
        print(f"{self.desc}: {done}{of} {self.unit}s, {elapsed:.0f} s", file=self.file, flush=True)
        self._shown, self._line_at = (done, total), time.monotonic()
