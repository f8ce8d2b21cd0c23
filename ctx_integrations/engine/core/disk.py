"""The disk tier of the KV-cache store: one safetensors file per entry, written atomically, checked on load.

Each file holds the entry's keys/values, its token ids, its key and a checksum. Writes go to a temp
file in the same folder and are renamed into place (``os.replace``), so a reader never sees half an
entry. A file that fails any check on load is reported with :class:`CorruptCacheWarning`, deleted and
treated as a miss, so the store recomputes it. transformers has no on-disk cache format, hence this module.

Checks on load: format, key, checksum, token ids, the stored format against the tier's (an int8, fp16 or bf16
entry copied into a native folder is a miss, never served: ``kv_codec.readable_formats``), the dtype that format
stores, and the tensor against the model (layer count, KV heads, head dim, token count, finite and not all-zero
values), so an entry from another model or another format, a damaged one or a hand-made one is never served.

Threat model. The checksum only catches accidents (truncation, bit rot, a copy from another model); anyone
who can write the cache folder can also recompute it, and a forged entry steers every answer that uses
that document. For a folder shared between users or machines, set a signing key outside the folder
(``CTX_CACHE_KEY``, or the file ``cache-signing.key`` in the user config directory): every entry then
carries an HMAC-SHA256 over its key, its stored format, token ids and tensor bytes, and an entry whose
signature is missing or wrong (a signed entry re-labelled as another format included) is discarded and
recomputed. Signing does not hide the cached text, and a writer who holds the key is trusted. (Entries
signed before the stored format was covered fail once and are recomputed.)

Layout: one folder per model under a cache root (:func:`model_directory`: ``<root>/<model name>-<hash of the
model's identity and dtype>``), so every store, collection, framework adapter and process that points at the
same root shares one copy of each entry. Entries of the layout before per-model folders (``<root>/<key[:2]>/``)
are still found and moved into the model's folder on first use.

Size before reading: a file larger than the entry can be (header + the document's tokens x the model's KV
bytes per token at the widest accepted dtype) is refused from its ``stat`` alone, so a sparse or padded file in
place of an entry never makes the reader allocate its size.

Resources: ``disk_bytes`` bounds the folder (least recently used entries, by mtime, are evicted first; a
load touches the entry), orphan ``.tmp-*`` files older than an hour (left by a writer killed mid-write; none is
written for that long) are removed when the tier opens, in the model's folder and in the legacy layout's, and
a folder that cannot be written (read-only, full, a directory where an entry belongs) makes the tier keep
entries in memory only, with one :class:`~ctx_integrations.errors.CacheStoreWarning`. A failed write
(``OSError`` or safetensors' own ``SafetensorError``, e.g. "No space left on device") never leaves its temp
file behind, and a read that fails with an ``OSError`` (EIO, EACCES) is a miss with that same warning, the
file left in place (it is not known to be corrupt).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ctx_integrations.engine.core.kv_codec import (
    KV_FORMATS,
    check_format,
    check_stored,
    decode,
    encode,
    is_lossy,
    readable_formats,
    storable_format,
    stored_names,
)
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.validation import optional_whole_number
from ctx_integrations.errors import CacheStoreError, CacheStoreWarning, CorruptCacheWarning

FORMAT_VERSION = "ctx-kv-1"
SIGNING_KEY_ENV = "CTX_CACHE_KEY"
SIGNING_KEY_FILE = "cache-signing.key"
ORPHAN_AGE_S = 3600.0
# Errors after which no write to the folder can succeed: stop trying, keep entries in memory.
_FOLDER_UNWRITABLE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", errno.ENOSPC)}
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_WIDEST_DTYPE = max(_CACHE_DTYPES, key=lambda dtype: dtype.itemsize)
# A safetensors header: 8 bytes of length, then JSON naming two tensors and our metadata (format, key, checksum,
# signature): a few hundred bytes. Anything past this bound is not one of our entries.
_HEADER_BYTES = 16 << 10
_LEGACY_SHARD = re.compile(r"[0-9a-f]{2}")  # the legacy layout's folders: an entry key's first two hex digits
# safetensors reports write failures as its own SafetensorError, with the OS message as text: map it back.
_UNWRITABLE_MESSAGES = {"no space left on device": errno.ENOSPC, "read-only file system": errno.EROFS,
                        "permission denied": errno.EACCES, "disk quota exceeded": errno.ENOSPC}


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


def model_directory(root: str | os.PathLike, loaded: LoadedModel, kv_format: str = "native") -> Path:
    """The folder of ``loaded``'s entries under a cache root: one per model identity, dtype and lossy format.

    Entry keys already hash the model, so one folder could hold every model; a folder per model keeps them
    apart for people (``du``, deleting one model's caches) and gives every process that names the same root
    the same folder, whichever store or collection it serves. Readable name first, hash for uniqueness.
    A lossy ``kv_format`` (``kv_codec``: fp16, bf16, int8) has a folder of its own, suffixed with its name,
    so an engine that stores exact entries never reads another engine's rounded ones for the same key.
    """
    digest = hashlib.sha256(f"{loaded.identity}\x1f{loaded.dtype}".encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", loaded.name).strip("-.")[:48] or "model"
    return Path(root) / (f"{name}-{digest}" + (f"-{kv_format}" if is_lossy(kv_format) else ""))


def _write_errno(error: Exception) -> int | None:
    """The errno behind a failed write: an ``OSError``'s own, or the one a ``SafetensorError``'s message names."""
    if isinstance(error, OSError):
        return error.errno
    text = str(error).lower()
    return next((code for message, code in _UNWRITABLE_MESSAGES.items() if message in text), None)


@dataclass
class CacheStats:
    """Counts of a store's (or one request's) lookups: hits per tier, misses, entries discarded as corrupt."""

    memory_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    corrupt: int = 0

    @property
    def hits(self) -> int:
        return self.memory_hits + self.host_hits + self.disk_hits + self.remote_hits

    def by_tier(self) -> dict[str, int]:
        """Hits per tier: ``memory`` (the model's device), ``host`` (pinned host memory, on a GPU), ``disk``,
        ``remote`` (the Redis/Valkey server every replica shares)."""
        return {"memory": self.memory_hits, "host": self.host_hits, "disk": self.disk_hits,
                "remote": self.remote_hits}

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "memory_hits": self.memory_hits, "host_hits": self.host_hits,
                "disk_hits": self.disk_hits, "remote_hits": self.remote_hits, "misses": self.misses,
                "corrupt": self.corrupt}


@dataclass
class DiskTier:
    """A folder of safetensors entries, addressed by their content key (``<dir>/<key[:2]>/<key>.safetensors``).

    ``kv_format``: how entries are stored (:mod:`~ctx_integrations.engine.core.kv_codec`): ``"native"`` (the
    model's dtype, bit for bit), ``"fp16"`` / ``"bf16"`` (half of fp32, values rounded, so logits are no longer
    bit-identical to a fresh prefill) or ``"int8"`` (a quarter, KIVI-quantised); entries are read back in the
    model's dtype. Entries discarded on load are counted in ``stats.corrupt``.
    ``disk_bytes``: the most bytes of entries the folder may hold (``None``: unbounded); the least recently
    used are evicted first. ``signing_key``: HMAC key (default :func:`cache_signing_key`; ``None``: unsigned).
    ``legacy_directory``: a folder in the layout before per-model folders, whose entries are moved here when
    first asked for (``None``: none).
    """

    directory: Path
    loaded: LoadedModel
    kv_format: str = "native"
    stats: CacheStats = field(default_factory=CacheStats)
    disk_bytes: int | None = None
    signing_key: bytes | None = field(default_factory=cache_signing_key, repr=False)
    legacy_directory: Path | None = None

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.kv_format = check_format(self.kv_format)
        self.disk_bytes = optional_whole_number("disk_bytes", self.disk_bytes, minimum=0,
                                                hint=" (None = no limit)")
        if isinstance(self.signing_key, str):
            self.signing_key = self.signing_key.encode("utf-8")
        self.writable, self.evicted, self._warned = True, 0, False
        for folder in (self.legacy_directory, self.directory):
            if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
                raise CacheStoreError(f"cache_dir {folder} is a file, not a folder: give a folder (or None)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CacheStoreError(f"cache_dir {self.directory} cannot be created ({error.strerror or error}): give a "
                                  "writable folder, or cache_dir=None to keep caches in memory") from None
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Delete ``.tmp-*`` files left by writers killed mid-write (older than ``ORPHAN_AGE_S``: not being written
        now), in this folder, its shards, and the legacy layout's shards (``<root>/<key[:2]>/``)."""
        cutoff = time.time() - ORPHAN_AGE_S
        found = [*self.directory.glob(".tmp-*"), *self.directory.glob("*/.tmp-*")]
        if self.legacy_directory is not None:
            found += [tmp for tmp in Path(self.legacy_directory).glob("*/.tmp-*")
                      if _LEGACY_SHARD.fullmatch(tmp.parent.name)]
        for tmp in found:
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass  # another process removed it, or the folder is read-only: harmless

    def _cannot_write(self, error: Exception, what: str) -> None:
        """Keep going without the disk for this entry (or for good, when the folder is unwritable); warn once."""
        unwritable = _write_errno(error) in _FOLDER_UNWRITABLE
        if unwritable:
            self.writable = False
        if not self._warned:
            self._warned = True
            scope = "entries are kept in memory only from now on" if unwritable else "this entry is kept in memory"
            reason = getattr(error, "strerror", None) or error
            warnings.warn(f"KV cache folder {self.directory}: cannot {what} ({reason}); {scope}. "
                          "Free space, fix permissions, or remove what occupies the entry's path.",
                          CacheStoreWarning, stacklevel=5)

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file() or (self.legacy_directory is not None and self._legacy_path(key).is_file())

    def _legacy_path(self, key: str) -> Path:
        return Path(self.legacy_directory or self.directory) / key[:2] / f"{key}.safetensors"

    def _adopt_legacy(self, key: str) -> Path:
        """Where to read ``key`` from: its path here, after moving a legacy-layout entry into place if there is one.

        A move that fails (another device, a read-only folder) leaves the entry where it is, read from there.
        """
        path = self.path(key)
        if self.legacy_directory is None or path.is_file():
            return path
        legacy = self._legacy_path(key)
        if not legacy.is_file():
            return path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(legacy, path)
        except OSError:
            return legacy
        return path

    def max_entry_bytes(self, tokens: int) -> int:
        """The largest file an entry of ``tokens`` tokens can be (:func:`max_entry_bytes`)."""
        return max_entry_bytes(self.loaded, tokens)

    def delete(self, key: str) -> None:
        """Remove the entry, and its copy in the legacy layout if there is one."""
        paths = [self.path(key)] + ([self._legacy_path(key)] if self.legacy_directory is not None else [])
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                self._cannot_write(error, f"delete entry {key[:16]}")

    def save(self, key: str, token_ids: tuple[int, ...], kv: torch.Tensor) -> None:
        """Write one entry atomically (temp file + rename); on an OS error, warn once and keep it in memory only."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        if not self.writable:
            return
        tensors, metadata = entry_tensors(key, token_ids, kv, self.kv_format, self.signing_key)
        path, tmp = self.path(key), None
        try:
            if self.disk_bytes is not None and not self._make_room(sum(t.nbytes for t in tensors.values())):
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
            os.close(fd)
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        except (OSError, SafetensorError) as error:
            self._cannot_write(error, f"write entry {key[:16]}")
        finally:
            if tmp is not None:
                try:
                    Path(tmp).unlink(missing_ok=True)
                except OSError:
                    pass  # the folder went read-only meanwhile; orphans are removed when the tier next opens

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

        ``None`` when there is no file, when the file fails a check (then it is deleted and reported), or when
        reading it fails with an OS error (reported once; the file stays).
        """
        from safetensors import safe_open

        path = self._adopt_legacy(key)
        try:
            if not path.is_file():
                return None
            size, limit = path.stat().st_size, self.max_entry_bytes(len(token_ids))
        except OSError as error:
            self._cannot_read(error, path)
            return None
        if size > limit:  # checked before opening: a sparse or padded file is never read into memory
            return self._discard(path, f"{size} bytes, more than an entry of {len(token_ids)} tokens can take "
                                       f"({limit} bytes)")
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                problem = names_problem(metadata, handle.keys())
                if problem:
                    return self._discard(path, problem)
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            kv, problem = read_entry(self.loaded, self.kv_format, self.signing_key, metadata, tensors, key, token_ids,
                                     device)
        except OSError as error:  # EIO, EACCES, ...: the file may be fine, the read was not
            self._cannot_read(error, path)
            return None
        except Exception as error:  # safetensors raises several types for truncated or garbled files
            problem = f"unreadable ({type(error).__name__}: {error})"
        if problem:
            return self._discard(path, problem)
        try:
            os.utime(path)  # least recently used eviction goes by mtime
        except OSError:
            pass  # read-only folder: eviction order is only approximate then
        return kv

    def _discard(self, path: Path, problem: str) -> None:
        """Report a corrupt entry, delete it (a read-only folder keeps it, never served) and count it."""
        warnings.warn(f"KV cache entry {path} is corrupt: {problem}; it was discarded and will be recomputed",
                      CorruptCacheWarning, stacklevel=5)
        self.stats.corrupt += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as error:  # a read-only shared folder: the entry stays, but is never served
            self._cannot_write(error, f"delete corrupt entry {path.name}")
        return None

    def _cannot_read(self, error: OSError, path: Path) -> None:
        """A read that failed for an OS reason: a miss (the entry is recomputed in memory), warned once."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"KV cache folder {self.directory}: cannot read entry {path.name} "
                          f"({error.strerror or error}); it is recomputed and kept in memory. Check the disk and "
                          "the folder's permissions.", CacheStoreWarning, stacklevel=5)


# -- the entry format, shared by the disk and remote tiers ------------------------------------------------------------
def entry_tensors(key: str, token_ids: tuple[int, ...], kv: torch.Tensor, tier_format: str,
                  signing_key: bytes | None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One entry as stored by every persistent tier: its tensors (``kv`` encoded in ``tier_format``, or the format it
    can take, and the token ids) and its metadata (format, key, kv_format, checksum, and an HMAC when signing)."""
    kv = kv.to("cpu")
    kv_format = storable_format(kv, tier_format)  # each entry names its own format in its metadata
    tensors = {**encode(kv, kv_format), "token_ids": torch.tensor(token_ids, dtype=torch.int64)}
    metadata = {"format": FORMAT_VERSION, "key": key, "kv_format": kv_format, "checksum": checksum(tensors)}
    if signing_key is not None:
        metadata["signature"] = signature(signing_key, key, tensors, kv_format)
    return tensors, metadata


def names_problem(metadata: dict, names: Iterable[str]) -> str | None:
    """Why tensors named ``names`` are not an entry of the format its metadata names (``None`` when they are);
    checked before any tensor is read."""
    kv_format = metadata.get("kv_format", "native")  # entries written before formats are native
    expected = set(stored_names(kv_format)) if kv_format in KV_FORMATS else set()
    found = set(names)
    if not expected or found != expected | {"token_ids"}:
        return f"its tensors {sorted(found)} are not a {kv_format!r} entry"
    return None


def read_entry(loaded: LoadedModel, tier_format: str, signing_key: bytes | None, metadata: dict,
               tensors: dict[str, torch.Tensor], key: str, token_ids: tuple[int, ...],
               device: torch.device | None) -> tuple[torch.Tensor | None, str | None]:
    """``(kv, None)``: the stored entry decoded on ``device`` (default: the model's), every check passed; or
    ``(None, why)`` naming the first check it fails (:func:`entry_problem`, then :func:`kv_problem`)."""
    problem = entry_problem(loaded, tier_format, signing_key, metadata, tensors, key, token_ids)
    if problem:
        return None, problem
    kv = decode(tensors, metadata.get("kv_format", "native"), loaded.dtype, loaded.device if device is None else device)
    problem = kv_problem(loaded, kv, token_ids)
    return (None, problem) if problem else (kv, None)


def entry_problem(loaded: LoadedModel, tier_format: str, signing_key: bytes | None, metadata: dict, tensors: dict,
                  key: str, token_ids: tuple[int, ...]) -> str | None:
    """Why the stored tensors are not this entry's (``None`` when they are); the decoded KV is checked apart."""
    if metadata.get("format") != FORMAT_VERSION or metadata.get("key") != key:
        return "wrong format or key"
    if metadata.get("checksum") != checksum(tensors):
        return "checksum mismatch"
    kv_format = metadata.get("kv_format", "native")  # entries written before formats are native
    if signing_key is not None:
        if "signature" not in metadata:
            return "unsigned (a signing key is set)"
        expected = signature(signing_key, key, tensors, kv_format)
        if not hmac.compare_digest(str(metadata["signature"]), expected):
            return "signature mismatch"
    ids = tensors["token_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 1 or tuple(ids.tolist()) != token_ids:
        return "token ids differ from the document's"
    if kv_format not in readable_formats(tier_format):
        return (f"stored as {kv_format!r}, but this tier's entries are {tier_format!r} (an entry copied from "
                "another format's folder is not served)")
    return check_stored(tensors, kv_format, loaded.dtype)


def kv_problem(loaded: LoadedModel, kv: torch.Tensor, token_ids: tuple[int, ...]) -> str | None:
    """Why the decoded entry does not fit this model and document (``None`` when it does)."""
    shape = loaded.kv_shape
    expected = (shape.layers, 2, shape.kv_heads, shape.head_dim, len(token_ids))
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[3]) != expected:
        return (f"shape {tuple(kv.shape)} does not fit this model ([layers, 2, kv_heads, tokens, head_dim] = "
                f"{[expected[0], 2, expected[2], expected[4], expected[3]]})")
    if not bool(torch.isfinite(kv).all()):
        return "non-finite values (NaN or inf)"
    if not bool(kv.any()):
        return "all values are zero"
    return None


def max_entry_bytes(loaded: LoadedModel, tokens: int) -> int:
    """The largest stored entry of ``tokens`` tokens: header + KV at the widest dtype + token ids."""
    per_token = loaded.kv_shape.bytes_per_token(_WIDEST_DTYPE)
    return 8 + _HEADER_BYTES + tokens * (per_token + 8)


def signature(key: bytes, entry_key: str, tensors: dict[str, torch.Tensor], kv_format: str) -> str:
    """HMAC-SHA256 over the file format, the entry's key, its stored ``kv_format`` and every tensor's name, dtype,
    shape and bytes (the stored format is covered, so a signed entry re-labelled as another format fails)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(f"{FORMAT_VERSION}\x1f{entry_key}\x1f{kv_format}".encode())
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
