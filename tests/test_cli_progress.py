"""Progress while KV caches are computed (issue 5): ``Engine.warm(progress=...)`` reports each batched forward from
the scheduler's thread, :class:`~ctx_integrations.progress.Progress` prints the counts from its own thread (a tqdm
bar on a terminal, plain lines elsewhere), and ``ctx-experts ingest`` shows them on a stderr that is not a terminal.

Before: 20-35 s of silence after "embedding 100%", and nothing at all when stderr was not a terminal.
"""

from __future__ import annotations

import io
import re
import threading
import time

import pytest

from ctx_integrations.engine.core.engine import Engine
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.progress import Progress, terminal_only_bars
from tests.helpers import run_cli, tiny_loaded

DOCS = [f"Passage {i}: the lighthouse keeper number {i} kept the lamp lit for {i + 3} winters." for i in range(5)]


class Stream(io.StringIO):
    """A stderr stand-in that says whether it is a terminal."""

    def __init__(self, terminal: bool = False):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


# -- the engine reports its progress -------------------------------------------------------------------------
def test_warm_reports_each_batched_forward_from_the_scheduler_thread(tmp_path):
    engine = Engine(tiny_loaded(), cache_dir=tmp_path / "kv")
    engine.store.batch_tokens = 1  # one document per batched forward: one report each
    engine.warm(DOCS[:1])  # one cache there already: counted as done from the first report on
    calls: list[tuple[int, int, str]] = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total, threading.current_thread().name))

    counts = engine.warm(DOCS, progress=progress)
    assert counts["misses"] == 4 and counts["hits"] == 1
    assert [(done, total) for done, total, _ in calls] == [(2, 5), (3, 5), (4, 5), (5, 5)]
    assert all(name != threading.current_thread().name for _, _, name in calls)  # the scheduler's, not ours


def test_warm_counts_a_text_given_twice_as_two_documents(tmp_path):
    engine = Engine(tiny_loaded(), cache_dir=tmp_path / "kv")
    calls: list[tuple[int, int]] = []
    engine.warm([DOCS[0], DOCS[1], DOCS[0]], progress=lambda done, total: calls.append((done, total)))
    assert calls == [(3, 3)]  # one batched forward; both copies have their cache after it


def test_warm_refuses_a_progress_that_is_not_callable(tmp_path):
    engine = Engine(tiny_loaded(), cache_dir=None)
    with pytest.raises(InvalidOptionError, match="progress must be a callable taking"):
        engine.warm(DOCS, progress=5)


# -- Progress prints from its own thread -------------------------------------------------------------------
def test_plain_lines_when_stderr_is_not_a_terminal():
    out = Stream(terminal=False)
    with Progress("kv caches", "document", file=out, every_s=0.05) as progress:
        progress.update(0, 3)
        time.sleep(0.3)  # a line at the start ...
        progress.update(1, 3)
        time.sleep(0.3)  # ... one every every_s while it runs ...
        progress.update(3)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()  # no carriage returns piling up in a log file
    assert lines[0] == "kv caches: 0/3 documents, 0 s"
    assert any(re.fullmatch(r"kv caches: 1/3 documents, [01] s", line) for line in lines)
    assert re.fullmatch(r"kv caches: 3/3 documents, [01] s", lines[-1])  # ... and one when it ends
    assert sum(line.startswith("kv caches: 3/3") for line in lines) == 1


def test_a_step_given_its_total_counts_time_from_the_start_of_the_block():
    """Embedding reports after each batch: a one-batch step's only count comes at its end, and its line must say
    how long it took, not 0 s."""
    out = Stream(terminal=False)
    with Progress("embedding", "passage", 2, file=out) as progress:
        time.sleep(1.2)
        progress.advance(2)
    assert out.getvalue() == "embedding: 2/2 passages, 1 s\n"


def test_a_step_that_never_starts_prints_nothing():
    out = Stream(terminal=False)
    with Progress("kv caches", "document", file=out):
        pass
    assert out.getvalue() == ""


def test_a_bar_on_a_terminal_and_nothing_when_switched_off():
    terminal = Stream(terminal=True)
    with Progress("kv caches", "document", file=terminal) as progress:
        progress.update(2, 4)
    assert "kv caches" in terminal.getvalue() and "\r" in terminal.getvalue()  # tqdm's bar
    quiet = Stream(terminal=True)
    with Progress("kv caches", "document", file=quiet, show=False) as progress:
        progress.update(2, 4)
    assert quiet.getvalue() == ""


def test_counting_never_waits_for_a_blocked_stderr():
    """The counts come from the engine's scheduler thread: a stderr that blocks (a full pipe, a paused terminal)
    must hold up only Progress's own thread, never the thread that reports."""
    release = threading.Event()

    class Blocked(Stream):
        def write(self, text: str) -> int:
            release.wait(10)
            return super().write(text)

    out = Blocked()
    with Progress("kv caches", "document", file=out, every_s=0.0) as progress:
        progress.update(0, 100)
        time.sleep(0.2)  # the rendering thread is now stuck in write
        started = time.perf_counter()
        for done in range(1, 101):
            progress.update(done)
        counting_s = time.perf_counter() - started
        release.set()
    assert counting_s < 0.5
    assert out.getvalue().splitlines()[-1].startswith("kv caches: 100/100 documents")


# -- ctx-experts ingest --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    loaded = tiny_loaded("llama")
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(DOCS[:3]):
        (folder / f"note{i}.txt").write_text(text)
    return folder


def test_ingest_prints_kv_cache_lines_when_stderr_is_not_a_terminal(corpus, model_folder, tmp_path, capfd):
    assert run_cli("ingest", str(corpus), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "kv"),
                   "--model", str(model_folder)) == 0
    out, err = capfd.readouterr()
    assert "kv caches: 0/3 documents, " in err and "kv caches: 3/3 documents, " in err
    assert "embedding: 3/3 passages, " in err and "reading: 3/3 files, " in err
    assert "\r" not in err and "kv caches" not in out
    assert out.startswith("ingested 3 files into ") and "KV caches: 3 computed" in out


def test_ingest_no_progress_prints_none(corpus, model_folder, tmp_path, capfd):
    assert run_cli("ingest", str(corpus), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "kv"),
                   "--model", str(model_folder), "--no-progress") == 0
    out, err = capfd.readouterr()
    assert err == "" and "KV caches: 3 computed" in out


def test_loading_a_model_shows_transformers_bars_only_on_a_terminal(model_folder, capfd):
    from transformers.utils import logging as hf_logging

    from ctx_integrations.engine.core.model import load_model

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process (another test may have turned them off)
    try:
        load_model(str(model_folder), device="cpu")
        assert "Loading weights" not in capfd.readouterr().err  # stderr is not a terminal here
        assert hf_logging.is_progress_bar_enabled()  # restored for the caller's own bars
        with terminal_only_bars(Stream(terminal=True)):
            assert hf_logging.is_progress_bar_enabled()
        with terminal_only_bars(Stream(terminal=False)):
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_loading_the_embedder_shows_no_bars_off_a_terminal(capfd):
    from transformers.utils import logging as hf_logging

    from ctx_integrations.retrieval.embedders import TransformerEmbedder, minilm_dir

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        TransformerEmbedder(minilm_dir()).embed_documents(["a passage"])
        assert "Loading weights" not in capfd.readouterr().err  # stderr is not a terminal here
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
