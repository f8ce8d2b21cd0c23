"""KV caches at ingestion: an ``IngestionPipeline`` step that computes each node's cache, so the first query is warm.

The cache of a node is keyed by the model, the prompt layout and the tokens of the text the decoder will
read (``convert.node_text``: the node text plus its LLM-visible metadata). Editing a node changes those
tokens, so its next query misses and recomputes; a stale entry is never used. Put this step last in the
pipeline (after splitters, extractors and the embedding), so it sees the nodes exactly as they are stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, TransformComponent

from ctx_integrations.adapters import USER_CACHE_DIR, CacheDir
from ctx_integrations.llama_index.convert import node_text
from ctx_integrations.llama_index.events import KVCacheWarmEvent, dispatcher
from ctx_integrations.llama_index.llm import resolve_llm


class KVCacheWarmer(TransformComponent):
    """Compute (or load) every node's KV cache; nodes pass through unchanged.

    The engine is ``engine`` / ``llm``'s, else ``Settings.llm``'s when it is an ExpertDecoderLLM, else the
    shared embedded one with caches in ``cache_dir`` (default: the user cache dir): the same one
    ``ContextOfExpertsQueryEngine`` and ``ContextOfExpertsSynthesizer`` pick with the same arguments.
    ``stats`` totals the cache hits / misses of every run: a node that is already cached (unchanged text,
    same model) is a hit and costs nothing.

    ``IngestionPipeline`` skips a step whose input it has cached; ``engine_key`` (model identity, prompt
    layout and cache folder) is part of that hash, so another model or layout always recomputes. With
    an engine that keeps caches in memory only (``cache_dir=None``), a new process loses them. Run the
    pipeline with ``num_workers=None`` (an engine is not shared across processes).
    """

    engine: Any = Field(default=None, exclude=True, description="a ctx_integrations.Engine; None: embedded default")
    engine_key: str = Field(default="", description="identifies the model, layout and cache folder")
    _stats: dict[str, int] = PrivateAttr(default_factory=lambda: {"hits": 0, "misses": 0, "corrupt": 0})

    def __init__(self, engine: Any = None, *, llm: Any = None, cache_dir: CacheDir = USER_CACHE_DIR, **data: Any):
        resolved = resolve_llm(llm, engine, cache_dir).resolved_engine  # Settings.llm's engine when it is ours
        key = f"{resolved.loaded.identity}:{resolved.layout.fingerprint}:{resolved.store.directory}"
        super().__init__(engine=resolved, engine_key=key, **data)

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheWarmer"

    @property
    def stats(self) -> dict[str, int]:
        """Cache hits / misses / corrupt entries over every run of this step."""
        return dict(self._stats)

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texted = [(node.node_id, text) for node in nodes if (text := node_text(node)).strip()]
        if texted:  # nodes without text (e.g. images) have nothing to cache
            counts = self.engine.warm([text for _, text in texted])
            for key, value in counts.items():
                self._stats[key] += value
            dispatcher.event(KVCacheWarmEvent(node_ids=[node_id for node_id, _ in texted], hits=counts["hits"],
                                              misses=counts["misses"], corrupt=counts["corrupt"]))
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
