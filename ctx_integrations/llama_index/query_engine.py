"""``ContextOfExpertsQueryEngine``: a LlamaIndex query engine whose answer step is the local decoder.

retrieve (any LlamaIndex retriever; every score kept) -> node postprocessors (rerankers; their scores
kept and fused with the retrieval score) -> :class:`ContextOfExpertsSynthesizer` (one ``Engine.generate``
call over the nodes, their fused relevance r and their cached KV) -> a ``Response`` whose ``source_nodes``
carry every score and whose ``metadata`` holds the per-token trace, the cited nodes, timings and cache
hits. It is a ``RetrieverQueryEngine``, so stock wrappers (``CondenseQuestionChatEngine``, query tools)
treat it as one, streaming toggle included. ``query_many`` answers a list of questions in one
``Engine.generate_many`` call (IPPD by default), sharing contexts between questions that retrieved the
same nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType
from llama_index.core.settings import Settings

from ctx_integrations import DEFAULT_MODE, Answer, Engine, SamplingParams, check_mode
from ctx_integrations.adapters import USER_CACHE_DIR, CacheDir
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError
from ctx_integrations.llama_index.convert import node_text, to_document
from ctx_integrations.llama_index.llm import ExpertDecoderLLM, resolve_llm
from ctx_integrations.llama_index.score_keeping import (
    RerankerScoreFusion,
    ScoreKeepingRetriever,
    finalize,
    keep_reranker_score,
)
from ctx_integrations.llama_index.scores import check_score_kind
from ctx_integrations.llama_index.synthesizer import ContextOfExpertsSynthesizer

dispatcher = instrument.get_dispatcher(__name__)


class ContextOfExpertsQueryEngine(RetrieverQueryEngine):
    """Answer LlamaIndex queries with the local decoder (PCED by default), keeping every score.

    Args:
        retriever: any LlamaIndex ``BaseRetriever`` (e.g. ``index.as_retriever(similarity_top_k=4)``).
        llm: an :class:`ExpertDecoderLLM` (its engine decodes). Default: ``Settings.llm`` when it is an
            ExpertDecoderLLM, else the shared embedded model (loaded at the first query; a warning says so
            when ``Settings.llm`` is another LLM): never a second model silently.
        engine: instead of ``llm``, a :class:`~ctx_integrations.Engine` (or an ExpertDecoderLLM).
        cache_dir: instead of ``llm`` / ``engine``, where the shared embedded engine keeps KV caches (left
            out: the user cache dir, ``$CTX_CACHE_DIR``, so caches outlive the process; ``None``: memory only).
        mode: any mode the engine has (``engine.modes``: ``pced``, ``concat``, ``single``, ...).
        mode_options: ``{mode: {option: value}}``, e.g. ``{"pced": {"gamma": 2.0}}``; checked here.
        node_postprocessors: run in order after retrieval. One that changes ``node.score`` is a reranker:
            its score is kept as ``reranker`` and fused with the retrieval score (harmonic mean).
        retrieval_score_kind: what the retriever's ``node.score`` is; ``"auto"`` knows the default
            in-memory store and Chroma (see :mod:`ctx_integrations.llama_index.scores`).
        reranker_score_kind: what a reranker writes: ``"reranker"`` (a logit) or ``"relevance"`` ([0, 1]).
        streaming: ``query`` returns a ``StreamingResponse`` (``aquery``: ``AsyncStreamingResponse``)
            yielding text pieces as they are decoded.
        max_new_tokens (alias max_tokens), temperature, top_p, seed, stop: decoding settings of every
            answer (default: the LLM's).
        batch_mode: the mode of :meth:`query_many` (default ``"ippd"``: questions over the same nodes
            in one stacked decode); ``None`` answers each question with ``mode``, exactly as ``query``.
    """

    def __init__(self, retriever: BaseRetriever, *, llm: ExpertDecoderLLM | None = None,
                 engine: Engine | ExpertDecoderLLM | None = None, cache_dir: CacheDir = USER_CACHE_DIR,
                 mode: str = DEFAULT_MODE, mode_options: Mapping[str, Mapping[str, Any]] | None = None,
                 node_postprocessors: Sequence[BaseNodePostprocessor] | None = None,
                 retrieval_score_kind: str = "auto", reranker_score_kind: str = "reranker",
                 streaming: bool = False, max_new_tokens: int | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | None = None, batch_mode: str | None = "ippd",
                 callback_manager: CallbackManager | None = None):
        if batch_mode is not None:
            check_mode(batch_mode)
        self.batch_mode = batch_mode
        self.reranker_score_kind = check_score_kind(reranker_score_kind)
        if isinstance(retriever, ScoreKeepingRetriever):
            if retrieval_score_kind not in ("auto", retriever.score_kind):
                raise InvalidOptionError(f"the retriever already keeps {retriever.score_kind!r} scores: drop "
                                         f"retrieval_score_kind={retrieval_score_kind!r}")
        else:
            retriever = ScoreKeepingRetriever(retriever, retrieval_score_kind)
        postprocessors = list(node_postprocessors or [])
        for postprocessor in postprocessors:
            if not isinstance(postprocessor, BaseNodePostprocessor):
                raise InvalidOptionError(f"node_postprocessors must be LlamaIndex BaseNodePostprocessor objects, got "
                                         f"{type(postprocessor).__name__}")
        callback_manager = callback_manager or Settings.callback_manager
        synthesizer = ContextOfExpertsSynthesizer(
            resolve_llm(llm, engine, cache_dir), mode=mode, mode_options=mode_options,
            retrieval_score_kind=retriever.score_kind, streaming=streaming, max_new_tokens=max_new_tokens,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
            callback_manager=callback_manager)
        super().__init__(retriever, response_synthesizer=synthesizer, node_postprocessors=postprocessors,
                         callback_manager=callback_manager)

    @property
    def synthesizer(self) -> ContextOfExpertsSynthesizer:
        return self._response_synthesizer

    @property
    def llm(self) -> ExpertDecoderLLM:
        return self.synthesizer.llm

    @property
    def engine(self) -> Engine:
        """The engine that decodes (the shared embedded one is loaded on first use)."""
        return self.synthesizer.engine

    @property
    def mode(self) -> str:
        return self.synthesizer.mode

    @property
    def mode_options(self) -> dict[str, dict[str, Any]]:
        return self.synthesizer.mode_options

    @property
    def sampling(self) -> SamplingParams:
        """The decoding settings of every answer (the synthesizer's)."""
        return self.synthesizer.sampling

    @property
    def streaming(self) -> bool:
        return self.synthesizer._streaming

    @streaming.setter
    def streaming(self, value: bool) -> None:
        self.synthesizer._streaming = value

    @property
    def node_postprocessors(self) -> list[BaseNodePostprocessor]:
        return self._node_postprocessors

    @classmethod
    def from_index(cls, index: Any, *, llm: ExpertDecoderLLM | None = None,
                   engine: Engine | ExpertDecoderLLM | None = None, cache_dir: CacheDir = USER_CACHE_DIR,
                   mode: str = DEFAULT_MODE, similarity_top_k: int | None = None,
                   retriever_kwargs: Mapping[str, Any] | None = None, **options: Any) -> ContextOfExpertsQueryEngine:
        """Build over ``index.as_retriever(...)`` (e.g. an index from ``load_index_from_storage``).

        The decoder is ``llm`` / ``engine``, else ``Settings.llm`` when it is an ExpertDecoderLLM, else the
        shared embedded model with KV caches in ``cache_dir`` (default: the user cache dir).
        ``retriever_kwargs`` go to ``as_retriever`` (e.g. ``filters``); ``options`` to the constructor.
        """
        kwargs = dict(retriever_kwargs or {})
        if similarity_top_k is not None:
            kwargs["similarity_top_k"] = similarity_top_k
        return cls(index.as_retriever(**kwargs), llm=llm, engine=engine, cache_dir=cache_dir, mode=mode, **options)

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
        for postprocessor in self._node_postprocessors:
            previous = {item.node.node_id: item.score for item in nodes}
            processed = postprocessor.postprocess_nodes(nodes, query_bundle=query_bundle)
            nodes = processed if isinstance(postprocessor, RerankerScoreFusion) else self._rescored(previous, processed)
        return [finalize(item) for item in nodes]

    async def _apostprocess(self, nodes: list[NodeWithScore], query_bundle: QueryBundle) -> list[NodeWithScore]:
        for postprocessor in self._node_postprocessors:
            previous = {item.node.node_id: item.score for item in nodes}
            processed = await postprocessor.apostprocess_nodes(nodes, query_bundle=query_bundle)
            nodes = processed if isinstance(postprocessor, RerankerScoreFusion) else self._rescored(previous, processed)
        return [finalize(item) for item in nodes]

    def retrieve(self, query_bundle: QueryType) -> list[NodeWithScore]:
        """The nodes the decoder would read: retrieved, postprocessed, ``score`` = fused r, every part in metadata."""
        query_bundle = _bundle(query_bundle)
        return self._postprocess(self._retriever.retrieve(query_bundle), query_bundle)

    async def aretrieve(self, query_bundle: QueryType) -> list[NodeWithScore]:
        query_bundle = _bundle(query_bundle)
        return await self._apostprocess(await self._retriever.aretrieve(query_bundle), query_bundle)

    # ----------------------------------------------------------------- decoding

    @staticmethod
    def _require_nodes(query: str, nodes: Sequence[NodeWithScore]) -> None:
        if not nodes:
            raise EmptyDocumentsError(f"the retriever found no nodes for {query!r}: check that the index is not empty "
                                      "and that no filter or similarity cutoff drops every node")

    @dispatcher.span
    def synthesize(self, query_bundle: QueryType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None) -> RESPONSE_TYPE:
        """Decode an answer from ``nodes`` (e.g. from :meth:`retrieve`) in one engine call."""
        query_bundle = _bundle(query_bundle)
        self._require_nodes(query_bundle.query_str, nodes)
        return self.synthesizer.synthesize(query_bundle, nodes, additional_source_nodes)

    @dispatcher.span
    async def asynthesize(self, query_bundle: QueryType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None) -> RESPONSE_TYPE:
        """Like :meth:`synthesize`, through ``Engine.agenerate`` / ``Engine.astream``: the event loop keeps running."""
        query_bundle = _bundle(query_bundle)
        self._require_nodes(query_bundle.query_str, nodes)
        return await self.synthesizer.asynthesize(query_bundle, nodes, additional_source_nodes)

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

    # ----------------------------------------------------------------- many questions

    def _batch(self, questions: list[str], per_question: list[list[NodeWithScore]],
               shared: bool) -> tuple[str, list[list[NodeWithScore]], Any, dict[str, Any]]:
        """What one ``generate_many`` call needs: the mode, node lists (shared order) and documents."""
        for question, nodes in zip(questions, per_question):
            self._require_nodes(question, nodes)
        mode = self.batch_mode or self.mode
        if self.batch_mode is not None and not shared:
            per_question = _shared_order(per_question)
        lists = [[to_document(item) for item in nodes] for nodes in per_question]
        return (mode, per_question, lists[0] if shared else lists,
                {"sampling": self.sampling, **self.mode_options.get(mode, {})})

    def _responses(self, questions: list[str], answers: list[Answer],
                   per_question: list[list[NodeWithScore]]) -> list[Response]:
        return [self.synthesizer.response(question, answer, nodes)
                for question, answer, nodes in zip(questions, answers, per_question)]

    @dispatcher.span
    def query_many(self, questions: Sequence[str], nodes: Sequence[NodeWithScore] | None = None) -> list[Response]:
        """Answer every question, in order, in one ``Engine.generate_many`` call (a span of the LLM, one
        completion report per question: :meth:`ExpertDecoderLLM.decode_many`).

        ``nodes``: answer all questions over these nodes. Otherwise each question is retrieved (and
        postprocessed) on its own; with ``batch_mode`` set, questions whose node sets are identical get
        them in the same order, so IPPD reads that context once per step for all of them (each question
        keeps its own scores in its ``source_nodes``). Always returns plain ``Response`` objects.
        """
        questions = _questions(questions)
        if nodes is not None:
            per_question, shared = [self.synthesizer.scored_nodes(nodes)] * len(questions), True
        else:
            per_question, shared = [self.retrieve(q) for q in questions], False
        mode, per_question, documents, options = self._batch(questions, per_question, shared)
        answers = self.llm.decode_many(questions, documents, mode=mode, callback_manager=self.callback_manager,
                                       **options)
        return self._responses(questions, answers, per_question)

    @dispatcher.span
    async def aquery_many(self, questions: Sequence[str],
                          nodes: Sequence[NodeWithScore] | None = None) -> list[Response]:
        """Like :meth:`query_many`: retrieval through the async path, decoding with ``Engine.agenerate_many``."""
        questions = _questions(questions)
        await asyncio.to_thread(lambda: self.engine)  # may load the model: not on the loop
        if nodes is not None:
            per_question, shared = [self.synthesizer.scored_nodes(nodes)] * len(questions), True
        else:
            per_question, shared = list(await asyncio.gather(*(self.aretrieve(q) for q in questions))), False
        mode, per_question, documents, options = self._batch(questions, per_question, shared)
        answers = await self.llm.adecode_many(questions, documents, mode=mode, callback_manager=self.callback_manager,
                                              **options)
        return self._responses(questions, answers, per_question)


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
