"""The local decoder as a LlamaIndex ``CustomLLM``, usable as ``Settings.llm`` for the rest of an app.

It is a chat model (``metadata.is_chat_model``): LlamaIndex then hands it chat messages (e.g. the stock
synthesizer's chat QA prompt), which go through the model's own chat template. ``complete(prompt)``
answers the prompt as one user turn of that template, because an instruction-tuned model (the embedded
SmolLM2 included) answers raw text poorly. Retrieval-augmented answers with per-document KV caches and
the decoding modes are :class:`~ctx_integrations.llama_index.ContextOfExpertsQueryEngine`'s job; this
class serves everything else an app asks an LLM (summaries, query rewriting, chat engines, ...).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from ctx_integrations.adapters import check_engine, resolve_engine
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.chat import conversation_ids
from ctx_integrations.engine.core.engine import Engine
from ctx_integrations.engine.core.token_stream import aiter_tokens, iter_tokens
from ctx_integrations.errors import InvalidOptionError

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}
_CALL_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed", "stop")


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex messages -> ``[{"role", "content"}]`` for the chat template (tool/other roles speak as user)."""
    return [{"role": _ROLES.get(m.role, "user"), "content": m.content or ""} for m in messages]


@dataclass
class _Request:
    """One resolved call: the engine, the conversation and the decoding settings."""

    engine: Engine
    messages: list[dict[str, str]]
    settings: dict[str, Any]

    def run(self, on_token: Any = None) -> Answer:
        return self.engine.chat(self.messages, on_token=on_token, **self.settings)

    def raw(self, answer: Answer) -> dict[str, Any]:
        """Token usage in the shape LlamaIndex's ``TokenCountingHandler`` reads, plus timings."""
        prompt = len(conversation_ids(self.engine.loaded.tokenizer, self.messages))
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": len(answer.token_ids),
                          "total_tokens": prompt + len(answer.token_ids)},
                "model": self.engine.loaded.name, "timings": dict(answer.timings),
                "finish_reason": answer.finish_reason}


class ExpertDecoderLLM(CustomLLM):
    """A LlamaIndex LLM over a local :class:`~ctx_integrations.Engine` (``engine=None``: the embedded default).

    ``complete`` / ``stream_complete`` / ``chat`` / ``stream_chat`` and their async versions; the async
    ones decode on a worker thread, so the event loop keeps running. Streaming yields one response per
    decoded piece of text (``delta``), then an empty-delta response whose ``raw`` holds token usage and
    timings. Per-call options: ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``.
    """

    engine: Any = Field(default=None, exclude=True, description="a ctx_integrations.Engine; None: embedded default")
    max_new_tokens: int = Field(default=256, gt=0, description="tokens generated per call (metadata.num_output)")
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy decoding")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="sampling seed (temperature > 0)")
    stop: list[str] = Field(default_factory=list, description="stop sequences")

    def __init__(self, **data: Any):
        super().__init__(**data)
        check_engine(self.engine)

    @classmethod
    def class_name(cls) -> str:
        return "ExpertDecoderLLM"

    @property
    def resolved_engine(self) -> Engine:
        """The engine this LLM decodes with (the shared embedded default is loaded on first use)."""
        return resolve_engine(self.engine)

    @property
    def metadata(self) -> LLMMetadata:
        """The model's real window, this LLM's answer budget and the model's name."""
        loaded = self.resolved_engine.loaded
        return LLMMetadata(context_window=loaded.max_positions, num_output=self.max_new_tokens, is_chat_model=True,
                           model_name=loaded.name, system_role=MessageRole.SYSTEM)

    # ----------------------------------------------------------------- requests

    def _request(self, engine: Engine, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> _Request:
        unknown = sorted(set(kwargs) - set(_CALL_OPTIONS))
        if unknown:
            raise InvalidOptionError(f"ExpertDecoderLLM does not accept {', '.join(unknown)}; per-call options are: "
                                     f"{', '.join(_CALL_OPTIONS)}")
        settings = {"max_new_tokens": kwargs.get("max_new_tokens", self.max_new_tokens),
                    "temperature": kwargs.get("temperature", self.temperature),
                    "top_p": kwargs.get("top_p", self.top_p), "seed": kwargs.get("seed", self.seed),
                    "stop": tuple(kwargs.get("stop", self.stop) or ())}
        return _Request(engine, messages, settings)

    def _prompt_messages(self, prompt: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": prompt}]

    async def _arequest(self, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> _Request:
        engine = await asyncio.to_thread(resolve_engine, self.engine)  # may load the model: not on the loop
        return self._request(engine, messages, kwargs)

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
        answer = await asyncio.to_thread(request.run)
        return CompletionResponse(text=answer.text, raw=request.raw(answer))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        request = await self._arequest(self._prompt_messages(prompt), kwargs)
        return _acompletion_chunks(request)

    # ----------------------------------------------------------------- chat

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._request(self.resolved_engine, to_chat_messages(messages), kwargs)
        answer = request.run()
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer.text),
                            raw=request.raw(answer))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request = self._request(self.resolved_engine, to_chat_messages(messages), kwargs)
        return _chat_chunks(_completion_chunks(request))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = await self._arequest(to_chat_messages(messages), kwargs)
        answer = await asyncio.to_thread(request.run)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer.text),
                            raw=request.raw(answer))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = await self._arequest(to_chat_messages(messages), kwargs)
        return _achat_chunks(_acompletion_chunks(request))


def _completion_chunks(request: _Request) -> Iterator[CompletionResponse]:
    """One response per decoded piece (``text`` so far, ``delta``), then an empty delta carrying ``raw``."""
    pieces = iter_tokens(request.run)
    text = ""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as finished:
            yield CompletionResponse(text=text, delta="", raw=request.raw(finished.value))
            return
        text += piece
        yield CompletionResponse(text=text, delta=piece)


async def _acompletion_chunks(request: _Request) -> AsyncIterator[CompletionResponse]:
    sink: dict[str, Answer] = {}
    text = ""
    async for piece in aiter_tokens(request.run, sink):
        text += piece
        yield CompletionResponse(text=text, delta=piece)
    yield CompletionResponse(text=text, delta="", raw=request.raw(sink["answer"]))


def _chat_response(chunk: CompletionResponse) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=chunk.text), delta=chunk.delta,
                        raw=chunk.raw)


def _chat_chunks(chunks: Iterator[CompletionResponse]) -> Iterator[ChatResponse]:
    for chunk in chunks:
        yield _chat_response(chunk)


async def _achat_chunks(chunks: AsyncIterator[CompletionResponse]) -> AsyncIterator[ChatResponse]:
    async for chunk in chunks:
        yield _chat_response(chunk)
