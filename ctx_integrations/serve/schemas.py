"""The HTTP wire format: pydantic models of every request body, so bad input is refused with the field named.

Pydantic checks types and ranges before the engine sees anything; what only the engine can check
(an unknown mode, a mode option out of range, a prompt longer than the window) comes back as a typed
``ctx_integrations.errors`` error and is mapped to a 4xx in :mod:`ctx_integrations.serve.errors`.

Bodies are validated with strict JSON types (``"5"`` or ``true`` is not an integer), finite numbers,
and the server's size limits (:class:`~ctx_integrations.serve.limits.ServerLimits`, passed as the
validation context) checked on the parsed strings, before anything is tokenised. A size error has
the pydantic type ``too_large`` (413); an OpenAI field the server does not implement, or an unknown
field of a chat request, ``unsupported_field`` (400, :mod:`ctx_integrations.serve.unsupported`);
other errors are 422, malformed JSON 400.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.defaults import DEFAULT_MAX_NEW_TOKENS
from ctx_integrations.serve.limits import ServerLimits
from ctx_integrations.serve.unsupported import refuse_unsupported

_DEFAULT_LIMITS = ServerLimits()
# keywords the server passes to the engine itself: a mode option of the same name would collide with them
RESERVED_OPTIONS = frozenset({"query", "queries", "documents", "scores", "top_k", "mode", "stream", "max_new_tokens",
                              "temperature", "top_p", "seed", "stop", "timeout", "on_token", "messages", "options"})
# no mode's knob means anything beyond this magnitude; refusing it here keeps the arithmetic finite
MAX_OPTION_MAGNITUDE = 1e6
MAX_OPTION_STRING = 256
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def limits_of(info: ValidationInfo) -> ServerLimits:
    return (info.context or {}).get("limits", _DEFAULT_LIMITS)


def too_large(what: str, size: int, unit: str, limit: int, option: str) -> PydanticCustomError:
    return PydanticCustomError("too_large", "{what} has {size} {unit}, more than this server's limit of {limit} "
                               "({option}): shorten it, or split it into several requests",
                               {"what": what, "size": size, "unit": unit, "limit": limit, "option": option})


def check_text(text: str, what: str, limit: int, option: str) -> str:
    if len(text) > limit:
        raise too_large(what, len(text), "characters", limit, option)
    return text


def _option_name(name: str) -> str:
    if name in RESERVED_OPTIONS:
        raise PydanticCustomError("reserved_option", "{name} is a request field, not a mode option: send it at the "
                                  "top level of the request, not inside options", {"name": name})
    return name


def _option_value(value: Any) -> Any:
    """Mode options are JSON scalars of a sane size (every mode's knobs are numbers, strings or flags)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or abs(value) > MAX_OPTION_MAGNITUDE:
            raise PydanticCustomError("option_range", "mode options must be finite numbers of magnitude at most "
                                      "{limit:g}, got {value!r}", {"limit": MAX_OPTION_MAGNITUDE, "value": value})
        return value
    if isinstance(value, str):
        if len(value) > MAX_OPTION_STRING:
            raise too_large("a string mode option", len(value), "characters", MAX_OPTION_STRING, "fixed")
        return value
    raise PydanticCustomError("option_type", "mode options must be numbers, strings, true/false or null, got {kind}",
                              {"kind": type(value).__name__})


ModeOptions = dict[Annotated[str, AfterValidator(_option_name)], Annotated[Any, AfterValidator(_option_value)]]


class DocumentIn(BaseModel):
    """One inline document: its text, and optionally an id, a relevance score r in [0, 1] and metadata."""

    model_config = _STRICT

    text: str = Field(min_length=1)
    id: str | None = None
    score: float | None = Field(default=None, ge=0.0, le=1.0)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("text")
    @classmethod
    def _text_size(cls, text: str, info: ValidationInfo) -> str:
        limits = limits_of(info)
        return check_text(text, "a document", limits.max_document_chars, "max_document_chars, --max-document-chars")

    def to_document(self) -> Document:
        return Document(self.text, id=self.id, score=self.score, metadata=dict(self.metadata))


def _check_documents(items: list[str | DocumentIn] | None, info: ValidationInfo) -> list[str | DocumentIn] | None:
    if items is None:
        return None
    limits = limits_of(info)
    if len(items) > limits.max_documents:
        raise too_large("the request", len(items), "documents", limits.max_documents,
                        "max_documents, --max-documents")
    for item in items:
        if isinstance(item, str):
            check_text(item, "a document", limits.max_document_chars, "max_document_chars, --max-document-chars")
    return items


def _check_top_k(top_k: int | None, info: ValidationInfo) -> int | None:
    limit = limits_of(info).max_documents
    if top_k is not None and top_k > limit:
        raise too_large("top_k", top_k, "documents", limit, "max_documents, --max-documents")
    return top_k


def to_documents(items: list[str | DocumentIn]) -> list[Document]:
    return [Document(item) if isinstance(item, str) else item.to_document() for item in items]


class Sampling(BaseModel):
    """Decoding settings shared by every endpoint (the engine's keyword arguments)."""

    model_config = _STRICT

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    timeout: float | None = Field(default=None, gt=0.0, description="seconds; past it the request is cancelled")

    def sampling_fields(self) -> dict[str, Any]:
        """A job's ``"sampling"``: the fields of :class:`~ctx_integrations.SamplingParams` as a plain dict (it
        crosses to a Ray replica unchanged); the backend builds the object from it."""
        return {"max_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": list(self.stop)}


class AnswerRequest(Sampling):
    """``POST /v1/answer``: documents inline, or ``top_k`` of them retrieved from the server's store."""

    query: str = Field(min_length=1)
    documents: list[str | DocumentIn] | None = Field(default=None, min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=256)
    mode: str = "pced"
    options: ModeOptions = Field(default_factory=dict)
    stream: bool = False

    _documents_size = field_validator("documents")(_check_documents)
    _top_k_size = field_validator("top_k")(_check_top_k)

    @field_validator("query")
    @classmethod
    def _query_size(cls, query: str, info: ValidationInfo) -> str:
        return check_text(query, "query", limits_of(info).max_query_chars, "max_query_chars, --max-query-chars")

    @model_validator(mode="after")
    def _documents_or_top_k(self) -> AnswerRequest:
        if self.documents is not None and self.top_k is not None:
            raise ValueError("give either documents (inline) or top_k (retrieve from the store), not both")
        if not self.query.strip():
            raise ValueError("query must not be blank")
        return self


class BatchRequest(Sampling):
    """``POST /v1/answer/batch``: many questions; shared documents are answered together with IPPD."""

    queries: list[str] = Field(min_length=1, max_length=256)
    documents: list[str | DocumentIn] | None = Field(default=None, min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=256)
    mode: str | None = Field(default=None, description="default: ippd when the documents are shared, else pced")
    options: ModeOptions = Field(default_factory=dict)

    _documents_size = field_validator("documents")(_check_documents)
    _top_k_size = field_validator("top_k")(_check_top_k)

    @field_validator("queries")
    @classmethod
    def _queries_size(cls, queries: list[str], info: ValidationInfo) -> list[str]:
        limit = limits_of(info).max_query_chars
        for query in queries:
            check_text(query, "a query", limit, "max_query_chars, --max-query-chars")
        return queries

    @model_validator(mode="after")
    def _documents_or_top_k(self) -> BatchRequest:
        if self.documents is not None and self.top_k is not None:
            raise ValueError("give either documents (inline) or top_k (retrieve from the store), not both")
        if any(not q.strip() for q in self.queries):
            raise ValueError("every query must be a non-empty string")
        return self


class ChatMessage(BaseModel):
    """One message: its role and its text (a string, or content parts of type ``text``).

    Other OpenAI message fields (``name``, ``tool_calls``...) and roles (``tool``) are refused by
    :func:`~ctx_integrations.serve.unsupported.refuse_unsupported` before this model sees them.
    """

    model_config = _STRICT

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)

    @field_validator("content")
    @classmethod
    def _content_size(cls, content: str | list[dict[str, Any]], info: ValidationInfo) -> Any:
        texts = [content] if isinstance(content, str) else [str(part.get("text", "")) for part in content]
        check_text("".join(texts), "a message", limits_of(info).max_document_chars,
                   "max_document_chars, --max-document-chars")
        return content


