"""Per-document KV caches: compute once, persist as safetensors, load, and batch them into streams.

Layout (docs/methods.md#layout): the shared prefix is encoded once at positions 0..L_p-1 and
stored once; every document is encoded after that prefix at positions L_p..L_p+len-1, and only its
own keys/values (post-RoPE) are stored. Every document therefore starts at the same position, so
PCED, Soft-NBCE, APE and IPPD can all reuse the same entries without re-rotating keys.

Keys are content addresses: sha256(model identity incl. weights, dtype, layout fingerprint, token
ids). A changed model, template or text is a miss, never a wrong hit. Files are written atomically
(temp file + ``os.replace``) and carry a checksum, their key and their token ids; an entry that
fails any check is reported with :class:`CorruptCacheWarning`, deleted and recomputed.

transformers has no on-disk cache format, hence this module; in memory we use its ``DynamicCache``.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ctx_integrations.engine.core.config import DEFAULT_MEMORY_BYTES, check_setting, half_on_disk_format
from ctx_integrations.engine.core.disk import FORMAT_VERSION, CacheStats, DiskTier, model_directory
from ctx_integrations.engine.core.kv_codec import decode, encode
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.prepared import PreparedText
from ctx_integrations.engine.core.remote import RemoteTier
from ctx_integrations.engine.core.transfer import Transfer, pinned, to_device_async, to_host


@dataclass(frozen=True)
class CachedKV:
    """Keys and values of one piece of prompt, shaped ``[layers, 2, kv_heads, tokens, head_dim]``."""

    key: str
    token_ids: tuple[int, ...]
    kv: torch.Tensor

    @property
    def length(self) -> int:
        return self.kv.shape[-2]


@dataclass(frozen=True)
class HostEntry:
    """An entry in the host tier, stored as ``kv_codec`` encodes it (``{"kv": kv}`` in the native format)."""

    key: str
    token_ids: tuple[int, ...]
    stored: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.stored.values())


def cache_from_kv(kv: torch.Tensor) -> DynamicCache:
    """Wrap a ``[layers, 2, batch, heads, tokens, dim]`` tensor as a transformers ``DynamicCache``."""
    return DynamicCache(ddp_cache_data=[(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])])


def kv_from_cache(cache: DynamicCache, start: int = 0) -> torch.Tensor:
    """Stack a batch-1 ``DynamicCache`` into ``[layers, 2, heads, tokens, dim]`` from column ``start`` on."""
    return torch.stack([torch.stack([layer.keys[0, :, start:], layer.values[0, :, start:]])
                        for layer in cache.layers])


DEFAULT_HOST_BYTES = 16 << 30  # 16 GiB of pinned host memory behind a GPU's memory tier (none on CPU)


@dataclass
class KVCacheStore:
    """Content-addressed store of document KV caches: a memory tier, a pinned host tier, a disk tier, a remote tier.

    The memory tier lives on the model's device (GPU memory when there is one, host RAM otherwise) and
    keeps at most ``memory_bytes`` of entries, evicting the least recently used. On a GPU, entries it
    evicts move to the host tier: at most ``host_bytes`` (default 16 GiB on CUDA, none on CPU, where
    the memory tier already is host RAM) of page-locked host memory, from which an entry returns to
    the GPU by DMA on a side stream (``transfer.py``) instead of a disk read. ``directory=None``
    keeps everything in memory only; otherwise ``directory`` is a cache root and every document entry is
    also written to the disk tier (:class:`~ctx_integrations.engine.core.disk.DiskTier`) in the model's own
    folder under it (``disk.model_directory``): every engine of the same model that names the same root, in
    any process, for any store or collection, shares one copy of each entry. ``disk_format``: how entries are
    stored on disk (:mod:`~ctx_integrations.engine.core.kv_codec`: ``"native"``, ``"fp16"``, ``"bf16"`` or
    ``"int8"``; lossy formats round values, so logits are no longer bit-identical to a fresh prefill, and keep
    a folder of their own). ``half_on_disk=True`` is the older name of ``disk_format="fp16"``. ``host_format``:
    the same formats for the host tier: an encoded entry crosses PCIe in its stored size and is widened on
    the device, so the host tier holds up to 4x the entries in its budget. ``remote_url``: a Redis/Valkey server
    (:class:`~ctx_integrations.engine.core.remote.RemoteTier`) that every replica, on every machine, names: looked
    up after the disk tier (a hit is also written to the disk tier), and every computed document entry is written
    to it, so a document computed by one replica is a hit for all the others.

    Query-time entries (``persist=False``: a RAPID long context, an IPPD concatenation, MapReduce's
    summary layout) live in the memory tier only, so they never fill the disk.

    Thread-safe: the scheduler's loader thread reads disk entries into memory (:meth:`prefetch`) while
    the model's thread looks entries up and computes misses. With a host tier, the loader thread
    reads disk entries into pinned memory and starts their copies to the GPU; the model's thread
    only makes its CUDA stream wait for a copy's event where the entry is first used, so copies
    overlap the forward passes of the requests already running. Every lookup counts into the store's
    ``stats`` and, when given, into a request's own ``stats`` (hits per tier, misses).
    """

    loaded: LoadedModel
    directory: Path | None = None
    half_on_disk: bool = False
    disk_format: str = "native"
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    batch_tokens: int = 16384
    stats: CacheStats = field(default_factory=CacheStats)
    disk_bytes: int | None = None  # the disk tier's budget (least recently used entries evicted); None: unbounded
    host_bytes: int | None = None  # the host tier's budget; None: DEFAULT_HOST_BYTES on CUDA, 0 (none) elsewhere
    host_format: str = "native"
    remote_url: str | None = None  # a Redis/Valkey server every replica shares (remote.py); None: no remote tier

    def __post_init__(self) -> None:
        # every setting is checked as EngineConfig checks it, whether or not its tier exists (a disk budget without
        # a folder is still a mistake worth naming): a store can be built without an engine
        for name in ("memory_bytes", "host_bytes", "disk_bytes", "disk_format", "host_format"):
            setattr(self, name, check_setting(name, getattr(self, name)))
        self.remote_url = check_setting("remote_cache_url", self.remote_url)
        if self.host_bytes is None:
            self.host_bytes = DEFAULT_HOST_BYTES if self.loaded.device.type == "cuda" else 0
        self.disk_format = half_on_disk_format(self.disk_format, self.half_on_disk)
        self.disk: DiskTier | None = None
        if self.directory is not None:
            root = Path(self.directory)
            self.disk = DiskTier(model_directory(root, self.loaded, self.disk_format), self.loaded, self.disk_format,
                                 self.stats, self.disk_bytes, legacy_directory=root)
        self.remote = (RemoteTier(self.remote_url, self.loaded, self.disk_format, self.stats)
                       if self.remote_url else None)
        self._memory: OrderedDict[str, CachedKV] = OrderedDict()
        self._memory_used = 0
        self._host: OrderedDict[str, HostEntry] = OrderedDict()  # host tensors (page-locked when CUDA is usable)
        self._host_used = 0
        self._in_flight: dict[str, Transfer] = {}  # memory-tier entries whose copy from the host may still run
        self._prefetched: dict[str, str] = {}  # key -> the tier it was read from ahead of use (counted at first use)
        self._prefix_keys: dict[str, str] = {}  # layout fingerprint -> its prefix's key
        self._lock = threading.RLock()

    # -- keys ------------------------------------------------------------------------------------
    def entry_key(self, layout: PromptLayout, token_ids: Sequence[int], kind: str = "doc") -> str:
        digest = hashlib.sha256()
        for part in (FORMAT_VERSION, kind, self.loaded.identity, str(self.loaded.dtype), layout.fingerprint):
            digest.update(part.encode() + b"\x1f")
        digest.update(_int64_bytes(token_ids))
        return digest.hexdigest()

    # -- public API ------------------------------------------------------------------------------
    def prefix(self, layout: PromptLayout) -> CachedKV:
        """The shared prefix's cache (system prompt + template text before the documents); not counted.

        Its key is hashed once per layout (every request looks the prefix up, some modes twice)."""
        key = self._prefix_keys.get(layout.fingerprint)
        ids = tuple(layout.prefix_ids)
        if key is None:
            key = self._prefix_keys[layout.fingerprint] = self.entry_key(layout, ids, "prefix")
        entry = self._lookup(key, ids, ())
        return entry if entry is not None else self._add(CachedKV(key, ids, self._compute(ids, None)), True)

    def document(self, layout: PromptLayout, text: str) -> CachedKV:
        """One document's cache, encoded after the shared prefix; computed and stored on a miss."""
        return self.document_tokens(layout, layout.context_ids(text))

    def document_tokens(self, layout: PromptLayout, token_ids: list[int] | tuple[int, ...], *,
                        stats: CacheStats | None = None, persist: bool = True) -> CachedKV:
        """Like :meth:`document` for text that is already tokenised with ``layout.context_ids``."""
        return self.documents_tokens(layout, [list(token_ids)], stats=stats, persist=persist)[0]

    def documents(self, layout: PromptLayout, texts: list[str], *, stats: CacheStats | None = None) -> list[CachedKV]:
        return self.documents_tokens(layout, [layout.context_ids(text) for text in texts], stats=stats)

    def documents_tokens(self, layout: PromptLayout, token_lists: list[list[int]], *, stats: CacheStats | None = None,
                         persist: bool = True) -> list[CachedKV]:
        """Caches of many documents; all misses are computed together in right-padded batched forwards.

        One forward per ``batch_tokens`` budget instead of one per document: a cold query costs about
        what prefilling the same tokens as one prompt costs. Computing runs the model: call this on
        the model's thread (the scheduler's) only.
        """
        prepared = [PreparedText(tuple(ids), self.entry_key(layout, ids)) for ids in token_lists]
        return self.documents_prepared(layout, prepared, stats=stats, persist=persist)

    def documents_prepared(self, layout: PromptLayout, prepared: Sequence[PreparedText], *,
                           stats: CacheStats | None = None, persist: bool = True) -> list[CachedKV]:
        """:meth:`documents_tokens` for documents whose tokens and keys are known (:mod:`.prepared`): no hashing."""
        steps = self.documents_in_steps(layout, prepared, stats=stats, persist=persist)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def documents_in_steps(self, layout: PromptLayout, prepared: Sequence[PreparedText], *,
                           stats: CacheStats | None = None,
                           persist: bool = True) -> Generator[int, None, list[CachedKV]]:
        """:meth:`documents_prepared` as a generator that yields after each batched forward and returns the caches.

        ``Engine.warm`` runs it as a scheduler job, so other requests run (and time out) between the
        forwards of a large corpus instead of waiting for all of it. Each yield is how many of ``prepared``
        have their cache by then (found or computed), which ``Engine.warm`` reports as its progress.
        """
        counters = (self.stats,) if stats is None else (self.stats, stats)
        prefix = self.prefix(layout)
        wanted = [(p.key, p.ids) for p in prepared]
        found: dict[str, CachedKV] = {}
        for key, ids in dict(wanted).items():
            if (entry := self._lookup(key, ids, counters)) is not None:
                found[key] = entry
        missing = list({key: ids for key, ids in wanted if key not in found}.items())
        duplicates = len(wanted) - len(dict(wanted))
        for counter in counters:
            counter.misses += len(missing)  # a duplicate within one request is computed once: one miss ...
            counter.memory_hits += duplicates  # ... and served from memory the second time
        per_key = Counter(key for key, _ in wanted)  # a text given twice is two documents with one cache
        ready = sum(per_key[key] for key in found)
        for group in _token_budget_groups(missing, self.batch_tokens):
            for (key, ids), kv in zip(group, self._compute_batch([ids for _, ids in group], prefix)):
                found[key] = self._add(CachedKV(key, ids, kv), persist)
            ready += sum(per_key[key] for key, _ in group)
            yield ready
        return [found[key] for key, _ in wanted]

    def prefetch(self, prepared: Sequence[PreparedText]) -> None:
        """Bring the host and disk entries among ``prepared`` into the memory tier (no counting, no computing).

        The scheduler runs this on its loader thread, so disk reads and host-to-GPU copies overlap with
        the model's work. With a host tier a disk entry is read into pinned memory (and kept in the host
        tier), then copied to the device asynchronously; the first lookup waits for the copy on the GPU.
        """
        for item in prepared:
            key, ids = item.key, item.ids
            with self._lock:
                if key in self._memory:
                    continue
                host = self._host.get(key)
            if host is not None:
                tier, kv = "host", self._from_host(host)
            else:
                # with a host tier: read into pinned memory (kept there), else straight onto the device
                tier, kv = self._load_persisted(key, ids, torch.device("cpu") if self.host_bytes else None)
                if kv is None:
                    continue
                if self.host_bytes:
                    kv = pinned(kv)
                    with self._lock:
                        self._keep_on_host(CachedKV(key, ids, kv))
            transfer = to_device_async(kv, self.loaded.device)  # already there (no host tier): no copy, no event
            with self._lock:
                if key not in self._memory:
                    self._remember(CachedKV(key, ids, transfer.tensor))
                    if key in self._memory:
                        self._in_flight[key] = transfer
                        self._prefetched[key] = tier

    def contains(self, layout: PromptLayout, text: str) -> bool:
        key = self.entry_key(layout, layout.context_ids(text))
        with self._lock:
            return (key in self._memory or key in self._host or (self.disk is not None and self.disk.contains(key))
                    or (self.remote is not None and self.remote.contains(key)))

    def forget(self, layout: PromptLayout, text: str) -> None:
        """Drop a document's entry from every tier (used when a stored document is changed or deleted)."""
        key = self.entry_key(layout, layout.context_ids(text))
        with self._lock:
            self._drop(key)
            self._drop_host(key)
            if self.disk is not None:
                self.disk.delete(key)
            if self.remote is not None:
                self.remote.delete(key)

    def clear_memory(self) -> None:
        """Empty the memory and host tiers; entries on disk and on the remote server stay (benchmarks use this to time
        cold calls)."""
        with self._lock:
            for key in list(self._memory):
                self._drop(key)
            for key in list(self._host):
                self._drop_host(key)

    @property
    def memory_used(self) -> int:
        """Bytes of KV in the memory tier now."""
        return self._memory_used

    @property
    def host_used(self) -> int:
        """Bytes of KV in the host tier now."""
        return self._host_used

    def disk_used(self) -> int:
        """Bytes of entries in the disk tier now (0 without one); walks the folder, so not for hot paths."""
        if self.disk is None:
            return 0
        return sum(f.stat().st_size for f in self.disk.directory.rglob("*.safetensors") if f.is_file())

    # -- internals -------------------------------------------------------------------------------
    def _lookup(self, key: str, token_ids: tuple[int, ...], counters: tuple[CacheStats, ...]) -> CachedKV | None:
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                self._memory.move_to_end(key)
                _count(counters, self._prefetched.pop(key, "memory"))
                transfer = self._in_flight.pop(key, None)
                if transfer is not None:
                    transfer.wait()  # the compute stream waits for the copy (the CPU does not)
                return entry
            host = self._host.get(key)
            if host is not None:
                self._host.move_to_end(key)
                _count(counters, "host")
                entry = CachedKV(key, token_ids, self._from_host(host))
                self._remember(entry)
                return entry
            corrupt = self.stats.corrupt
            tier, kv = self._load_persisted(key, token_ids, None)
            for counter in counters[1:]:  # the store's own count is kept by the disk and remote tiers
                counter.corrupt += self.stats.corrupt - corrupt
            if kv is None:
                return None
            entry = CachedKV(key, token_ids, kv)
            _count(counters, tier)
            self._remember(entry)
            return entry

    def _load_persisted(self, key: str, token_ids: tuple[int, ...],
                        device: torch.device | None) -> tuple[str, torch.Tensor | None]:
        """The entry from the disk tier, else from the remote tier (then also written to the disk tier, so the next
        lookup is local): ``(tier, kv)``, ``kv`` ``None`` on a miss in both."""
        if self.disk is not None and (kv := self.disk.load(key, token_ids, device)) is not None:
            return "disk", kv
        if self.remote is None or (kv := self.remote.load(key, token_ids, device)) is None:
            return "disk", None
        if self.disk is not None:
            self.disk.save(key, token_ids, kv)
        return "remote", kv

    def _add(self, entry: CachedKV, persist: bool) -> CachedKV:
        """Persist (unless query-time) and remember a freshly computed entry."""
        if persist and self.disk is not None:
            self.disk.save(entry.key, entry.token_ids, entry.kv)
        if persist and self.remote is not None:
            self.remote.save(entry.key, entry.token_ids, entry.kv)
        self._remember(entry)
        return entry

    def _remember(self, entry: CachedKV) -> None:
        """Put an entry in the memory tier and evict the least recently used ones beyond ``memory_bytes``
        (to the host tier, when there is one).

        An entry larger than the whole tier is not kept (it is used once by the request that needed it).
        """
        size = _size(entry)
        with self._lock:
            if size > self.memory_bytes:
                self._keep_on_host(entry)
                return
            self._drop(entry.key)
            self._memory[entry.key] = entry
            self._memory_used += size
            while self._memory_used > self.memory_bytes:
                evicted = self._memory[next(iter(self._memory))]
                self._drop(evicted.key)
                self._keep_on_host(evicted)

    def _keep_on_host(self, entry: CachedKV) -> None:
        """Copy an entry into the host tier (pinned; from the GPU asynchronously) unless it is there or does not fit.

        Copies to and from the host tier run in order on one side stream per GPU (``transfer.py``), so a
        copy back to the GPU never reads a host tensor whose copy from the GPU is still running.
        """
        with self._lock:
            if entry.key in self._host:
                self._host.move_to_end(entry.key)
                return
            if not self.host_bytes:
                return
            # encoded where the entry is (a GPU encodes its own); a host tensor (read from disk into pinned memory,
            # or a CPU model's entry) is kept as it is in the native format
            stored = {name: pinned(tensor) if tensor.device.type == "cpu" else to_host(tensor).tensor
                      for name, tensor in encode(entry.kv, self.host_format).items()}
            host = HostEntry(entry.key, entry.token_ids, stored)
            if host.nbytes > self.host_bytes:
                return
            self._host[entry.key] = host
            self._host_used += host.nbytes
            while self._host_used > self.host_bytes:
                self._drop_host(next(iter(self._host)))

    def _drop(self, key: str) -> None:
        self._prefetched.pop(key, None)
        self._in_flight.pop(key, None)
        entry = self._memory.pop(key, None)
        if entry is not None:
            self._memory_used -= _size(entry)

    def _drop_host(self, key: str) -> None:
        entry = self._host.pop(key, None)
        if entry is not None:
            self._host_used -= entry.nbytes

    def _from_host(self, host: HostEntry) -> torch.Tensor:
        """A host entry on the model's device in its dtype: copied in its stored size (on the side stream, the
        current stream waiting for the copies), then widened there."""
        device = self.loaded.device
        on_device = {name: to_device_async(tensor, device).wait() for name, tensor in host.stored.items()}
        return decode(on_device, self.host_format, self.loaded.dtype, device)

    @torch.inference_mode()
    def _compute(self, token_ids: tuple[int, ...], prefix: CachedKV | None) -> torch.Tensor:
        model, device = self.loaded.model, self.loaded.device
        start = prefix.length if prefix is not None else 0
        cache = cache_from_kv(prefix.kv.unsqueeze(2)) if prefix is not None else DynamicCache()
        ids = torch.tensor([token_ids], device=device)
        positions = torch.arange(start, start + len(token_ids), device=device).unsqueeze(0)
        model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return kv_from_cache(cache, start).contiguous()

    @torch.inference_mode()
    def _compute_batch(self, token_lists: list[tuple[int, ...]], prefix: CachedKV) -> list[torch.Tensor]:
        """Encode several documents after the prefix in one forward pass.

        Documents are right-padded: attention is causal, so a real token never sees the padding
        after it, and the padding's keys are cut off before storing.
        """
        if len(token_lists) == 1:
            return [self._compute(token_lists[0], prefix)]
        device, start = self.loaded.device, prefix.length
        width = max(len(ids) for ids in token_lists)
        pad = token_lists[0][0]
        ids = torch.tensor([list(t) + [pad] * (width - len(t)) for t in token_lists], device=device)
        cache = cache_from_kv(prefix.kv.unsqueeze(2).expand(-1, -1, len(token_lists), -1, -1, -1))
        positions = torch.arange(start, start + width, device=device).expand(len(token_lists), -1)
        self.loaded.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                          logits_to_keep=1, attention_mask=torch.ones(len(token_lists), start + width,
                                                                      dtype=torch.long, device=device))
        spans = [slice(start, start + len(t)) for t in token_lists]
        return [torch.stack([torch.stack([layer.keys[b, :, span], layer.values[b, :, span]]) for layer in cache.layers])
                .contiguous() for b, span in enumerate(spans)]

