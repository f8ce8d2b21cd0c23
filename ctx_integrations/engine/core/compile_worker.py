"""The process side of :mod:`~ctx_integrations.engine.core.compile_pool`: compiles formats with xgrammar, told what.

Kept free of the rest of the library (xgrammar and the standard library only), so a worker loads nothing else.
:func:`build` is also what the engine's own process runs to build a format.
"""

from __future__ import annotations

import time
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
    """The worker's entry point (``python -c``): serve the socket ``fd``, whose first message is the vocabulary."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    try:
        tokenizer_info = conn.recv()
    except (EOFError, OSError):  # the engine's process closed (or replaced) this worker before it started
        return
    serve(conn, tokenizer_info)


def serve(conn: Any, tokenizer_info: str) -> None:
    """Answer ``(kind, text)`` requests on ``conn`` until it closes: ``("ok", seconds)`` once the format has
    compiled (the compiled format is not sent back; see ``compile_pool``), ``("error", message)`` for a format
    xgrammar refuses. ``("ready", None)`` is sent first, once the vocabulary is loaded."""
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    conn.send(("ready", None))
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
