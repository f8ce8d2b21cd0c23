"""The local decoder as a LangChain chat model, for plain chat and for chat over documents.

Without documents it is an ordinary local chat model: the conversation goes through the model's own
chat template. With documents the last user message is answered from them with ``mode`` (PCED by
default), reusing each document's KV cache, and the answer's trace, citations and timings land in
``response_metadata``. Documents come, in this order of precedence, from the call
(``invoke(messages, documents=[...])`` or ``.bind(documents=...)``), from tagged messages in the prompt
(``ChatPromptTemplate`` with a ``("placeholder", "{documents}")`` slot filled by
:func:`documents_as_messages`), from the sealed text blocks of :func:`format_docs` in the prompt (LangChain's
RAG tutorial chain with our ``format_docs``; marker-like text that ``format_docs`` did not write, e.g. in a
question or a pasted message, is plain text), or from the ``documents`` field. A prompt inside a chain that
speaks of context or documents but carries none of these is answered as plain chat, with one
:class:`UndecodedContextWarning` per model naming the one-line fix: documents joined into plain text
cannot be split back into documents, so the product's per-document decoding would be lost silently.

Being a ``BaseChatModel``, it emits LangChain's standard events (``on_chat_model_start`` / ``_stream`` /
``_end`` in ``astream_events``, ``on_llm_new_token`` for callbacks) and puts token counts in
``usage_metadata``.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import run_in_executor
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr

from ctx_integrations import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    EMBEDDED_MODEL_NAME,
    Answer,
    AnswerStream,
    Engine,
    SamplingParams,
    StructuredOutput,
    ToolCallFilter,
    check_mode,
)
from ctx_integrations.adapters import aliased, check_engine, check_model, length_budget, resolve_engine
from ctx_integrations.errors import InvalidOptionError, UndecodedContextWarning
from ctx_integrations.langchain.convert import (
    from_langchain_documents,
    response_metadata,
    split_document_messages,
    split_formatted_documents,
    usage_metadata,
)
from ctx_integrations.langchain.structured import structured_runnable

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}
_MENTIONS_CONTEXT = re.compile(r"\b(context|documents?)\b", re.IGNORECASE)
_SAMPLING_OPTIONS = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")
_CALL_OPTIONS = frozenset({"documents", "mode", "mode_options", "model", "max_tokens", "max_new_tokens", "temperature",
                           "top_p", "seed", "stream", "logprobs", "top_logprobs", "response_format",
                           *_SAMPLING_OPTIONS, *_TOOL_OPTIONS})
# what LangChain's with_structured_output binds for tracing only (popped by BaseChatModel before most paths)
_TRACING_OPTIONS = ("ls_structured_output_format", "structured_output_format")


UNDECODED_CONTEXT_MESSAGE = (
    "ChatContextOfExperts got a prompt that speaks of context or documents but carries none it can decode "
    "(no documents=, no documents_as_messages, no format_docs blocks), so it answers as plain chat "
    "(mode 'chat': no per-document caches, scores or citations). One-line fix: format the retrieved documents "
    "with ctx_integrations.langchain.format_docs, e.g. {'context': retriever | format_docs, 'question': "
    "RunnablePassthrough()} (see docs/langchain.md). Warned once per chat model.")


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages -> ``[{"role", "content"}]`` for the chat template: an ``AIMessage``'s tool calls and a
    ``ToolMessage``'s result in OpenAI's shape (``Engine.chat`` writes them in the model's format); other roles
    speak as user."""
    converted: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, ToolMessage):
            converted.append({"role": "tool", "content": str(message.text), "tool_call_id": message.tool_call_id})
            continue
        entry: dict[str, Any] = {"role": _ROLES.get(message.type, "user"), "content": str(message.text)}
        if isinstance(message, AIMessage) and message.tool_calls:
            entry["tool_calls"] = [{"id": call.get("id") or "", "type": "function",
                                    "function": {"name": call["name"], "arguments": call["args"]}}
                                   for call in message.tool_calls]
        converted.append(entry)
    return converted


def _langchain_calls(answer: Answer) -> list[dict[str, Any]]:
    return [{"name": call.name, "args": dict(call.arguments), "id": call.id, "type": "tool_call"}
            for call in answer.tool_calls]


