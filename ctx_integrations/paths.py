"""Where the library keeps its files: one user cache directory, overridable with ``CTX_CACHE_DIR``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The user cache directory (``$CTX_CACHE_DIR`` or the platform's cache dir)."""
    override = os.environ.get("CTX_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ctx-integrations"))


def kv_root() -> Path:
    """The KV-cache root every default picks (``<cache root>/kv``): one folder per model beneath it, shared by
    every store, collection, framework adapter and process (``engine.core.disk.model_directory``)."""
    return cache_root() / "kv"
