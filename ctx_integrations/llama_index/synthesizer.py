"""``ContextOfExpertsSynthesizer``: the local decoder as a LlamaIndex response synthesizer.

A stock query engine keeps its retriever, postprocessors and callbacks and gets the decoder by changing
one argument::

    query_engine = index.as_query_engine(response_synthesizer=ContextOfExpertsSynthesizer())
    query_engine = RetrieverQueryEngine.from_args(retriever, response_synthesizer=ContextOfExpertsSynthesizer())

``synthesize`` answers from the nodes themselves in one ``Engine.generate`` call (PCED by default, any
mode): each node is an expert with its own KV cache (reused across queries and processes) and its
relevance prior r from its score; the ``Response`` carries every score on its ``source_nodes`` and the
per-token trace, the cited nodes, timings and cache hits in its ``metadata``.

Callbacks: the standard ``SynthesizeStartEvent`` / ``SynthesizeEndEvent`` and ``CBEventType.SYNTHESIZE``;
the decode is a call of the :class:`ExpertDecoderLLM` (``ExpertDecoderLLM.decode`` and its stream / async
versions), so it is an LLM span inside the ``synthesize`` span with LlamaIndex's standard
``LLMCompletionStartEvent`` / ``LLMCompletionInProgressEvent`` / ``LLMCompletionEndEvent`` and a legacy
``CBEventType.LLM`` event with the prompt and completion token counts (``TokenCountingHandler`` and
``LlamaDebugHandler`` read it); then this package's ``KVCacheLookupEvent`` / ``DecodingEndEvent``.

A node's score becomes its prior as ``retrieval_score_kind`` says; a stock engine's retriever gives no hint,
so over Chroma pass the kind the index's store gives (``infer_score_kind(index)`` reads the collection's
distance space): ``ContextOfExpertsSynthesizer(retrieval_score_kind=infer_score_kind(index))``.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.indices.prompt_helper import ChatPromptHelper, PromptHelper
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.core.types import RESPONSE_TEXT_TYPE

from ctx_integrations import DEFAULT_MODE, Answer, Document, Engine, check_mode
from ctx_integrations.adapters import USER_CACHE_DIR, CacheDir
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.llama_index.convert import response_metadata, to_document
from ctx_integrations.llama_index.events import emit_answer_events
from ctx_integrations.llama_index.llm import ExpertDecoderLLM, ReportedAnswerStream, resolve_llm
from ctx_integrations.llama_index.score_keeping import (
    SCORES_KEY,
    finalize,
    keep_retrieval_score,
    node_scores,
)
from ctx_integrations.llama_index.scores import check_score_kind

dispatcher = instrument.get_dispatcher(__name__)


class MissingScoreWarning(UserWarning):
    """Nodes reached the decoder without a score, so they get r = 1 (no relevance prior)."""


class ContextOfExpertsSynthesizer(BaseSynthesizer):
    """Answer from the retrieved nodes with the local decoder (PCED by default), keeping every score.

    Args:
        llm: an :class:`ExpertDecoderLLM` (its engine decodes); default ``Settings.llm`` when it is one,
            else the shared embedded model (a warning says so when ``Settings.llm`` is another LLM).
        engine, cache_dir: instead of ``llm``, an :class:`~ctx_integrations.Engine`, or where the shared
            engine keeps KV caches (left out: the user cache dir; ``None``: memory only).
        mode, mode_options: the decoding mode and ``{mode: {option: value}}`` (checked here).
        retrieval_score_kind: what ``node.score`` means for nodes that arrive without kept scores (a stock
            retriever): ``"dense"`` (default: the in-memory store's cosine) or another kind of
            :data:`ctx_integrations.llama_index.SCORE_KINDS` (``"chroma_l2"`` for Chroma's default space,
            ``"relevance"`` for a score already in [0, 1]). Nodes from a :class:`ScoreKeepingRetriever` or
            :class:`RerankerScoreFusion` keep what they carry.
        streaming: ``synthesize`` returns a ``StreamingResponse`` (``asynthesize``: ``AsyncStreamingResponse``).
        max_new_tokens (alias max_tokens), temperature, top_p, seed, stop: default to the LLM's.

    A node without any score gets r = 1 (no prior); the first such query warns (:class:`MissingScoreWarning`).
    """

    def __init__(self, llm: ExpertDecoderLLM | None = None, *, engine: Engine | None = None,
                 cache_dir: CacheDir = USER_CACHE_DIR, mode: str = DEFAULT_MODE,
                 mode_options: Mapping[str, Mapping[str, Any]] | None = None, retrieval_score_kind: str = "dense",
                 streaming: bool = False, max_new_tokens: int | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | None = None, callback_manager: CallbackManager | None = None):
        llm = resolve_llm(llm, engine, cache_dir)
        check_mode(mode)
        self.mode = mode
        self.mode_options = {name: dict(options) for name, options in (mode_options or {}).items()}
        for name, options in self.mode_options.items():
            check_mode(name, options)
        self.retrieval_score_kind = check_score_kind(retrieval_score_kind)
        self.sampling = llm.sampling_params({"max_new_tokens": max_new_tokens, "max_tokens": max_tokens,
                                             "temperature": temperature, "top_p": top_p, "seed": seed, "stop": stop})
        self._warned_missing_scores = False
        # explicit prompt helpers: the defaults read llm.metadata, which would load the model at construction
        super().__init__(llm=llm, callback_manager=callback_manager, prompt_helper=PromptHelper(),
                         chat_prompt_helper=ChatPromptHelper(), streaming=streaming)

    @property
    def llm(self) -> ExpertDecoderLLM:
        return self._llm

    @property
    def engine(self) -> Engine:
        """The engine that decodes (the shared embedded one is loaded on first use)."""
        return self._llm.resolved_engine

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {}  # the prompt is the model's chat template and the engine's layout, not a LlamaIndex prompt

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        if prompts:
            raise InvalidOptionError(f"ContextOfExpertsSynthesizer has no LlamaIndex prompts to update (got "
                                     f"{', '.join(prompts)}): its prompt is the engine's layout (Engine(system_prompt="
                                     "..., question_template=...))")

    # ----------------------------------------------------------------- nodes -> documents

    def scored_nodes(self, nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
        """The nodes as the decoder sees them: every score kept in metadata, ``node.score`` = the fused r."""
        kept = [item if SCORES_KEY in item.node.metadata else keep_retrieval_score(item, self.retrieval_score_kind)
                for item in nodes]
        missing = [item.node.node_id for item in kept if "fused" not in node_scores(item)[1]]
        if missing and not self._warned_missing_scores:
            self._warned_missing_scores = True
            warnings.warn(f"{len(missing)} node(s) reached the decoder without a score (first: {missing[0]!r}), so "
                          "they get r = 1, no relevance prior: use a retriever that scores nodes "
                          "(index.as_retriever()), or give the nodes a score in a node postprocessor "
                          "(RerankerScoreFusion after a reranker)", MissingScoreWarning, stacklevel=4)
        return [finalize(item) for item in kept]

    def _options(self, mode: str) -> dict[str, Any]:
        return self.mode_options.get(mode, {})

    def _documents(self, nodes: Sequence[NodeWithScore]) -> list[Document]:
        return [to_document(item) for item in nodes]

    # ----------------------------------------------------------------- one answer

    def answer(self, query: str, nodes: list[NodeWithScore]) -> Answer:
        """Decode one answer over ``nodes`` (already scored) as a call of the LLM (:meth:`ExpertDecoderLLM.decode`:
        its span, LlamaIndex's completion events and a legacy ``CBEventType.LLM`` event on this synthesizer's
        callback manager)."""
        return self._llm.decode(query, self._documents(nodes), mode=self.mode, sampling=self.sampling,
                                callback_manager=self.callback_manager, **self._options(self.mode))

    async def aanswer(self, query: str, nodes: list[NodeWithScore]) -> Answer:
        return await self._llm.adecode(query, self._documents(nodes), mode=self.mode, sampling=self.sampling,
                                       callback_manager=self.callback_manager, **self._options(self.mode))

    def response(self, query: str, answer: Answer, nodes: list[NodeWithScore]) -> Response:
        """The ``Response`` of a decoded answer (its cache and decoding events are sent on the way)."""
        return Response(answer.text, source_nodes=nodes, metadata=self.answer_metadata(query, answer, nodes))

    def answer_metadata(self, query: str, answer: Answer, nodes: list[NodeWithScore]) -> dict[str, Any]:
        emit_answer_events(query, answer, nodes)
        return response_metadata(answer, nodes, self.engine.loaded.name)

    def _stream(self, query: str, nodes: list[NodeWithScore], metadata: dict[str, Any]) -> Iterator[str]:
        """Text pieces as decoded; when the answer is complete, ``metadata`` (the response's own dict) is filled.

        The LLM's stream is started now (its span and start event belong to the caller's span, e.g.
        ``synthesize``); decoding starts when the pieces are read.
        """
        pieces = self._llm.stream_decode(query, self._documents(nodes), mode=self.mode, sampling=self.sampling,
                                         callback_manager=self.callback_manager, **self._options(self.mode))
        return self._finish(pieces, query, nodes, metadata)

    def _finish(self, pieces: Generator[str, None, Answer], query: str, nodes: list[NodeWithScore],
                metadata: dict[str, Any]) -> Iterator[str]:
        answer = yield from pieces
        metadata.update(self.answer_metadata(query, answer, nodes))

    async def _astream(self, query: str, nodes: list[NodeWithScore], metadata: dict[str, Any]) -> AsyncIterator[str]:
        """Like :meth:`_stream`, awaited (the stream is started in the caller's span), yielding async pieces."""
        stream = await self._llm.astream_decode(query, self._documents(nodes), mode=self.mode, sampling=self.sampling,
                                                callback_manager=self.callback_manager, **self._options(self.mode))
        return self._afinish(stream, query, nodes, metadata)

    async def _afinish(self, stream: ReportedAnswerStream, query: str, nodes: list[NodeWithScore],
                       metadata: dict[str, Any]) -> AsyncIterator[str]:
        try:
            async for piece in stream:
                yield piece
        finally:
            await stream.aclose()  # a consumer that stopped early cancels the request
        metadata.update(self.answer_metadata(query, stream.answer, nodes))

    # ----------------------------------------------------------------- BaseSynthesizer

    def _empty(self, query: QueryTextType, asynchronous: bool) -> RESPONSE_TYPE:
        """No nodes: what every stock synthesizer answers (``Empty Response``), streamed when streaming."""
        if not self._streaming:
            response: RESPONSE_TYPE = Response(self._empty_response)
        elif asynchronous:
            response = AsyncStreamingResponse(response_gen=self._empty_response_agenerator())
        else:
            response = StreamingResponse(response_gen=self._empty_response_generator())
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @dispatcher.span
    def synthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None,
                   **response_kwargs: Any) -> RESPONSE_TYPE:
        """Decode an answer from ``nodes`` in one engine call (``additional_source_nodes`` are listed, not read)."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        if not nodes:
            return self._empty(query, asynchronous=False)
        bundle = QueryBundle(query) if isinstance(query, str) else query
        nodes = self.scored_nodes(nodes)
        sources = nodes + list(additional_source_nodes or [])
        with self.callback_manager.event(CBEventType.SYNTHESIZE,
                                         payload={EventPayload.QUERY_STR: bundle.query_str}) as event:
            if self._streaming:
                metadata: dict[str, Any] = {}
                response: RESPONSE_TYPE = StreamingResponse(
                    response_gen=self._stream(bundle.query_str, nodes, metadata), source_nodes=sources,
                    metadata=metadata)
            else:
                answer = self.answer(bundle.query_str, nodes)
                response = Response(answer.text, source_nodes=sources,
                                    metadata=self.answer_metadata(bundle.query_str, answer, nodes))
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    @dispatcher.span
    async def asynthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None,
                          **response_kwargs: Any) -> RESPONSE_TYPE:
        """Like :meth:`synthesize`, through ``Engine.agenerate`` / ``Engine.astream``."""
        dispatcher.event(SynthesizeStartEvent(query=query))
        if not nodes:
            return self._empty(query, asynchronous=True)
        await asyncio.to_thread(lambda: self.engine)  # the first use may load the model: not on the event loop
        bundle = QueryBundle(query) if isinstance(query, str) else query
        nodes = self.scored_nodes(nodes)
        sources = nodes + list(additional_source_nodes or [])
        with self.callback_manager.event(CBEventType.SYNTHESIZE,
                                         payload={EventPayload.QUERY_STR: bundle.query_str}) as event:
            if self._streaming:
                metadata: dict[str, Any] = {}
                response: RESPONSE_TYPE = AsyncStreamingResponse(
                    response_gen=await self._astream(bundle.query_str, nodes, metadata), source_nodes=sources,
                    metadata=metadata)
            else:
                answer = await self.aanswer(bundle.query_str, nodes)
                response = Response(answer.text, source_nodes=sources,
                                    metadata=self.answer_metadata(bundle.query_str, answer, nodes))
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        """Bare text chunks (no nodes, so no scores): each chunk is an expert with r = 1."""
        nodes = [NodeWithScore(node=_text_node(text), score=None) for text in text_chunks]
        if self._streaming:
            return self._stream(query_str, self.scored_nodes(nodes), {})
        return self.answer(query_str, self.scored_nodes(nodes)).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        nodes = [NodeWithScore(node=_text_node(text), score=None) for text in text_chunks]
        if self._streaming:
            return await self._astream(query_str, self.scored_nodes(nodes), {})
        return (await self.aanswer(query_str, self.scored_nodes(nodes))).text


def _text_node(text: str) -> Any:
    from llama_index.core.schema import TextNode

    return TextNode(text=text)
