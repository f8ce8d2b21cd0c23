"""Map the library's typed errors to HTTP: the status, the field at fault and a message that says what to do.

Every error body has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so stock
OpenAI clients surface it; ``param`` names the request field at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ctx_integrations import errors
from ctx_integrations.serve.encoding import SafeJSONResponse

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
    # a union member's name (e.g. "str" or "DocumentIn") is not a field of the request, nor is a dict key's marker
    skipped = ("str", "function-after", "[key]")
    return ".".join(p for p in parts if not p[:1].isupper() and p not in skipped) or "body"


def validation_error_response(problems: Sequence[Any]) -> SafeJSONResponse:
    """pydantic's errors as one response: malformed JSON 400, a size limit 413, anything else 422.

    ``param`` is the field at fault (``documents.0.score``, ``options.beta``), never a character
    offset: a JSON syntax error names the body, and its message says what is wrong and where.
    """
    problems = list(problems) or [{"loc": ("body",), "msg": "invalid", "type": "invalid"}]
    kinds = {p.get("type") for p in problems}
    if "json_invalid" in kinds:
        problem = next(p for p in problems if p.get("type") == "json_invalid")
        message = (f"the request body is not valid JSON ({problem.get('msg', 'invalid')}): send one UTF-8 JSON "
                   "object; text must be valid Unicode (no lone surrogate escapes such as \\ud800)")
        return SafeJSONResponse(error_body(message, "invalid_request_error", "body", 400), status_code=400)
    status = 413 if "too_large" in kinds else 422
    if status == 413:
        problems = [p for p in problems if p.get("type") == "too_large"]
    # of a union's alternatives (a document as text or as an object), the deepest error is the useful one
    first = max(problems, key=lambda p: len(validation_field(p.get("loc", ()))))
    field = validation_field(first.get("loc", ("body",)))
    body = error_body(f"{field}: {first.get('msg', 'invalid')}", "invalid_request_error", field, status)
    body["error"]["details"] = [{"field": validation_field(p.get("loc", ())), "message": p.get("msg", "")}
                                for p in problems]
    return SafeJSONResponse(body, status_code=status)