@dataclass
class _Request:
    """One resolved call: the engine, what to decode and how; ``run(on_token)`` does it."""

    engine: Engine
    messages: list[dict[str, Any]]
    documents: list[Any] | None
    mode: str
    options: dict[str, Any]
    sampling: SamplingParams
    tools: dict[str, Any] = field(default_factory=dict)  # Engine.chat's tools, tool_choice, parallel_tool_calls

    @property
    def question(self) -> str:
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        if not users:
            raise InvalidOptionError("answering from documents needs a user message with the question")
        return users[-1]

    def run(self) -> Answer:
        if self.documents is None:
            return self.engine.chat(self.messages, sampling=self.sampling, **self.tools)
        return self.engine.generate(self.question, self.documents, mode=self.mode, sampling=self.sampling,
                                    **self.options)

    def stream(self) -> Iterator[str]:
        if self.documents is None:
            return self.engine.stream_chat(self.messages, sampling=self.sampling, **self.tools)
        return self.engine.stream(self.question, self.documents, mode=self.mode, sampling=self.sampling,
                                  **self.options)

    async def arun(self) -> Answer:
        if self.documents is None:
            return await self.engine.achat(self.messages, sampling=self.sampling, **self.tools)
        return await self.engine.agenerate(self.question, self.documents, mode=self.mode, sampling=self.sampling,
                                           **self.options)

    def astream(self) -> AnswerStream:
        if self.documents is None:
            return self.engine.astream_chat(self.messages, sampling=self.sampling, **self.tools)
        return self.engine.astream(self.question, self.documents, mode=self.mode, sampling=self.sampling,
                                   **self.options)

    def input_tokens(self, answer: Answer) -> int:
        return answer.prompt_tokens  # counted once, when the request was prepared


