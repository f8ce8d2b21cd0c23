"""Responses that can always be written: JSON and server-sent events encoded without ever raising.

Python strings may hold lone surrogates (``"\\ud800"``) and floats may be ``inf``/``nan``; neither can be
written as UTF-8 JSON, and Starlette's ``JSONResponse`` raises while writing the response, so the
client sees a dropped connection instead of an answer. Requests cannot bring lone surrogates in
(pydantic's JSON parser refuses them, 400), but text can also come from a store or a model, so the
output side has its own policy: a lone surrogate is written as U+FFFD (the replacement character)
and a non-finite float as ``null``. The common case pays one ``str.encode``; the repair runs only
when that fails.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi.responses import JSONResponse

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8(text: str) -> bytes:
    """``text`` as UTF-8, lone surrogates replaced by U+FFFD."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(inner) for key, inner in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(inner) for inner in value]
    return value


def dumps(content: Any) -> str:
    """Compact JSON (UTF-8 text kept as is); ``inf``/``nan`` become ``null`` instead of invalid JSON."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class SafeJSONResponse(JSONResponse):
    """Starlette's ``JSONResponse`` with the policy above: it never fails while rendering."""

    def render(self, content: Any) -> bytes:
        return utf8(dumps(content))


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (``data`` as is when a string, else JSON), ready to write."""
    head = f"event: {event}\n" if event else ""
    return utf8(f"{head}data: {data if isinstance(data, str) else dumps(data)}\n\n")
