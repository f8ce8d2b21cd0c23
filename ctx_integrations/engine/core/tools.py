"""Tool calling: the tools a conversation offers, how the model writes a call, and its calls read back from the answer.

A call is written the way the model's chat template writes one in an assistant turn: the template is rendered
once with a probe call, and the text around the call's JSON object (``<tool_call>\\n`` ... ``\\n</tool_call>``
for Qwen 2.5 and Hermes-style templates, nothing around it for Llama 3.1's) and the keys of its name and
arguments become the model's :class:`ToolCallFormat`. A template that renders no tool calls (the embedded
SmolLM2's) gets the Hermes format, with the tools described in a system message as Hermes and Qwen do.

The answer is held to that format by a structural tag (xgrammar; :mod:`~ctx_integrations.engine.core.structured`):
with ``tool_choice="auto"`` the model may write text or, once it writes the call's opening, a call whose name
is one of the tools and whose arguments are valid against that tool's ``parameters`` schema; ``"required"``
and a named tool allow calls only. :meth:`ToolCallFormat.parse` reads the calls back, so every call returned
is valid against its schema (unless ``max_tokens`` cut it, then it stays in the text).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ctx_integrations.engine.core.structured import StructuredOutput, _schema_text, bounded_integers, load_xgrammar
from ctx_integrations.errors import InvalidOptionError, InvalidStructuredOutputError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (and a dot, as vLLM allows)
NO_PARAMETERS = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema (as JSON text)."""

    name: str
    description: str = ""
    parameters: str = json.dumps(NO_PARAMETERS)

    def openai(self) -> dict[str, Any]:
        """OpenAI's tool object, as chat templates and xgrammar take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(self.parameters)}}


def as_tool(value: Any) -> Tool:
    """A :class:`Tool` from OpenAI's ``{"type": "function", "function": {...}}``, the bare function, or a Tool."""
    if isinstance(value, Tool):
        return value
    if not isinstance(value, Mapping):
        raise InvalidOptionError(f"a tool must be a dict like {{'type': 'function', 'function': {{'name': ..., "
                                 f"'parameters': {{...}}}}}}, got {type(value).__name__}")
    if value.get("type", "function") != "function":
        raise InvalidOptionError(f"only tools of type 'function' can be called, got type {value.get('type')!r}")
    if "function" in value:
        value = value["function"]
        if not isinstance(value, Mapping):
            raise InvalidOptionError("a tool's 'function' must be an object with a name and parameters")
    name = value.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidOptionError(f"a tool's name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
    description = value.get("description") or ""
    if not isinstance(description, str):
        raise InvalidOptionError(f"tool {name!r}: description must be a string")
    parameters = value.get("parameters")
    return Tool(name, description, _schema_text(NO_PARAMETERS if parameters is None else parameters))


def as_tools(values: Sequence[Any] | None) -> tuple[Tool, ...]:
    if values is None:
        return ()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise InvalidOptionError(f"tools must be a list of tools, got {type(values).__name__}")
    tools = tuple(as_tool(value) for value in values)
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidOptionError(f"tool names must be unique, got {names}")
    return tools


def tool_choice(value: Any, tools: Sequence[Tool]) -> str | Tool:
    """``"none"``, ``"auto"``, ``"required"`` or the one tool named (OpenAI's ``{"type": "function", "function":
    {"name": ...}}`` or just the name); ``None`` is ``"auto"``."""
    if value is None:
        return "auto"
    if isinstance(value, Mapping):
        function = value.get("function")
        value = function.get("name") if isinstance(function, Mapping) else value.get("name")
    if value in TOOL_CHOICES:
        if value == "required" and not tools:
            raise InvalidOptionError("tool_choice='required' needs at least one tool")
        return value
    for tool in tools:
        if tool.name == value:
            return tool
    raise InvalidOptionError(f"tool_choice must be 'none', 'auto', 'required' or the name of one of the tools "
                             f"({', '.join(t.name for t in tools) or 'none given'}), got {value!r}")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: an id (made up here, as OpenAI does), the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (the arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": dict(self.arguments)}


@dataclass(frozen=True)
class ToolCallFormat:
    """How one call is written: ``begin``, then ``{"<name_key>": "NAME", "<arguments_key>": {...}}``, then ``end``.

    ``native``: the chat template renders tools (and calls, and ``tool`` messages) itself; otherwise the
    tools are described in a system message and tool results come back as user turns in ``<tool_response>``.
    """

    begin: str = "<tool_call>\n"
    end: str = "\n</tool_call>"
    name_key: str = "name"
    arguments_key: str = "arguments"
    native: bool = False

    def call_text(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, str, str]:
        """A call as (begin, its JSON, end): the JSON is user data, the wrappers are the template's text."""
        body = json.dumps({self.name_key: name, self.arguments_key: dict(arguments)}, ensure_ascii=False)
        return self.begin, body, self.end

    @property
    def _opening(self) -> str:
        return self.begin + '{"' + self.name_key + '": "'

    def structured(self, tools: Sequence[Tool], choice: str | Tool, parallel: bool = True) -> StructuredOutput:
        """The structural tag that holds an answer to ``choice`` over ``tools`` (``choice != "none"``)."""
        xgr = load_xgrammar()

        def tag(tool: Tool) -> dict[str, Any]:
            # the arguments as compact JSON (the structural tag's own JSON content lets whitespace in anywhere)
            try:
                grammar = xgr.Grammar.from_json_schema(bounded_integers(tool.parameters), any_whitespace=False,
                                                       strict_mode=True)
            except (RuntimeError, ValueError, TypeError) as error:
                raise InvalidStructuredOutputError(f"tool {tool.name!r}: its parameters schema cannot be compiled: "
                                                   f"{error}", "tools") from None
            return {"type": "tag", "begin": self._opening + tool.name + '", "' + self.arguments_key + '": ',
                    "content": {"type": "grammar", "grammar": str(grammar)}, "end": "}" + self.end}

        trigger = self.begin or self._opening
        if isinstance(choice, Tool):
            fmt: dict[str, Any] = tag(choice)
        elif choice == "required":
            fmt = {"type": "tags_with_separator", "tags": [tag(t) for t in tools], "separator": "\n",
                   "at_least_one": True, "stop_after_first": not parallel}
        else:
            fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": [tag(t) for t in tools],
                   "stop_after_first": not parallel}
        return StructuredOutput(structural_tag=json.dumps({"type": "structural_tag", "format": fmt},
                                                          ensure_ascii=False))

    def parse(self, text: str, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
        """The answer's text without its calls, and the calls (complete ones only, of known tools when given)."""
        names = {t.name for t in tools}
        decoder = json.JSONDecoder(strict=False)  # a tab in a string (xgrammar lets it through) is read, re-escaped
        calls: list[ToolCall] = []
        kept, position = [], 0
        marker = self.begin or '{"' + self.name_key + '"'
        while (start := text.find(marker, position)) >= 0:
            body_at = start + len(self.begin)
            try:
                value, body_end = decoder.raw_decode(text, body_at)
            except ValueError:
                break
            name, arguments = (value.get(self.name_key), value.get(self.arguments_key)) if isinstance(value, dict) \
                else (None, None)
            if (not isinstance(name, str) or not isinstance(arguments, dict) or (names and name not in names)
                    or not text.startswith(self.end, body_end)):
                kept.append(text[position:body_at])
                position = body_at
                continue
            kept.append(text[position:start])
            calls.append(ToolCall(name, arguments))
            position = body_end + len(self.end)
        kept.append(text[position:])
        return "".join(kept).strip(), calls


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: those offered, the choice among them, and whether several calls may be made."""

    tools: tuple[Tool, ...]
    choice: str | Tool
    parallel: bool = True

    def sampling(self, sampling: Any, fmt: ToolCallFormat) -> Any:
        """``sampling`` with the structural tag that holds the answer to this choice in ``fmt``."""
        return replace(sampling, structured=fmt.structured(self.tools, self.choice, self.parallel))


def tool_request(tools: Sequence[Any] | None, choice: Any = None, parallel: bool = True,
                 sampling: Any = None) -> ToolRequest | None:
    """The request's tools checked, or ``None`` when none are offered (no tools, or ``tool_choice="none"``).

    Tools and structured output are one constraint each: both at once are refused.
    """
    offered = as_tools(tools)
    picked = tool_choice(choice, offered)
    if not isinstance(parallel, bool):
        raise InvalidOptionError(f"parallel_tool_calls must be True or False, got {parallel!r}")
    if not offered or picked == "none":
        return None
    if sampling is not None and getattr(sampling, "structured", None) is not None:
        raise InvalidOptionError("give tools or a structured output format (response_format), not both: a tool's "
                                 "parameters are its arguments' schema")
    return ToolRequest(offered, picked, parallel)


class ToolCallFilter:
    """A streamed answer's text with its tool calls held back: what comes before the first call's opening is
    passed on as it arrives (less a tail that may be the start of the opening), nothing after it; the rest of
    the answer's text comes from :meth:`rest` once the calls are read back from the whole answer."""

    def __init__(self, fmt: ToolCallFormat):
        self.marker = fmt.begin or '{"' + fmt.name_key + '"'
        self.seen, self.sent, self.calling = "", 0, False

    @classmethod
    def for_engine(cls, engine: Any) -> ToolCallFilter:
        """The filter for a stream of ``engine``'s answers (its model writes calls in ``engine.layout.tool_format``):
        how a front end (the LangChain and LlamaIndex chat models, the HTTP server) streams a conversation with
        tools without reaching into the engine's prompt layout."""
        return cls(engine.layout.tool_format)

    def push(self, piece: str) -> str:
        self.seen += piece
        if self.calling:
            return ""
        at = self.seen.find(self.marker)
        if at >= 0:
            self.calling, safe = True, at
        else:
            held = next((n for n in range(min(len(self.marker) - 1, len(self.seen)), 0, -1)
                         if self.marker.startswith(self.seen[-n:])), 0)
            safe = len(self.seen) - held
        out = self.seen[self.sent:safe]
        self.sent = max(self.sent, safe)
        return out

    def rest(self, content: str) -> str:
        """What of the answer's final text (its calls taken out) was not passed on yet."""
        sent = self.seen[:self.sent].strip()
        return content[len(sent):] if content.startswith(sent) else ""


HERMES = ToolCallFormat()
_PROBE_NAME, _PROBE_ARGS = "ctx_probe_function", {"ctx_probe_argument": "ctx probe value"}
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {
                                                    "ctx_probe_argument": {"type": "string"}}}}}


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False,
                                         add_generation_prompt=generation)