class ChatContextOfExperts(BaseChatModel):
    """A LangChain chat model over a local :class:`~ctx_integrations.Engine` (``engine=None``: the embedded default).

    ``model`` (alias ``model_name``), like ``ChatOllama(model=...)``: load that model instead of the embedded
    one (a local folder, a ``.gguf`` file, a hub id in the Hugging Face cache, a fetched catalog alias), once
    per process per name. A name this machine does not hold is a
    :class:`~ctx_integrations.errors.ModelNotFoundError` at construction, never another model under that name;
    with ``engine=`` it must be that engine's model.

    Per call (and as fields): ``max_tokens`` (alias ``max_new_tokens``), ``temperature``, ``top_p``, ``seed``,
    ``top_k``, ``min_p``, ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``logprobs`` /
    ``top_logprobs`` (OpenAI's ``response_metadata["logprobs"]``); per call only: ``documents`` (answer from them
    with ``mode``), ``mode``, ``mode_options``, ``response_format`` (OpenAI's, or a pydantic class).

    Tool calling (``bind_tools``; calls in ``AIMessage.tool_calls``, arguments valid against each tool's schema)
    and ``with_structured_output`` (``json_schema``, ``function_calling``, ``json_mode``) are held by constrained
    decoding (:class:`~ctx_integrations.StructuredOutput`): valid even from the embedded 135M model, though
    what it chooses to put in them is a 135M model's choice. Tools answer a conversation; with documents,
    ``response_format`` holds the answer over them.
    """

    engine: Any = Field(default=None, exclude=True)
    model_name: str | None = Field(default=None, alias="model")
    mode: str = DEFAULT_MODE
    mode_options: dict[str, Any] = Field(default_factory=dict)
    documents: list[Any] | None = Field(default=None, exclude=True)
    temperature: float = 0.0
    max_tokens: int | None = Field(default=None, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)
    _warned_undecoded: bool = PrivateAttr(default=False)
    _load_name: str | None = PrivateAttr(default=None)

    def __init__(self, **data: Any):
        super().__init__(**aliased(aliased(data, "max_tokens", "max_new_tokens"), "model", "model_name"))
        self._check()

    def _check(self) -> None:
        """Refuse an unknown mode, option, engine type or model at construction."""
        check_mode(self.mode, self.mode_options)
        check_engine(self.engine)
        self._load_name = check_model(self.model_name, self.engine)

    @property
    def _llm_type(self) -> str:
        return "ctx-integrations"

    @property
    def resolved_model_name(self) -> str:
        """The name of the model that answers, without loading it: the engine's, the given one (what it loads
        under), or the embedded default's."""
        if self.engine is not None:
            return self.engine.loaded.name
        return self.model_name or EMBEDDED_MODEL_NAME

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.resolved_model_name, "mode": self.mode, "mode_options": dict(self.mode_options),
                "temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                "seed": self.seed}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="ctx_integrations", ls_model_type="chat",
                                 ls_model_name=kwargs.get("model") or self.resolved_model_name,
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=length_budget(kwargs) or self.max_tokens or DEFAULT_MAX_NEW_TOKENS)
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop)
        return params

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` (pydantic classes, functions, LangChain tools or OpenAI tool dicts) offered.

        ``tool_choice``: ``None`` / ``"auto"`` (the model may answer or call), ``"none"``, ``"any"`` / ``"required"`` /
        ``True`` (at least one call), or a tool's name (that tool). ``parallel_tool_calls=False``: one call at most.
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        if tool_choice is True or tool_choice == "any":
            tool_choice = "required"
        bound: dict[str, Any] = {"tools": formatted, **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**bound)

    def with_structured_output(self, schema: Any = None, *, method: str = "json_schema", include_raw: bool = False,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Answers as ``schema`` (a pydantic class, a TypedDict, a JSON schema or an OpenAI function dict), parsed.

        ``method``: ``"json_schema"`` (default; ``response_format`` with the schema), ``"function_calling"`` (the
        schema as the one tool to call) or ``"json_mode"`` (JSON mode: any JSON object without a schema, the
        schema's objects with one).
        Every method decodes under a constraint, so what is parsed is valid JSON that keeps to the schema.
        ``include_raw``: ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``. ``strict`` is accepted (the
        answer keeps to the schema either way).
        """
        kwargs.pop("strict", None)
        return structured_runnable(self, schema, method=method, include_raw=include_raw, bind_tools=self.bind_tools,
                                   **kwargs)

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
                 in_chain: bool = False) -> _Request:
        kwargs = {name: value for name, value in kwargs.items() if name not in _TRACING_OPTIONS}
        unknown = sorted(set(kwargs) - _CALL_OPTIONS)
        if unknown:
            raise InvalidOptionError(f"ChatContextOfExperts does not accept {', '.join(unknown)}; per-call options "
                                     f"are: {', '.join(sorted(_CALL_OPTIONS - {'stream'}))}")
        model = kwargs.get("model")
        if model is not None and model != self.resolved_model_name:
            raise InvalidOptionError(f"this chat model serves {self.resolved_model_name!r}, not {model!r}: build "
                                     f"another ChatContextOfExperts(model={model!r}) for it")
        in_prompt, messages = _documents_in_prompt(messages)
        if in_prompt is not None and "documents" in kwargs:
            raise InvalidOptionError("documents came both in the prompt (tagged messages or format_docs blocks) and "
                                     "as documents=: give them one way")
        documents = (kwargs["documents"] if "documents" in kwargs else in_prompt if in_prompt is not None
                     else self.documents)
        if documents is None and in_chain:
            self._warn_if_context_is_lost(messages)
        mode = kwargs.get("mode", self.mode)
        options = kwargs.get("mode_options", self.mode_options if mode == self.mode else {})
        budget = length_budget(kwargs)  # refuses max_tokens and max_new_tokens both given
        wants_logprobs = kwargs.get("logprobs", self.logprobs)
        top = kwargs.get("top_logprobs", self.top_logprobs)
        sampling = SamplingParams(max_tokens=budget or self.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                                  temperature=kwargs.get("temperature", self.temperature),
                                  top_p=kwargs.get("top_p", self.top_p), seed=kwargs.get("seed", self.seed),
                                  stop=stop if stop is not None else self.stop,
                                  **{name: kwargs.get(name, getattr(self, name)) for name in _SAMPLING_OPTIONS},
                                  structured=StructuredOutput.from_response_format(kwargs.get("response_format")),
                                  logprobs=(top or 0) if wants_logprobs else None)
        tools = {name: kwargs[name] for name in _TOOL_OPTIONS if name in kwargs}
        docs = None if documents is None else from_langchain_documents(documents)
        if docs is not None and tools.get("tools") and tools.get("tool_choice") != "none":
            raise InvalidOptionError("tools are offered to a conversation, not to an answer over documents: call the "
                                     "model with tools without documents (or answer from documents without tools)")
        return _Request(resolve_engine(self.engine, model=self._load_name), to_chat_messages(messages), docs, mode,
                        options, sampling, tools)

    def _warn_if_context_is_lost(self, messages: Sequence[BaseMessage]) -> None:
        """Warn once when a chained prompt mentions context but none reached the decoder as documents.

        A heuristic on purpose: retrieved text joined into a plain string looks like any other prompt text,
        so the mention of context/documents in a chain's prompt is the signal; plain chat outside a chain
        never warns.
        """
        if not self._warned_undecoded and any(_MENTIONS_CONTEXT.search(str(m.text)) for m in messages):
            self._warned_undecoded = True
            warnings.warn(UNDECODED_CONTEXT_MESSAGE, UndecodedContextWarning, stacklevel=2)

    def _metadata(self, request: _Request, answer: Answer) -> dict[str, Any]:
        metadata = response_metadata(answer, request.engine.loaded.name)
        if request.sampling.logprobs is not None:  # ChatOpenAI's place for them
            metadata["logprobs"] = {"content": answer.token_logprobs(request.engine.loaded.tokenizer)}
        return {"response_metadata": metadata, "usage_metadata": usage_metadata(request.input_tokens(answer), answer)}

    def _message(self, request: _Request, answer: Answer) -> AIMessage:
        answer.refuse_cut_tool_call()  # a call cut by max_tokens is an IncompleteStructuredOutputError, never text
        return AIMessage(content=answer.text, tool_calls=_langchain_calls(answer), **self._metadata(request, answer))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        request = self._request(messages, stop, kwargs, _in_chain(run_manager))
        answer = request.run()
        return ChatResult(generations=[ChatGeneration(message=self._message(request, answer))])

    def _last_chunk(self, request: _Request, answer: Answer, calls: ToolCallFilter | None) -> ChatGenerationChunk:
        """A chunk carrying the metadata once (chunks merge by concatenating their metadata), and with tools the
        text after the calls and the calls themselves (as tool-call chunks, so the merged message has them)."""
        answer.refuse_cut_tool_call()  # at the stream's end
        text, chunks = "", []
        if calls is not None:
            text = calls.rest(answer.text)
            chunks = [{"name": call.name, "args": json.dumps(call.arguments, ensure_ascii=False), "id": call.id,
                       "index": index, "type": "tool_call_chunk"} for index, call in enumerate(answer.tool_calls)]
        return ChatGenerationChunk(message=AIMessageChunk(content=text, chunk_position="last", tool_call_chunks=chunks,
                                                          **self._metadata(request, answer)))

    def _calls(self, request: _Request) -> ToolCallFilter | None:
        """With tools, the filter that holds the calls' markup back from the streamed text."""
        return ToolCallFilter.for_engine(request.engine) if request.tools.get("tools") else None

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs, _in_chain(run_manager))
        pieces, calls = request.stream(), self._calls(request)
        try:
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as finished:
                    yield self._last_chunk(request, finished.value, calls)
                    return
                text = piece if calls is None else calls.push(piece)
                if text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        finally:
            pieces.close()  # a consumer that stopped early cancels the request

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        request = await run_in_executor(None, self._request, messages, stop, kwargs,  # may load the model
                                        _in_chain(run_manager))
        answer = await request.arun()
        return ChatResult(generations=[ChatGeneration(message=self._message(request, answer))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        request = await run_in_executor(None, self._request, messages, stop, kwargs,  # may load the model
                                        _in_chain(run_manager))
        stream, calls = request.astream(), self._calls(request)
        try:
            async for piece in stream:
                text = piece if calls is None else calls.push(piece)
                if text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        finally:
            await stream.aclose()  # a consumer that stopped early cancels the request
        yield self._last_chunk(request, stream.answer, calls)


def _documents_in_prompt(messages: Sequence[BaseMessage]) -> tuple[list[Any] | None, list[BaseMessage]]:
    """Documents the prompt carries (tagged messages or format_docs blocks; ``None``: none) and the rest."""
    tagged, messages = split_document_messages(messages)
    formatted, messages = split_formatted_documents(messages)
    if tagged is not None and formatted is not None:
        raise InvalidOptionError("the prompt carries documents both as tagged messages (documents_as_messages) and "
                                 "as format_docs blocks: use one of the two")
    return (tagged if tagged is not None else formatted), messages


def _in_chain(run_manager: Any) -> bool:
    """Whether this call runs inside a chain (a prompt built by it), not a direct ``chat.invoke``."""
    return getattr(run_manager, "parent_run_id", None) is not None
