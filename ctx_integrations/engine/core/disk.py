"""The disk tier of the KV-cache store: one safetensors file per entry, written atomically, checked on load.

Each file holds the entry's keys/values, its token ids, its key and a checksum. Writes go to a temp
file in the same folder and are renamed into place (``os.replace``), so a reader never sees half an
entry. A file that fails any check on load is reported with :class:`CorruptCacheWarning`, deleted and
treated as a miss, so the store recomputes it. transformers has no on-disk cache format, hence this module.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.errors import CorruptCacheWarning

FORMAT_VERSION = "ctx-kv-1"


@dataclass
class CacheStats:
    """Counts of a store's (or one request's) lookups: hits per tier, misses, entries discarded as corrupt."""

    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0

    @property
    def hits(self) -> int:
        return self.memory_hits + self.disk_hits

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "memory_hits": self.memory_hits, "disk_hits": self.disk_hits,
                "misses": self.misses, "corrupt": self.corrupt}


@dataclass
class DiskTier:
    """A folder of safetensors entries, addressed by their content key (``<dir>/<key[:2]>/<key>.safetensors``).

    ``half_on_disk`` stores fp32 caches as fp16 (half the disk, values rounded, so logits are no longer
    bit-identical to a fresh prefill). Entries discarded on load are counted in ``stats.corrupt``.
    """

    directory: Path
    loaded: LoadedModel
    half_on_disk: bool = False
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def save(self, key: str, token_ids: tuple[int, ...], kv: torch.Tensor) -> None:
        """Write one entry atomically (temp file + rename)."""
        from safetensors.torch import save_file

        kv = kv.to("cpu")
        if self.half_on_disk and kv.dtype == torch.float32:
            kv = kv.to(torch.float16)
        tensors = {"kv": kv.contiguous(), "token_ids": torch.tensor(token_ids, dtype=torch.int64)}
        metadata = {"format": FORMAT_VERSION, "key": key, "checksum": checksum(tensors)}
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, key: str, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The entry's ``[layers, 2, kv_heads, tokens, head_dim]`` tensor on the model's device, or ``None``.

        ``None`` when there is no file, or when the file fails a check (then it is deleted and reported).
        """
        from safetensors import safe_open

        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in ("kv", "token_ids")}
            problem = self._check(metadata, tensors, key, token_ids)
        except Exception as error:  # safetensors raises several types for truncated or garbled files
            problem = f"unreadable ({type(error).__name__}: {error})"
        if problem:
            warnings.warn(f"KV cache entry {path} is corrupt: {problem}; it was discarded and will be recomputed",
                          CorruptCacheWarning, stacklevel=4)
            self.stats.corrupt += 1
            path.unlink(missing_ok=True)
            return None
        return tensors["kv"].to(device=self.loaded.device, dtype=self.loaded.dtype)

    def _check(self, metadata: dict, tensors: dict, key: str, token_ids: tuple[int, ...]) -> str | None:
        config = self.loaded.model.config
        if metadata.get("format") != FORMAT_VERSION or metadata.get("key") != key:
            return "wrong format or key"
        if metadata.get("checksum") != checksum(tensors):
            return "checksum mismatch"
        if tuple(tensors["token_ids"].tolist()) != token_ids:
            return "token ids differ from the document's"
        kv = tensors["kv"]
        expected = (config.num_hidden_layers, 2, len(token_ids))
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3]) != expected:
            return f"unexpected shape {tuple(kv.shape)}"
        return None


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
