"""Plain chat with no documents: the conversation rendered with the model's own chat template, one stream.

The engine's ``generate`` always answers from documents (its prompt layout is prefix + documents +
question); a chat model (LangChain's ``ChatContextOfExperts``, LlamaIndex's ``ExpertDecoderLLM``) must
also answer ``"hello"``. :meth:`Engine.chat <ctx_integrations.engine.core.engine.Engine.chat>` renders the
whole conversation with :func:`conversation_ids` and decodes it as one stream with the identity rule.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ctx_integrations.documents import user_text
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.tools import Tool, check_tool_text, tools_prompt
from ctx_integrations.errors import ChatTemplateError, InvalidOptionError

CHAT_MODE = "chat"
_MESSAGE_MARK = "\x00MESSAGE{}\x00"


def conversation_ids(layout: PromptLayout, messages: Sequence[dict[str, Any]], tools: Sequence[Tool] = ()) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn opener.

    Message contents are user data, like documents and queries: the template is rendered around a
    marker per message, and each content is tokenised as user text, so a control token written in a
    message (``<|im_end|>``, ``<|im_start|>system``) stays text and cannot open a forged turn; only the
    template's own control tokens become control ids.

    Tool calling (OpenAI's message shapes): an assistant message's ``tool_calls`` are written after its content
    in the model's call format (:attr:`PromptLayout.tool_format`; the call's JSON is user text, its wrappers the
    template's), a ``tool`` message carries a call's result, and ``tools`` are offered to the model, by its
    template when it renders tools, else in a system message (:func:`~ctx_integrations.engine.core.tools.tools_prompt`).
    """
    if not messages:
        raise InvalidOptionError("no messages were given: pass at least one message")
    uses_tools = bool(tools) or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                    for m in messages)
    fmt = layout.tool_format if uses_tools else None
    contents: list[list[tuple[str, bool]]] = []
    marked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidOptionError(f"message {i} must be a dict with a role and a content, got "
                                     f"{type(message).__name__}")
        role, calls = message.get("role"), message.get("tool_calls") or []
        content = message.get("content")
        if calls and content is None:
            content = ""
        parts = [(user_text(content, f"message {i}'s content"), True)]
        if calls:
            assert fmt is not None
            for number, call in enumerate(calls):
                name, arguments = _call_parts(call, f"message {i}'s tool call {number}")
                begin, body, end = fmt.call_text(name, arguments)
                parts += [("\n" if number else "", False), (begin, False), (body, True), (end, False)]
        if role == "tool" and fmt is not None and not fmt.native:  # a template without tools: Hermes' tool turn
            role, parts = "user", [("<tool_response>\n", False), *parts, ("\n</tool_response>", False)]
        contents.append(parts)
        marked.append({"role": role, "content": _MESSAGE_MARK.format(i)})
    if tools and fmt is not None and not fmt.native:
        offer = tools_prompt(tools, fmt)
        if marked[0]["role"] == "system":
            contents[0] = [*contents[0], ("\n\n" + offer, True)]
        else:
            contents.insert(0, [(offer, True)])
            marked = [{"role": "system", "content": ""}, *marked]
            marked = [{**m, "content": _MESSAGE_MARK.format(i)} for i, m in enumerate(marked)]
    offered = {}
    if tools and fmt is not None and fmt.native:
        check_tool_text(tools, layout._special_tokens[1])
        offered = {"tools": [tool.openai() for tool in tools]}
    try:
        text = layout.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True, **offered)
    except Exception as error:  # templates raise jinja errors of many kinds (e.g. unsupported roles)
        raise ChatTemplateError(f"the chat template could not render this conversation: {error}") from error
    parts: list[tuple[str, bool]] = []
    for i, content in enumerate(contents):
        before, mark, text = text.partition(_MESSAGE_MARK.format(i))
        if not mark:
            raise ChatTemplateError(f"the chat template dropped or altered message {i}; it cannot be tokenised safely")
        parts += [(before, False), *content]
    return layout.encode_parts(parts + [(text, False)])


def _call_parts(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    """A tool call's name and arguments, from OpenAI's ``{"function": {"name", "arguments": JSON text}}`` or a
    plain ``{"name", "arguments": dict}``."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise InvalidOptionError(f"{where} must be a dict with a function name and arguments")
    name, arguments = function.get("name"), function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidOptionError(f"{where}: arguments must be a JSON object, got {arguments!r:.80}") from None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise InvalidOptionError(f"{where} must have a function name (a string) and arguments (a JSON object)")
    return name, arguments