class RetrievalOptions(BaseModel):
    """The ``ctx`` extra field of a chat request: answer from the server's store instead of from memory.

    The last user message is the query; ``top_k`` documents are retrieved with every score and
    answered with ``mode`` (``pced`` by default), so the reply cites them.
    """

    model_config = _STRICT

    store: bool = True
    top_k: int = Field(default=4, ge=1, le=256)
    mode: str = "pced"
    options: ModeOptions = Field(default_factory=dict)

    _top_k_size = field_validator("top_k")(_check_top_k)


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    model_config = _STRICT

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` in OpenAI's format: every field here is honoured; any other is refused.

    An OpenAI field this server does not implement (``response_format``, ``tools``, ``logprobs``,
    ``n`` > 1, ...; the table is :data:`ctx_integrations.serve.unsupported.REFUSED`) or a field nobody
    declared is a 400 naming it, unless its value asks for nothing (``null``, ``n=1``...). ``user``
    is accepted as OpenAI accepts it: it identifies the end user to the provider, and no answer
    depends on it. ``model`` must be one of the served names (checked by the route).
    """

    model_config = _STRICT

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    ctx: RetrievalOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _honoured_fields_only(cls, data: Any) -> Any:
        return refuse_unsupported(data, cls.model_fields, ChatMessage.model_fields,
                                  {"stream_options": StreamOptions.model_fields})

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("unsupported_field", "stream_options: only a streamed request (stream=true) has "
                                      "stream options: leave it out, or send stream=true", {"field": "stream_options"})
        return self

    @field_validator("messages")
    @classmethod
    def _messages_count(cls, messages: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        limit = limits_of(info).max_messages
        if len(messages) > limit:
            raise too_large("the conversation", len(messages), "messages", limit, "max_messages, --max-messages")
        return messages

    def sampling(self) -> Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(max_new_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                        temperature=0.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=stop)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def last_user_message(self) -> str:
        for message in reversed(self.messages):
            if message.role == "user" and message.text().strip():
                return message.text()
        raise ValueError("no user message with text")
