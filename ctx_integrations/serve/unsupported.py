"""OpenAI request fields this server does not implement, refused by name instead of being silently ignored.

A client that sends a field the server ignores (``n=3``, ``logit_bias``) and gets HTTP 200 has no way to
know its request was not honoured. So every field of a chat-completion request is either honoured (a
field of :class:`~ctx_integrations.serve.schemas.ChatCompletionRequest`: structured output, tools,
logprobs and the sampling knobs included) or refused with a 400 whose ``param`` names it: the fields
listed in :data:`REFUSED` (with what to do instead), and any field nobody declared. A refused field is
accepted only with a value that asks for nothing: ``null``, or one of its ``neutral`` values (``n=1``,
``logit_bias={}``, ``functions=[]``), which is dropped before the request is validated.

:data:`REFUSED` is the one table to edit when a feature lands: delete the field's entry here and
declare it on the request model in :mod:`~ctx_integrations.serve.schemas`. Keys are request paths:
a top-level field (``"tools"``), or a field of every message (``"messages.*.name"``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from pydantic_core import PydanticCustomError


class Refused(NamedTuple):
    """Why a field is refused and what to do instead; ``neutral`` values ask for nothing and are accepted."""

    reason: str
    neutral: tuple[Any, ...] = ()


_FUNCTIONS = ("the deprecated functions API is not implemented by this server: send tools (and tool_choice) "
              "instead")
_TEXT_ONLY = "this server reads and writes text only"

REFUSED: dict[str, Refused] = {
    "functions": Refused(_FUNCTIONS, ([],)),
    "function_call": Refused(_FUNCTIONS, ("none",)),
    "n": Refused("this server answers with one choice per request: send n=1 or leave it out, and send several "
                 "requests (with different seeds) for several answers", (1,)),
    "logit_bias": Refused("logit_bias is not implemented by this server: leave it out", ({},)),
    "modalities": Refused(_TEXT_ONLY, (["text"],)),
    "audio": Refused(_TEXT_ONLY),
    "prediction": Refused("predicted outputs are not implemented by this server: leave prediction out"),
    "web_search_options": Refused("this server does not search the web: leave web_search_options out"),
    "reasoning_effort": Refused("this server has no reasoning-effort setting: leave reasoning_effort out"),
    "service_tier": Refused("this server has one service tier: leave service_tier out", ("auto", "default")),
    "store": Refused("this server stores no completions: send store=false or leave it out", (False,)),
    "metadata": Refused("this server stores no completions, so it keeps no metadata: leave metadata out", ({},)),
    "messages.*.name": Refused("participant names are not passed to the model by this server: put the name in the "
                               "message's content"),
    "messages.*.function_call": Refused(_FUNCTIONS),
    "messages.*.refusal": Refused("a refusal is not passed to the model by this server: send it as the content"),
    "messages.*.audio": Refused(_TEXT_ONLY),
}
# message roles and content parts that only make sense with the features above
REFUSED_ROLES: dict[str, str] = {"function": _FUNCTIONS}
TEXT_PART_FIELDS = frozenset({"type", "text"})


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality where ``true`` is not ``1`` (``n=true`` is not ``n=1``; no neutral value nests a number)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _refuse(field: str, message: str) -> PydanticCustomError:
    # the field travels in the context: this error is raised before pydantic locates anything
    return PydanticCustomError("unsupported_field", f"{field}: {message}", {"field": field})


def _unknown(field: str) -> PydanticCustomError:
    return _refuse(field, "unrecognized request field: this server implements the OpenAI fields listed in its "
                          "documentation (and ctx); remove it")


def _checked(data: dict[str, Any], declared: Collection[str], prefix: str, pattern: str) -> dict[str, Any]:
    """``data`` without its neutral refused fields; raises for a refused or unknown field."""
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in declared:
            kept[key] = value
            continue
        refused = REFUSED.get(pattern + key)
        if refused is None:
            raise _unknown(prefix + key)
        if value is not None and not any(_same(value, neutral) for neutral in refused.neutral):
            raise _refuse(prefix + key, refused.reason)
    return kept


def refuse_unsupported(data: Any, declared: Collection[str], message_fields: Collection[str],
                       nested: dict[str, Collection[str]]) -> Any:
    """A chat-completion body (the JSON object, before validation) with every field honoured, or a 400 error.

    ``declared``: the request's own fields; ``message_fields``: a message's; ``nested``: the fields of
    object-valued request fields checked here too (``stream_options``). Anything that is not the
    expected shape is left to the model's own validation (a 422 naming it).
    """
    if not isinstance(data, dict):
        return data
    data = _checked(data, declared, "", "")
    for name, fields in nested.items():
        if isinstance(data.get(name), dict):
            data[name] = _checked(data[name], fields, f"{name}.", f"{name}.")
    messages = data.get("messages")
    if isinstance(messages, list):
        data["messages"] = [_checked_message(m, i, message_fields) if isinstance(m, dict) else m
                            for i, m in enumerate(messages)]
    return data


def _checked_message(message: dict[str, Any], index: int, fields: Collection[str]) -> dict[str, Any]:
    prefix = f"messages.{index}."
    role = message.get("role")
    if isinstance(role, str) and role in REFUSED_ROLES:
        raise _refuse(prefix + "role", f"{role} messages: {REFUSED_ROLES[role]}")
    content = message.get("content")
    if isinstance(content, list):
        for number, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part.get("type", "text")
            if kind != "text":
                raise _refuse(f"{prefix}content.{number}.type", f"{kind!s:.40} content: {_TEXT_ONLY} (content parts "
                              'of type "text")')
            for key in part:
                if key not in TEXT_PART_FIELDS:
                    raise _unknown(f"{prefix}content.{number}.{key}")
    return _checked(message, fields, prefix, "messages.*.")
