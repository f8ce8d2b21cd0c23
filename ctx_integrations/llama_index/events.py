"""What the decoder reports to LlamaIndex's instrumentation and callbacks: the LLM call, KV caches, ingestion.

Retrieval is already reported by LlamaIndex itself (``RetrievalStartEvent`` / ``RetrievalEndEvent``
from every ``BaseRetriever``), and the answer step by the standard ``SynthesizeStartEvent`` /
``SynthesizeEndEvent`` that :class:`ContextOfExpertsQueryEngine` emits. The decode itself is an LLM call
and is reported as LlamaIndex's own LLMs report one (:class:`CompletionReport`): the standard
``LLMCompletionStartEvent`` / ``LLMCompletionInProgressEvent`` / ``LLMCompletionEndEvent`` (what tracing
integrations turn into an LLM span) and the legacy ``CBEventType.LLM`` callback event (what
``TokenCountingHandler`` and ``LlamaDebugHandler`` read). LlamaIndex's ``llm_completion_callback``
decorator cannot be reused for it: it wraps ``complete(prompt)``, while the decoder reads documents and a
question, not one prompt string. What LlamaIndex has no event for are the parts this project adds, so
they are defined here as ``BaseEvent`` subclasses and sent through ``get_dispatcher``: any handler added
to the root dispatcher (or to this package's) sees them, inside the span of the query that caused them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.exception import ExceptionEvent
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionInProgressEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.schema import NodeWithScore

from ctx_integrations import Answer, Document, Engine
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


def decoder_prompt(question: str, documents: Sequence[Document]) -> str:
    """The prompt as the decoder reads it, as one string for handlers: the documents, then the question."""
    return "\n\n".join([*(doc.text for doc in documents), question])


class CompletionReport:
    """One decode over documents, reported as LlamaIndex's LLMs report a ``complete`` call.

    Built when the call starts (inside the LLM's span: every event carries that ``span_id``, also the ones
    a stream sends after the span has returned, as LlamaIndex's own streaming LLMs do), it sends
    ``LLMCompletionStartEvent`` and opens a legacy ``CBEventType.LLM`` event on ``callback_manager``;
    :meth:`piece` reports streamed text, :meth:`end` the answer (a ``CompletionResponse`` whose
    ``raw["usage"]`` has the real prompt and completion token counts), :meth:`fail` an error.
    """

    def __init__(self, engine: Engine, question: str, documents: Sequence[Document], *, model: Mapping[str, Any],
                 options: Mapping[str, Any], callback_manager: CallbackManager):
        self.engine, self.question, self.documents = engine, question, list(documents)
        self.prompt = decoder_prompt(question, self.documents)
        self.callback_manager = callback_manager
        self.span_id = active_span_id.get()
        self.text = ""
        dispatcher.event(LLMCompletionStartEvent(prompt=self.prompt, additional_kwargs=dict(options),
                                                 model_dict=dict(model), span_id=self.span_id))
        self.event_id = callback_manager.on_event_start(CBEventType.LLM, payload={
            EventPayload.PROMPT: self.prompt, EventPayload.SERIALIZED: dict(model)})

    def completion(self, answer: Answer) -> CompletionResponse:
        """The answer as an LLM completion whose ``raw["usage"]`` is what ``TokenCountingHandler`` reads."""
        prompt = answer.prompt_tokens  # counted once, when the request was prepared
        completion = len(answer.token_ids)
        return CompletionResponse(text=answer.text, raw={
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "model": self.engine.loaded.name, "mode": answer.mode, "timings": dict(answer.timings)})

    def piece(self, delta: str) -> None:
        """A streamed piece of the answer (``LLMCompletionInProgressEvent``: the text so far and the delta)."""
        self.text += delta
        dispatcher.event(LLMCompletionInProgressEvent(
            prompt=self.prompt, response=CompletionResponse(text=self.text, delta=delta), span_id=self.span_id))

    def end(self, answer: Answer) -> None:
        response = self.completion(answer)
        self.callback_manager.on_event_end(CBEventType.LLM, payload={
            EventPayload.PROMPT: self.prompt, EventPayload.COMPLETION: response}, event_id=self.event_id)
        dispatcher.event(LLMCompletionEndEvent(prompt=self.prompt, response=response, span_id=self.span_id))

    def fail(self, error: BaseException) -> None:
        """The decode raised: the legacy event ends with the exception, and an ``ExceptionEvent`` is sent."""
        self.callback_manager.on_event_end(CBEventType.LLM, payload={EventPayload.EXCEPTION: error},
                                           event_id=self.event_id)
        dispatcher.event(ExceptionEvent(exception=error, span_id=self.span_id))
