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

import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ctx_integrations import DEFAULT_BATCH_MODE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODE
from ctx_integrations.documents import Document
from ctx_integrations.serve.limits import ServerLimits
from ctx_integrations.serve.unsupported import refuse_unsupported

_DEFAULT_LIMITS = ServerLimits()
# keywords the server passes to the engine itself: a mode option of the same name would collide with them
RESERVED_OPTIONS = frozenset({"query", "queries", "documents", "scores", "top_k", "mode", "stream", "max_new_tokens",
                              "temperature", "top_p", "seed", "stop", "timeout", "on_token", "messages", "options",
                              "token_top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                              "response_format", "logprobs", "sampling"})
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


def _no_empty_stop(stop: Any) -> Any:
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise ValueError("a stop string must not be empty (it would never match): leave it out")
    return stop


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


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: a name, and the schema every answer is valid against."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(default=None, description="accepted; every answer keeps to the schema anyway")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (the default), ``json_object`` (JSON mode: any JSON object) or
    ``json_schema`` (held to the schema); honoured by constrained decoding (``StructuredOutput``)."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('a json_schema goes with type "json_schema", and only with it')
        return self

    def structured(self) -> dict[str, Any] | None:
        """The fields of a :class:`~ctx_integrations.StructuredOutput` (``None``: text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is not None:
            return {"json": json.dumps(self.json_schema.json_schema, ensure_ascii=False)}
        return None


class Sampling(BaseModel):
    """Decoding settings shared by every endpoint (the engine's keyword arguments).

    ``token_top_k`` is vLLM's ``top_k`` (keep the k most likely tokens): on these endpoints ``top_k`` is the
    number of documents to retrieve. ``logprobs``: how many alternatives to return with each token's
    log-probability (``null``: none; the answer's ``trace`` carries them).
    """

    model_config = _STRICT

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Annotated[list[str], AfterValidator(_no_empty_stop)] = Field(default_factory=list)
    token_top_k: int = Field(default=0, ge=-1, le=1_000_000, description="0 or -1: every token")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    timeout: float | None = Field(default=None, gt=0.0, description="seconds; past it the request is cancelled")

    def sampling_fields(self) -> dict[str, Any]:
        """A job's ``"sampling"``: the fields of :class:`~ctx_integrations.SamplingParams` as a plain dict (it
        crosses to a Ray replica unchanged; the structured-output format as StructuredOutput's fields); the
        backend builds the object from it. Knobs at their defaults are left out."""
        fields: dict[str, Any] = {"max_tokens": self.max_new_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "seed": self.seed, "stop": list(self.stop)}
        knobs = {"top_k": (self.token_top_k, 0), "min_p": (self.min_p, 0.0),
                 "repetition_penalty": (self.repetition_penalty, 1.0),
                 "frequency_penalty": (self.frequency_penalty, 0.0), "presence_penalty": (self.presence_penalty, 0.0),
                 "logprobs": (self.logprobs, None),
                 "structured": (None if self.response_format is None else self.response_format.structured(), None)}
        fields.update({name: value for name, (value, default) in knobs.items() if value != default})
        return fields


class AnswerRequest(Sampling):
    """``POST /v1/answer``: documents inline, or ``top_k`` of them retrieved from the server's store."""

    query: str = Field(min_length=1)
    documents: list[str | DocumentIn] | None = Field(default=None, min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=256)
    mode: str = DEFAULT_MODE
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
    mode: str | None = Field(default=None, description=f"default: {DEFAULT_BATCH_MODE} when the documents are "
                                                       f"shared, else {DEFAULT_MODE}")
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


class FunctionCallIn(BaseModel):
    """A call's function in an assistant message: its name and its arguments as JSON text (OpenAI's shape)."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCallIn(BaseModel):
    """One tool call an assistant message made (sent back in the conversation, before the tool's result)."""

    model_config = _STRICT

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One message: its role and its text (a string, or content parts of type ``text``), an assistant's
    ``tool_calls`` (its content may then be ``null``), or a ``tool`` message carrying a call's result
    (``tool_call_id`` names the call).

    Other OpenAI message fields (``name``, ``function_call``...) and roles (``function``) are refused by
    :func:`~ctx_integrations.serve.unsupported.refuse_unsupported` before this model sees them.
    """

    model_config = _STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)

    @field_validator("content")
    @classmethod
    def _content_size(cls, content: str | list[dict[str, Any]] | None, info: ValidationInfo) -> Any:
        if content is None:
            return content
        texts = [content] if isinstance(content, str) else [str(part.get("text", "")) for part in content]
        check_text("".join(texts), "a message", limits_of(info).max_document_chars,
                   "max_document_chars, --max-document-chars")
        return content

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message names the call it answers (tool_call_id), and only a tool message does")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as the engine takes it (OpenAI's shape; ``developer`` speaks as ``system``)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionIn(BaseModel):
    """A tool's function: its name, what it does and its arguments' JSON schema (OpenAI's shape)."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, description="accepted; every call keeps to its schema anyway")


class ToolIn(BaseModel):
    """A tool the model may call (only functions)."""

    model_config = _STRICT

    type: Literal["function"]
    function: FunctionIn

    def as_dict(self) -> dict[str, Any]:
        function = {"name": self.function.name, "description": self.function.description or ""}
        if self.function.parameters is not None:
            function["parameters"] = self.function.parameters
        return {"type": "function", "function": function}


class FunctionName(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    model_config = _STRICT

    type: Literal["function"]
    function: FunctionName


class RetrievalOptions(BaseModel):
    """The ``ctx`` extra field of a chat request: answer from the server's store instead of from memory.

    The last user message is the query; ``top_k`` documents are retrieved with every score and
    answered with ``mode`` (``pced`` by default), so the reply cites them.
    """

    model_config = _STRICT

    store: bool = True
    top_k: int = Field(default=4, ge=1, le=256)
    mode: str = DEFAULT_MODE
    options: ModeOptions = Field(default_factory=dict)

    _top_k_size = field_validator("top_k")(_check_top_k)


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    model_config = _STRICT

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` in OpenAI's format: every field here is honoured; any other is refused.

    ``response_format`` (``json_object``, ``json_schema``), ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
    ``logprobs`` / ``top_logprobs`` and vLLM's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``)
    are honoured with the penalties. An OpenAI field this server does not implement (``n`` > 1, ``logit_bias``,
    ...; the table is :data:`ctx_integrations.serve.unsupported.REFUSED`) or a field nobody
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
    stop: Annotated[str | list[str] | None, AfterValidator(_no_empty_stop)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolIn] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
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

    @model_validator(mode="after")
    def _fields_that_go_together(self) -> ChatCompletionRequest:
        """OpenAI's pairings: top_logprobs needs logprobs, tool_choice needs tools; tools and a JSON format are two
        constraints on one answer; tools answer a conversation, not the store (``ctx``)."""
        def refuse(field: str, message: str) -> PydanticCustomError:
            return PydanticCustomError("unsupported_field", "{field}: {message}", {"field": field, "message": message})

        if self.top_logprobs is not None and not self.logprobs:
            raise refuse("top_logprobs", "top_logprobs needs logprobs=true: send both, or leave top_logprobs out")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise refuse("tool_choice", "tool_choice needs tools: send the tools, or leave tool_choice out")
        if self.tools and self.tool_choice != "none":
            if self.response_format is not None and self.response_format.type != "text":
                raise refuse("response_format", "give tools or a JSON response_format, not both: a tool's parameters "
                             "are its arguments' schema")
            if self.ctx is not None and self.ctx.store:
                raise refuse("tools", "tools are offered to a conversation, not to an answer from the store (ctx): "
                             "leave one of them out")
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
        given = {"token_top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                 "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                 "response_format": self.response_format,
                 "logprobs": (self.top_logprobs or 0) if self.logprobs else None}
        return Sampling(max_new_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                        temperature=0.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=stop,
                        **{name: value for name, value in given.items() if value is not None})

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_fields(self) -> dict[str, Any]:
        """A chat job's tools (``{}`` without any): OpenAI's tool objects, the choice and parallel calls."""
        if not self.tools or self.tool_choice == "none":
            return {}
        choice = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return {"tools": [tool.as_dict() for tool in self.tools], "tool_choice": choice or "auto",
                "parallel_tool_calls": self.parallel_tool_calls is not False}

    def last_user_message(self) -> str:
        for message in reversed(self.messages):
            if message.role == "user" and message.text().strip():
                return message.text()
        raise ValueError("no user message with text")
