"""Per-document KV caches: compute once, persist as safetensors, load, and batch them into streams.

Layout (METHODS.md "Shared ground"): the shared prefix is encoded once at positions 0..L_p-1 and
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
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ctx_integrations.engine.core.disk import FORMAT_VERSION, CacheStats, DiskTier
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.errors import InvalidOptionError


@dataclass(frozen=True)
class CachedKV:
    """Keys and values of one piece of prompt, shaped ``[layers, 2, kv_heads, tokens, head_dim]``."""

    key: str
    token_ids: tuple[int, ...]
    kv: torch.Tensor

    @property
    def length(self) -> int:
        return self.kv.shape[-2]


def cache_from_kv(kv: torch.Tensor) -> DynamicCache:
    """Wrap a ``[layers, 2, batch, heads, tokens, dim]`` tensor as a transformers ``DynamicCache``."""
    return DynamicCache(ddp_cache_data=[(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])])


def kv_from_cache(cache: DynamicCache, start: int = 0) -> torch.Tensor:
    """Stack a batch-1 ``DynamicCache`` into ``[layers, 2, heads, tokens, dim]`` from column ``start`` on."""
    return torch.stack([torch.stack([layer.keys[0, :, start:], layer.values[0, :, start:]])
                        for layer in cache.layers])


@dataclass
class KVCacheStore:
    """Content-addressed store of document KV caches: in-memory LRU in front of a safetensors folder.

    ``directory=None`` keeps everything in memory only. ``half_on_disk`` stores fp32 caches as fp16
    (half the disk, values rounded, so logits are no longer bit-identical to a fresh prefill).
    """

    loaded: LoadedModel
    directory: Path | None = None
    half_on_disk: bool = False
    memory_entries: int = 256
    batch_tokens: int = 16384
    stats: CacheStats = field(default_factory=CacheStats)
    disk_bytes: int | None = None  # the disk tier's budget (least recently used entries evicted); None: unbounded

    def __post_init__(self) -> None:
        if self.memory_entries < 0:
            raise InvalidOptionError("memory_entries must be >= 0")
        self.disk: DiskTier | None = None
        if self.directory is not None:
            self.disk = DiskTier(Path(self.directory), self.loaded, self.half_on_disk, self.stats, self.disk_bytes)
        self._memory: OrderedDict[str, CachedKV] = OrderedDict()

    # -- keys ------------------------------------------------------------------------------------
    def entry_key(self, layout: PromptLayout, token_ids: list[int] | tuple[int, ...], kind: str = "doc") -> str:
        digest = hashlib.sha256()
        for part in (FORMAT_VERSION, kind, self.loaded.identity, str(self.loaded.dtype), layout.fingerprint):
            digest.update(part.encode() + b"\x1f")
        digest.update(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
        return digest.hexdigest()

    # -- public API ------------------------------------------------------------------------------
    def prefix(self, layout: PromptLayout) -> CachedKV:
        """The shared prefix's cache (system prompt + template text before the documents)."""
        ids = tuple(layout.prefix_ids)
        return self._get(self.entry_key(layout, ids, "prefix"), ids, None, count=False)

    def document(self, layout: PromptLayout, text: str) -> CachedKV:
        """One document's cache, encoded after the shared prefix; computed and stored on a miss."""
        return self.document_tokens(layout, layout.context_ids(text))

    def document_tokens(self, layout: PromptLayout, token_ids: list[int] | tuple[int, ...]) -> CachedKV:
        """Like :meth:`document` for text that is already tokenised with ``layout.context_ids``."""
        ids = tuple(token_ids)
        return self._get(self.entry_key(layout, ids), ids, self.prefix(layout), count=True)

    def documents(self, layout: PromptLayout, texts: list[str]) -> list[CachedKV]:
        return self.documents_tokens(layout, [layout.context_ids(text) for text in texts])

    def documents_tokens(self, layout: PromptLayout, token_lists: list[list[int]]) -> list[CachedKV]:
        """Caches of many documents; all misses are computed together in right-padded batched forwards.

        One forward per ``batch_tokens`` budget instead of one per document: a cold query costs about
        what prefilling the same tokens as one prompt costs.
        """
        prefix = self.prefix(layout)
        wanted = [(self.entry_key(layout, ids), tuple(ids)) for ids in token_lists]
        found: dict[str, CachedKV] = {}
        for key, ids in wanted:
            if key not in found and (entry := self._lookup(key, ids)) is not None:
                found[key] = entry
        missing = list({key: ids for key, ids in wanted if key not in found}.items())
        self.stats.misses += len(missing)  # a duplicate within one request is computed once: one miss
        self.stats.hits += len(wanted) - len(missing)
        for group in _token_budget_groups(missing, self.batch_tokens):
            for (key, ids), kv in zip(group, self._compute_batch([ids for _, ids in group], prefix)):
                found[key] = self._add(CachedKV(key, ids, kv))
        return [found[key] for key, _ in wanted]

    def contains(self, layout: PromptLayout, text: str) -> bool:
        key = self.entry_key(layout, layout.context_ids(text))
        return key in self._memory or (self.disk is not None and self.disk.contains(key))

    def forget(self, layout: PromptLayout, text: str) -> None:
        """Drop a document's entry (used when a stored document is changed or deleted)."""
        key = self.entry_key(layout, layout.context_ids(text))
        self._memory.pop(key, None)
        if self.disk is not None:
            self.disk.delete(key)

    def clear_memory(self) -> None:
        """Empty the in-memory LRU; entries on disk stay (benchmarks use this to time cold calls)."""
        self._memory.clear()

    # -- internals -------------------------------------------------------------------------------
    def _get(self, key: str, token_ids: tuple[int, ...], prefix: CachedKV | None, count: bool) -> CachedKV:
        entry = self._lookup(key, token_ids)
        if entry is not None:
            self.stats.hits += count
            return entry
        self.stats.misses += count
        return self._add(CachedKV(key, token_ids, self._compute(token_ids, prefix)))

    def _lookup(self, key: str, token_ids: tuple[int, ...]) -> CachedKV | None:
        entry = self._memory.get(key)
        if entry is None and self.disk is not None:
            kv = self.disk.load(key, token_ids)
            entry = CachedKV(key, token_ids, kv) if kv is not None else None
        if entry is not None:
            self._remember(entry)
        return entry

    def _add(self, entry: CachedKV) -> CachedKV:
        """Persist and remember a freshly computed entry."""
        if self.disk is not None:
            self.disk.save(entry.key, entry.token_ids, entry.kv)
        self._remember(entry)
        return entry

    def _remember(self, entry: CachedKV) -> None:
        if self.memory_entries == 0:
            return
        self._memory[entry.key] = entry
        self._memory.move_to_end(entry.key)
        while len(self._memory) > self.memory_entries:
            self._memory.popitem(last=False)

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
class StreamBatch:
    """B cached streams laid side by side in one batched cache, right-padded.

    Keys are stored after RoPE, so a key's column in the buffer does not matter: padding sits at the
    end of the shorter streams, is masked out, and every new token of stream b gets position
    ``positions[b]`` through ``position_ids``.
    """

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, columns] 1 = real token, 0 = padding
    positions: torch.Tensor  # [B] position of the next token of each stream
    forward_kwargs: dict = field(default_factory=dict)  # extra model kwargs every step needs (e.g. APE's layout)


def batch_streams(prefix: CachedKV, contexts: list[CachedKV | None]) -> StreamBatch:
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
    return StreamBatch(cache_from_kv(buffer), mask, positions)


def concatenated_stream(prefix: CachedKV, contexts: list[CachedKV], next_position: int) -> StreamBatch:
    """One stream holding ``prefix + context_1 + ... + context_N`` back to back, without padding.

    Keys keep the positions they were encoded at (every context after the prefix, so they share a
    position range: APE's parallel encoding); the next token gets ``next_position``.
    """
    kv = torch.cat([prefix.kv] + [c.kv for c in contexts], dim=3).unsqueeze(2)
    mask = torch.ones(1, kv.shape[4], dtype=torch.long, device=kv.device)
    return StreamBatch(cache_from_kv(kv), mask, torch.tensor([next_position], device=kv.device))
