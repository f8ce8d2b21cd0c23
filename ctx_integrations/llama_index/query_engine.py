"""``ContextOfExpertsQueryEngine``: a LlamaIndex query engine whose answer step is the local decoder.

retrieve (any LlamaIndex retriever; every score kept) -> node postprocessors (rerankers; their scores
kept and fused with the retrieval score) -> one ``Engine.generate`` call over the nodes, their fused
relevance r and their cached KV -> a ``Response`` whose ``source_nodes`` carry every score and whose
``metadata`` holds the per-token trace, the cited nodes, timings and cache hits. ``query_many`` answers a
list of questions in one ``Engine.generate_many`` call (IPPD by default), sharing contexts between
questions that retrieved the same nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType
from llama_index.core.settings import Settings

from ctx_integrations.adapters import check_engine, resolve_engine
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.engine import Engine
from ctx_integrations.engine.core.registry import check_options, resolve_mode
from ctx_integrations.engine.core.token_stream import aiter_tokens, iter_tokens
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError
from ctx_integrations.llama_index.convert import node_text, response_metadata, to_document
from ctx_integrations.llama_index.events import emit_answer_events
from ctx_integrations.llama_index.llm import ExpertDecoderLLM
from ctx_integrations.llama_index.score_keeping import (
    SCORES_KEY,
    RerankerScoreFusion,
    ScoreKeepingRetriever,
    finalize,
    keep_reranker_score,
    keep_retrieval_score,
)
from ctx_integrations.llama_index.scores import check_score_kind

dispatcher = instrument.get_dispatcher(__name__)
TokenCall = Callable[[Callable[[str], None] | None], Answer]


class ContextOfExpertsQueryEngine(BaseQueryEngine):
    """Answer LlamaIndex queries with the local decoder (PCED by default), keeping every score.

    Args:
        retriever: any LlamaIndex ``BaseRetriever`` (e.g. ``index.as_retriever(similarity_top_k=4)``).
        engine: a :class:`~ctx_integrations.Engine`, an :class:`ExpertDecoderLLM` (its engine is used), or
            ``None`` for the shared embedded default (loaded at the first query).
        mode: any mode the engine has (``engine.modes``: ``pced``, ``concat``, ``single``, ...).
        mode_options: ``{mode: {option: value}}``, e.g. ``{"pced": {"gamma": 2.0}}``; checked here.
        node_postprocessors: run in order after retrieval. One that changes ``node.score`` is a reranker:
            its score is kept as ``reranker`` and fused with the retrieval score (harmonic mean).
        retrieval_score_kind: what the retriever's ``node.score`` is; ``"auto"`` knows the default
            in-memory store and Chroma (see :mod:`ctx_integrations.llama_index.scores`).
        reranker_score_kind: what a reranker writes: ``"reranker"`` (a logit) or ``"relevance"`` ([0, 1]).
        streaming: ``query`` returns a ``StreamingResponse`` (``aquery``: ``AsyncStreamingResponse``)
            yielding text pieces as they are decoded.
        max_new_tokens, temperature, top_p, seed, stop: decoding settings of every answer.
        batch_mode: the mode of :meth:`query_many` (default ``"ippd"``: questions over the same nodes
            in one stacked decode); ``None`` answers each question with ``mode``, exactly as ``query``.
    """

    def __init__(self, retriever: BaseRetriever, *, engine: Engine | ExpertDecoderLLM | None = None,
                 mode: str = "pced", mode_options: Mapping[str, Mapping[str, Any]] | None = None,
                 node_postprocessors: Sequence[BaseNodePostprocessor] | None = None,
                 retrieval_score_kind: str = "auto", reranker_score_kind: str = "reranker",
                 streaming: bool = False, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] = (), batch_mode: str | None = "ippd",
                 callback_manager: CallbackManager | None = None):
        self.engine = engine.engine if isinstance(engine, ExpertDecoderLLM) else engine
        check_engine(self.engine)
        resolve_mode(mode)
        if batch_mode is not None:
            resolve_mode(batch_mode)
        self.mode, self.batch_mode = mode, batch_mode
        self.mode_options = {name: dict(options) for name, options in (mode_options or {}).items()}
        for name, options in self.mode_options.items():
            check_options(name, options)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidOptionError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                         "stop": tuple(stop)}
        self.streaming = streaming
        self.reranker_score_kind = check_score_kind(reranker_score_kind)
        if isinstance(retriever, ScoreKeepingRetriever):
            if retrieval_score_kind not in ("auto", retriever.score_kind):
                raise InvalidOptionError(f"the retriever already keeps {retriever.score_kind!r} scores: drop "
                                         f"retrieval_score_kind={retrieval_score_kind!r}")
            self.retriever = retriever
        else:
            self.retriever = ScoreKeepingRetriever(retriever, retrieval_score_kind)
        self.node_postprocessors = list(node_postprocessors or [])
        for postprocessor in self.node_postprocessors:
            if not isinstance(postprocessor, BaseNodePostprocessor):
                raise InvalidOptionError(f"node_postprocessors must be LlamaIndex BaseNodePostprocessor objects, got "
                                         f"{type(postprocessor).__name__}")
        callback_manager = callback_manager or Settings.callback_manager
        for postprocessor in self.node_postprocessors:
            postprocessor.callback_manager = callback_manager
        super().__init__(callback_manager=callback_manager)

    @classmethod
    def from_index(cls, index: Any, *, engine: Engine | ExpertDecoderLLM | None = None, mode: str = "pced",
                   similarity_top_k: int | None = None, retriever_kwargs: Mapping[str, Any] | None = None,
                   **options: Any) -> ContextOfExpertsQueryEngine:
        """Build over ``index.as_retriever(...)``; the embedded decoder unless ``engine`` is given.

        ``retriever_kwargs`` go to ``as_retriever`` (e.g. ``filters``); ``options`` to the constructor.
        """
        kwargs = dict(retriever_kwargs or {})
        if similarity_top_k is not None:
            kwargs["similarity_top_k"] = similarity_top_k
        return cls(index.as_retriever(**kwargs), engine=engine, mode=mode, **options)

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}  # the prompt is the model's chat template and the engine's layout, not a LlamaIndex prompt

    # ----------------------------------------------------------------- retrieval with every score

    def _rescored(self, previous: dict[str, float | None], after: list[NodeWithScore]) -> list[NodeWithScore]:
        """Keep the score of every node a postprocessor rescored (a reranker) and fuse it with r_ret.

        ``previous`` is taken before the postprocessor runs: rerankers overwrite ``node.score`` in place.
        """

        def rescored(item: NodeWithScore) -> bool:
            node_id = item.node.node_id
            return item.score is not None and node_id in previous and item.score != previous[node_id]

        return [keep_reranker_score(item, self.reranker_score_kind) if rescored(item) else item for item in after]

    def _postprocess(self, nodes: list[NodeWithScore], query_bundle: QueryBundle) -> list[NodeWithScore]:
        for postprocessor in self.node_postprocessors:
            previous = {item.node.node_id: item.score for item in nodes}
            processed = postprocessor.postprocess_nodes(nodes, query_bundle=query_bundle)
            nodes = processed if isinstance(postprocessor, RerankerScoreFusion) else self._rescored(previous, processed)
        return [finalize(item) for item in nodes]

    async def _apostprocess(self, nodes: list[NodeWithScore], query_bundle: QueryBundle) -> list[NodeWithScore]:
        for postprocessor in self.node_postprocessors:
            previous = {item.node.node_id: item.score for item in nodes}
            processed = await postprocessor.apostprocess_nodes(nodes, query_bundle=query_bundle)
            nodes = processed if isinstance(postprocessor, RerankerScoreFusion) else self._rescored(previous, processed)
        return [finalize(item) for item in nodes]

    def retrieve(self, query_bundle: QueryType) -> list[NodeWithScore]:
        """The nodes the decoder would read: retrieved, postprocessed, ``score`` = fused r, every part in metadata."""
        query_bundle = _bundle(query_bundle)
        return self._postprocess(self.retriever.retrieve(query_bundle), query_bundle)

    async def aretrieve(self, query_bundle: QueryType) -> list[NodeWithScore]:
        query_bundle = _bundle(query_bundle)
        return await self._apostprocess(await self.retriever.aretrieve(query_bundle), query_bundle)

    # ----------------------------------------------------------------- decoding

    def _scored(self, nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
        """Nodes handed to ``synthesize`` from elsewhere: keep their scores as this retriever's kind first."""
        kind = self.retriever.score_kind
        return [item if SCORES_KEY in item.node.metadata else finalize(keep_retrieval_score(item, kind))
                for item in nodes]

    @staticmethod
    def _require_nodes(query: str, nodes: list[NodeWithScore]) -> None:
        if not nodes:
            raise EmptyDocumentsError(f"the retriever found no nodes for {query!r}: check that the index is not empty "
                                      "and that no filter or similarity cutoff drops every node")

    def _call(self, engine: Engine, query: str, nodes: list[NodeWithScore]) -> TokenCall:
        self._require_nodes(query, nodes)
        documents = [to_document(item) for item in nodes]
        options = self.mode_options.get(self.mode, {})

        def call(on_token: Callable[[str], None] | None = None) -> Answer:
            return engine.generate(query, documents, mode=self.mode, on_token=on_token, **self.settings, **options)

        return call

    @dispatcher.span
    def synthesize(self, query_bundle: QueryType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None) -> RESPONSE_TYPE:
        """Decode an answer from ``nodes`` (e.g. from :meth:`retrieve`) in one engine call."""
        query_bundle, nodes = _bundle(query_bundle), self._scored(nodes)
        dispatcher.event(SynthesizeStartEvent(query=query_bundle))
        engine = resolve_engine(self.engine)
        with self.callback_manager.event(CBEventType.SYNTHESIZE,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            call = self._call(engine, query_bundle.query_str, nodes)
            if self.streaming:
                metadata: dict[str, Any] = {}
                response: RESPONSE_TYPE = StreamingResponse(
                    response_gen=_stream(call, query_bundle.query_str, nodes, engine, metadata), source_nodes=nodes,
                    metadata=metadata)
            else:
                response = _response(query_bundle.query_str, call(), nodes, engine)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query_bundle, response=response))
        return response

    @dispatcher.span
    async def asynthesize(self, query_bundle: QueryType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None) -> RESPONSE_TYPE:
        """Like :meth:`synthesize`; decoding runs on a worker thread, so the event loop keeps running."""
        query_bundle, nodes = _bundle(query_bundle), self._scored(nodes)
        dispatcher.event(SynthesizeStartEvent(query=query_bundle))
        engine = await asyncio.to_thread(resolve_engine, self.engine)
        with self.callback_manager.event(CBEventType.SYNTHESIZE,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            call = self._call(engine, query_bundle.query_str, nodes)
            if self.streaming:
                metadata: dict[str, Any] = {}
                response: RESPONSE_TYPE = AsyncStreamingResponse(
                    response_gen=_astream(call, query_bundle.query_str, nodes, engine, metadata), source_nodes=nodes,
                    metadata=metadata)
            else:
                response = _response(query_bundle.query_str, await asyncio.to_thread(call), nodes, engine)
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query_bundle, response=response))
        return response

    # ----------------------------------------------------------------- many questions

    def _answer_many(self, engine: Engine, questions: list[str], per_question: list[list[NodeWithScore]],
                     shared: bool) -> list[Response]:
        """One ``generate_many`` call: shared nodes once, or one node list per question."""
        for question, nodes in zip(questions, per_question):
            self._require_nodes(question, nodes)
        mode = self.batch_mode or self.mode
        if self.batch_mode is not None and not shared:
            per_question = _shared_order(per_question)
        lists = [[to_document(item) for item in nodes] for nodes in per_question]
        answers = engine.generate_many(questions, lists[0] if shared else lists, mode=mode, **self.settings,
                                       **self.mode_options.get(mode, {}))
        return [_response(question, answer, nodes, engine)
                for question, answer, nodes in zip(questions, answers, per_question)]

    @dispatcher.span
    def query_many(self, questions: Sequence[str], nodes: Sequence[NodeWithScore] | None = None) -> list[Response]:
        """Answer every question, in order, in one ``Engine.generate_many`` call.

        ``nodes``: answer all questions over these nodes. Otherwise each question is retrieved (and
        postprocessed) on its own; with ``batch_mode`` set, questions whose node sets are identical get
        them in the same order, so IPPD reads that context once per step for all of them (each question
        keeps its own scores in its ``source_nodes``). Always returns plain ``Response`` objects.
        """
        questions = _questions(questions)
        engine = resolve_engine(self.engine)
        if nodes is not None:
            return self._answer_many(engine, questions, [self._scored(nodes)] * len(questions), shared=True)
        return self._answer_many(engine, questions, [self.retrieve(q) for q in questions], shared=False)

    @dispatcher.span
    async def aquery_many(self, questions: Sequence[str],
                          nodes: Sequence[NodeWithScore] | None = None) -> list[Response]:
        """Like :meth:`query_many`: retrieval through the async path, decoding on a worker thread."""
        questions = _questions(questions)
        engine = await asyncio.to_thread(resolve_engine, self.engine)
        if nodes is not None:
            per_question, shared = [self._scored(nodes)] * len(questions), True
        else:
            per_question, shared = list(await asyncio.gather(*(self.aretrieve(q) for q in questions))), False
        return await asyncio.to_thread(self._answer_many, engine, questions, per_question, shared)

    # ----------------------------------------------------------------- BaseQueryEngine

    @dispatcher.span
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        with self.callback_manager.event(CBEventType.QUERY,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            response = self.synthesize(query_bundle, self.retrieve(query_bundle))
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    @dispatcher.span
    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        with self.callback_manager.event(CBEventType.QUERY,
                                         payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
            response = await self.asynthesize(query_bundle, await self.aretrieve(query_bundle))
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response


def _bundle(query: QueryType) -> QueryBundle:
    return QueryBundle(query) if isinstance(query, str) else query


def _questions(questions: Sequence[str]) -> list[str]:
    if isinstance(questions, str) or not questions:
        raise InvalidOptionError("query_many takes a non-empty list of questions; use query for one question")
    return list(questions)


def _shared_order(per_question: list[list[NodeWithScore]]) -> list[list[NodeWithScore]]:
    """Give questions with the same node set the first such question's node order (one shared context)."""
    first_order: dict[frozenset, dict[str, int]] = {}
    out = []
    for nodes in per_question:
        key = frozenset((item.node.node_id, node_text(item.node)) for item in nodes)  # not .hash: it hashes scores
        order = first_order.setdefault(key, {item.node.node_id: i for i, item in enumerate(nodes)})
        out.append(sorted(nodes, key=lambda item: order[item.node.node_id]))
    return out


def _answer_metadata(query: str, answer: Answer, nodes: list[NodeWithScore], engine: Engine) -> dict[str, Any]:
    """The response metadata of a decoded answer; its cache and decoding events are sent on the way."""
    emit_answer_events(query, answer, nodes)
    return response_metadata(answer, nodes, engine.loaded.name)


def _response(query: str, answer: Answer, nodes: list[NodeWithScore], engine: Engine) -> Response:
    return Response(answer.text, source_nodes=nodes, metadata=_answer_metadata(query, answer, nodes, engine))


def _stream(call: TokenCall, query: str, nodes: list[NodeWithScore], engine: Engine,
            metadata: dict[str, Any]) -> Iterator[str]:
    """Text pieces as decoded; when the answer is complete, ``metadata`` (the response's own dict) is filled."""
    answer = yield from iter_tokens(call)
    metadata.update(_answer_metadata(query, answer, nodes, engine))


async def _astream(call: TokenCall, query: str, nodes: list[NodeWithScore], engine: Engine,
                   metadata: dict[str, Any]) -> AsyncIterator[str]:
    sink: dict[str, Answer] = {}
    async for piece in aiter_tokens(call, sink):
        yield piece
    metadata.update(_answer_metadata(query, sink["answer"], nodes, engine))
