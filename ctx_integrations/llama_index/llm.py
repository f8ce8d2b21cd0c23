"""The local decoder as a LlamaIndex ``CustomLLM``, usable as ``Settings.llm`` for the rest of an app.

It is a chat model (``metadata.is_chat_model``): LlamaIndex then hands it chat messages (e.g. the stock
synthesizer's chat QA prompt), which go through the model's own chat template. ``complete(prompt)``
answers the prompt as one user turn of that template, because an instruction-tuned model (the embedded
SmolLM2 included) answers raw text poorly. Retrieval-augmented answers with per-document KV caches and
the decoding modes are :class:`~ctx_integrations.llama_index.ContextOfExpertsQueryEngine`'s job; this
class serves everything else an app asks an LLM (summaries, query rewriting, chat engines, ...).

Those classes decode through this LLM too (:meth:`ExpertDecoderLLM.decode` and its stream / async / batch
versions), so an answer over documents is a span of this LLM with LlamaIndex's standard completion events,
as every LlamaIndex LLM call is, and tracing tools show it as one.

Set as ``Settings.llm`` under a *stock* LlamaIndex query or chat engine, it gets the retrieved nodes already
joined into its prompt text by a stock response synthesizer (the ``context_str`` / ``context_msg`` template
arguments of LlamaIndex's QA, refine and context-chat prompts): they cannot be split back into documents, so
it answers as plain chat, and it says so once (:class:`~ctx_integrations.errors.UndecodedContextWarning`)
with the one-line fix. Plain chat and prompts without retrieved context (condensing a question, summaries)
never warn.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.settings import Settings
from llama_index.core.types import PydanticProgramMode

from ctx_integrations import (
    DEFAULT_BATCH_MODE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    Answer,
    AnswerStream,
    Document,
    Engine,
    SamplingParams,
    StructuredOutput,
    ToolCallFilter,
)
from ctx_integrations.adapters import (
    USER_CACHE_DIR,
    CacheDir,
    UserCacheDir,
    aliased,
    check_engine,
    check_model,
    resolve_engine,
)
from ctx_integrations.errors import InvalidOptionError, UndecodedContextWarning
from ctx_integrations.llama_index.events import CompletionReport
from ctx_integrations.llama_index.tools import answer_message, to_chat_messages, tool_selections

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

dispatcher = instrument.get_dispatcher(__name__)

# SamplingParams' filters and penalties, as fields and per call (their checks are SamplingParams')
_KNOBS = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_CALL_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed", "stop", "response_format", *_KNOBS)
_TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only: a completion has nowhere to put calls
# the pydantic program modes whose programs this LLM holds to the schema (the others are other LLMs' programs)
_PROGRAM_MODES = (PydanticProgramMode.DEFAULT, PydanticProgramMode.FUNCTION, PydanticProgramMode.LLM)
# The template arguments LlamaIndex's stock response synthesizers fill with the retrieved nodes' joined text
# (QA / summary prompts: context_str; refine prompts: context_msg), in every prompt of llama-index-core 0.14.
_STUFFED_CONTEXT_ARGS = ("context_str", "context_msg")

UNDECODED_CONTEXT_MESSAGE = (
    "ExpertDecoderLLM got retrieved nodes already joined into its prompt by a stock LlamaIndex response "
    "synthesizer (e.g. index.as_query_engine() or index.as_chat_engine() with Settings.llm = ExpertDecoderLLM()), "
    "so it answers as plain chat: no per-document KV caches, relevance priors or citations. One-line fix: "
    "query_engine = ContextOfExpertsQueryEngine.from_index(index) (or ContextOfExpertsChatEngine.from_index(index) "
    "for chat); to keep the stock engine, pass it response_synthesizer=ContextOfExpertsSynthesizer("
    "retrieval_score_kind=infer_score_kind(index)) (see docs/llama_index.md). Warned once per LLM.")


def _stuffs_context(prompt: BasePromptTemplate, prompt_args: Mapping[str, Any]) -> bool:
    """Whether a prompt template call carries retrieved text joined into one string (a stock synthesizer's)."""
    given = {**getattr(prompt, "kwargs", {}), **prompt_args}
    return any(isinstance(given.get(name), str) and given[name].strip() for name in _STUFFED_CONTEXT_ARGS)


@dataclass
class _Request:
    """One resolved call: the engine, the conversation and the decoding settings."""

    engine: Engine
    messages: list[dict[str, Any]]
    sampling: SamplingParams
    tools: dict[str, Any] = field(default_factory=dict)  # Engine.chat's tools, tool_choice, parallel_tool_calls
    answer: Answer | None = None  # a stream's, once it ends

    def run(self) -> Answer:
        return self.engine.chat(self.messages, sampling=self.sampling, **self.tools)

    def stream(self) -> Iterator[str]:
        return self.engine.stream_chat(self.messages, sampling=self.sampling, **self.tools)

    async def arun(self) -> Answer:
        return await self.engine.achat(self.messages, sampling=self.sampling, **self.tools)

    def astream(self) -> AnswerStream:
        return self.engine.astream_chat(self.messages, sampling=self.sampling, **self.tools)

    def calls(self) -> ToolCallFilter | None:
        """With tools, the filter that holds the calls' markup back from the streamed text."""
        return ToolCallFilter.for_engine(self.engine) if self.tools.get("tools") else None

    def raw(self, answer: Answer) -> dict[str, Any]:
        """Token usage in the shape LlamaIndex's ``TokenCountingHandler`` reads, plus timings."""
        prompt = answer.prompt_tokens
        raw = {"usage": {"prompt_tokens": prompt, "completion_tokens": len(answer.token_ids),
                         "total_tokens": prompt + len(answer.token_ids)},
               "model": self.engine.loaded.name, "timings": dict(answer.timings),
               "finish_reason": answer.finish_reason}
        if self.tools.get("tools") and answer.finish_reason != "eos":
            raw["tool_call_cut"] = answer.cut_tool_call is not None  # the engine read the cut call apart
        return raw


class ExpertDecoderLLM(CustomLLM, FunctionCallingLLM):
    """A LlamaIndex LLM over a local :class:`~ctx_integrations.Engine` (``engine=None``: the embedded default).

    ``complete`` / ``stream_complete`` / ``chat`` / ``stream_chat`` and their async versions (``Engine.achat``
    / ``astream_chat``: the event loop keeps running; closing an async stream early cancels the request).
    Streaming yields one response per decoded piece of text (``delta``), then an empty-delta response whose
    ``raw`` holds token usage and timings. Per-call options: ``max_new_tokens`` (alias ``max_tokens``),
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``top_k``, ``min_p``, ``repetition_penalty``,
    ``frequency_penalty``, ``presence_penalty`` (as :class:`~ctx_integrations.SamplingParams` reads them; also
    fields, the LLM's defaults), ``response_format`` (OpenAI's, or a pydantic class: the answer is held to it);
    ``chat`` also ``tools`` (OpenAI's tool dicts), ``tool_choice``, ``parallel_tool_calls``.

    A function-calling LLM (``metadata.is_function_calling_model``, LlamaIndex's ``FunctionCallingLLM``):
    ``chat_with_tools`` / ``predict_and_call`` / ``FunctionAgent`` get their calls as ``ToolCallBlock``s, each
    valid against its tool's schema, because the engine holds the call to it token by token
    (:class:`~ctx_integrations.StructuredOutput`); so ``structured_predict`` / ``astructured_predict`` /
    ``stream_structured_predict`` / ``as_structured_llm`` (LlamaIndex's ``FunctionCallingProgram``, the schema as
    the one tool the model must call) return objects valid against the schema, even from a 135M model. An
    answer cut by ``max_new_tokens`` before its call was complete raises
    :class:`~ctx_integrations.errors.IncompleteStructuredOutputError` (raise the budget).
    ``pydantic_program_mode``: ``DEFAULT`` / ``FUNCTION`` (held by constrained decoding) or ``LLM`` (LlamaIndex's
    text-and-parse program, not held); the other modes are other LLMs' programs and are refused.

    ``model_name`` (alias ``model``), like ``HuggingFaceLLM(model_name=...)``: load that model instead of the
    embedded one (a local folder, a ``.gguf`` file, a hub id in the Hugging Face cache, a fetched catalog alias),
    once per process per name. A name this machine does not hold is a
    :class:`~ctx_integrations.errors.ModelNotFoundError` at construction, never another model under that name;
    with ``engine=`` it must be that engine's model. ``metadata.model_name`` is the loaded model's.

    Set it as ``Settings.llm`` and every ctx-integrations LlamaIndex class (query engine, synthesizer,
    chat engine) decodes with its engine: one model for the whole app. ``cache_dir``: where the default
    engine keeps document KV caches (left out: the user cache dir, ``$CTX_CACHE_DIR``; ``None``: memory
    only); give either ``engine`` or ``cache_dir``.

    Those classes answer over documents through :meth:`decode` (``adecode``, ``stream_decode``,
    ``astream_decode``, ``decode_many``, ``adecode_many``): spans of this LLM with LlamaIndex's standard
    completion events, like ``complete``. A stock synthesizer's prompt with the nodes joined into it is
    answered as plain chat and warned about once (:class:`~ctx_integrations.errors.UndecodedContextWarning`).
    """

    engine: Any = Field(default=None, exclude=True, description="a ctx_integrations.Engine; None: embedded default")
    model_name: str | None = Field(default=None, description="the model to load (a local folder, a .gguf file, a "
                                   "cached hub id or a fetched catalog alias); None: the embedded default")
    cache_dir: Any = Field(default=USER_CACHE_DIR, exclude=True,
                           description="KV cache folder of the default engine; None: memory only")
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, gt=0,
                                description="tokens generated per call (metadata.num_output)")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy decoding")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="sampling seed (temperature > 0)")
    top_k: int = Field(default=0, description="keep the k most likely tokens (0 or -1: all)")
    min_p: float = Field(default=0.0, description="drop tokens below min_p x the top token's probability")
    repetition_penalty: float = Field(default=1.0, description="transformers' repetition penalty (1: off)")
    frequency_penalty: float = Field(default=0.0, description="OpenAI's frequency penalty, -2..2 (0: off)")
    presence_penalty: float = Field(default=0.0, description="OpenAI's presence penalty, -2..2 (0: off)")
    stop: list[str] = Field(default_factory=list, description="stop sequences")
    _warned_undecoded: bool = PrivateAttr(default=False)
    _load_name: str | None = PrivateAttr(default=None)

    def __init__(self, **data: Any):
        data = aliased(aliased(data, "max_new_tokens", "max_tokens"), "model_name", "model")  # other LLMs' names
        super().__init__(**data)
        if self.pydantic_program_mode not in _PROGRAM_MODES:
            raise InvalidOptionError(f"pydantic_program_mode {self.pydantic_program_mode.value!r} is another LLM's "
                                     "program: use PydanticProgramMode.DEFAULT (structured output held to the schema "
                                     "by constrained tool calls) or LLM (text, then parsed)")
        self.sampling_params()  # the decoding settings' typed errors now, not at the first call
        check_engine(self.engine, self.cache_dir)
        self._load_name = check_model(self.model_name, self.engine)

    @classmethod
    def class_name(cls) -> str:
        return "ExpertDecoderLLM"

    @property
    def resolved_engine(self) -> Engine:
        """The engine this LLM decodes with (the shared embedded default is loaded on first use)."""
        return resolve_engine(self.engine, self.cache_dir, self._load_name)

    @property
    def metadata(self) -> LLMMetadata:
        """The model's real window, this LLM's answer budget and the model's name."""
        loaded = self.resolved_engine.loaded
        return LLMMetadata(context_window=loaded.max_positions, num_output=self.max_new_tokens, is_chat_model=True,
                           is_function_calling_model=True, model_name=loaded.name, system_role=MessageRole.SYSTEM)

    # ----------------------------------------------------------------- requests

    def _request(self, engine: Engine, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                 chat: bool = False) -> _Request:
        kwargs = aliased(kwargs, "max_new_tokens", "max_tokens")
        options = _CALL_OPTIONS + _TOOL_OPTIONS if chat else _CALL_OPTIONS
        unknown = sorted(set(kwargs) - set(options))
        if unknown:
            where = "" if chat or set(unknown) - set(_TOOL_OPTIONS) else (
                " (tools are offered in chat: chat(messages, tools=...), chat_with_tools or predict_and_call)")
            raise InvalidOptionError(f"ExpertDecoderLLM{'' if chat else '.complete'} does not accept "
                                     f"{', '.join(unknown)}{where}; per-call options are: {', '.join(options)}")
        structured = StructuredOutput.from_response_format(kwargs.get("response_format"))
        sampling = replace(self.sampling_params(kwargs), structured=structured)
        tools = {name: kwargs[name] for name in _TOOL_OPTIONS if kwargs.get(name) is not None}
        return _Request(engine, messages, sampling, tools)

    def sampling_params(self, overrides: Mapping[str, Any] | None = None) -> SamplingParams:
        """This LLM's decoding settings as one :class:`~ctx_integrations.SamplingParams`, with ``overrides``
        (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` and the filters and penalties;
        ``None`` keeps the LLM's value; ``max_tokens`` is taken for ``max_new_tokens``, never both)."""
        overrides = aliased(overrides or {}, "max_new_tokens", "max_tokens")
        given = {name: value for name, value in overrides.items() if value is not None}
        return SamplingParams(max_tokens=given.get("max_new_tokens", self.max_new_tokens),
                              temperature=given.get("temperature", self.temperature),
                              top_p=given.get("top_p", self.top_p), seed=given.get("seed", self.seed),
                              stop=given.get("stop", self.stop),
                              **{knob: given.get(knob, getattr(self, knob)) for knob in _KNOBS})

    def _prompt_messages(self, prompt: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": prompt}]

    async def _arequest(self, messages: list[dict[str, Any]], kwargs: dict[str, Any], chat: bool = False) -> _Request:
        engine = await asyncio.to_thread(resolve_engine, self.engine, self.cache_dir, self._load_name)  # may load
        return self._request(engine, messages, kwargs, chat)

    # ----------------------------------------------------------------- completion

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt`` as one user turn of the model's chat template (``formatted`` changes nothing)."""
        request = self._request(self.resolved_engine, self._prompt_messages(prompt), kwargs)
        answer = request.run()
        return CompletionResponse(text=answer.text, raw=request.raw(answer))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._request(self.resolved_engine, self._prompt_messages(prompt), kwargs)
        return _completion_chunks(request)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        request = await self._arequest(self._prompt_messages(prompt), kwargs)
        answer = await request.arun()
        return CompletionResponse(text=answer.text, raw=request.raw(answer))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        request = await self._arequest(self._prompt_messages(prompt), kwargs)
        return _acompletion_chunks(request)

    # ----------------------------------------------------------------- chat

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the conversation; with ``tools``, the calls made are ``ToolCallBlock``s in the message."""
        request = self._request(self.resolved_engine, to_chat_messages(messages), kwargs, chat=True)
        answer = request.run()
        return ChatResponse(message=answer_message(answer), raw=request.raw(answer))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """:meth:`chat`, streamed; with ``tools`` the calls' markup is held back and the last response carries
        the calls (as ``FunctionAgent`` reads them)."""
        request = self._request(self.resolved_engine, to_chat_messages(messages), kwargs, chat=True)
        return _chat_chunks(_completion_chunks(request), request)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = await self._arequest(to_chat_messages(messages), kwargs, chat=True)
        answer = await request.arun()
        return ChatResponse(message=answer_message(answer), raw=request.raw(answer))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = await self._arequest(to_chat_messages(messages), kwargs, chat=True)
        return _achat_chunks(_acompletion_chunks(request), request)

    # ----------------------------------------------------------------- function calling (FunctionCallingLLM)

    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        """``chat``'s arguments for ``chat_with_tools`` and the rest: the tools as OpenAI's tool dicts, ``tool_choice``
        (a tool's name, ``"auto"``, ``"required"``, ``"none"``; left out: ``"required"`` with ``tool_required``, else
        ``"auto"``, as LlamaIndex's OpenAI LLM resolves it). ``strict`` is accepted: calls keep to the schema anyway."""
        kwargs.pop("strict", None)
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        if not specs:
            return {"messages": messages, **kwargs}
        choice = tool_choice if tool_choice is not None else "required" if tool_required else "auto"
        return {"messages": messages, "tools": specs, "tool_choice": choice,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def _structured_stream_call(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        """LlamaIndex's streaming program with the call required (its own leaves ``tool_choice`` to the model, and a
        model that answers in text streams empty objects); the text-and-parse program in ``LLM`` mode."""
        return self._stream_program(output_cls, prompt).stream_call(llm_kwargs=llm_kwargs, **prompt_args)

    async def _structured_astream_call(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                       llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Any:
        return await self._stream_program(output_cls, prompt).astream_call(llm_kwargs=llm_kwargs, **prompt_args)

    def _stream_program(self, output_cls: type[BaseModel], prompt: BasePromptTemplate) -> Any:
        from llama_index.core.program.function_program import FunctionCallingProgram
        from llama_index.core.program.utils import get_program_for_llm

        if self.pydantic_program_mode == PydanticProgramMode.LLM:
            return get_program_for_llm(output_cls, prompt, self, pydantic_program_mode=self.pydantic_program_mode)
        return FunctionCallingProgram.from_defaults(output_cls=output_cls, llm=self, prompt=prompt,
                                                    tool_choice="required")

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The calls in ``response`` (:func:`~ctx_integrations.llama_index.tools.tool_selections`): none is a
        ``NoToolCallError``, or an ``IncompleteStructuredOutputError`` when the budget cut the call, unless
        ``error_on_no_tool_call=False``."""
        return tool_selections(response, error_on_no_tool_call)

    # ----------------------------------------------------------------- prompt templates (stock synthesizers)

    def _log_template_data(self, prompt: BasePromptTemplate, **prompt_args: Any) -> None:
        """Warn once when a stock synthesizer stuffs retrieved nodes into the prompt, then log as LlamaIndex does.

        LlamaIndex's ``predict`` / ``stream`` / ``apredict`` / ``astream`` (how every stock response synthesizer
        calls an LLM) pass the template and its arguments through this one method before formatting them, so
        it is where the stuffed ``context_str`` / ``context_msg`` can still be seen; overriding the four public
        methods instead would put a second span around each call.
        """
        if not self._warned_undecoded and _stuffs_context(prompt, prompt_args):
            self._warned_undecoded = True
            warnings.warn(UNDECODED_CONTEXT_MESSAGE, UndecodedContextWarning, stacklevel=3)
        super()._log_template_data(prompt, **prompt_args)

    # ----------------------------------------------------------------- answers from documents (the synthesizer's)

    def _report(self, engine: Engine, question: str, documents: Sequence[Document], mode: str,
                options: Mapping[str, Any], callback_manager: CallbackManager | None) -> CompletionReport:
        return CompletionReport(engine, question, documents, model=self.to_payload(), options={"mode": mode, **options},
                                callback_manager=callback_manager or self.callback_manager)

    @dispatcher.span
    def decode(self, question: str, documents: Sequence[Document], *, mode: str = DEFAULT_MODE,
               sampling: SamplingParams | None = None, callback_manager: CallbackManager | None = None,
               **options: Any) -> Answer:
        """Answer ``question`` from ``documents`` with ``mode`` in one ``Engine.generate`` call, as an LLM call.

        :class:`~ctx_integrations.llama_index.ContextOfExpertsSynthesizer` decodes through it. The call is a
        span of this LLM and is reported as LlamaIndex's LLMs report ``complete``: ``LLMCompletionStartEvent``
        / ``LLMCompletionEndEvent`` (the prompt as the decoder reads it: the documents, then the question; the
        answer with its token usage) and a legacy ``CBEventType.LLM`` event on ``callback_manager`` (default:
        this LLM's). ``sampling``: default this LLM's settings; ``options``: the mode's.
        """
        engine = self.resolved_engine
        report = self._report(engine, question, documents, mode, options, callback_manager)
        try:
            answer = engine.generate(question, documents, mode=mode, sampling=sampling or self.sampling_params(),
                                     **options)
        except Exception as error:
            report.fail(error)
            raise
        report.end(answer)
        return answer

    @dispatcher.span
    async def adecode(self, question: str, documents: Sequence[Document], *, mode: str = DEFAULT_MODE,
                      sampling: SamplingParams | None = None, callback_manager: CallbackManager | None = None,
                      **options: Any) -> Answer:
        """:meth:`decode` through ``Engine.agenerate``: the event loop keeps running."""
        engine = await asyncio.to_thread(resolve_engine, self.engine, self.cache_dir)  # may load the model
        report = self._report(engine, question, documents, mode, options, callback_manager)
        try:
            answer = await engine.agenerate(question, documents, mode=mode,
                                            sampling=sampling or self.sampling_params(), **options)
        except Exception as error:
            report.fail(error)
            raise
        report.end(answer)
        return answer

    @dispatcher.span
    def stream_decode(self, question: str, documents: Sequence[Document], *, mode: str = DEFAULT_MODE,
                      sampling: SamplingParams | None = None, callback_manager: CallbackManager | None = None,
                      **options: Any) -> Generator[str, None, Answer]:
        """:meth:`decode`, streamed: text pieces as decoded (each an ``LLMCompletionInProgressEvent``); the
        generator's return value is the :class:`~ctx_integrations.Answer`.

        As with LlamaIndex's own ``stream_complete``, the span is the call that starts the stream and the
        stream's events carry its id. Closing the generator early cancels the decode.
        """
        engine = self.resolved_engine
        pieces = engine.stream(question, documents, mode=mode, sampling=sampling or self.sampling_params(), **options)
        return _reported_pieces(pieces, self._report(engine, question, documents, mode, options, callback_manager))

    @dispatcher.span
    async def astream_decode(self, question: str, documents: Sequence[Document], *, mode: str = DEFAULT_MODE,
                             sampling: SamplingParams | None = None, callback_manager: CallbackManager | None = None,
                             **options: Any) -> ReportedAnswerStream:
        """:meth:`stream_decode` for async callers (``Engine.astream``); after the loop, the stream's ``answer``."""
        engine = await asyncio.to_thread(resolve_engine, self.engine, self.cache_dir)  # may load the model
        stream = engine.astream(question, documents, mode=mode, sampling=sampling or self.sampling_params(),
                                **options)  # checks the request now: a bad one raises in this span, nothing started
        return ReportedAnswerStream(stream, self._report(engine, question, documents, mode, options, callback_manager))

    def _many_reports(self, engine: Engine, questions: Sequence[str], documents: Sequence[Any], mode: str,
                      options: Mapping[str, Any], callback_manager: CallbackManager | None) -> list[CompletionReport]:
        """One report per question; ``documents`` as ``Engine.generate_many`` takes them (shared or one list each)."""
        per_question = (documents if documents and all(isinstance(docs, (list, tuple)) for docs in documents)
                        else [documents] * len(questions))
        return [self._report(engine, question, docs, mode, options, callback_manager)
                for question, docs in zip(questions, per_question)]

    @dispatcher.span
    def decode_many(self, questions: Sequence[str], documents: Sequence[Any], *, mode: str = DEFAULT_BATCH_MODE,
                    sampling: SamplingParams | None = None, callback_manager: CallbackManager | None = None,
                    **options: Any) -> list[Answer]:
        """Every question in one ``Engine.generate_many`` call (``documents``: one list shared by all questions,
        or one list per question), in one span of this LLM with one completion report per question."""
        engine = self.resolved_engine
        reports = self._many_reports(engine, questions, documents, mode, options, callback_manager)
        try:
            answers = engine.generate_many(questions, documents, mode=mode, sampling=sampling or self.sampling_params(),
                                           **options)
        except Exception as error:
            for report in reports:
                report.fail(error)
            raise
        for report, answer in zip(reports, answers):
            report.end(answer)
        return answers

    @dispatcher.span
    async def adecode_many(self, questions: Sequence[str], documents: Sequence[Any], *, mode: str = DEFAULT_BATCH_MODE,
                           sampling: SamplingParams | None = None, callback_manager: CallbackManager | None = None,
                           **options: Any) -> list[Answer]:
        """:meth:`decode_many` through ``Engine.agenerate_many``."""
        engine = await asyncio.to_thread(resolve_engine, self.engine, self.cache_dir)  # may load the model
        reports = self._many_reports(engine, questions, documents, mode, options, callback_manager)
        try:
            answers = await engine.agenerate_many(questions, documents, mode=mode,
                                                  sampling=sampling or self.sampling_params(), **options)
        except Exception as error:
            for report in reports:
                report.fail(error)
            raise
        for report, answer in zip(reports, answers):
            report.end(answer)
        return answers


def _completion_chunks(request: _Request) -> Iterator[CompletionResponse]:
    """One response per decoded piece (``text`` so far, ``delta``), then an empty delta carrying ``raw``."""
    pieces = request.stream()
    text = ""
    try:
        while True:
            try:
                piece = next(pieces)
            except StopIteration as finished:
                request.answer = finished.value
                yield CompletionResponse(text=text, delta="", raw=request.raw(finished.value))
                return
            text += piece
            yield CompletionResponse(text=text, delta=piece)
    finally:
        pieces.close()  # a consumer that stopped early cancels the request


async def _acompletion_chunks(request: _Request) -> AsyncIterator[CompletionResponse]:
    stream, text = request.astream(), ""
    try:
        async for piece in stream:
            text += piece
            yield CompletionResponse(text=text, delta=piece)
    finally:
        await stream.aclose()  # a consumer that stopped early cancels the request
    request.answer = stream.answer
    yield CompletionResponse(text=text, delta="", raw=request.raw(stream.answer))


def _reported_pieces(pieces: Generator[str, None, Answer], report: CompletionReport) -> Generator[str, None, Answer]:
    """The engine's stream, each piece and the end (or an error) reported; returns the answer."""
    try:
        while True:
            try:
                piece = next(pieces)
            except StopIteration as finished:
                report.end(finished.value)
                return finished.value
            report.piece(piece)
            yield piece
    except Exception as error:
        report.fail(error)
        raise
    finally:
        pieces.close()  # a consumer that stopped early cancels the request


class ReportedAnswerStream:
    """An engine :class:`~ctx_integrations.AnswerStream` whose pieces and end (or error)
    are reported; ``answer`` is the stream's once it is read to the end, ``aclose()`` cancels it."""

    def __init__(self, stream: AnswerStream, report: CompletionReport):
        self._stream, self._report = stream, report

    @property
    def answer(self) -> Answer | None:
        return self._stream.answer

    def __aiter__(self) -> ReportedAnswerStream:
        return self

    async def __anext__(self) -> str:
        try:
            piece = await self._stream.__anext__()
        except StopAsyncIteration:
            self._report.end(self._stream.answer)
            raise
        except Exception as error:
            self._report.fail(error)
            raise
        self._report.piece(piece)
        return piece

    async def aclose(self) -> None:
        await self._stream.aclose()


class _ChatChunks:
    """Completion chunks as chat responses. With tools, each delta passes through the request's
    :class:`~ctx_integrations.ToolCallFilter` (a call's markup never shows as text) and the last response's message
    is the whole answer's: its text without the calls, and the calls as ``ToolCallBlock``s."""

    def __init__(self, request: _Request):
        self.request, self.calls, self.text = request, request.calls(), ""

    def response(self, chunk: CompletionResponse) -> ChatResponse | None:
        answer = self.request.answer  # set just before the last chunk
        if self.calls is None:
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=chunk.text),
                                delta=chunk.delta, raw=chunk.raw)
        if answer is None:
            delta = self.calls.push(chunk.delta or "")
            if not delta:
                return None
            self.text += delta
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=self.text), delta=delta)
        return ChatResponse(message=answer_message(answer), delta=self.calls.rest(answer.text), raw=chunk.raw)


def _chat_chunks(chunks: Generator[CompletionResponse, None, None], request: _Request) -> Iterator[ChatResponse]:
    converter = _ChatChunks(request)
    with closing(chunks):  # closing this stream early closes (and so cancels) the decoding one
        for chunk in chunks:
            response = converter.response(chunk)
            if response is not None:
                yield response


async def _achat_chunks(chunks: AsyncGenerator[CompletionResponse, None],
                        request: _Request) -> AsyncIterator[ChatResponse]:
    converter = _ChatChunks(request)
    async with aclosing(chunks):  # closing this stream early closes (and so cancels) the decoding one
        async for chunk in chunks:
            response = converter.response(chunk)
            if response is not None:
                yield response


_warned_settings_llm: set[int] = set()


def resolve_llm(llm: Any = None, engine: Any = None, cache_dir: CacheDir = USER_CACHE_DIR) -> ExpertDecoderLLM:
    """The :class:`ExpertDecoderLLM` a ctx-integrations LlamaIndex class decodes with; never a second model silently.

    ``llm`` (an ExpertDecoderLLM) or ``engine`` (an Engine, or an ExpertDecoderLLM for compatibility) if
    given; else ``Settings.llm`` when it is an ExpertDecoderLLM; else one over the shared embedded engine
    (``cache_dir``). When ``Settings.llm`` is another LLM, that fallback is announced with a warning: the
    decoder needs a local model with per-document KV caches, so it cannot answer with ``Settings.llm``.
    """
    given = [name for name, value in (("llm", llm), ("engine", engine)) if value is not None]
    if not isinstance(cache_dir, UserCacheDir):
        given.append("cache_dir")
    if len(given) > 1:
        raise InvalidOptionError(f"give one of llm=, engine= or cache_dir=, not {' and '.join(given)}")
    if isinstance(engine, ExpertDecoderLLM):
        llm, engine = engine, None
    if llm is not None:
        if not isinstance(llm, ExpertDecoderLLM):
            raise InvalidOptionError(f"llm must be an ExpertDecoderLLM (the local decoder), got {type(llm).__name__}: "
                                     "build ExpertDecoderLLM(engine=Engine.from_pretrained(...)) for your model")
        return llm
    if engine is not None or given:
        return ExpertDecoderLLM(engine=engine, cache_dir=cache_dir)
    current = Settings._llm  # the attribute, not the property: the property would resolve (and load) a default LLM
    if isinstance(current, ExpertDecoderLLM):
        return current
    if current is not None and id(current) not in _warned_settings_llm:
        _warned_settings_llm.add(id(current))
        warnings.warn(f"Settings.llm is a {type(current).__name__}, which cannot decode with per-document KV caches: "
                      "answering with the embedded model instead. Set Settings.llm = ExpertDecoderLLM(...) (used for "
                      "condensing and summaries too, one model) or pass llm=ExpertDecoderLLM(...)", UserWarning,
                      stacklevel=3)
    return ExpertDecoderLLM()