def _int64_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as native int64 bytes: what the keys have always hashed (a torch int64 tensor's bytes), without
    building a tensor from a list of 2048 ints per document."""
    return array("q", token_ids).tobytes()


def _size(entry: CachedKV) -> int:
    return entry.kv.numel() * entry.kv.element_size()


def _count(counters: tuple[CacheStats, ...], tier: str) -> None:
    """One hit served by ``tier`` ("memory", "host", "disk" or "remote") in every counter."""
    for counter in counters:
        setattr(counter, f"{tier}_hits", getattr(counter, f"{tier}_hits") + 1)


def _token_budget_groups(items: list, budget: int) -> list[list]:
    """Split (key, token_ids) items into groups whose padded size (count x longest) stays within ``budget``."""
    groups: list[list] = []
    for item in sorted(items, key=lambda kv: len(kv[1])):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * len(item[1]) <= budget:
            group.append(item)
        else:
            groups.append([item])
    return groups


@dataclass
class SequenceBatch:
    """B cached sequences (a request's streams on the exclusive path) side by side in one ``DynamicCache``,
    right-padded; the shared batch of every request is the row pool (``rows.py``), not this.

    Keys are stored after RoPE, so a key's column in the buffer does not matter: padding sits at the
    end of the shorter sequences, is masked out, and every new token of sequence b gets position
    ``positions[b]`` through ``position_ids``.
    """

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, columns] 1 = real token, 0 = padding
    positions: torch.Tensor  # [B] position of the next token of each stream
    forward_kwargs: dict = field(default_factory=dict)  # extra model kwargs every step needs (e.g. APE's layout)


def batch_sequences(prefix: CachedKV, contexts: list[CachedKV | None]) -> SequenceBatch:
    """Build one batched cache of ``prefix + context_b`` for each b (``None`` = prefix only, the amateur).

    One allocation and one copy per stream; this runs once per query, never inside a decode step.
    """
    lengths = [c.length if c is not None else 0 for c in contexts]
    width = prefix.length + max(lengths)
    layers, _, heads, _, dim = prefix.kv.shape
    buffer = prefix.kv.new_zeros(layers, 2, len(contexts), heads, width, dim)
    buffer[:, :, :, :, : prefix.length] = prefix.kv.unsqueeze(2)
    mask = torch.zeros(len(contexts), width, dtype=torch.long, device=prefix.kv.device)
    for b, context in enumerate(contexts):
        end = prefix.length + lengths[b]
        if context is not None:
            buffer[:, :, b, :, prefix.length:end] = context.kv
        mask[b, :end] = 1
    positions = torch.tensor([prefix.length + n for n in lengths], device=prefix.kv.device)
    return SequenceBatch(cache_from_kv(buffer), mask, positions)


def concatenated_stream(prefix: CachedKV, contexts: list[CachedKV], next_position: int) -> SequenceBatch:
    """One stream holding ``prefix + context_1 + ... + context_N`` back to back, without padding.

    Keys keep the positions they were encoded at (every context after the prefix, so they share a
    position range: APE's parallel encoding); the next token gets ``next_position``.
    """
    kv = torch.cat([prefix.kv] + [c.kv for c in contexts], dim=3).unsqueeze(2)
    mask = torch.ones(1, kv.shape[4], dtype=torch.long, device=kv.device)
    return SequenceBatch(cache_from_kv(kv), mask, torch.tensor([next_position], device=kv.device))
