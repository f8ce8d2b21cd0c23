"""docs/serving.md's honoured and refused chat fields are the server's: the request models and REFUSED.

A field that moves from refused to honoured (or a new one) changes the code; this test fails until the docs say so.
"""

from __future__ import annotations

import re
from pathlib import Path

from ctx_integrations.serve.schemas import ChatCompletionRequest, ChatMessage
from ctx_integrations.serve.unsupported import REFUSED, REFUSED_ROLES

DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
MESSAGE = "messages.*."


def _bullet(label: str) -> str:
    """The text of the bullet that starts with ``- **label``, up to the next bullet."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^- \*\*{label}\b.*?(?=^- \*\*|^$)", text, re.S | re.M)
    assert match, f"docs/serving.md has no '- **{label}' bullet"
    return match.group(0)


def _names(text: str) -> set[str]:
    """The backticked field names in ``text`` (values such as ``n: 1`` or ``"none"`` are not names)."""
    return {name for name in re.findall(r"`([a-z_]+)`", text)}


def _parts(label: str) -> tuple[set[str], set[str]]:
    """The names a bullet lists for the request, and those it lists after 'in a message:'."""
    request, _, message = _bullet(label).partition("in a message:")
    assert message, f"the {label} bullet has no 'in a message:' part"
    return _names(request), _names(message)


def test_honoured_fields_are_the_request_models():
    request, message = _parts("Honoured")
    roles = set(ChatMessage.model_fields["role"].annotation.__args__)
    assert set(ChatCompletionRequest.model_fields) <= request
    assert set(ChatMessage.model_fields) <= message
    extra = request - set(ChatCompletionRequest.model_fields) - {"include_usage", "text", "json_object", "json_schema"}
    assert not extra, f"docs/serving.md lists as honoured what the request model lacks: {sorted(extra)}"
    assert message - set(ChatMessage.model_fields) - {"text"} == roles


def test_refused_fields_are_the_refused_table():
    request, message = _parts("Refused")
    top = {key for key in REFUSED if "." not in key}
    in_message = {key.removeprefix(MESSAGE) for key in REFUSED if key.startswith(MESSAGE)}
    assert top <= request, f"refused but not in the docs: {sorted(top - request)}"
    assert in_message | set(REFUSED_ROLES) <= message
    honoured = request & set(ChatCompletionRequest.model_fields)
    assert not honoured, f"docs/serving.md lists as refused what the server honours: {sorted(honoured)}"
    assert not (message - in_message - set(REFUSED_ROLES) - {"text"})
