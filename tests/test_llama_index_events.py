"""Instrumentation: users' event and span handlers on the root dispatcher see retrieval, cache and decoding.

A handler is added to LlamaIndex's root dispatcher exactly as an observability integration would add
it; the tiny random Llama keeps the decode fast, and its caches live in memory, so the first query
misses and the second hits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import llama_index.core.instrumentation as instrument
import pytest
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler

from ctx_integrations import Engine
from ctx_integrations.llama_index import ContextOfExpertsQueryEngine, KVCacheWarmer
from ctx_integrations.llama_index.events import DecodingEndEvent, KVCacheLookupEvent, KVCacheWarmEvent
from tests.helpers import tiny_loaded
from tests.llama_index_support import QUESTION, make_nodes, memory_index

TOKENS = 6


class Collector(BaseEventHandler):
    events: list[Any] = []

    @classmethod
    def class_name(cls) -> str:
        return "Collector"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)

    def named(self, *names: str) -> list[Any]:
        return [e for e in self.events if e.class_name() in names]


@pytest.fixture
def seen():
    """A fresh event collector and span handler on the root dispatcher, removed afterwards."""
    root = instrument.get_dispatcher()
    collector, spans = Collector(events=[]), SimpleSpanHandler()
    root.add_event_handler(collector)
    root.add_span_handler(spans)
    yield collector, spans
    root.event_handlers.remove(collector)
    root.span_handlers.remove(spans)


@pytest.fixture
def query_engine():
    engine = Engine(tiny_loaded("llama"))  # memory-only caches: nothing cached yet
    return ContextOfExpertsQueryEngine.from_index(memory_index(), engine=engine, similarity_top_k=2,
                                                  max_new_tokens=TOKENS)


def test_a_query_reports_retrieval_cache_lookups_and_decoding_in_order(seen, query_engine):
    collector, spans = seen
    response = query_engine.query(QUESTION)
    node_ids = [item.node.node_id for item in response.source_nodes]
    names = [e.class_name() for e in collector.named("RetrievalStartEvent", "RetrievalEndEvent", "SynthesizeStartEvent",
                                                     "KVCacheLookupEvent", "DecodingEndEvent", "SynthesizeEndEvent")]
    # retrieval (LlamaIndex's own events; the score-keeping wrapper and the index retriever each send a pair)
    # ends before the answer step starts
    retrieval = [name for name in names if name.startswith("Retrieval")]
    assert retrieval and names[:len(retrieval)] == retrieval and retrieval.count("RetrievalEndEvent") >= 1
    assert names[len(retrieval):] == ["SynthesizeStartEvent", "KVCacheLookupEvent", "DecodingEndEvent",
                                      "SynthesizeEndEvent"]
    assert [item.node.node_id for item in collector.named("RetrievalEndEvent")[-1].nodes] == node_ids

    (lookup,) = collector.named("KVCacheLookupEvent")
    assert isinstance(lookup, KVCacheLookupEvent)
    assert lookup.node_ids == node_ids and lookup.mode == "pced" and (lookup.hits, lookup.misses) == (0, 2)
    (decoded,) = collector.named("DecodingEndEvent")
    assert isinstance(decoded, DecodingEndEvent)
    assert decoded.text == response.response and decoded.query == QUESTION
    assert decoded.num_tokens == len(response.metadata["trace"]) == TOKENS
    assert decoded.cited_node_ids == response.metadata["cited_nodes"] and decoded.timings["ttft_s"] > 0

    # the events happen inside the synthesizer's span, inside the engine's synthesize span, inside the query's
    synthesizer = next(s for s in spans.completed_spans if s.id_ == lookup.span_id)
    assert synthesizer.id_.startswith("ContextOfExpertsSynthesizer.synthesize")
    synthesize = next(s for s in spans.completed_spans if s.id_ == synthesizer.parent_id)
    assert synthesize.id_.startswith("ContextOfExpertsQueryEngine.synthesize")
    assert synthesize.parent_id.startswith("ContextOfExpertsQueryEngine._query")

    collector.events.clear()
    query_engine.query(QUESTION)
    (lookup,) = collector.named("KVCacheLookupEvent")
    assert (lookup.hits, lookup.misses) == (2, 0)


def test_streaming_reports_decoding_once_the_stream_is_read(seen, query_engine):
    collector, _ = seen
    query_engine.streaming = True
    response = query_engine.query(QUESTION)
    assert collector.named("SynthesizeEndEvent") and not collector.named("DecodingEndEvent")
    text = "".join(response.response_gen)
    (decoded,) = collector.named("DecodingEndEvent")
    assert decoded.text == text and len(collector.named("KVCacheLookupEvent")) == 1


def test_aquery_and_query_many_report_every_answer(seen, query_engine):
    collector, _ = seen
    asyncio.run(query_engine.aquery(QUESTION))
    assert len(collector.named("KVCacheLookupEvent")) == len(collector.named("DecodingEndEvent")) == 1
    collector.events.clear()
    questions = [QUESTION, "What is the capital of France?"]
    responses = query_engine.query_many(questions)
    decoded = collector.named("DecodingEndEvent")
    assert [e.query for e in decoded] == questions and [e.mode for e in decoded] == ["ippd", "ippd"]
    assert [e.text for e in decoded] == [r.response for r in responses]


def test_ingestion_reports_each_warmed_batch(seen):
    collector, _ = seen
    warmer = KVCacheWarmer(Engine(tiny_loaded("llama")))
    nodes = make_nodes()
    IngestionPipeline(transformations=[warmer]).run(nodes=nodes)
    (warm,) = collector.named("KVCacheWarmEvent")
    assert isinstance(warm, KVCacheWarmEvent)
    assert warm.node_ids == [n.node_id for n in nodes] and (warm.hits, warm.misses, warm.corrupt) == (0, 3, 0)
