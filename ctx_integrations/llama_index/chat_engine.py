"""``ContextOfExpertsChatEngine``: chat over an index with the local decoder, LlamaIndex's condense-question way.

Each turn: the question is condensed with the chat history into a standalone one (by the same
:class:`ExpertDecoderLLM`, so one model serves the app), retrieved, and answered over the retrieved nodes
by :class:`ContextOfExpertsQueryEngine` in any mode (PCED by default), with their KV caches and scores.
It is LlamaIndex's own ``CondenseQuestionChatEngine``: ``chat`` / ``stream_chat`` / ``achat`` /
``astream_chat``, memory, ``reset`` and ``chat_repl`` behave as in every LlamaIndex tutorial, and each
answer's ``sources[0].raw_output`` is the query engine's response (source nodes with every score,
per-token citations, timings). The same engine comes from the stock factory::

    index.as_chat_engine(chat_mode="condense_question", llm=ExpertDecoderLLM(),
                         response_synthesizer=ContextOfExpertsSynthesizer())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine import CondenseQuestionChatEngine
from llama_index.core.memory import BaseMemory
from llama_index.core.prompts.base import BasePromptTemplate

from ctx_integrations import DEFAULT_MODE, Engine
from ctx_integrations.adapters import USER_CACHE_DIR, CacheDir
from ctx_integrations.llama_index.llm import ExpertDecoderLLM, resolve_llm
from ctx_integrations.llama_index.query_engine import ContextOfExpertsQueryEngine


class ContextOfExpertsChatEngine(CondenseQuestionChatEngine):
    """A ``CondenseQuestionChatEngine`` whose answers come from :class:`ContextOfExpertsQueryEngine`."""

    @classmethod
    def from_index(cls, index: Any, *, llm: ExpertDecoderLLM | None = None, engine: Engine | None = None,
                   cache_dir: CacheDir = USER_CACHE_DIR, mode: str = DEFAULT_MODE, similarity_top_k: int | None = None,
                   chat_history: Sequence[ChatMessage] | None = None, memory: BaseMemory | None = None,
                   condense_question_prompt: BasePromptTemplate | None = None, verbose: bool = False,
                   retriever_kwargs: Mapping[str, Any] | None = None,
                   **query_engine_options: Any) -> ContextOfExpertsChatEngine:
        """Chat over ``index``: the decoder is ``llm`` / ``engine``, else ``Settings.llm`` when it is an
        ExpertDecoderLLM, else the shared embedded model; it condenses questions too.

        ``query_engine_options`` go to :class:`ContextOfExpertsQueryEngine` (``mode_options``,
        ``node_postprocessors``, ``max_new_tokens``, ...).
        """
        llm = resolve_llm(llm, engine, cache_dir)
        query_engine = ContextOfExpertsQueryEngine.from_index(index, llm=llm, mode=mode,
                                                              similarity_top_k=similarity_top_k,
                                                              retriever_kwargs=retriever_kwargs,
                                                              **query_engine_options)
        return cls.from_query_engine(query_engine, chat_history=chat_history, memory=memory,
                                     condense_question_prompt=condense_question_prompt, verbose=verbose)

    @classmethod
    def from_query_engine(cls, query_engine: ContextOfExpertsQueryEngine, *,
                          chat_history: Sequence[ChatMessage] | None = None, memory: BaseMemory | None = None,
                          condense_question_prompt: BasePromptTemplate | None = None,
                          verbose: bool = False) -> ContextOfExpertsChatEngine:
        """Chat with an existing query engine; its LLM condenses the questions."""
        engine = cls.from_defaults(query_engine, condense_question_prompt=condense_question_prompt,
                                   chat_history=list(chat_history or []), memory=memory, verbose=verbose,
                                   llm=query_engine.llm)
        return engine
