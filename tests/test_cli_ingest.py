"""``ctx-experts ingest`` for scripts and humans: every text file read whatever its name, binary files refused
by content and named, each file or folder not read listed with its reason (stderr and ``--json``), an unreadable
folder's passages kept, links out of the folder followed only with ``--follow-symlinks``, a non-zero exit when
nothing was ingested, pypdf's warnings kept out, progress bars.

Runs with ``--no-cache`` (the LLM's tokenizer sizes passages; no model is loaded) and the embedded MiniLM, but
for one test: caches ingested with the engine flags are the ones ``ask`` with the same flags reads (embedded LLM).
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import re
from pathlib import Path

import pytest

from ctx_integrations.errors import EmptyDocumentsError
from ctx_integrations.retrieval import DocumentStore
from ctx_integrations.retrieval.ingest import ingest
from ctx_integrations.retrieval.reading import BinaryFileError, read_document
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
    assert "note:" not in capfd.readouterr().err
    assert ask_misses("int8") == 1  # another format's folder: the test can tell the two apart

    # ask with settings the store was not ingested with: said once, and what it computes is kept
    assert run_cli("--disk-format", "bf16", "--dtype", "float32", "ask", question, "--store", str(store),
                   "--mode", "pced", "--top-k", "1", "--max-new-tokens", "1") == 0
    err = capfd.readouterr().err
    assert err.count("note: 1 of the 1 passages retrieved have no KV cache") == 1, err
    assert f"`ctx-experts ingest PATH --store {store}`" in err
    assert ask_misses("bf16") == 0 and "note:" not in capfd.readouterr().err  # stored by the ask before


# -- what is read, what is not, and why ----------------------------------------------------------------------
MIT = ("Permission is hereby granted, free of charge, to any person obtaining a copy of this software, to deal in "
       "the Software without restriction.")


@pytest.fixture
def project(tmp_path):
    """A folder as users have them: text files without a .txt / .md / .pdf suffix, other encodings, binaries, a
    hidden folder."""
    folder = tmp_path / "project"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (folder / "LICENSE").write_text(f"MIT License\n\n{MIT}\n")
    (folder / "README").write_text("Quillby's harbour tools.\n")
    (folder / "copyright").write_text("Copyright 2024 the Quillby harbour office.\n")
    (folder / "notes.rst").write_text("Notes\n=====\n\nThe lighthouse was built in 1871.\n")
    (folder / "legacy.txt").write_bytes("Crème brûlée at the Quillby café.\n".encode("cp1252"))
    (folder / "windows.txt").write_bytes(codecs.BOM_UTF16_LE + "Saved by Notepad as UTF-16.".encode("utf-16-le"))
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (folder / "noise.dat").write_bytes(bytes(range(128, 256)) * 16)
    return folder


def test_cli_ingest_reads_every_text_file_and_lists_each_skip_with_its_reason(project, tmp_path, capfd):
    """Bug caught: ``ingest FOLDER`` read 1 of 26 files and exited 0 with ``"skipped": []``: LICENSE, README,
    copyright (no .txt / .md / .pdf suffix) were dropped without a word."""
    store = tmp_path / "store"
    assert run_cli("ingest", str(project), "--store", str(store), "--no-cache", "--json") == 0
    out, err = capfd.readouterr()
    report = json.loads(out)
    assert report["files"] == 6 and report["passages"] == 6
    reasons = {Path(item["path"]).name: item["reason"] for item in report["skipped"]}
    assert set(reasons) == {".git", "logo.png", "noise.dat"}
    assert reasons[".git"].startswith("hidden")
    assert reasons["logo.png"].startswith("BinaryFileError: ") and "NUL bytes" in reasons["logo.png"]
    assert reasons["noise.dat"].startswith("BinaryFileError: ") and "no other text encoding" in reasons["noise.dat"]
    for item in report["skipped"]:
        assert f"skipped {item['path']}: {item['reason']}" in err
    texts = {Path(doc.metadata["source"]).name: doc.text for doc in DocumentStore(store).all_documents()}
    assert set(texts) == {"LICENSE", "README", "copyright", "notes.rst", "legacy.txt", "windows.txt"}
    assert texts["legacy.txt"] == "Crème brûlée at the Quillby café." and texts["windows.txt"].startswith("Saved")

    assert run_cli("ingest", str(project), "--store", str(tmp_path / "human"), "--no-cache") == 0
    out, err = capfd.readouterr()
    assert out.startswith("ingested 6 files, 3 skipped (listed on stderr) into ")
    assert [line.split(":")[0] for line in err.splitlines() if line.startswith("skipped ")] == [
        f"skipped {project / name}" for name in (".git", "logo.png", "noise.dat")]


def test_cli_reingest_with_an_unreadable_folder_keeps_its_passages(tmp_path, capfd, monkeypatch):
    """Bug caught: re-ingesting a folder in which one sub-folder had become unreadable removed that sub-folder's
    passages and exited 0 (``removed: 3``, ``skipped: []``, store 6 -> 3)."""
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    (corpus / "sub").mkdir(parents=True)
    for i in range(3):
        (corpus / f"top{i}.txt").write_text(f"Top file number {i}.")
        (corpus / "sub" / f"inner{i}.txt").write_text(f"Inner file number {i}.")
    assert run_cli("ingest", str(corpus), "--store", str(store), "--no-cache", "--json") == 0
    assert json.loads(capfd.readouterr().out)["added"] == 6

    real = os.scandir

    def scandir(path="."):  # what the kernel answers a user without the right to list it (root ignores chmod)
        if Path(path) == corpus / "sub":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert run_cli("ingest", str(corpus), "--store", str(store), "--no-cache", "--json") == 0
    report = json.loads(capfd.readouterr().out)
    assert DocumentStore(store).count() == 6 and (report["removed"], report["unchanged"]) == (0, 3)
    assert report["kept"] == 3 and [item["path"] for item in report["skipped"]] == [str(corpus / "sub")]
    assert "PermissionError" in report["skipped"][0]["reason"]
    assert run_cli("ingest", str(corpus), "--store", str(store), "--no-cache") == 0
    out, err = capfd.readouterr()
    assert "0 removed, 3 kept (not read this time)" in out and f"skipped {corpus / 'sub'}: cannot be read" in err


def test_cli_ingest_follows_links_out_of_the_folder_only_when_asked(tmp_path, capfd):
    """Bug caught: a link in the folder to a file outside it (a password file in the issue) was stored."""
    corpus, outside = tmp_path / "corpus", tmp_path / "outside.txt"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("The lighthouse of Quillby was built in 1871.")
    outside.write_text("The vault code is 4721.")
    (corpus / "passwd.txt").symlink_to(outside)
    assert run_cli("ingest", str(corpus), "--store", str(tmp_path / "store"), "--no-cache", "--json") == 0
    out, err = capfd.readouterr()
    assert all("4721" not in doc.text for doc in DocumentStore(tmp_path / "store").all_documents())
    report = json.loads(out)
    assert report["files"] == 1 and [item["path"] for item in report["skipped"]] == [str(corpus / "passwd.txt")]
    assert "outside" in report["skipped"][0]["reason"] and "--follow-symlinks" in err

    assert run_cli("ingest", str(corpus), "--store", str(tmp_path / "store"), "--no-cache", "--json",
                   "--follow-symlinks") == 0
    report = json.loads(capfd.readouterr().out)
    assert (report["files"], report["skipped"]) == (2, [])
    assert any("4721" in doc.text for doc in DocumentStore(tmp_path / "store").all_documents())


def test_cli_ingest_takes_file_names_that_are_not_utf8(tmp_path, capfd):
    """Bug caught: a name that is not UTF-8 aborted ingest with chromadb's untyped ``InvalidArgumentError``
    (exit 1, 2 of 3 files stored)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    try:
        (corpus / os.fsdecode(b"caf\xe9.txt")).write_text("The caf\u00e9 opens at nine.")
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    (corpus / "a.txt").write_text("First file.")
    (corpus / "z.txt").write_text("Last file.")
    assert run_cli("ingest", str(corpus), "--store", str(tmp_path / "store"), "--no-cache", "--json") == 0
    report = json.loads(capfd.readouterr().out)
    assert (report["files"], report["added"], report["skipped"]) == (3, 3, [])
    sources = {doc.metadata["source"] for doc in DocumentStore(tmp_path / "store").all_documents()}
    assert f"{corpus}/caf\\xe9.txt" in sources
