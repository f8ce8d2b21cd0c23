"""The remote tier of the KV-cache store: one Redis/Valkey value per entry, shared by every replica and machine.

Why Redis/Valkey: it is what LMCache's shared tier uses and what users of this field already run; an entry is
one ``SET`` and one ``GET`` (no listing, no multipart upload as on an object store), and the server's
``maxmemory`` with ``maxmemory-policy allkeys-lru`` gives the size budget and the eviction for every replica at
once (a budget kept by each client would count only its own writes, so this tier keeps none of its own).

Entries are the disk tier's: the same safetensors bytes (``safetensors.torch.save``), checksum, HMAC signature
(``CTX_CACHE_KEY``) and checks on load (:func:`~ctx_integrations.engine.core.disk.read_entry`), so a truncated,
forged or foreign entry is refused with :class:`~ctx_integrations.errors.CorruptCacheWarning`, deleted and
recomputed. Keys are content-addressed: ``ctx-kv:<the model's folder name>:<entry key>``, the folder name being
:func:`~ctx_integrations.engine.core.disk.model_directory`'s, so two models (or formats) never share entries.

Faults: a server that cannot be reached (down at start, killed mid-run, a timeout) makes every lookup a miss and
every write a no-op, with one :class:`~ctx_integrations.errors.CacheStoreWarning` naming the URL; the tier tries
again at most every ``retry_s`` seconds, so a dead server costs one refused connection per interval, not one per
entry. A write the server refuses (``OOM`` under ``noeviction``) drops that entry only, warned once too.
"""

from __future__ import annotations

import json
import struct
import time
import warnings
from dataclasses import dataclass, field

import torch

from ctx_integrations.engine.core.disk import (
    CacheStats,
    cache_signing_key,
    entry_tensors,
    max_entry_bytes,
    model_directory,
    names_problem,
    read_entry,
)
from ctx_integrations.engine.core.kv_codec import check_format
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.errors import CacheStoreWarning, CorruptCacheWarning, MissingDependencyError

KEY_PREFIX = "ctx-kv"
DEFAULT_RETRY_S = 30.0  # how long a tier whose server failed waits before it tries the server again
CONNECT_TIMEOUT_S = 1.0
IO_TIMEOUT_S = 5.0  # one GET of a long document's entry (tens of MiB) across a network


def _client(url: str):  # -> redis.Redis
    """A client for ``url`` without redis-py's own retries (this tier backs off itself)."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise MissingDependencyError("remote_cache_url needs the redis client: pip install "
                                     "'ctx-integrations[remote]' (or pip install redis)") from None
    return redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=IO_TIMEOUT_S,
                                retry=Retry(NoBackoff(), 0), retry_on_timeout=False)


def entry_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """An entry as one value: the safetensors bytes the disk tier writes to a file."""
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


def parse_entry(data: bytes) -> tuple[dict, dict[str, torch.Tensor] | None, str | None]:
    """An entry's metadata and tensors from its bytes, or ``(metadata, None, why)`` when its tensors' names are not
    those of the format its metadata names (checked from the header: a wrong entry's tensors are never built).
    Raises on bytes that are not safetensors (truncated, garbled)."""
    from safetensors.torch import load

    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", None) or {}
    problem = names_problem(metadata, header)
    return (metadata, None, problem) if problem else (metadata, load(data), None)


@dataclass
class RemoteTier:
    """Entries of one model (and format) in a Redis/Valkey server at ``url`` (``redis://``, ``rediss://``,
    ``unix://``). ``kv_format`` and ``signing_key`` as for :class:`~ctx_integrations.engine.core.disk.DiskTier`;
    discarded entries count in ``stats.corrupt``. ``retry_s``: after a failed command, the seconds during which the
    server is not asked again. ``failures``: commands that failed to reach the server."""

    url: str
    loaded: LoadedModel
    kv_format: str = "native"
    stats: CacheStats = field(default_factory=CacheStats)
    signing_key: bytes | None = field(default_factory=cache_signing_key, repr=False)
    retry_s: float = DEFAULT_RETRY_S

    def __post_init__(self) -> None:
        self.kv_format = check_format(self.kv_format)
        if isinstance(self.signing_key, str):
            self.signing_key = self.signing_key.encode("utf-8")
        self.prefix = f"{KEY_PREFIX}:{model_directory('', self.loaded, self.kv_format).name}:"
        self.client = _client(self.url)
        self.failures, self._down_until, self._warned = 0, 0.0, False

    def name(self, key: str) -> str:
        """The server's key of entry ``key``."""
        return self.prefix + key

    def _call(self, what: str, command, *args):
        """``command(*args)``, or ``None`` when the server is backed off or fails (then warned once, backed off)."""
        from redis.exceptions import ConnectionError, ResponseError, TimeoutError

        if time.monotonic() < self._down_until:
            return None
        try:
            return command(*args)
        except (ConnectionError, TimeoutError, OSError) as error:
            self.failures += 1
            self._down_until = time.monotonic() + self.retry_s
            self._warn(f"cannot reach it to {what} ({error}); entries are computed and kept locally, and the server "
                       f"is tried again every {self.retry_s:g} s. Start the server, or fix --remote-cache-url")
        except ResponseError as error:  # the server answered with a refusal (OOM under noeviction, READONLY replica)
            self._warn(f"it refused to {what} ({error}); that entry is kept locally. Give the server "
                       "maxmemory-policy allkeys-lru so that writes evict old entries")
        return None

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"KV cache server {self.url}: {text}.", CacheStoreWarning, stacklevel=6)

    def contains(self, key: str) -> bool:
        return bool(self._call("look up an entry", self.client.exists, self.name(key)))

    def delete(self, key: str) -> None:
        self._call("delete an entry", self.client.delete, self.name(key))

    def save(self, key: str, token_ids: tuple[int, ...], kv: torch.Tensor) -> None:
        """Store one entry (one ``SET``); a server that is down or refuses it only costs this entry."""
        if time.monotonic() < self._down_until:
            return  # not even encoded: the server is backed off
        tensors, metadata = entry_tensors(key, token_ids, kv, self.kv_format, self.signing_key)
        self._call("store an entry", self.client.set, self.name(key), entry_bytes(tensors, metadata))

    def load(self, key: str, token_ids: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor | None:
        """The entry's ``[layers, 2, kv_heads, tokens, head_dim]`` tensor on ``device`` (default: the model's), or
        ``None`` when the server has none, cannot be reached, or holds one that fails a check (then deleted)."""
        data = self._call("read an entry", self.client.get, self.name(key))
        if data is None:
            return None
        limit = max_entry_bytes(self.loaded, len(token_ids))
        if len(data) > limit:
            return self._discard(key, f"{len(data)} bytes, more than an entry of {len(token_ids)} tokens can take "
                                      f"({limit} bytes)")
        try:
            metadata, tensors, problem = parse_entry(data)
            kv = None
            if tensors is not None:
                kv, problem = read_entry(self.loaded, self.kv_format, self.signing_key, metadata, tensors, key,
                                         token_ids, device)
        except Exception as error:  # struct, json and safetensors raise several types for truncated bytes
            kv, problem = None, f"unreadable ({type(error).__name__}: {error})"
        return self._discard(key, problem) if problem else kv

    def _discard(self, key: str, problem: str) -> None:
        """Report a corrupt entry, delete it from the server (no replica trips on it again) and count it."""
        warnings.warn(f"KV cache entry {self.name(key)} on {self.url} is corrupt: {problem}; it was discarded and "
                      "will be recomputed", CorruptCacheWarning, stacklevel=5)
        self.stats.corrupt += 1
        self.delete(key)
        return None
