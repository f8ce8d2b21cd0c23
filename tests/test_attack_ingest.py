"""Attack suite for ingestion: corpora built to make ``ingest`` lose stored passages, read outside the corpus,
crash on a file name, store garbage, hang on a pipe, or take quadratic time (the reliability issue, item 4).

Each case runs the library's ``ingest`` on a small folder with a hash embedder (no model) and a word counter,
and names the bug it caught on 23c3a65, where it fails. The command line's report of the same cases (human and
``--json``) is checked in tests/test_cli_ingest.py.

Unreadable folders: the suite may run as root, whom ``chmod 000`` does not stop, so a folder is made unreadable
by ``os.scandir`` raising the ``PermissionError`` the kernel gives a user without the right; one test uses a
real ``chmod 000`` and is skipped as root.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import random
import zlib
from pathlib import Path

import pytest

from ctx_integrations.errors import InvalidDocumentError
from ctx_integrations.retrieval import DocumentStore
from ctx_integrations.retrieval.ingest import ingest, split_passages
from tests.test_core_cache import HashEmbedder


def words(text: str) -> int:
    return len(text.split())


def run(store: DocumentStore, paths: list[Path], **options):
    return ingest(store, paths, words, 64, warm=False, progress=False, **options)


def sources(store: DocumentStore) -> set[str]:
    return {doc.metadata["source"] for doc in store.all_documents()}


def stored_text(store: DocumentStore) -> str:
    return "\n".join(doc.text for doc in store.all_documents())


@pytest.fixture
def store(tmp_path) -> DocumentStore:
    return DocumentStore(tmp_path / "store", embedder=HashEmbedder())


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Three files at the top and three in ``sub``: six passages."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(3):
        (root / f"top{i}.txt").write_text(f"Top file number {i} of the corpus.")
        (root / "sub" / f"inner{i}.txt").write_text(f"Inner file number {i} of the corpus.")
    return root


def unreadable(monkeypatch, *folders: Path) -> None:
    """``os.scandir`` of these folders fails as for a user without the right to list them."""
    real, refused = os.scandir, set(folders)

    def scandir(path="."):
        if Path(path) in refused:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


# -- folders that cannot be read -------------------------------------------------------------------------------
def test_a_folder_that_cannot_be_listed_keeps_its_passages_and_is_reported(store, corpus, monkeypatch):
    """Bug caught: re-ingesting with ``sub`` unreadable removed its three passages (``removed: 3``, store 6 -> 3)
    and reported nothing (``skipped: []``): a folder that could not be listed looked like an emptied one."""
    assert run(store, [corpus]).added == 6
    unreadable(monkeypatch, corpus / "sub")
    report = run(store, [corpus])
    assert store.count() == 6 and (report.files, report.unchanged, report.removed) == (3, 3, 0)
    assert report.kept == 3
    [(path, reason)] = report.skipped
    assert path == corpus / "sub" and "PermissionError" in reason and "kept" in reason


def test_a_first_ingest_reports_a_folder_it_cannot_list(tmp_path, corpus, monkeypatch):
    """Bug caught: a first ingest said nothing about the folder it could not read (``skipped: []``)."""
    unreadable(monkeypatch, corpus / "sub")
    report = run(DocumentStore(tmp_path / "fresh", embedder=HashEmbedder()), [corpus])
    assert report.files == 3 and [path for path, _ in report.skipped] == [corpus / "sub"]


def test_an_unreadable_corpus_root_removes_nothing(store, corpus, monkeypatch):
    """The folder given itself cannot be listed: all six passages stay, and it is the one entry reported."""
    run(store, [corpus])
    unreadable(monkeypatch, corpus)
    report = run(store, [corpus])
    assert store.count() == 6 and (report.files, report.removed) == (0, 0) and report.kept == 6
    assert [path for path, _ in report.skipped] == [corpus]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root lists a chmod 000 folder (the cases above refuse the listing the same way); "
                           "`unshare -U` runs the suite as an unprivileged user")
def test_a_chmod_000_folder_keeps_its_passages(store, corpus):
    run(store, [corpus])
    (corpus / "sub").chmod(0)
    try:
        report = run(store, [corpus])
    finally:
        (corpus / "sub").chmod(0o755)
    assert report.removed == 0 and store.count() == 6
    assert report.kept == 3 and [path for path, _ in report.skipped] == [corpus / "sub"]


# -- symbolic links --------------------------------------------------------------------------------------------
@pytest.fixture
def linked(tmp_path, corpus) -> Path:
    """``corpus`` with links out of it (to a file, relative, to a folder) and one to a file inside it."""
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "secret.txt").write_text("The vault code is 4721.")
    (outside / "folder" / "more.txt").write_text("The safe code is 9931.")
    (corpus / "secret.txt").symlink_to(outside / "secret.txt")
    (corpus / "sub" / "relative").symlink_to(Path("..") / ".." / "outside" / "secret.txt")
    (corpus / "elsewhere").symlink_to(outside / "folder", target_is_directory=True)
    (corpus / "alias.txt").symlink_to(corpus / "top0.txt")
    return corpus


def test_symbolic_links_leaving_the_corpus_are_refused_and_reported(store, linked):
    """Bug caught: a link inside the corpus to a file outside it (a password file in the issue) was followed
    and its content stored as passages that anyone asking the store could retrieve."""
    report = run(store, [linked])
    assert "4721" not in stored_text(store) and "9931" not in stored_text(store)
    refused = {path: reason for path, reason in report.skipped}
    assert set(refused) == {linked / "secret.txt", linked / "sub" / "relative", linked / "elsewhere"}
    assert all("outside" in reason and "--follow-symlinks" in reason for reason in refused.values())
    assert str(linked / "alias.txt") in sources(store)  # a link staying inside is read under its own name
    assert report.files == 7


def test_follow_symlinks_reads_what_the_links_point_to(store, linked):
    report = run(store, [linked], follow_symlinks=True)
    assert "4721" in stored_text(store) and "9931" in stored_text(store) and report.skipped == []
    assert str(linked / "elsewhere" / "more.txt") in sources(store)  # stored under the path the link gives


def test_refusing_a_link_later_keeps_what_it_stored(store, linked):
    """A link followed once and refused the next time is not 'gone': its passages stay, counted as kept."""
    run(store, [linked], follow_symlinks=True)
    report = run(store, [linked])
    assert (report.removed, report.kept) == (0, 3)


def test_link_loops_broken_links_and_pipes_end_and_are_reported(store, corpus):
    """Bug caught: a broken link or a pipe (``pipe.txt``) was dropped without a word; a pipe, if read, hangs."""
    (corpus / "sub" / "up").symlink_to(corpus, target_is_directory=True)  # a loop when followed
    (corpus / "gone.txt").symlink_to(corpus / "missing.txt")
    (corpus / "self.txt").symlink_to(corpus / "self.txt")
    os.mkfifo(corpus / "pipe.txt")
    for follow in (False, True):
        report = run(store, [corpus], follow_symlinks=follow)
        reasons = dict(report.skipped)
        assert report.files == 6 and set(reasons) == {corpus / name for name in ("sub/up", "gone.txt", "self.txt",
                                                                                   "pipe.txt")}
        assert "cannot be reached" in reasons[corpus / "gone.txt"] and "not a regular file" in reasons[corpus /
                                                                                                      "pipe.txt"]
        assert ("contains it" if follow else "inside the corpus") in reasons[corpus / "sub" / "up"]


# -- file names that are not UTF-8 -----------------------------------------------------------------------------
def test_file_names_that_are_not_utf8_are_stored_with_their_bytes_escaped(store, corpus):
    """Bug caught: a name that is not UTF-8 aborted the whole ingest with chromadb's untyped
    ``InvalidArgumentError`` (exit 1, part of the folder stored)."""
    try:
        (corpus / os.fsdecode(b"caf\xe9.txt")).write_text("A name in Latin-1.")
        (corpus / os.fsdecode(b"caf\xe8.txt")).write_text("Another name in Latin-1.")
        (corpus / "sub" / os.fsdecode(b"bin\xff.txt")).write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    report = run(store, [corpus])
    assert (report.files, report.passages) == (8, 8)
    assert {f"{corpus}/caf\\xe9.txt", f"{corpus}/caf\\xe8.txt"} <= sources(store)
    data = json.loads(json.dumps(report.as_dict()))
    assert [item["path"] for item in data["skipped"]] == [f"{corpus}/sub/bin\\xff.txt"]
    assert "bin\\xff.txt has binary content" in data["skipped"][0]["reason"]
    again = run(store, [corpus])
    assert (again.unchanged, again.removed) == (8, 0)


# -- binary files without NUL bytes ----------------------------------------------------------------------------
def _no_nul(data: bytes) -> bytes:
    return data.replace(b"\x00", b"\x01")


_RANDOM = random.Random(0)
BINARY = {
    "random_high_bytes": bytes(_RANDOM.randrange(128, 256) for _ in range(4096)),
    "renamed_png": b"\x89PNG\r\n\x1a\n" + _no_nul(zlib.compress(_RANDOM.randbytes(4096))),
    "random_7bit_bytes": bytes(_RANDOM.randrange(1, 128) for _ in range(4096)),
    "random_bytes_after_a_bom": codecs.BOM_UTF8 + _no_nul(_RANDOM.randbytes(4096)),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_files_without_nul_bytes_are_refused_by_content(store, corpus, name):
    """Bug caught: random high bytes or a renamed PNG without a NUL in its first 8 KiB became garbage passages
    (``errors="replace"`` decoding)."""
    assert b"\x00" not in BINARY[name]
    (corpus / f"{name}.txt").write_bytes(BINARY[name])
    report = run(store, [corpus])
    assert report.files == 6 and [path.name for path, _ in report.skipped] == [f"{name}.txt"]
    assert report.skipped[0][1].startswith("BinaryFileError: ") and "has binary content" in report.skipped[0][1]
    assert str(corpus / f"{name}.txt") not in sources(store)


# -- splitting ---------------------------------------------------------------------------------------------------
class Tally:
    """A token counter (about 4 characters a token) that adds up the characters it is asked to count, what a
    tokenizer's time follows, and fails as soon as they pass ``budget``."""

    def __init__(self, budget: int):
        self.budget, self.characters, self.calls = budget, 0, 0

    def __call__(self, piece: str) -> int:
        self.characters += len(piece)
        self.calls += 1
        assert self.characters <= self.budget, f"counted {self.characters} characters: not linear in the text"
        return (len(piece) + 3) // 4


