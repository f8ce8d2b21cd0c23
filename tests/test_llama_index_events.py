"""Instrumentation: users' event and span handlers on the root dispatcher see retrieval, cache and decoding.

A handler is added to LlamaIndex's root dispatcher exactly as an observability integration would add
it; the tiny random Llama keeps the decode fast, and its caches live in memory, so the first query
misses and the second hits. Every LLM call, the query engine's decode included, is an ``ExpertDecoderLLM``
span carrying LlamaIndex's standard LLM events, which is what tracing integrations build their LLM spans from.
"""

from __future__ import annotations

import asyncio
from typing import Any

import llama_index.core.instrumentation as instrument
import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload, LlamaDebugHandler
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler

from ctx_integrations import DEFAULT_MODE, Document, Engine
from ctx_integrations.errors import RequestTooLargeError
from ctx_integrations.llama_index import (
    ContextOfExpertsQueryEngine,
    ContextOfExpertsSynthesizer,
    ExpertDecoderLLM,
    KVCacheWarmer,
)
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
    assert lookup.node_ids == node_ids and lookup.mode == DEFAULT_MODE and (lookup.hits, lookup.misses) == (0, 2)
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


# -- LlamaIndex's standard LLM events and the LLM span ---------------------------------------------------------
PROMPT = "Name a colour."
MESSAGES = [ChatMessage(role=MessageRole.USER, content="Hi")]


def llm_span(spans: SimpleSpanHandler, method: str) -> Any:
    """The one completed span of ``ExpertDecoderLLM.<method>``."""
    (span,) = [s for s in spans.completed_spans if s.id_.split("-")[0] == f"ExpertDecoderLLM.{method}"]
    return span


def llm_events(collector: Collector, kind: str) -> tuple[Any, list[Any], Any]:
    """The start event, the in-progress events and the end event of the one ``LLM<kind>`` call seen."""
    (start,) = collector.named(f"LLM{kind}StartEvent")
    (end,) = collector.named(f"LLM{kind}EndEvent")
    return start, collector.named(f"LLM{kind}InProgressEvent"), end


async def _collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


LLM_CALLS = {  # method -> (event kind, call returning the chunks it produced)
    "complete": ("Completion", lambda llm: [llm.complete(PROMPT)]),
    "stream_complete": ("Completion", lambda llm: list(llm.stream_complete(PROMPT))),
    "acomplete": ("Completion", lambda llm: [asyncio.run(llm.acomplete(PROMPT))]),
    "astream_complete": ("Completion", lambda llm: asyncio.run(_acollect(llm.astream_complete(PROMPT)))),
    "chat": ("Chat", lambda llm: [llm.chat(MESSAGES)]),
    "stream_chat": ("Chat", lambda llm: list(llm.stream_chat(MESSAGES))),
    "achat": ("Chat", lambda llm: [asyncio.run(llm.achat(MESSAGES))]),
    "astream_chat": ("Chat", lambda llm: asyncio.run(_acollect(llm.astream_chat(MESSAGES)))),
}


async def _acollect(call: Any) -> list[Any]:
    return await _collect(await call)


@pytest.mark.parametrize("method", list(LLM_CALLS))
def test_every_llm_call_is_a_span_with_the_standard_llm_events(seen, method):
    collector, spans = seen
    engine = Engine(tiny_loaded("llama"))
    kind, call = LLM_CALLS[method]
    chunks = call(ExpertDecoderLLM(engine=engine, max_new_tokens=TOKENS))
    span = llm_span(spans, method)
    start, progress, end = llm_events(collector, kind)
    assert {start.span_id, end.span_id, *(e.span_id for e in progress)} == {span.id_}
    assert start.model_dict["model_name"] == engine.loaded.name
    if kind == "Completion":
        assert start.prompt == end.prompt == PROMPT and end.response.text == chunks[-1].text
    else:
        assert start.messages == MESSAGES and end.response.message.content == chunks[-1].message.content
    streamed = method.startswith(("stream", "astream"))
    assert len(progress) == (len(chunks) if streamed else 0) and (not streamed or len(progress) > 1)


QUERIES = {  # how the query is made -> (the LLM span's method, the synthesizer span it is inside)
    "query": ("decode", "synthesize"),
    "aquery": ("adecode", "asynthesize"),
    "stream": ("stream_decode", "synthesize"),
    "astream": ("astream_decode", "asynthesize"),
}


async def _aquery(query_engine: Any, streaming: bool) -> Any:
    response = await query_engine.aquery(QUESTION)
    if streaming:
        response.response_txt = "".join([piece async for piece in response.async_response_gen()])
    return response


