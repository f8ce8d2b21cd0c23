"""Map the library's typed errors to HTTP: the status, the field at fault and a message that says what to do.

Every error body has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so stock
OpenAI clients surface it; ``param`` names the request field at fault.
"""

from __future__ import annotations

from typing import Any

from ctx_integrations import errors

# (status, field) per error type; the first matching class wins, so subclasses come before their bases
_STATUS: tuple[tuple[type[BaseException], int, str | None], ...] = (
    (errors.EngineOverloadedError, 503, None),
    (errors.RequestTimeoutError, 504, "timeout"),
    (errors.UnknownModeError, 422, "mode"),
    (errors.InvalidScoresError, 422, "documents"),
    (errors.EmptyDocumentsError, 422, "documents"),
    (errors.DocumentTooLongError, 422, "documents"),
    (errors.ChatTemplateError, 422, "messages"),
    (errors.InvalidOptionError, 422, "options"),
    (errors.MissingDependencyError, 501, None),
    (errors.CtxIntegrationsError, 400, None),
)

RETRY_AFTER_S = 1


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def status_of(error: BaseException, default_param: str | None = None) -> tuple[int, str | None]:
    """HTTP status and request field for a library error (400 and ``default_param`` for anything unlisted)."""
    for kind, status, param in _STATUS:
        if isinstance(error, kind):
            return status, param or default_param
    return 400, default_param


def headers_of(status: int) -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}


def validation_field(location: tuple[Any, ...] | list[Any]) -> str:
    """``("body", "documents", 0, "text")`` -> ``"documents.0.text"`` (pydantic's error location, body dropped)."""
    parts = [str(p) for p in location if p != "body"]
    # a union member's name (e.g. "str" or "DocumentIn") is not a field of the request
    return ".".join(p for p in parts if not p[:1].isupper() and p not in ("str", "function-after")) or "body"
