"""LlamaIndex instrumentation events for the decoder: KV-cache lookups, decoding results, ingestion warm-up.

Retrieval is already reported by LlamaIndex itself (``RetrievalStartEvent`` / ``RetrievalEndEvent``
from every ``BaseRetriever``), and the answer step by the standard ``SynthesizeStartEvent`` /
``SynthesizeEndEvent`` that :class:`ContextOfExpertsQueryEngine` emits. What LlamaIndex has no event
for are the parts this project adds, so they are defined here as ``BaseEvent`` subclasses and sent
through ``get_dispatcher``: any handler added to the root dispatcher (or to this package's) sees them,
inside the span of the query that caused them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.schema import NodeWithScore

from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.llama_index.convert import cited_node_ids

dispatcher = instrument.get_dispatcher("ctx_integrations.llama_index")


class KVCacheLookupEvent(BaseEvent):
    """The decoder looked up the KV caches of the nodes it answered from.

    ``hits``: caches found (in memory or on disk); ``misses``: caches computed during this answer
    (zero when ingestion warmed them).
    """

    query: str
    mode: str
    node_ids: list[str]
    hits: int
    misses: int

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheLookupEvent"


class DecodingEndEvent(BaseEvent):
    """One answer was decoded: its text, length, timings and the nodes that won its tokens."""

    query: str
    mode: str
    text: str
    num_tokens: int
    finish_reason: str
    timings: dict[str, Any]
    cited_node_ids: list[str]

    @classmethod
    def class_name(cls) -> str:
        return "DecodingEndEvent"


class KVCacheWarmEvent(BaseEvent):
    """An ingestion step computed (misses) or found (hits) the KV caches of a batch of nodes."""

    node_ids: list[str]
    hits: int
    misses: int
    corrupt: int

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheWarmEvent"


def emit_answer_events(query: str, answer: Answer, nodes: Sequence[NodeWithScore]) -> None:
    """Report the cache lookups and the result of one decoded answer."""
    dispatcher.event(KVCacheLookupEvent(query=query, mode=answer.mode, node_ids=[item.node.node_id for item in nodes],
                                        hits=answer.cache_hits, misses=answer.cache_misses))
    dispatcher.event(DecodingEndEvent(query=query, mode=answer.mode, text=answer.text,
                                      num_tokens=len(answer.token_ids), finish_reason=answer.finish_reason,
                                      timings=dict(answer.timings), cited_node_ids=cited_node_ids(answer, nodes)))
