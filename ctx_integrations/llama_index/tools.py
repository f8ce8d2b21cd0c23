"""Tool calls between LlamaIndex's messages and the engine's: LlamaIndex's shapes only, no decoding.

LlamaIndex (0.14) carries a call as a :class:`ToolCallBlock` in the assistant message's ``blocks`` (what its own
``MockFunctionCallingLLM`` and the OpenAI integration write, and what ``FunctionAgent`` keeps in its scratchpad;
the OpenAI integration also keeps them in ``additional_kwargs["tool_calls"]``, where some of LlamaIndex's code
looks),
and a tool's result as a ``tool`` message whose ``additional_kwargs["tool_call_id"]`` names the call. The engine
takes OpenAI's shapes (``Engine.chat(tools=...)``, ``tool_calls`` on assistant messages, ``tool`` messages) and
writes them in the model's own call format. Calls an older integration left in ``additional_kwargs["tool_calls"]``
(OpenAI's dicts or objects) are read too, so a history from another LLM carries over.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from ctx_integrations import Answer
from ctx_integrations.errors import IncompleteStructuredOutputError, NoToolCallError

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


def _openai_call(call: Any) -> dict[str, Any]:
    """An ``additional_kwargs["tool_calls"]`` entry (OpenAI's dict or its client's object) in OpenAI's dict shape."""
    if not isinstance(call, dict):
        function = getattr(call, "function", None)
        call = {"id": getattr(call, "id", None), "function": {"name": getattr(function, "name", None),
                                                              "arguments": getattr(function, "arguments", None)}}
    return {"id": call.get("id") or "", "type": "function", "function": dict(call.get("function") or {})}


def message_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """The tool calls an assistant message made, in OpenAI's shape (arguments as a dict or JSON text)."""
    blocks = [block for block in message.blocks if isinstance(block, ToolCallBlock)]
    if blocks:
        return [{"id": block.tool_call_id or "", "type": "function",
                 "function": {"name": block.tool_name, "arguments": block.tool_kwargs}} for block in blocks]
    return [_openai_call(call) for call in message.additional_kwargs.get("tool_calls") or []]


def to_chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages -> ``[{"role", "content", ...}]`` for the chat template: an assistant message's tool
    calls and a ``tool`` message's result in OpenAI's shape (``Engine.chat`` writes them in the model's format);
    other roles speak as user."""
    converted: list[dict[str, Any]] = []
    for message in messages:
        if message.role == MessageRole.TOOL:
            converted.append({"role": "tool", "content": message.content or "",
                              "tool_call_id": message.additional_kwargs.get("tool_call_id") or ""})
            continue
        entry: dict[str, Any] = {"role": _ROLES.get(message.role, "user"), "content": message.content or ""}
        calls = message_calls(message) if message.role == MessageRole.ASSISTANT else []
        if calls:
            entry["tool_calls"] = calls
        converted.append(entry)
    return converted


def answer_message(answer: Answer) -> ChatMessage:
    """The assistant's message for ``answer``: its text, then one :class:`ToolCallBlock` per call it made; the
    calls in OpenAI's shape in ``additional_kwargs["tool_calls"]`` too, where LlamaIndex's streaming programs and
    chat memories look for them. A call ``max_new_tokens`` cut is an
    :class:`~ctx_integrations.errors.IncompleteStructuredOutputError` (so ``FunctionAgent`` never takes it for
    its final answer)."""
    answer.refuse_cut_tool_call()
    if not answer.tool_calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content=answer.text)
    blocks: list[Any] = [TextBlock(text=answer.text)]
    blocks += [ToolCallBlock(tool_call_id=call.id, tool_name=call.name, tool_kwargs=dict(call.arguments))
               for call in answer.tool_calls]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks,
                       additional_kwargs={"tool_calls": [call.openai() for call in answer.tool_calls]})


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """The calls in ``response`` as LlamaIndex's :class:`ToolSelection` (each valid against its tool's schema).

    None with ``error_on_no_tool_call``: :class:`~ctx_integrations.errors.IncompleteStructuredOutputError` when
    the answer was cut (``max_new_tokens``) inside a call (``raw["tool_call_cut"]``, :class:`ExpertDecoderLLM`'s),
    else
    :class:`~ctx_integrations.errors.NoToolCallError` (the model chose to answer in text).
    """
    selections = []
    for call in message_calls(response.message):
        arguments = call["function"].get("arguments")
        selections.append(ToolSelection(tool_id=call["id"], tool_name=call["function"].get("name") or "",
                                        tool_kwargs=json.loads(arguments) if isinstance(arguments, str)
                                        else dict(arguments or {})))
    if selections or not error_on_no_tool_call:
        return selections
    text = response.message.content or ""
    raw = response.raw if isinstance(response.raw, dict) else {}
    if raw.get("tool_call_cut"):
        raise IncompleteStructuredOutputError(
            f"the tool call was cut before it was complete (finish_reason {raw.get('finish_reason')!r}): raise "
            f"max_new_tokens (or "
            f"bound the schema's strings and arrays: maxLength, maxItems); the answer reads {text[:200]!r}", text)
    raise NoToolCallError(f"the model answered in text, not with a tool call: pass tool_required=True (or "
                          f"tool_choice='<tool name>') so the call is held by constrained decoding, or "
                          f"error_on_no_tool_call=False to take the text; it reads {text[:200]!r}")
