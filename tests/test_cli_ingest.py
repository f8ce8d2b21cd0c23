"""``ctx-experts ingest`` for scripts and humans: binary files refused by name, skipped files counted as
skipped, a non-zero exit when nothing was ingested, pypdf's warnings kept out, ``--json``, progress bars.

Runs with ``--no-cache`` (the LLM's tokenizer sizes passages; no model is loaded) and the embedded MiniLM, but
for one test: caches ingested with the engine flags are the ones ``ask`` with the same flags reads (embedded LLM).
"""

from __future__ import annotations

import json
import re

import pytest

from ctx_integrations.errors import EmptyDocumentsError
from ctx_integrations.retrieval import DocumentStore
from ctx_integrations.retrieval.ingest import BinaryFileError, ingest, read_document
from tests.helpers import run_cli
from tests.test_retrieval_ingest import minimal_pdf


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.txt").write_text("The lighthouse of Quillby was built in 1871.")
    (folder / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    broken = re.sub(rb"startxref\n\d+", b"startxref\n99", minimal_pdf(["The bakery opened in 1820."]))
    (folder / "report.pdf").write_bytes(broken)  # readable, but pypdf warns about the xref pointer
    return folder


def test_binary_content_in_a_text_file_is_refused_by_name(docs):
    with pytest.raises(BinaryFileError, match=r"image\.txt has binary content") as raised:
        read_document(docs / "image.txt")
    assert isinstance(raised.value, EmptyDocumentsError) and isinstance(raised.value, ValueError)


def test_ingest_counts_skipped_files_as_skipped(docs, tmp_path):
    report = ingest(DocumentStore(tmp_path / "store"), [docs], words, 64, warm=False, progress=False)
    assert report.files == 2 and report.passages == 2  # notes.txt and report.pdf; image.txt is not a file read
    assert [(path.name, reason.split(":")[0]) for path, reason in report.skipped] == [("image.txt", "BinaryFileError")]
    data = report.as_dict()
    assert data["files"] == 2 and data["skipped"][0]["path"].endswith("image.txt")


def test_cli_ingest_json_names_the_skipped_file_and_keeps_pypdf_quiet(docs, tmp_path, capfd):
    assert run_cli("ingest", str(docs), "--store", str(tmp_path / "store"), "--no-cache", "--json") == 0
    out, err = capfd.readouterr()
    report = json.loads(out)
    assert (report["files"], report["passages"], report["added"]) == (2, 2, 2)
    assert [item["path"] for item in report["skipped"]] == [str(docs / "image.txt")]
    assert f"skipped {docs / 'image.txt'}: BinaryFileError" in err
    assert "startxref" not in out + err and "pypdf" not in out + err  # pypdf's repair warnings stay out


def test_cli_ingest_exits_non_zero_when_nothing_was_ingested(docs, tmp_path, capfd):
    assert run_cli("ingest", str(docs / "image.txt"), "--store", str(tmp_path / "store"), "--no-cache") == 2
    out, err = capfd.readouterr()
    assert "ingested 0 files, 1 skipped" in out
    assert "error: nothing was ingested" in err and "every file was skipped" in err


def test_progress_bars_go_to_stderr_when_asked(docs, tmp_path, capfd):
    assert run_cli("ingest", str(docs / "notes.txt"), "--store", str(tmp_path / "store"), "--no-cache",
                   "--progress") == 0
    out, err = capfd.readouterr()
    assert "reading" in err and "embedding" in err and "passage" in err
    assert out.startswith("ingested 1 files into") and "reading" not in out


def test_cli_ingest_writes_caches_where_cache_dir_says_and_reports_the_folder(docs, tmp_path, capfd):
    """Bugs caught: ``--cache-dir`` ignored (caches land in a folder ``serve --cache-dir`` does not read), or
    the default folder differing from the store's own, which ``serve`` and the Ray app use by default."""
    store = tmp_path / "store"
    assert run_cli("ingest", str(docs / "notes.txt"), "--store", str(store), "--no-cache", "--json") == 0
    assert json.loads(capfd.readouterr().out)["kv_dir"] == str(DocumentStore(store).kv_dir)
    assert run_cli("ingest", str(docs / "notes.txt"), "--store", str(store), "--no-cache", "--json",
                   "--cache-dir", str(tmp_path / "kv")) == 0
    assert json.loads(capfd.readouterr().out)["kv_dir"] == str(tmp_path / "kv")


def test_caches_ingested_with_the_engine_flags_are_the_ones_ask_reads(docs, tmp_path, capfd):
    """Bug caught: ``ingest`` building its engine without ``--disk-format`` / ``--dtype`` / ``--threads``: its
    caches landed in the native folder, and an ``ask`` with the same flags computed every passage again."""
    store, question = tmp_path / "store", "When was the lighthouse of Quillby built?"
    assert run_cli("--disk-format", "fp16", "--dtype", "float32", "ingest", str(docs / "notes.txt"), "--store",
                   str(store), "--json") == 0
    assert json.loads(capfd.readouterr().out)["cache_misses"] == 1

    def ask_misses(disk_format: str) -> int:
        assert run_cli("--disk-format", disk_format, "--dtype", "float32", "ask", question, "--store", str(store),
                       "--mode", "pced", "--top-k", "1", "--max-new-tokens", "1", "--json") == 0
        return json.loads(capfd.readouterr().out)["cache"]["misses"]

    assert ask_misses("fp16") == 0  # what ingest computed
    assert ask_misses("int8") == 1  # another format's folder: the test can tell the two apart
