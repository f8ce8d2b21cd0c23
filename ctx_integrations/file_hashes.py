"""sha256 of large files, computed once per file: remembered by path, size and mtime.

A GGUF of hundreds of MB takes seconds to hash; model loading keys its converted folder by content and the
model catalog verifies fetched files against pins, so both ask for the same hashes again and again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from ctx_integrations.paths import cache_root

_HASHES_FILE = "gguf-hashes.json"


def file_content_hash(file: Path) -> str:
    """sha256 of a file's bytes, remembered in ``<cache>/models/gguf-hashes.json`` by path + size + mtime."""
    stat = file.stat()
    index_file = cache_root() / "models" / _HASHES_FILE
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    path = str(file.resolve())
    known = index.get(path)
    if isinstance(known, dict) and {k: known.get(k) for k in stamp} == stamp and isinstance(known.get("sha256"), str):
        return known["sha256"]
    sha256 = sha256_of_file(file)
    index[path] = {**stamp, "sha256": sha256}
    try:  # best effort: a read-only cache only costs re-hashing next time
        index_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=index_file.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(index, out)
        os.replace(tmp, index_file)
    except OSError:
        pass
    return sha256


def sha256_of_file(file: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
