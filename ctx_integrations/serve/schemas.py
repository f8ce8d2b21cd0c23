"""The HTTP wire format: pydantic models of every request body, so bad input is refused with the field named.

Pydantic checks types and ranges before the engine sees anything; what only the engine can check
(an unknown mode, a mode option out of range, a prompt longer than the window) comes back as a typed
``ctx_integrations.errors`` error and is mapped to a 4xx in :mod:`ctx_integrations.serve.errors`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.defaults import DEFAULT_MAX_NEW_TOKENS


class DocumentIn(BaseModel):
    """One inline document: its text, and optionally an id, a relevance score r in [0, 1] and metadata."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    id: str | None = None
    score: float | None = Field(default=None, ge=0.0, le=1.0)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def to_document(self) -> Document:
        return Document(self.text, id=self.id, score=self.score, metadata=dict(self.metadata))


def to_documents(items: list[str | DocumentIn]) -> list[Document]:
    return [Document(item) if isinstance(item, str) else item.to_document() for item in items]


class Sampling(BaseModel):
    """Decoding settings shared by every endpoint (the engine's keyword arguments)."""

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    timeout: float | None = Field(default=None, gt=0.0, description="seconds; past it the request is cancelled")

    def engine_kwargs(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": tuple(self.stop)}


class AnswerRequest(Sampling):
    """``POST /v1/answer``: documents inline, or ``top_k`` of them retrieved from the server's store."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1)
    documents: list[str | DocumentIn] | None = Field(default=None, min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=256)
    mode: str = "pced"
    options: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False

    @model_validator(mode="after")
    def _documents_or_top_k(self) -> AnswerRequest:
        if self.documents is not None and self.top_k is not None:
            raise ValueError("give either documents (inline) or top_k (retrieve from the store), not both")
        if not self.query.strip():
            raise ValueError("query must not be blank")
        return self


class BatchRequest(Sampling):
    """``POST /v1/answer/batch``: many questions; shared documents are answered together with IPPD."""

    model_config = ConfigDict(extra="forbid")

    queries: list[str] = Field(min_length=1, max_length=256)
    documents: list[str | DocumentIn] | None = Field(default=None, min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=256)
    mode: str | None = Field(default=None, description="default: ippd when the documents are shared, else pced")
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _documents_or_top_k(self) -> BatchRequest:
        if self.documents is not None and self.top_k is not None:
            raise ValueError("give either documents (inline) or top_k (retrieve from the store), not both")
        if any(not q.strip() for q in self.queries):
            raise ValueError("every query must be a non-empty string")
        return self


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type", "text") == "text")


class RetrievalOptions(BaseModel):
    """The ``ctx`` extra field of a chat request: answer from the server's store instead of from memory.

    The last user message is the query; ``top_k`` documents are retrieved with every score and
    answered with ``mode`` (``pced`` by default), so the reply cites them.
    """

    model_config = ConfigDict(extra="forbid")

    store: bool = True
    top_k: int = Field(default=4, ge=1, le=256)
    mode: str = "pced"
    options: dict[str, Any] = Field(default_factory=dict)


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` in OpenAI's format (unknown OpenAI fields are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float | None = Field(default=None, ge=0.0, le=10.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description="only one choice per request")
    ctx: RetrievalOptions | None = None

    def sampling(self) -> Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(max_new_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                        temperature=0.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=stop)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages
                if m.role != "tool"]

    def last_user_message(self) -> str:
        for message in reversed(self.messages):
            if message.role == "user" and message.text().strip():
                return message.text()
        raise ValueError("no user message with text")
