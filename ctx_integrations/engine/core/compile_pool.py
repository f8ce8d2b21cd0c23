"""Compiling a structured-output format within bounds: a size limit checked first, then a compile that can be stopped.

Contract (:meth:`CompilePool.run`): a format over ``max_format_bytes`` is refused before any compile
(:class:`~ctx_integrations.errors.FormatTooLargeError`); otherwise it is compiled by a warm worker process, which
is killed the moment the compile passes ``format_compile_timeout_s``
(:class:`~ctx_integrations.errors.FormatCompileTimeoutError`) or its request is cancelled, so no compile outlives
its request or its limit. Why a process: xgrammar's C++ compile cannot be interrupted from a Python thread,
and a process is the only unit of work the OS stops at once, memory included.

What the worker sends back is only that the format compiled (and how long it took), never the compiled format:
``CompiledGrammar.serialize_json`` grows with the square of an object's properties (300 required properties: 46 MB,
2.9 s to write and 0.9 s to read back, against 29 ms to compile), so the engine builds the format itself once the
worker has shown it compiles within the limit (xgrammar releases the GIL meanwhile; about as long again, and
never past the limit the worker kept to). Workers are forked by a zygote, a plain ``python -c`` child that has
imported xgrammar once (:mod:`~ctx_integrations.engine.core.compile_worker`), not by ``multiprocessing``: spawn and
forkserver re-run the caller's ``__main__`` in the child (a script without the ``if __name__ == "__main__"``
guard would run twice), and forking the engine's own process copies threads' locks. So a killed worker is replaced
by a fork (milliseconds) instead of a new interpreter importing xgrammar and torch (seconds, paid once per
vocabulary and process, in the background, when the first format is asked for); one idle worker stays warm.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from ctx_integrations.errors import FormatCompileTimeoutError, FormatTooLargeError, InvalidStructuredOutputError

DEFAULT_MAX_FORMAT_BYTES = 64 * 1024
DEFAULT_FORMAT_COMPILE_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 120.0  # a worker that is not ready by then (a machine out of memory) is a typed error
_POLL_S = 0.02  # how often a waiting compile looks at its request's cancellation
_WORKER = "import sys; from ctx_integrations.engine.core.compile_worker import main; main(int(sys.argv[1]))"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds ctx_integrations/


class CompileCancelled(Exception):
    """The request whose format was compiling was cancelled; the worker was killed."""


def check_format_size(kind: str, text: str, max_bytes: int, field: str | None = None) -> None:
    """Refuse a format whose text (the schema, regex, grammar or structural tag xgrammar is given) is over
    ``max_bytes`` UTF-8 bytes, before anything is compiled."""
    if len(text) <= max_bytes // 4:  # at most 4 bytes a character: no need to encode
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise FormatTooLargeError(
            f"the {kind} format is {size} bytes, more than the limit of {max_bytes} bytes (max_format_bytes; "
            f"--max-format-bytes on the server): send a smaller format (fewer enum values, properties or "
            f"alternatives), or raise the limit, e.g. Engine(max_format_bytes={max(2 * max_bytes, size)})", field)


class _Zygote:
    """The process that forks workers (:func:`~ctx_integrations.engine.core.compile_worker.main`): started once per
    vocabulary (it imports xgrammar and torch: seconds), in the background, and again only if it dies."""

    def __init__(self, tokenizer_info: str):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))}
        with theirs:
            self.process = subprocess.Popen([sys.executable, "-c", _WORKER, str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        self.control = ours
        self.conn = Connection(os.dup(ours.fileno()))
        # sent from a thread of its own: the zygote reads it only once it has imported xgrammar (seconds)
        threading.Thread(target=self._send_quietly, args=(tokenizer_info,), daemon=True).start()
        self.ready = False
        self._lock = threading.Lock()

    def _send_quietly(self, message: object) -> None:
        try:
            self.conn.send(message)
        except OSError:  # closed before it read the vocabulary
            pass

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, cancelled: Callable[[], bool]) -> Connection:
        """A new worker's connection (the zygote forks it; it says ``("ready", pid)`` first)."""
        while not self._lock.acquire(timeout=_POLL_S):  # one thread waits for the zygote to start, others for it
            if cancelled():
                raise CompileCancelled()
        try:
            if not self.ready:
                deadline = time.monotonic() + STARTUP_TIMEOUT_S
                while not self.conn.poll(_POLL_S):
                    if cancelled():
                        raise CompileCancelled()
                    if not self.alive() or time.monotonic() > deadline:
                        raise InvalidStructuredOutputError(
                            f"the format compiler's process did not start within {STARTUP_TIMEOUT_S:g} s (exit code "
                            f"{self.process.poll()}): retry, or check the machine's memory")
                self.conn.recv()
                self.ready = True
            ours, theirs = socket.socketpair()
            with theirs:
                socket.send_fds(self.control, [b"w"], [theirs.fileno()])
            return Connection(ours.detach())
        finally:
            self._lock.release()

    def close(self) -> None:
        self.control.close()  # the zygote reads EOF and exits; its workers read EOF when their sockets close
        self.conn.close()


