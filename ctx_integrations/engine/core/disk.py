"""The disk tier of the KV-cache store: one safetensors file per entry, written atomically, checked on load.

Each file holds the entry's keys/values, its token ids, its key and a checksum. Writes go to a temp
file in the same folder and are renamed into place (``os.replace``), so a reader never sees half an
entry. A file that fails any check on load is reported with :class:`CorruptCacheWarning`, deleted and
treated as a miss, so the store recomputes it. transformers has no on-disk cache format, hence this module.

Checks on load: format, key, checksum, token ids, and the tensor against the model (floating dtype,
layer count, KV heads, head dim, token count, finite and not all-zero values), so an entry from another
model, a damaged one or a hand-made one is never served.

Threat model. The checksum only catches accidents (truncation, bit rot, a copy from another model); anyone
who can write the cache folder can also recompute it, and a forged entry steers every answer that uses
that document. For a folder shared between users or machines, set a signing key outside the folder
(``CTX_CACHE_KEY``, or the file ``cache-signing.key`` in the user config directory): every entry then
carries an HMAC-SHA256 over its key, token ids and tensor bytes, and an entry whose signature is missing
or wrong is discarded and recomputed. Signing does not hide the cached text, and a writer who holds the
key is trusted.

Resources: ``disk_bytes`` bounds the folder (least recently used entries, by mtime, are evicted first; a
load touches the entry), orphan ``.tmp-*`` files older than a minute are removed when the tier opens, and
a folder that cannot be written (read-only, full, a directory where an entry belongs) makes the tier keep
entries in memory only, with one :class:`~ctx_integrations.errors.CacheStoreWarning`.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.validation import optional_whole_number
from ctx_integrations.errors import CacheStoreError, CacheStoreWarning, CorruptCacheWarning

FORMAT_VERSION = "ctx-kv-1"
SIGNING_KEY_ENV = "CTX_CACHE_KEY"
SIGNING_KEY_FILE = "cache-signing.key"
ORPHAN_AGE_S = 60.0
# Errors after which no write to the folder can succeed: stop trying, keep entries in memory.
_FOLDER_UNWRITABLE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", errno.ENOSPC)}
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def signing_key_file() -> Path:
    """Where a signing key is read from when ``CTX_CACHE_KEY`` is not set (outside every cache folder)."""
    from platformdirs import user_config_dir

    return Path(user_config_dir("ctx-integrations")) / SIGNING_KEY_FILE


def cache_signing_key() -> bytes | None:
    """The HMAC key for shared stores: ``$CTX_CACHE_KEY``, else the key file, else ``None`` (no signing)."""
    value = os.environ.get(SIGNING_KEY_ENV)
    if value:
        return value.encode("utf-8")
    file = signing_key_file()
    try:
        key = file.read_bytes().strip()
    except OSError:
        return None
    return key or None


@dataclass
class CacheStats:
    """Counts of a store's (or one request's) lookups: hits per tier, misses, entries discarded as corrupt."""

    memory_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0

    @property
    def hits(self) -> int:
        return self.memory_hits + self.host_hits + self.disk_hits

    def by_tier(self) -> dict[str, int]:
        """Hits per tier: ``memory`` (the model's device), ``host`` (pinned host memory, on a GPU), ``disk``."""
        return {"memory": self.memory_hits, "host": self.host_hits, "disk": self.disk_hits}

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "memory_hits": self.memory_hits, "host_hits": self.host_hits,
                "disk_hits": self.disk_hits, "misses": self.misses, "corrupt": self.corrupt}


