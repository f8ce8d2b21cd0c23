"""sha256 of large files, computed once per file version: remembered by the file's full stat stamp.

A GGUF of hundreds of MB takes a second to hash; model loading keys its converted folder by content and the
model catalog verifies fetched files against pins, so both ask for the same hashes again and again. What
is remembered, and where, differs by what the hash is for:

- :func:`file_content_hash` (a cache key: which converted folder belongs to a GGUF) remembers hashes
  across processes in ``<cache>/models/gguf-hashes.json``.
- :func:`process_content_hash` (a check against a pin in code) remembers them in this process only, so no
  file on disk can vouch for a model file's bytes: a model replaced together with a forged record is
  hashed all the same.

A remembered hash is reused only while the file's stamp is unchanged: device, inode, size, mtime and ctime.
ctime cannot be set by hand (``os.utime`` restoring the mtime moves it), and a copy or replacement has a new
inode. Timestamps are coarse on many kernels (a tick of a few ms), so a change within the tick of the hashed
version would keep its stamp: as git does for its index ("racy" timestamps), a hash is only remembered for a
file whose ctime is older than :data:`SETTLE_NS` when hashing starts; a fresher file is hashed on every call.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ctx_integrations.paths import cache_root

_HASHES_FILE = "gguf-hashes.json"
SETTLE_NS = 2_000_000_000  # more than any file system's timestamp step a ctime is read with (FAT: 2 s mtimes)

_process_hashes: dict[str, tuple[FileStamp, str]] = {}
_process_lock = threading.Lock()


@dataclass(frozen=True)
class FileStamp:
    """What identifies one version of a file without reading it: any write, replacement or touch changes it."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> FileStamp:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _settled(stamp: FileStamp, started_ns: int) -> bool:
    """Whether any later change of the file must get another ctime (its last change is a settling time old)."""
    return stamp.ctime_ns < started_ns - SETTLE_NS


def _hash_version(file: Path) -> tuple[FileStamp, str, bool]:
    """Hash ``file``; return the stamp of the version hashed, its sha256 and whether that may be remembered
    (settled, and not changed while it was read)."""
    started_ns = time.time_ns()
    before = FileStamp.of(file.stat())
    sha256 = sha256_of_file(file)
    rememberable = _settled(before, started_ns) and FileStamp.of(file.stat()) == before
    return before, sha256, rememberable


def file_content_hash(file: Path) -> str:
    """sha256 of a file's bytes, remembered in ``<cache>/models/gguf-hashes.json`` by path and stamp.

    For cache keys only: the record is a file anyone who can write the cache can write, so a check against
    a pinned hash uses :func:`process_content_hash`.
    """
    index_file = cache_root() / "models" / _HASHES_FILE
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    path = str(file.resolve())
    known = index.get(path)
    stamp = asdict(FileStamp.of(file.stat()))
    if isinstance(known, dict) and {k: known.get(k) for k in stamp} == stamp and isinstance(known.get("sha256"), str):
        return known["sha256"]
    hashed, sha256, rememberable = _hash_version(file)
    if not rememberable:
        return sha256
    index[path] = {**asdict(hashed), "sha256": sha256}
    try:  # best effort: a read-only cache only costs re-hashing next time
        index_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=index_file.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(index, out)
        os.replace(tmp, index_file)
    except OSError:
        pass
    return sha256


def process_content_hash(file: Path, *, rehash: bool = False) -> str:
    """sha256 of a file's bytes, remembered in this process only (by path and stamp); ``rehash``: read it all again.

    What a pinned hash is compared with: each process hashes a model file once, then again on any change of
    its stamp, and nothing written to disk is taken as the hash of a file.
    """
    path = str(file.resolve())
    if not rehash:
        with _process_lock:
            known = _process_hashes.get(path)
        if known is not None and known[0] == FileStamp.of(file.stat()):
            return known[1]
    hashed, sha256, rememberable = _hash_version(file)
    if rememberable:  # else an older entry may stay: its stamp can never match this file again
        with _process_lock:
            _process_hashes[path] = (hashed, sha256)
    return sha256


def sha256_of_file(file: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