class _Worker:
    def __init__(self, zygote: _Zygote, cancelled: Callable[[], bool]):
        self.conn = zygote.fork(cancelled)
        self.pid: int | None = None

    def wait(self, seconds: float, cancelled: Callable[[], bool]) -> bool:
        """Whether a message arrived within ``seconds``; :class:`CompileCancelled` when ``cancelled()`` first."""
        deadline = time.monotonic() + seconds
        while not self.conn.poll(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if cancelled():
                raise CompileCancelled()
            if time.monotonic() >= deadline:
                return False
        return True

    def recv(self) -> tuple[str, object]:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise InvalidStructuredOutputError(
                "the format compiler's process ended while compiling: the format is likely too large for this "
                "machine's memory; send a smaller one") from None

    def start_up(self, cancelled: Callable[[], bool]) -> None:
        if self.pid is None:
            if not self.wait(STARTUP_TIMEOUT_S, cancelled):
                raise InvalidStructuredOutputError(f"the format compiler's process did not start within "
                                                   f"{STARTUP_TIMEOUT_S:g} s: retry, or check the machine's memory")
            self.pid = int(self.recv()[1])  # type: ignore[call-overload]

    def kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.conn.close()  # a worker not started yet reads EOF first and exits

    def close(self) -> None:
        self.conn.close()  # the worker reads EOF and exits


class CompilePool:
    """Warm worker processes that compile formats for one vocabulary (``tokenizer_info``: xgrammar's
    ``TokenizerInfo.serialize_json()``); each compile takes a worker of its own, so a slow format never holds
    up another. One idle worker is kept (started at once, and again after one is killed); more are started
    while several formats compile at the same time, and closed when they finish."""

    KEEP_IDLE = 1

    def __init__(self, tokenizer_info: str):
        self._info = tokenizer_info
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._zygote = _Zygote(tokenizer_info)

    def _zygote_now(self) -> _Zygote:
        with self._lock:
            if not self._zygote.alive():  # killed from outside, or out of memory: start another
                self._zygote.close()
                self._zygote = _Zygote(self._info)
            return self._zygote

    def _refill(self) -> None:
        """Fork a worker to keep warm, if none is (best effort: the next compile forks one otherwise)."""
        with self._lock:
            if self._closed or self._idle or not self._zygote.ready:
                return
        with contextlib.suppress(Exception):
            worker = _Worker(self._zygote_now(), lambda: False)
            self._give_back(worker)

    def _take(self, cancelled: Callable[[], bool]) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Worker(self._zygote_now(), cancelled)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.KEEP_IDLE:
                self._idle.append(worker)
                return
        worker.close()

    def run(self, kind: str, text: str, timeout_s: float, cancelled: Callable[[], bool],
            field: str | None = None, name: str | None = None) -> float:
        """Compile ``text`` as a ``kind`` format in a worker (blocking this thread): the seconds it took. Raises
        :class:`~ctx_integrations.errors.FormatCompileTimeoutError` past ``timeout_s``, :class:`CompileCancelled`
        as soon as ``cancelled()`` is true, ``InvalidStructuredOutputError`` for a format xgrammar refuses; the
        worker is killed in the first two cases. ``name``: the format's kind as the user gave it (for messages)."""
        name = name or kind
        worker = self._take(cancelled)
        with self._lock:
            self._busy.add(worker)
        try:
            worker.start_up(cancelled)
            worker.conn.send((kind, text))
            if not worker.wait(timeout_s, cancelled):
                raise FormatCompileTimeoutError(
                    f"the {name} format did not compile within {timeout_s:g} s (format_compile_timeout_s; "
                    f"--format-compile-timeout-s on the server); the compile was stopped: send a simpler format "
                    f"(fewer enum values, properties or alternatives), or raise the limit, e.g. "
                    f"Engine(format_compile_timeout_s={2 * timeout_s:g})", field)
            status, value = worker.recv()
        except BaseException:
            worker.kill()
            self._refill()
            raise
        finally:
            with self._lock:
                self._busy.discard(worker)
        self._give_back(worker)
        if status == "error":
            raise InvalidStructuredOutputError(f"the {name} format cannot be compiled: {value}", field)
        return float(value)

    def workers(self) -> dict[str, list[int]]:
        """The process ids of the workers, ``{"idle": [...], "busy": [...]}`` (for tests and diagnostics)."""
        with self._lock:
            return {"idle": [w.pid for w in self._idle if w.pid], "busy": [w.pid for w in self._busy if w.pid]}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()
        self._zygote.close()


_POOLS: dict[str, CompilePool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(tokenizer_info: str) -> CompilePool:
    """The process's pool for this vocabulary (xgrammar's ``TokenizerInfo.serialize_json()``), shared by every model
    with the same one."""
    key = hashlib.sha256(tokenizer_info.encode()).hexdigest()
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = CompilePool(tokenizer_info)
        return _POOLS[key]
