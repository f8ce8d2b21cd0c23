"""Map the library's typed errors to HTTP: the status, the field at fault and a message that says what to do.

Every error body has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, whatever
produced it (a route, the body-size middleware, the API-key check, an unknown route or method, a
bug), so stock OpenAI clients surface it. ``type`` is one of the kinds OpenAI-compatible servers
(OpenAI, llama.cpp's server) use, chosen by the status alone (:func:`error_type`); ``param`` names
the request field at fault; ``code`` is the HTTP status, as vLLM and llama.cpp send it, or OpenAI's
own string code where one exists (``model_not_found``, ``invalid_api_key``).

This module imports no web framework: the ASGI middlewares (:mod:`~ctx_integrations.serve.limits`,
:mod:`~ctx_integrations.serve.auth`) build their responses from it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ctx_integrations import errors


class ModelNotServedError(errors.CtxIntegrationsError, LookupError):
    """A request naming a model this server does not serve: 404 with OpenAI's ``code: "model_not_found"``."""

    openai_code = "model_not_found"

    def __init__(self, requested: str, served: Sequence[str]):
        names = ", ".join(repr(name) for name in served)
        super().__init__(f"the model {requested[:200]!r} is not served here: this server serves {names} "
                         "(GET /v1/models lists them; --served-model-name sets them)")


# (status, field) per error type; the first matching class wins, so subclasses come before their bases
_STATUS: tuple[tuple[type[BaseException], int, str | None], ...] = (
    (ModelNotServedError, 404, "model"),
    (errors.EngineOverloadedError, 503, None),
    (errors.RequestTimeoutError, 504, "timeout"),
    (errors.UnknownModeError, 422, "mode"),
    (errors.InvalidScoresError, 422, "documents"),
    (errors.EmptyDocumentsError, 422, "documents"),
    (errors.DocumentTooLongError, 422, "documents"),
    (errors.ChatTemplateError, 422, "messages"),
    (errors.InvalidStructuredOutputError, 400, "response_format"),
    (errors.UnsupportedSamplingError, 400, None),
    (errors.InvalidOptionError, 422, "options"),
    (errors.MissingDependencyError, 501, None),
    (errors.CtxIntegrationsError, 400, None),
)

# OpenAI's kinds by status (llama.cpp's server uses the same names); anything else 4xx is the client's request
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}

RETRY_AFTER_S = 1


def error_type(status: int) -> str:
    """The ``type`` of an error answered with ``status``: never a Python class name."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_body(message: str, status: int, param: str | None = None, code: int | str | None = None) -> dict[str, Any]:
    """OpenAI's error object; ``code`` defaults to the status."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status if code is None else code}}


def error_bytes(message: str, status: int, param: str | None = None, code: int | str | None = None) -> bytes:
    """:func:`error_body` as the JSON bytes a raw ASGI response sends (messages here are the server's own text)."""
    return json.dumps(error_body(message, status, param, code)).encode()


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


def validation_error(problems: Sequence[Any]) -> tuple[int, dict[str, Any]]:
    """pydantic's errors as one ``(status, body)``: malformed JSON 400, a field the server does not implement 400,
    a size limit 413, anything else 422.

    ``param`` is the field at fault (``documents.0.score``, ``options.beta``, ``response_format``),
    never a character offset: a JSON syntax error names the body, and its message says what is wrong
    and where. A refused field (error type ``unsupported_field``, raised before the rest is validated)
    names itself in the error's context, since it is refused before pydantic reaches it.
    """
    problems = list(problems) or [{"loc": ("body",), "msg": "invalid", "type": "invalid"}]
    kinds = {p.get("type") for p in problems}
    if "json_invalid" in kinds:
        problem = next(p for p in problems if p.get("type") == "json_invalid")
        message = (f"the request body is not valid JSON ({problem.get('msg', 'invalid')}): send one UTF-8 JSON "
                   "object; text must be valid Unicode (no lone surrogate escapes such as \\ud800)")
        return 400, error_body(message, 400, "body")
    if "unsupported_field" in kinds:
        problem = next(p for p in problems if p.get("type") == "unsupported_field")
        field = str((problem.get("ctx") or {}).get("field", "body"))
        return 400, error_body(problem.get("msg", "unsupported"), 400, field)
    status = 413 if "too_large" in kinds else 422
    if status == 413:
        problems = [p for p in problems if p.get("type") == "too_large"]
    # of a union's alternatives (a document as text or as an object), the deepest error is the useful one
    first = max(problems, key=lambda p: len(validation_field(p.get("loc", ()))))
    field = validation_field(first.get("loc", ("body",)))
    body = error_body(f"{field}: {first.get('msg', 'invalid')}", status, field)
    body["error"]["details"] = [{"field": validation_field(p.get("loc", ())), "message": p.get("msg", "")}
                                for p in problems]
    return status, body