def test_splitting_a_2mb_line_without_whitespace_is_linear():
    """Bug caught: a line without whitespace was cut by a bisection over the whole remaining text for every
    passage, after counting the whole text once per boundary level: time x3.2-4.2 per doubling, over 600 s for
    2 MB. Here the counting stops the test as soon as it passes 4 times the text."""
    counted: dict[int, int] = {}
    for size in (1 << 20, 2 << 20):
        text, count = random.Random(size).randbytes(size // 2).hex(), Tally(4 * size)
        passages = split_passages(text, count, 512)
        assert "".join(passages) == text and len(passages) == size // 2048  # each full: 512 tokens of 4 characters
        assert count.characters <= 1.05 * size and count.calls <= len(passages) + 32  # one count a passage
        counted[size] = count.characters
    assert counted[2 << 20] < 2.2 * counted[1 << 20]


# -- the store's own inputs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("document", [{"id": "a", "text": "Text.", "metadata": {"source": "caf\udce9.txt"}},
                                      {"id": "caf\udce9", "text": "Text."},
                                      {"id": "a", "text": "Text.", "metadata": {"caf\udce9": "key"}}],
                         ids=["metadata_value", "id", "metadata_key"])
def test_lone_surrogates_in_ids_and_metadata_are_typed_errors_and_nothing_is_stored(store, document):
    """Bug caught: Chroma's untyped ``TypeError`` / ``UnicodeEncodeError`` / ``InvalidArgumentError`` escaped
    ``DocumentStore.add`` and ``where`` for text that is not valid Unicode (a path decoded with surrogates)."""
    with pytest.raises(InvalidDocumentError, match="lone surrogate"):
        store.add([{"id": "fine", "text": "A fine document."}, document], warm=False)
    assert store.count() == 0
    with pytest.raises(InvalidDocumentError, match="lone surrogate"):
        store.where({"source": "caf\udce9.txt"})