@dataclass
class DiskTier:
    """A folder of safetensors entries, addressed by their content key (``<dir>/<key[:2]>/<key>.safetensors``).

    ``half_on_disk`` stores fp32 caches as fp16 (half the disk, values rounded, so logits are no longer
    bit-identical to a fresh prefill). Entries discarded on load are counted in ``stats.corrupt``.
    ``disk_bytes``: the most bytes of entries the folder may hold (``None``: unbounded); the least recently
    used are evicted first. ``signing_key``: HMAC key (default :func:`cache_signing_key`; ``None``: unsigned).
    """

    directory: Path
    loaded: LoadedModel
    half_on_disk: bool = False
    stats: CacheStats = field(default_factory=CacheStats)
    disk_bytes: int | None = None
    signing_key: bytes | None = field(default_factory=cache_signing_key, repr=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.disk_bytes = optional_whole_number("disk_bytes", self.disk_bytes, minimum=0,
                                                hint=" (None = no limit)")
        if isinstance(self.signing_key, str):
            self.signing_key = self.signing_key.encode("utf-8")
        self.writable, self.evicted, self._warned = True, 0, False
        if self.directory.exists() and not self.directory.is_dir():
            raise CacheStoreError(f"cache_dir {self.directory} is a file, not a folder: give a folder (or None)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CacheStoreError(f"cache_dir {self.directory} cannot be created ({error.strerror or error}): give a "
                                  "writable folder, or cache_dir=None to keep caches in memory") from None
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Delete ``.tmp-*`` files left by writers killed mid-write (older than a minute: not being written now)."""
        cutoff = time.time() - ORPHAN_AGE_S
        for tmp in self.directory.glob("*/.tmp-*"):
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass  # another process removed it, or the folder is read-only: harmless

    def _cannot_write(self, error: OSError, what: str) -> None:
        """Keep going without the disk for this entry (or for good, when the folder is unwritable); warn once."""
        unwritable = error.errno in _FOLDER_UNWRITABLE
        if unwritable:
            self.writable = False
        if not self._warned:
            self._warned = True
            scope = "entries are kept in memory only from now on" if unwritable else "this entry is kept in memory"
            warnings.warn(f"KV cache folder {self.directory}: cannot {what} ({error.strerror or error}); {scope}. "
                          "Free space, fix permissions, or remove what occupies the entry's path.",
                          CacheStoreWarning, stacklevel=5)

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as error:
            self._cannot_write(error, f"delete entry {key[:16]}")

    def save(self, key: str, token_ids: tuple[int, ...], kv: torch.Tensor) -> None:
        """Write one entry atomically (temp file + rename); on an OS error, warn once and keep it in memory only."""
        from safetensors.torch import save_file

        if not self.writable:
            return
        kv = kv.to("cpu")
        if self.half_on_disk and kv.dtype == torch.float32:
            kv = kv.to(torch.float16)
        tensors = {"kv": kv.contiguous(), "token_ids": torch.tensor(token_ids, dtype=torch.int64)}
        metadata = {"format": FORMAT_VERSION, "key": key, "checksum": checksum(tensors)}
        if self.signing_key is not None:
            metadata["signature"] = signature(self.signing_key, key, tensors)
        path, tmp = self.path(key), None
        try:
            if self.disk_bytes is not None and not self._make_room(sum(t.nbytes for t in tensors.values())):
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
            os.close(fd)
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        except OSError as error:
            self._cannot_write(error, f"write entry {key[:16]}")
        finally:
            if tmp is not None and Path(tmp).exists():
                Path(tmp).unlink(missing_ok=True)

    # -- disk budget -------------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """Every entry file as (mtime, bytes, path), oldest first (temp files excluded)."""
        found = []
        for path in self.directory.glob("*/*.safetensors"):
            if path.name.startswith(".tmp-"):
                continue
            try:
                stat = path.stat()
            except OSError:
                continue  # removed meanwhile
            found.append((stat.st_mtime, stat.st_size, path))
        return sorted(found)

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def _make_room(self, incoming: int) -> bool:
        """Evict least recently used entries until ``incoming`` more bytes fit ``disk_bytes``; False if it never can."""
        budget = int(self.disk_bytes or 0)
        if incoming > budget:
            return False
        entries = self.entries()
        used = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if used + incoming <= budget:
                break
            path.unlink(missing_ok=True)
            used -= size
            self.evicted += 1
        return used + incoming <= budget

    def load(self, key: str, token_ids: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor | None:
        """The entry's ``[layers, 2, kv_heads, tokens, head_dim]`` tensor on ``device`` (default: the model's).

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
            try:
                path.unlink(missing_ok=True)
            except OSError as error:  # a read-only shared folder: the entry stays, but is never served
                self._cannot_write(error, f"delete corrupt entry {path.name}")
            return None
        try:
            os.utime(path)  # least recently used eviction goes by mtime
        except OSError:
            pass  # read-only folder: eviction order is only approximate then
        return tensors["kv"].to(device=self.loaded.device if device is None else device, dtype=self.loaded.dtype)

    def _check(self, metadata: dict, tensors: dict, key: str, token_ids: tuple[int, ...]) -> str | None:
        config = self.loaded.model.config
        if metadata.get("format") != FORMAT_VERSION or metadata.get("key") != key:
            return "wrong format or key"
        if metadata.get("checksum") != checksum(tensors):
            return "checksum mismatch"
        if self.signing_key is not None:
            if "signature" not in metadata:
                return "unsigned (a signing key is set)"
            if not hmac.compare_digest(str(metadata["signature"]), signature(self.signing_key, key, tensors)):
                return "signature mismatch"
        ids = tensors["token_ids"]
        if ids.dtype != torch.int64 or ids.dim() != 1 or tuple(ids.tolist()) != token_ids:
            return "token ids differ from the document's"
        kv = tensors["kv"]
        if kv.dtype not in _CACHE_DTYPES:
            return f"dtype {kv.dtype} is not a floating KV cache dtype"
        expected = (config.num_hidden_layers, 2, *model_kv_shape(config), len(token_ids))
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[3]) != expected:
            return (f"shape {tuple(kv.shape)} does not fit this model ([layers, 2, kv_heads, tokens, head_dim] = "
                    f"{[expected[0], 2, expected[2], expected[4], expected[3]]})")
        if not bool(torch.isfinite(kv).all()):
            return "non-finite values (NaN or inf)"
        if not bool(kv.any()):
            return "all values are zero"
        return None


def model_kv_shape(config: object) -> tuple[int, int]:
    """(kv_heads, head_dim) of a transformers config."""
    config = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(config, "num_attention_heads", 1) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(kv_heads), int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def signature(key: bytes, entry_key: str, tensors: dict[str, torch.Tensor]) -> str:
    """HMAC-SHA256 over the format, the entry's key and every tensor's name, dtype, shape and bytes."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(f"{FORMAT_VERSION}\x1f{entry_key}".encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        mac.update(f"\x1f{name}:{tensor.dtype}:{tuple(tensor.shape)}\x1f".encode())
        mac.update(tensor.view(torch.uint8).numpy().tobytes())
    return mac.hexdigest()


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
