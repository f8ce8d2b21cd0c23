"""``create_context_of_experts_chain``: LangChain's ``create_retrieval_chain`` pattern, answered by the decoder.

``create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))`` stuffs the retrieved
documents into one prompt string, so scores and per-document caches are lost. This chain keeps the same
shape (input ``{"input": question}``, output ``{"input", "context", "answer"}``, ``answer`` streamed token
by token) and answers with :class:`ChatContextOfExperts` over the documents themselves: each document is an
expert with its KV cache and its relevance prior (``metadata["score"]``, e.g. from
:class:`VectorStoreScoredRetriever`). It adds ``citations``: the documents that won tokens, most first.

Written with LCEL pieces (``RunnablePassthrough.assign`` for retrieval, a ``RunnableGenerator`` for the
answer), so tracing, ``astream_events`` (the model call is a chat-model run) and configs work as usual.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from typing import Any

from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_core.runnables import (
    Runnable,
    RunnableConfig,
    RunnableGenerator,
    RunnableLambda,
    RunnablePassthrough,
)
from langchain_core.runnables.utils import AddableDict

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.langchain.chat_model import ChatContextOfExperts
from ctx_integrations.langchain.runnable import merge_streamed_input


def citations(context: list[Any], response_metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """The documents that won tokens of the answer, most first: id, position in ``context``, tokens, score."""
    documents = response_metadata.get("documents") or []
    out = []
    for index in response_metadata.get("cited_documents") or []:
        document = context[index]
        out.append({"id": document.id, "index": index, "tokens_won": documents[index]["tokens_won"],
                    "score": document.metadata.get("score"), "source": document.metadata.get("source")})
    return out


def require_input(value: Any) -> dict[str, Any]:
    """The chain's input must be ``{"input": question, ...}``, as for ``create_retrieval_chain``."""
    if not isinstance(value, dict) or "input" not in value:
        raise InvalidOptionError("create_context_of_experts_chain takes {'input': question} (like "
                                 f"create_retrieval_chain), got {type(value).__name__}")
    return value


class _Answer:
    """The answer step: ``{"input", "context", ...}`` in, the same dict plus ``answer`` (streamed) and citations out."""

    def __init__(self, model: ChatContextOfExperts):
        self.model = model

    @staticmethod
    def _state(merged: Any) -> dict[str, Any]:
        return require_input(merged)

    def _final(self, state: dict[str, Any], last: AIMessageChunk) -> AddableDict:
        return AddableDict(citations=citations(state["context"], last.response_metadata),
                           response_metadata=last.response_metadata, usage_metadata=last.usage_metadata)

    def transform(self, inputs: Iterator[Any], config: RunnableConfig) -> Iterator[AddableDict]:
        state = self._state(merge_streamed_input(inputs))
        yield AddableDict(state)
        last = None
        for chunk in self.model.stream([HumanMessage(content=state["input"])], config,
                                       documents=state["context"]):
            if chunk.content:
                yield AddableDict(answer=str(chunk.content))
            last = chunk if last is None else last + chunk
        yield self._final(state, last)

    async def atransform(self, inputs: AsyncIterator[Any], config: RunnableConfig) -> AsyncIterator[AddableDict]:
        state = self._state(merge_streamed_input([chunk async for chunk in inputs]))
        yield AddableDict(state)
        last = None
        async for chunk in self.model.astream([HumanMessage(content=state["input"])], config,
                                              documents=state["context"]):
            if chunk.content:
                yield AddableDict(answer=str(chunk.content))
            last = chunk if last is None else last + chunk
        yield self._final(state, last)


def create_context_of_experts_chain(retriever: Runnable, llm: ChatContextOfExperts | None = None,
                                    **model_options: Any) -> Runnable:
    """A retrieval chain whose answer step is the decoder, in the shape of ``create_retrieval_chain``.

    Args:
        retriever: any LangChain retriever (a Runnable from the question to documents); scores in
            ``metadata["score"]`` become relevance priors (a document without one gets r = 1).
        llm: a :class:`ChatContextOfExperts`; default one built from ``model_options`` (``engine``,
            ``mode``, ``mode_options``, ``max_tokens``, ``temperature``, ...).

    Returns a Runnable: ``{"input": str}`` -> ``{"input", "context": [Document, ...], "answer": str,
    "citations": [{"id", "index", "tokens_won", "score", "source"}, ...], "response_metadata",
    "usage_metadata"}``. ``stream`` yields ``{"answer": piece}`` chunks as tokens are decoded.
    """
    if llm is not None and model_options:
        raise InvalidOptionError(f"give llm= or model options ({', '.join(model_options)}), not both")
    if llm is not None and not isinstance(llm, ChatContextOfExperts):
        raise InvalidOptionError(f"llm must be a ChatContextOfExperts, got {type(llm).__name__}: for another chat "
                                 "model use LangChain's create_retrieval_chain")
    if not isinstance(retriever, Runnable):
        raise InvalidOptionError(f"retriever must be a LangChain Runnable (e.g. a BaseRetriever), got "
                                 f"{type(retriever).__name__}")
    model = llm if llm is not None else ChatContextOfExperts(**model_options)
    answer = _Answer(model)
    retrieve = (itemgetter("input") | retriever).with_config(run_name="retrieve_documents")
    return (RunnableLambda(require_input, name="check_input") | RunnablePassthrough.assign(context=retrieve)
            | RunnableGenerator(answer.transform, answer.atransform, name="context_of_experts_answer")
            ).with_config(run_name="context_of_experts_chain")
