"""The process side of :mod:`~ctx_integrations.engine.core.compile_pool`: a zygote that forks compile workers.

The zygote (``python -c``, :func:`main`) imports xgrammar and reads the vocabulary once, then forks a worker for
each socket the engine's process passes it (``SCM_RIGHTS``); the worker (:func:`serve`) compiles what it is sent on
that socket. The zygote never compiles (it runs no thread of its own: forking it is safe), so a worker killed in
the middle of a compile is replaced by a fork, in milliseconds, instead of a new interpreter importing xgrammar
and torch, in seconds. Kept free of the rest of the library (xgrammar and the standard library only).
:func:`build` is also what the engine's own process runs to build a format.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import xgrammar

# (kind, text): what xgrammar is asked to compile; "json_object" is a JSON schema compiled without strict mode
KINDS = ("json", "json_object", "regex", "grammar", "structural_tag")


def build(compiler: Any, kind: str, text: str) -> Any:
    """``text`` compiled by ``compiler`` (an ``xgrammar.GrammarCompiler``) as a format of ``kind`` (:data:`KINDS`)."""
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(text)


def main(fd: int) -> None:
    """The zygote (``python -c``): the socket ``fd``'s first message is the vocabulary (xgrammar's
    ``TokenizerInfo.serialize_json()``); it answers ``("ready", None)``, then forks one worker per file descriptor
    passed to it, until the socket closes."""
    control = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    try:
        info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):  # the engine's process closed (or replaced) the zygote before it started
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the system
    conn.send(("ready", None))
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not message:
            return
        for channel in fds:
            if os.fork() == 0:
                try:
                    control.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    serve(Connection(channel), info)
                finally:
                    os._exit(0)
            os.close(channel)


def serve(conn: Any, info: Any) -> None:
    """A worker: send ``("ready", pid)``, then answer ``(kind, text)`` requests on ``conn`` until it closes:
    ``("ok", seconds)`` once the format has compiled (the compiled format is not sent back; see
    ``compile_pool``), ``("error", message)`` for a format xgrammar refuses."""
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        started = time.perf_counter()
        try:
            build(compiler, kind, text)
        except Exception as error:  # xgrammar's refusals: RuntimeError, ValueError, its own error types
            conn.send(("error", str(error)))
        else:
            conn.send(("ok", time.perf_counter() - started))
