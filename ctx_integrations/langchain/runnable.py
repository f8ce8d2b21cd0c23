"""The decoder as an LCEL Runnable: ``{"question", "documents"} -> AIMessage`` with trace, citations and timings.

Drop it at the end of ``{"question": RunnablePassthrough(), "documents": retriever} | ...`` and every
retrieval score in ``Document.metadata`` reaches the decoder as its relevance prior, while document
KV caches are reused across calls. ``mode`` (and ``mode_options``, ``max_tokens``, ``temperature``)
can be switched per call through ``config["configurable"]``, so one chain compares PCED against the
baselines. The model call goes through :class:`ChatContextOfExperts` as a child run, so LangChain emits
its standard chat-model events (``on_chat_model_start`` / ``_stream`` / ``_end``, ``on_llm_new_token``)
for it, with ``usage_metadata`` on the final message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import get_config_list, patch_config, run_in_executor
from langchain_core.runnables.utils import ConfigurableFieldSpec, get_unique_config_specs
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr

from ctx_integrations import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    Answer,
    Document,
    Engine,
    SamplingParams,
    available_modes,
    check_mode,
    mode_spec,
)
from ctx_integrations.adapters import aliased, check_engine, check_model, length_budget, resolve_engine
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError
from ctx_integrations.langchain.chat_model import ChatContextOfExperts
from ctx_integrations.langchain.convert import from_langchain_documents, response_metadata, usage_metadata

Output = AIMessage | str


@dataclass
class _Call:
    """One resolved request: what to answer, from what, and how."""

    question: str
    documents: list[Document]
    mode: str
    options: dict[str, Any]
    sampling: SamplingParams

    @property
    def messages(self) -> list[BaseMessage]:
        return [HumanMessage(content=self.question)]

    @property
    def model_options(self) -> dict[str, Any]:
        """The chat model's per-call options for this request (its ``stop`` is passed separately)."""
        sampling = self.sampling
        return {"documents": self.documents, "mode": self.mode, "mode_options": self.options,
                "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "seed": sampling.seed}

    @property
    def stop(self) -> list[str]:
        return list(self.sampling.stop)


def merge_streamed_input(chunks: Iterator[Any]) -> Any:
    """Reassemble an input that arrives in pieces (RunnableParallel streams one dict key at a time)."""
    merged: Any = None
    for chunk in chunks:
        if merged is None:
            merged = chunk
        elif isinstance(merged, Mapping) and isinstance(chunk, Mapping):
            merged = {**merged, **chunk}
        else:
            try:
                merged = merged + chunk
            except TypeError:
                merged = chunk
    return merged


class ContextOfExpertsRunnable(RunnableSerializable[Any, Output]):
    """Answer a question from documents with the local decoder (PCED by default), keeping every score.

    Input: ``{"question": str, "documents": list[Document]}`` (LangChain or project documents, or
    strings; the relevance r is read from ``metadata["score"]``, every part from ``metadata["scores"]``),
    or a plain question string when ``retriever`` is set. Output: an ``AIMessage`` whose
    ``response_metadata`` holds the per-token trace, the cited documents and the timings, with token
    counts in ``usage_metadata`` (``output="text"``: just the answer string).

    ``engine=None`` uses the embedded default model, or the one ``model`` (alias ``model_name``) names: a local
    folder, a ``.gguf`` file, a cached hub id or a fetched catalog alias, checked at construction as in
    :class:`ChatContextOfExperts`. ``max_tokens`` (alias ``max_new_tokens``) is the
    answer budget, also per call as ``configurable["max_tokens"]``. ``mode_options`` maps a mode name to its options,
    e.g. ``{"pced": {"gamma": 2.0}}``, so switching ``mode`` per call never sends one mode's options to
    another. ``batch``/``abatch`` over questions that share the same documents answer them all in one
    stacked decode with ``batch_mode`` (IPPD); ``batch_mode=None`` answers each with ``mode``.
    """

    engine: Any = Field(default=None, exclude=True)
    model_name: str | None = Field(default=None, alias="model")
    retriever: Any = Field(default=None, exclude=True)
    mode: str = DEFAULT_MODE
    mode_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    max_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS,
                            validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    output: Literal["message", "text"] = "message"
    batch_mode: str | None = "ippd"

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)
    _model: ChatContextOfExperts | None = PrivateAttr(default=None)
    _load_name: str | None = PrivateAttr(default=None)

    def __init__(self, **data: Any):
        super().__init__(**aliased(aliased(data, "max_tokens", "max_new_tokens"), "model", "model_name"))
        self._check()

    @property
    def max_new_tokens(self) -> int:
        """Alias of ``max_tokens`` (the engine's name for it)."""
        return self.max_tokens

    @property
    def chat_model(self) -> ChatContextOfExperts:
        """The chat model every answer goes through (so LangChain reports it as a chat-model run)."""
        if self._model is None:
            self._model = ChatContextOfExperts(engine=self.engine, model=self.model_name, mode=self.mode)
        return self._model

    def _check(self) -> None:
        """Refuse a typo in a mode name or option at construction, not at the first question."""
        check_mode(self.mode)
        if self.batch_mode is not None:
            check_mode(self.batch_mode)
        for name, options in self.mode_options.items():
            check_mode(name, options)
        check_engine(self.engine)
        self._load_name = check_model(self.model_name, self.engine)
        if self.retriever is not None and not isinstance(self.retriever, Runnable):
            raise InvalidOptionError("retriever must be a LangChain Runnable (e.g. a BaseRetriever) that maps a "
                                     f"question to documents, got {type(self.retriever).__name__}")

    @property
    def config_specs(self) -> list[ConfigurableFieldSpec]:
        own = [
            ConfigurableFieldSpec(id="mode", annotation=str, name="Decoding mode", default=self.mode,
                                  description=f"one of {', '.join(available_modes())}"),
            ConfigurableFieldSpec(id="mode_options", annotation=dict, name="Mode options", default={},
                                  description=f"options of this call's mode; {self.mode}'s: "
                                              f"{mode_spec(self.mode).options_text()}"),
            ConfigurableFieldSpec(id="max_tokens", annotation=int, name="Max tokens", default=self.max_tokens,
                                  description="answer budget in tokens (alias: max_new_tokens)"),
            ConfigurableFieldSpec(id="max_new_tokens", annotation=int, name="Max new tokens", default=self.max_tokens,
                                  description="alias of max_tokens"),
            ConfigurableFieldSpec(id="temperature", annotation=float, name="Temperature", default=self.temperature),
        ]
        return get_unique_config_specs(own + (self.retriever.config_specs if self.retriever is not None else []))

    # ----------------------------------------------------------------- resolving one call

    def _settings(self, config: RunnableConfig | None) -> tuple[str, dict[str, Any], SamplingParams]:
        configurable = (config or {}).get("configurable") or {}
        mode = configurable.get("mode", self.mode)
        options = {**self.mode_options.get(mode, {}), **(configurable.get("mode_options") or {})}
        budget = length_budget(configurable, self.max_tokens)
        sampling = SamplingParams(max_tokens=budget, temperature=configurable.get("temperature", self.temperature),
                                  top_p=self.top_p, seed=self.seed, stop=self.stop)
        return mode, options, sampling

    def _question(self, input: Any) -> tuple[str, Any]:
        """The question and the given documents (``None``: retrieve them)."""
        if isinstance(input, str):
            return input, None
        if isinstance(input, Mapping):
            if "question" not in input:
                raise InvalidOptionError(f"the input has keys {sorted(input)} but no 'question': pass "
                                         "{'question': str, 'documents': [...]}")
            return input["question"], input.get("documents")
        raise InvalidOptionError(f"cannot answer a {type(input).__name__}: pass {{'question': str, 'documents': "
                                 "[...]} or, with a retriever, a question string (to answer a chat prompt, put "
                                 "ChatContextOfExperts after it instead)")

    def _no_documents(self) -> EmptyDocumentsError:
        return EmptyDocumentsError("no 'documents' in the input and no retriever: pass {'question': ..., "
                                   "'documents': [...]} or build the runnable with retriever=...")

    def _call(self, question: str, documents: Any, config: RunnableConfig | None) -> _Call:
        mode, options, sampling = self._settings(config)
        return _Call(question, from_langchain_documents(documents), mode, options, sampling)

    def _resolve(self, input: Any, config: RunnableConfig | None) -> _Call:
        question, documents = self._question(input)
        if documents is None:
            if self.retriever is None:
                raise self._no_documents()
            documents = self.retriever.invoke(question, config)
        return self._call(question, documents, config)

    async def _aresolve(self, input: Any, config: RunnableConfig | None) -> _Call:
        question, documents = self._question(input)
        if documents is None:
            if self.retriever is None:
                raise self._no_documents()
            documents = await self.retriever.ainvoke(question, config)
        return self._call(question, documents, config)

    # ----------------------------------------------------------------- outputs

    def _output(self, engine: Engine, call: _Call, answer: Answer) -> Output:
        if self.output == "text":
            return answer.text
        return AIMessage(content=answer.text, **self._metadata(engine, call, answer))

    def _metadata(self, engine: Engine, call: _Call, answer: Answer) -> dict[str, Any]:
        return {"response_metadata": response_metadata(answer, engine.loaded.name),
                "usage_metadata": usage_metadata(answer.prompt_tokens, answer)}

    def _message_output(self, message: AIMessage) -> Output:
        return str(message.content) if self.output == "text" else message

    @staticmethod
    def _child(config: RunnableConfig, run_manager: Any) -> RunnableConfig:
        return patch_config(config, callbacks=run_manager.get_child())

    # ----------------------------------------------------------------- invoke

    def _invoke(self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig) -> Output:
        call = self._resolve(input, config)
        message = self.chat_model.invoke(call.messages, self._child(config, run_manager), stop=call.stop,
                                         **call.model_options)
        return self._message_output(message)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Output:
        return self._call_with_config(self._invoke, input, config)

    async def _ainvoke(self, input: Any, run_manager: AsyncCallbackManagerForChainRun,
                       config: RunnableConfig) -> Output:
        call = await self._aresolve(input, config)
        message = await self.chat_model.ainvoke(call.messages, self._child(config, run_manager), stop=call.stop,
                                                **call.model_options)
        return self._message_output(message)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Output:
        return await self._acall_with_config(self._ainvoke, input, config)

    # ----------------------------------------------------------------- streaming

    def _chunk_output(self, chunk: AIMessageChunk) -> Output | None:
        """A chat-model chunk as this runnable's output chunk (text mode skips the empty metadata chunk)."""
        if self.output == "message":
            return chunk
        return str(chunk.content) or None

    def _transform(self, inputs: Iterator[Any], run_manager: CallbackManagerForChainRun,
                   config: RunnableConfig) -> Iterator[Output]:
        call = self._resolve(merge_streamed_input(inputs), config)
        for chunk in self.chat_model.stream(call.messages, self._child(config, run_manager), stop=call.stop,
                                            **call.model_options):
            if (out := self._chunk_output(chunk)) is not None:
                yield out

    def transform(self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Output]:
        yield from self._transform_stream_with_config(input, self._transform, config)

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Output]:
        yield from self.transform(iter([input]), config, **kwargs)

    async def _atransform(self, inputs: AsyncIterator[Any], run_manager: AsyncCallbackManagerForChainRun,
                          config: RunnableConfig) -> AsyncIterator[Output]:
        call = await self._aresolve(merge_streamed_input([chunk async for chunk in inputs]), config)
        async for chunk in self.chat_model.astream(call.messages, self._child(config, run_manager), stop=call.stop,
                                                   **call.model_options):
            if (out := self._chunk_output(chunk)) is not None:
                yield out

    async def atransform(self, input: AsyncIterator[Any], config: RunnableConfig | None = None,
                         **kwargs: Any) -> AsyncIterator[Output]:
        async for chunk in self._atransform_stream_with_config(input, self._atransform, config):
            yield chunk

    async def astream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> AsyncIterator[Output]:
        async def single() -> AsyncIterator[Any]:
            yield input

        async for chunk in self.atransform(single(), config, **kwargs):
            yield chunk

    # ----------------------------------------------------------------- batching

    def _shared_batch(self, inputs: Sequence[Any], config: RunnableConfig | list[RunnableConfig] | None) -> bool:
        """True when every input brings the same documents and every call the same settings: one IPPD decode."""
        if self.batch_mode is None or len(inputs) < 2:
            return False
        if not all(isinstance(i, Mapping) and "question" in i and i.get("documents") is not None for i in inputs):
            return False
        configs = get_config_list(config, len(inputs))
        if any(self._settings(c) != self._settings(configs[0]) for c in configs):
            return False
        first = [(d.text, d.score, d.id) for d in from_langchain_documents(inputs[0]["documents"])]
        return all([(d.text, d.score, d.id) for d in from_langchain_documents(i["documents"])] == first
                   for i in inputs[1:])

    def _answer_shared(self, inputs: list[Any], config: list[RunnableConfig]) -> list[Output]:
        engine = resolve_engine(self.engine, model=self._load_name)
        calls = [self._call(*self._question(i), c) for i, c in zip(inputs, config)]
        options = self.mode_options.get(self.batch_mode, {})
        answers = engine.generate_many([c.question for c in calls], calls[0].documents, mode=self.batch_mode,
                                       sampling=calls[0].sampling, **options)
        return [self._output(engine, c, a) for c, a in zip(calls, answers)]

    def _batch_shared(self, inputs: list[Any], run_manager: list[CallbackManagerForChainRun],
                      config: list[RunnableConfig]) -> list[Output]:
        return self._answer_shared(inputs, config)

    async def _abatch_shared(self, inputs: list[Any], run_manager: list[AsyncCallbackManagerForChainRun],
                             config: list[RunnableConfig]) -> list[Output]:
        engine = await run_in_executor(None, resolve_engine, self.engine, model=self._load_name)  # may load the model
        calls = [self._call(*self._question(i), c) for i, c in zip(inputs, config)]
        options = self.mode_options.get(self.batch_mode, {})
        answers = await engine.agenerate_many([c.question for c in calls], calls[0].documents, mode=self.batch_mode,
                                              sampling=calls[0].sampling, **options)
        return [self._output(engine, c, a) for c, a in zip(calls, answers)]

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[Output]:
        if not self._shared_batch(inputs, config):
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        return self._batch_with_config(self._batch_shared, inputs, config, return_exceptions=return_exceptions,
                                       **kwargs)

    async def abatch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
                     return_exceptions: bool = False, **kwargs: Any) -> list[Output]:
        if not self._shared_batch(inputs, config):
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        return await self._abatch_with_config(self._abatch_shared, inputs, config,
                                              return_exceptions=return_exceptions, **kwargs)