def probe_format(tokenizer: Any) -> ToolCallFormat:
    """The model's own call format, read from its chat template rendering a probe call; :data:`HERMES` when the
    template renders no tools or no calls (or fails to render them)."""
    user = {"role": "user", "content": "ctx probe question"}
    call = {"id": "call_ctxprobe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGS}}
    try:
        if _PROBE_NAME not in _render(tokenizer, [user], True):
            return HERMES  # the template does not show the tools to the model
        opener = _render(tokenizer, [user], True)
        with_call = _render(tokenizer, [user, {"role": "assistant", "content": "", "tool_calls": [call]}])
        with_text = _render(tokenizer, [user, {"role": "assistant", "content": "ctx probe answer"}])
    except Exception:  # templates raise jinja errors of many kinds on shapes they do not know
        return HERMES
    if not (with_call.startswith(opener) and with_text.startswith(opener)):
        return HERMES
    turn, answer = with_call[len(opener):], with_text[len(opener):]
    closing = answer[answer.find("ctx probe answer") + len("ctx probe answer"):]
    found = _probe_object(turn)
    if found is None or not turn.endswith(closing):
        return HERMES
    start, end, name_key, arguments_key = found
    return ToolCallFormat(turn[:start], turn[end:len(turn) - len(closing)], name_key, arguments_key, native=True)


def _probe_object(turn: str) -> tuple[int, int, str, str] | None:
    """Where the probe call's JSON object lies in the rendered turn, and its name and arguments keys."""
    decoder = json.JSONDecoder()
    at = turn.find(_PROBE_NAME)
    for start in [i for i in range(at) if turn[i] == "{"][::-1]:
        try:
            value, end = decoder.raw_decode(turn, start)
        except ValueError:
            continue
        if not isinstance(value, dict) or end <= at:
            continue
        name_key = next((key for key, item in value.items() if item == _PROBE_NAME), None)
        arguments_key = next((key for key, item in value.items() if item == _PROBE_ARGS), None)
        if name_key and arguments_key and list(value) == [name_key, arguments_key]:
            return start, end, name_key, arguments_key
        return None
    return None


def tools_prompt(tools: Sequence[Tool], fmt: ToolCallFormat) -> str:
    """The system text that offers ``tools`` to a model whose template has no tools (Hermes' wording)."""
    listed = "\n".join(json.dumps(tool.openai(), ensure_ascii=False) for tool in tools)
    example = f'{fmt.begin}{{"{fmt.name_key}": <function-name>, "{fmt.arguments_key}": <arguments-object>}}{fmt.end}'
    return ("You may call one or more functions to assist with the user query. The functions, as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n\nTo call a function, answer with its name and arguments as JSON "
            f"within tags:\n{example}")


def check_tool_text(tools: Sequence[Tool], special: Any) -> None:
    """Refuse tools whose definitions hold the model's control tokens: a template renders them as its own text."""
    if special is None:
        return
    for tool in tools:
        found = special.search(json.dumps(tool.openai(), ensure_ascii=False))
        if found:
            raise InvalidStructuredOutputError(f"tool {tool.name!r} holds the model's control token "
                                               f"{found.group()!r}: remove it from its name, description and schema",
                                               "tools")
