"""Remembered file hashes: reused only for the very version of a file that was hashed.

Reliability issue, item 5: a fetched GGUF with one byte changed and its mtime restored, or replaced together
with its hash record, was accepted as verified, because the hash was remembered on disk by path, size and
mtime. Now the stamp is device, inode, size, mtime and ctime; a file changed within the timestamp tick of
its hashing is not remembered at all (git's "racy" rule); and the hash a pin is compared with is remembered
in the process only, never read from a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ctx_integrations import file_hashes
from ctx_integrations.file_hashes import FileStamp, file_content_hash, process_content_hash
from tests.helpers import move_ctime

BOTH = pytest.mark.parametrize("content_hash", [file_content_hash, process_content_hash],
                               ids=["on_disk", "in_process"])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(file_hashes, "_process_hashes", {})
    return tmp_path / "cache"


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """Every file whose bytes are read to hash them."""
    reads: list[Path] = []
    real = file_hashes.sha256_of_file

    def counting(file: Path) -> str:
        reads.append(file)
        return real(file)

    monkeypatch.setattr(file_hashes, "sha256_of_file", counting)
    return reads


@pytest.fixture
def settled(monkeypatch) -> None:
    """As if every file had last changed long before it is hashed (the usual case for a model file)."""
    monkeypatch.setattr(file_hashes, "SETTLE_NS", -10**18)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _model(tmp_path: Path, data: bytes = b"GGUF" + b"\x01" * 4096) -> Path:
    file = tmp_path / "model.gguf"
    file.write_bytes(data)
    return file


@BOTH
def test_a_settled_file_is_hashed_once_while_its_stamp_holds(tmp_path, cache, hashed, settled, content_hash):
    file = _model(tmp_path)
    assert content_hash(file) == content_hash(file) == _sha(file.read_bytes())
    assert hashed == [file]


@BOTH
def test_a_file_changed_within_the_settling_time_is_hashed_on_every_call(tmp_path, cache, hashed, content_hash):
    file = _model(tmp_path)  # just written: a change within its timestamp tick could keep the stamp
    assert content_hash(file) == content_hash(file)
    assert hashed == [file, file]
    assert not (cache / "models" / "gguf-hashes.json").exists()
    assert file_hashes._process_hashes == {}  # nothing remembered in either place


def test_the_settling_rule_compares_the_ctime_with_the_start_of_hashing():
    stamp = FileStamp(device=1, inode=2, size=3, mtime_ns=0, ctime_ns=10 * 10**9)
    assert file_hashes._settled(stamp, stamp.ctime_ns + file_hashes.SETTLE_NS + 1)
    assert not file_hashes._settled(stamp, stamp.ctime_ns + file_hashes.SETTLE_NS)
    assert not file_hashes._settled(stamp, stamp.ctime_ns)
    assert file_hashes.SETTLE_NS == 2 * 10**9


def _same_bytes_count_mtime_restored(file: Path) -> None:
    stat = file.stat()
    data = bytearray(file.read_bytes())
    data[100] ^= 0xFF
    file.write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    move_ctime(file)  # what the kernel does anyway, unless the change falls within one coarse tick


def _replaced_with_same_size_and_mtime(file: Path) -> None:
    stat = file.stat()
    other = file.with_name("other.gguf")
    other.write_bytes(b"GGUF" + b"\x02" * (stat.st_size - 4))
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, file)  # a new inode: the old one existed until now


def _mtime_moved(file: Path) -> None:
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def _appended(file: Path) -> None:
    with open(file, "ab") as out:
        out.write(b"tail")


@BOTH
@pytest.mark.parametrize("change", [_same_bytes_count_mtime_restored, _replaced_with_same_size_and_mtime,
                                    _mtime_moved, _appended])
def test_any_change_of_the_stamp_hashes_again(tmp_path, cache, hashed, settled, content_hash, change):
    file = _model(tmp_path)
    first = content_hash(file)
    change(file)
    assert content_hash(file) == _sha(file.read_bytes())
    assert len(hashed) == 2
    if change is not _mtime_moved:
        assert content_hash(file) != first


@BOTH
def test_a_file_that_changes_while_it_is_hashed_is_not_remembered(tmp_path, cache, settled, monkeypatch,
                                                                   content_hash):
    file = _model(tmp_path)
    real = file_hashes.sha256_of_file

    def racing(path: Path) -> str:
        digest = real(path)
        _appended(path)  # a writer finishes between reading the bytes and the second stat
        return digest

    monkeypatch.setattr(file_hashes, "sha256_of_file", racing)
    content_hash(file)
    monkeypatch.setattr(file_hashes, "sha256_of_file", real)
    assert content_hash(file) == _sha(file.read_bytes())


def test_the_record_on_disk_holds_the_stamp_of_the_version_hashed(tmp_path, cache, settled):
    file = _model(tmp_path)
    sha = file_content_hash(file)
    record = json.loads((cache / "models" / "gguf-hashes.json").read_text())[str(file.resolve())]
    stat = file.stat()
    assert record == {"device": stat.st_dev, "inode": stat.st_ino, "size": stat.st_size,
                      "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "sha256": sha}


def test_a_pin_check_never_takes_a_hash_from_a_record_on_disk(tmp_path, cache, hashed, settled):
    """A file replaced together with its hash record: the record is what file_content_hash reads, and what
    process_content_hash ignores."""
    file = _model(tmp_path)
    forged = {**vars(FileStamp.of(file.stat())), "sha256": "0" * 64}
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "gguf-hashes.json").write_text(json.dumps({str(file.resolve()): forged}))
    assert file_content_hash(file) == "0" * 64  # a cache key: trusted, and only ever used to name a folder
    assert process_content_hash(file) == _sha(file.read_bytes())


def test_rehash_reads_the_whole_file_again_though_its_stamp_holds(tmp_path, cache, hashed, settled):
    file = _model(tmp_path)
    process_content_hash(file)
    process_content_hash(file)
    assert len(hashed) == 1
    assert process_content_hash(file, rehash=True) == _sha(file.read_bytes())
    assert len(hashed) == 2
    process_content_hash(file)
    assert len(hashed) == 2  # the re-read version is remembered again


@BOTH
def test_each_file_is_remembered_on_its_own(tmp_path, cache, hashed, settled, content_hash):
    first = _model(tmp_path)
    second = tmp_path / "second.gguf"
    second.write_bytes(b"GGUF" + b"\x03" * 10)
    assert [content_hash(f) for f in (first, second, first, second)] == [_sha(first.read_bytes()),
                                                                         _sha(second.read_bytes())] * 2
    assert hashed == [first, second]


@pytest.mark.parametrize("index", ["not json", "[1, 2]", '{"%s": {"sha256": 5}}', '{"%s": "x"}'])
def test_an_unreadable_or_odd_record_file_means_hashing_again(tmp_path, cache, hashed, settled, index):
    file = _model(tmp_path)
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "gguf-hashes.json").write_text(index.replace("%s", str(file.resolve())))
    assert file_content_hash(file) == _sha(file.read_bytes())
    assert file_content_hash(file) == _sha(file.read_bytes())
    assert len(hashed) == 1  # and the record is rewritten


def test_a_cache_that_cannot_be_written_only_costs_hashing_again(tmp_path, monkeypatch, hashed, settled):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("CTX_CACHE_DIR", str(blocker))
    file = _model(tmp_path)
    assert file_content_hash(file) == file_content_hash(file) == _sha(file.read_bytes())
    assert len(hashed) == 2