@pytest.mark.parametrize("stock", [False, True], ids=["ours", "stock-engine"])
@pytest.mark.parametrize("how", list(QUERIES))
def test_the_query_engine_decode_is_an_llm_span_with_completion_events(seen, how, stock):
    """ContextOfExpertsQueryEngine, or a stock engine with ContextOfExpertsSynthesizer: the decode is one
    ``ExpertDecoderLLM`` span inside the synthesizer's, with start, streamed pieces and end, as for ``complete``."""
    collector, spans = seen
    llm = ExpertDecoderLLM(engine=Engine(tiny_loaded("llama")), max_new_tokens=TOKENS)
    streaming = how in ("stream", "astream")
    index = memory_index()
    query_engine = (index.as_query_engine(llm=llm, similarity_top_k=2, streaming=streaming,
                                          response_synthesizer=ContextOfExpertsSynthesizer(llm, streaming=streaming))
                    if stock else ContextOfExpertsQueryEngine.from_index(index, llm=llm, similarity_top_k=2,
                                                                         streaming=streaming))
    if how.startswith("a"):
        response = asyncio.run(_aquery(query_engine, streaming))
    else:
        response = query_engine.query(QUESTION)
        if streaming:
            response.response_txt = "".join(response.response_gen)
    text = response.response_txt if streaming else response.response
    method, parent = QUERIES[how]
    span = llm_span(spans, method)
    assert span.parent_id.split("-")[0] == f"ContextOfExpertsSynthesizer.{parent}"
    start, progress, end = llm_events(collector, "Completion")
    assert {start.span_id, end.span_id, *(e.span_id for e in progress)} == {span.id_}
    assert start.prompt == end.prompt and start.prompt.endswith(QUESTION)
    assert all(item.node.get_content() in start.prompt for item in response.source_nodes)
    assert start.model_dict["model_name"] == llm.resolved_engine.loaded.name
    assert start.additional_kwargs["mode"] == DEFAULT_MODE
    assert end.response.text == text and end.response.raw["usage"]["completion_tokens"] == TOKENS
    if streaming:
        assert len(progress) > 1 and "".join(e.response.delta for e in progress) == text
        assert progress[-1].response.text == text
    else:
        assert progress == []
    names = [e.class_name() for e in collector.named("SynthesizeStartEvent", "LLMCompletionStartEvent",
                                                     "LLMCompletionEndEvent", "DecodingEndEvent")]
    assert names == ["SynthesizeStartEvent", "LLMCompletionStartEvent", "LLMCompletionEndEvent", "DecodingEndEvent"]


def test_query_many_is_one_llm_span_with_a_completion_per_question(seen, query_engine):
    collector, spans = seen
    questions = [QUESTION, "What is the capital of France?"]
    responses = query_engine.query_many(questions)
    span = llm_span(spans, "decode_many")
    assert span.parent_id.split("-")[0] == "ContextOfExpertsQueryEngine.query_many"
    starts, ends = collector.named("LLMCompletionStartEvent"), collector.named("LLMCompletionEndEvent")
    assert [e.prompt.rsplit("\n\n", 1)[-1] for e in starts] == questions
    assert [e.response.text for e in ends] == [r.response for r in responses]
    assert {e.span_id for e in starts + ends} == {span.id_}
    assert all(e.additional_kwargs["mode"] == "ippd" for e in starts)


async def _adecode(llm: ExpertDecoderLLM, method: str, **kwargs: Any) -> Any:
    if method == "adecode":
        return await llm.adecode(QUESTION, **kwargs)
    return [piece async for piece in await llm.astream_decode(QUESTION, **kwargs)]


@pytest.mark.parametrize("method", ["decode", "stream_decode", "adecode", "astream_decode"])
def test_a_decode_that_fails_ends_its_llm_events_with_the_error(seen, method):
    """Every started completion is ended: a decode that raises sends an ``ExceptionEvent`` in the LLM's span and
    ends the legacy LLM event with the exception (``RequestTooLargeError``: its caches exceed the budget)."""
    collector, spans = seen
    llm = ExpertDecoderLLM(engine=Engine(tiny_loaded("llama"), max_request_bytes=1), max_new_tokens=TOKENS)
    debug = LlamaDebugHandler()
    kwargs = {"documents": [Document("The secret code of the vault is 4721.")],
              "callback_manager": CallbackManager([debug])}
    with pytest.raises(RequestTooLargeError):
        if method.startswith("a"):
            asyncio.run(_adecode(llm, method, **kwargs))
        elif method == "decode":
            llm.decode(QUESTION, **kwargs)
        else:
            list(llm.stream_decode(QUESTION, **kwargs))
    span_id = next(s for s in spans.dropped_spans + spans.completed_spans
                   if s.id_.split("-")[0] == f"ExpertDecoderLLM.{method}").id_
    (start,) = collector.named("LLMCompletionStartEvent")
    (error,) = collector.named("ExceptionEvent")
    assert start.span_id == error.span_id == span_id and isinstance(error.exception, RequestTooLargeError)
    assert not collector.named("LLMCompletionEndEvent")
    ((_, end),) = debug.get_event_pairs(CBEventType.LLM)
    assert isinstance(end.payload[EventPayload.EXCEPTION], RequestTooLargeError)
