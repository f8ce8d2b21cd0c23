"""``ctx-experts ask`` prints the answer as it is decoded (issue 5: it printed nothing until the whole answer was
done); ``--no-stream`` prints it whole, with the same text; ``--json`` stays one whole JSON document.

The store holds three passages embedded with the shipped MiniLM; the LLM is a tiny random model saved to a folder
(``--model``), in float32 so that greedy answers are the same from one run to the next.
"""

from __future__ import annotations

import io
import json
import sys
import threading

import pytest

from ctx_integrations import DEFAULT_MODE
from ctx_integrations.engine.core.handle import AnswerHandle, Pieces
from ctx_integrations.retrieval import DocumentStore
from tests.helpers import run_cli, tiny_loaded

PASSAGES = ["The vault code is 4721.", "The vault is in the cellar of the old mill.", "The mill has two wheels."]
QUESTION = "What is the vault code?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ask")
    DocumentStore(root / "store").add([{"id": f"p{i}", "text": t} for i, t in enumerate(PASSAGES)], warm=False)
    loaded = tiny_loaded("llama")
    loaded.model.save_pretrained(root / "model")
    loaded.tokenizer.save_pretrained(root / "model")
    return root


def ask(setup, *extra: str) -> int:
    return run_cli("--dtype", "float32", "ask", QUESTION, "--store", str(setup / "store"), "--model",
                   str(setup / "model"), "--max-new-tokens", "12", "--top-k", "2", *extra)


class Recorder(io.StringIO):
    """stdout that lets another thread wait until something more was written."""

    def __init__(self):
        super().__init__()
        self.written = threading.Condition()

    def write(self, text: str) -> int:
        with self.written:
            count = super().write(text)
            self.written.notify_all()
        return count


def watch_pieces(monkeypatch) -> tuple[Recorder, list[bool]]:
    """stdout replaced by a :class:`Recorder`, and every piece an answer handle's sync reader (``AnswerHandle.stream``,
    under ``Engine.stream``) is given held on the decoder's thread, after each piece with text, until stdout has
    grown: the list records, per piece, whether it was printed while decoding was held there (``False``: it did not
    show up within 10 s). It stays empty when ``ask`` read no stream, i.e. printed the answer only at the end.
    (Called in the test itself: pytest's capture sets ``sys.stdout`` again between a fixture's setup and the
    test.)"""
    out, seen = Recorder(), []
    monkeypatch.setattr(sys, "stdout", out)
    original_stream, original_push = AnswerHandle.stream, Pieces.push

    def stream(self):
        self._pieces.watched = True  # before the request is queued: Engine.stream starts it at the first read
        return original_stream(self)

    def push(self, piece: str) -> None:
        with out.written:
            before = len(out.getvalue())
        original_push(self, piece)
        if getattr(self, "watched", False) and piece.strip():
            with out.written:
                seen.append(out.written.wait_for(lambda: len(out.getvalue()) > before, timeout=10))

    monkeypatch.setattr(AnswerHandle, "stream", stream)
    monkeypatch.setattr(Pieces, "push", push)
    return out, seen


def answer_text(printed: str, mode: str = DEFAULT_MODE) -> str:
    """The text after ``[mode] `` up to the citations line."""
    return printed.split(f"\n[{mode}] ", 1)[1].split("\n    cited: ", 1)[0]


def test_ask_prints_each_piece_while_the_answer_is_being_decoded(setup, monkeypatch):
    out, seen = watch_pieces(monkeypatch)
    assert ask(setup) == 0
    assert seen and all(seen), seen
    printed = out.getvalue()
    assert printed.startswith("sources (retrieved in ") and f"\n[{DEFAULT_MODE}] " in printed and "TTFT " in printed


@pytest.mark.parametrize("mode", ["pced", "rapid", "map_reduce"])  # rapid emits whole drafts at once
def test_no_stream_prints_the_same_answer_once_it_is_done(setup, monkeypatch, mode):
    out, seen = watch_pieces(monkeypatch)
    assert ask(setup, "--mode", mode) == 0
    streamed = out.getvalue()
    out.seek(0)
    out.truncate()
    streamed_pieces = len(seen)
    assert ask(setup, "--mode", mode, "--no-stream") == 0
    assert streamed_pieces and len(seen) == streamed_pieces and all(seen)  # only the first run streamed
    whole = out.getvalue()
    assert answer_text(whole, mode) == answer_text(streamed, mode) and answer_text(whole, mode).strip()
    sources = [text.split(f"\n[{mode}] ")[0].split("\n", 1)[1] for text in (whole, streamed)]
    assert sources[0] == sources[1] and sources[0].startswith("  1. p0")


def test_json_stays_one_whole_document(setup, monkeypatch):
    out, seen = watch_pieces(monkeypatch)
    assert ask(setup, "--json") == 0
    answer = json.loads(out.getvalue())
    assert seen == [] and answer["question"] == QUESTION and answer["mode"] == DEFAULT_MODE and answer["text"]
