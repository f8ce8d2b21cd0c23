"""Tool calling: the tools a conversation offers, how the model writes a call, and its calls read back from the answer.

A call is written the way the model's chat template writes one in an assistant turn: the template is rendered
once with a probe call, and the text around the call's JSON object (``<tool_call>\\n`` ... ``\\n</tool_call>``
for Qwen 2.5 and Hermes-style templates, nothing around it for Llama 3.1's) and the keys of its name and
arguments become the model's :class:`ToolCallFormat`. A template that renders no tool calls (the embedded
SmolLM2's) gets the Hermes format, with the tools described in a system message as Hermes and Qwen do.

The answer is held to that format by a structural tag (xgrammar; :mod:`~ctx_integrations.engine.core.structured`):
with ``tool_choice="auto"`` the model may write text or, once it writes the call's opening, a call whose name
is one of the tools and whose arguments are valid against that tool's ``parameters`` schema (narrowed:
unbounded strings, arrays and integers get a bound, :func:`~ctx_integrations.engine.core.structured.narrowed_schema`);
``"required"`` and a named tool allow calls only.

:meth:`ToolCallFormat.read` reads the calls back, in the formats small models write when the choice is theirs
(what llama.cpp's and Ollama's parsers accept): the template's own markup, and JSON, bare or in a Markdown fence
(```json ... ```), that is an object ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``) or a list of
them. A call counts only if it names an offered tool and its arguments are valid against that tool's schema;
anything else (JSON that names no tool, prose) stays text. Every call returned is valid against its schema. A
call cut by ``max_tokens`` or a stop string is not a call: it is :class:`CutToolCall` (its name and the
arguments' text as far as written), kept out of the text, for the front ends to report (a typed error in process,
OpenAI's ``finish_reason="length"`` shape on the server).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from ctx_integrations.engine.core.structured import StructuredOutput, _schema_text, load_xgrammar, narrowed_schema
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
class CutToolCall:
    """A call ``max_tokens`` (or a stop string) cut before it was complete: the tool's name as far as it is known
    (``""`` when it was cut before it), and the arguments' JSON text as written (cut, so not valid JSON).

    Kept apart from :class:`ToolCall` (whose arguments are always valid) so no front end runs it or shows its markup
    as text: the adapters raise :class:`~ctx_integrations.errors.IncompleteStructuredOutputError`, the server
    answers it as OpenAI does, a ``tool_calls`` entry with the cut arguments and ``finish_reason="length"``."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry of a cut call (its ``arguments`` the text as far as written)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass
class CallsRead:
    """An answer read for calls: its text without them, the complete calls, and the call cut at its end if any."""

    text: str
    calls: list[ToolCall]
    cut: CutToolCall | None = None


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
                grammar = xgr.Grammar.from_json_schema(narrowed_schema(tool.parameters), any_whitespace=False,
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
        """The answer's text without its calls, and the calls (:meth:`read`'s, of an answer that ended on its own)."""
        read = self.read(text, tools)
        return read.text, read.calls

    def read(self, text: str, tools: Sequence[Tool] = (), choice: str | Tool = "auto", parallel: bool = True,
             cut: bool = False) -> CallsRead:
        """The answer's calls, in the template's markup or as bare or fenced JSON (:data:`CALL_FORMATS`), and its
        text without them.

        ``tools``: a call must name one and its arguments be valid against its schema (none given: any name, any
        arguments object). ``parallel=False``: the first call only (the others are dropped, not left as text).
        ``cut``: the answer did not end on its own (``max_tokens``, a stop string): an unfinished call at its end is
        never text; it is :attr:`CallsRead.cut` when it is the answer's only call, dropped when complete calls
        come before it. With ``choice`` ``"required"`` or a tool the answer is calls only, so whatever follows the
        complete calls is the cut one.
        """
        names = {t.name: t for t in tools}
        calls: list[ToolCall] = []
        kept, position, at = [], 0, 0
        while (found := self._next_call(text, at, names)) is not None:
            start, end, found_calls = found
            kept.append(text[position:start])
            calls.extend(found_calls)
            position = at = end
        rest = text[position:]
        cut_call = None
        if cut:
            opened = self._cut_opening(rest, names)
            if opened is None and choice != "auto" and rest.strip():
                opened = 0  # calls only: this is the cut call's text, whatever of its opening was written
            if opened is not None:
                cut_call = _cut_call(rest[opened:], self, tools, choice)
                rest = rest[:opened]
        kept.append(rest)
        calls = calls if parallel else calls[:1]
        # a call cut after complete ones is dropped: those are the answer (a small model repeats its call until
        # max_tokens when parallel calls are allowed), and the model can call again in the next turn
        return CallsRead("".join(kept).strip(), calls, None if calls else cut_call)

    def _next_call(self, text: str, at: int, tools: Mapping[str, Tool]) -> tuple[int, int, list[ToolCall]] | None:
        """The first span from ``at`` that holds calls: (start, end, its calls), or ``None``. JSON that is not calls
        is passed over whole (a list is calls all or none; a call inside other JSON is that JSON's data)."""
        while (start := _next_opening(text, at, self.begin)) is not None:
            end, calls = self._calls_at(text, start, tools)
            if calls:
                return start, end, calls
            at = max(end, start + 1)
        return None

    def _calls_at(self, text: str, start: int, tools: Mapping[str, Tool]) -> tuple[int, list[ToolCall]]:
        """The calls of the span that opens at ``start`` and where it ends (``[]`` and the end of the JSON there, if
        any, when it holds none): the template's markup (``begin`` JSON ``end``; an ``end`` left out, or cut, is
        let through), a closed fence around JSON, or bare JSON."""
        if self.begin and text.startswith(self.begin, start):
            value, end = _json_at(text, start + len(self.begin))
            calls = _calls_of(value, self, tools)
            if calls and (text.startswith(self.end, end) or (text[end:] and self.end.startswith(text[end:]))):
                end = min(len(text), end + len(self.end))  # its end, or the part of it written before a cut
            return end, calls
        fence = _FENCE.match(text, start)
        if fence is not None:
            value, end = _json_at(text, fence.end())
            closing = _FENCE_END.match(text, end)
            return (closing.end(), _calls_of(value, self, tools)) if closing is not None else (end, [])
        value, end = _json_at(text, start)
        return end, _calls_of(value, self, tools)

    def _cut_opening(self, rest: str, tools: Mapping[str, Tool]) -> int | None:
        """Where an unfinished call starts in ``rest`` (the text after the last complete call), or ``None``:
        the template's opening, or JSON (bare or fenced) that starts as a call of an offered tool, ``{"name": "``
        and a tool's name or the start of one; either one whose JSON does not end (JSON that ends, or names
        something else, stays text)."""
        openings = []
        if self.begin and (at := rest.find(self.begin)) >= 0 and _json_at(rest, at + len(self.begin))[0] is None:
            openings.append(at)
        for match in _CUT_JSON.finditer(rest):
            named = _NAME_VALUE.match(rest, match.end() - 1)
            written = rest[match.end():].strip()
            unfinished = _json_at(rest, rest.index("{", match.start()))[0] is None
            if unfinished and (not written or (named is not None and (
                    named.group(1) in tools if named.group(2) else
                    any(name.startswith(named.group(1)) for name in tools)))):
                openings.append(match.start())
                break
        return min(openings) if openings else None


# how a call may open when the model writes it as JSON (bare or fenced); a fence's closing
_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\r?\n?\s*", re.IGNORECASE)
_FENCE_END = re.compile(r"\s*```")
_JSON_OPENING = re.compile(r"```|[{\[]")
# a cut call written as JSON: its opening as far as the name key (fenced or not, in a list or not)
_CUT_JSON = re.compile(r'(?:```[ \t]*(?:json)?\s*)?(?:\[\s*)?\{\s*"name"\s*:', re.IGNORECASE)
CALL_FORMATS = ("the chat template's own markup (<tool_call>\\n{...}\\n</tool_call> for Hermes and Qwen)",
                '{"name": ..., "arguments": {...}} (or "parameters"), bare or in a ```json fence',
                "a JSON list of such objects")
_ARGUMENT_KEYS = ("arguments", "parameters")


def _next_opening(text: str, at: int, begin: str) -> int | None:
    """The first place from ``at`` where a call may open: the template's ``begin``, a fence, ``{`` or ``[``."""
    places = [text.find(begin, at)] if begin else []
    match = _JSON_OPENING.search(text, at)
    places += [match.start()] if match is not None else []
    places = [place for place in places if place >= 0]
    return min(places) if places else None


def _json_at(text: str, at: int) -> tuple[Any, int]:
    """The JSON value at ``at`` (after blanks) and where it ends; ``(None, at)`` when there is none."""
    decoder = json.JSONDecoder(strict=False)  # a tab in a string (xgrammar lets it through) is read, re-escaped
    skipped = len(text) - len(text[at:].lstrip())
    try:
        return decoder.raw_decode(text, skipped)
    except ValueError:
        return None, at


def _calls_of(value: Any, fmt: ToolCallFormat, tools: Mapping[str, Tool]) -> list[ToolCall]:
    """The calls a JSON value holds (one call object, or a list of them), all or none: ``[]`` when any entry is
    not a call of an offered tool with arguments valid against its schema (so that JSON stays text)."""
    values = value if isinstance(value, list) else [value]
    calls = [_call_of(item, fmt, tools) for item in values]
    return calls if values and all(call is not None for call in calls) else []  # type: ignore[return-value]


def _call_of(value: Any, fmt: ToolCallFormat, tools: Mapping[str, Tool]) -> ToolCall | None:
    """One call object as a :class:`ToolCall` (OpenAI's ``{"type": "function", "function": {...}}`` too, and its
    arguments as JSON text), or ``None`` when it is not a valid call of an offered tool."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value, dict):
        return None
    name = value.get(fmt.name_key, value.get("name"))
    arguments = next((value[key] for key in (fmt.arguments_key, *_ARGUMENT_KEYS) if key in value), None)
    if isinstance(arguments, str):  # the arguments as JSON text, as OpenAI writes them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    if tools and (name not in tools or not arguments_valid(tools[name], arguments)):
        return None
    return ToolCall(name, arguments)


def arguments_valid(tool: Tool, arguments: Mapping[str, Any]) -> bool:
    """Whether ``arguments`` are valid against ``tool``'s schema as given (xgrammar's strict JSON schema rules,
    those the constrained calls keep to): a call the model wrote unconstrained is checked as one it was held to."""
    matcher = load_xgrammar().GrammarMatcher(_arguments_grammar(tool.parameters))
    return bool(matcher.accept_string(json.dumps(dict(arguments), ensure_ascii=False)) and matcher.is_completed())


@lru_cache(maxsize=256)
def _arguments_grammar(parameters: str) -> Any:
    """A tool's parameters schema compiled without a vocabulary (for :meth:`GrammarMatcher.accept_string`)."""
    xgr = load_xgrammar()
    grammar = xgr.Grammar.from_json_schema(parameters, any_whitespace=False, strict_mode=True)
    return xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)


_NAME_SO_FAR = re.compile(r'"name"\s*:\s*"([^"]*)("?)')
_NAME_VALUE = re.compile(r':\s*"([^"]*)("?)')
_ARGUMENTS_SO_FAR = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _cut_call(text: str, fmt: ToolCallFormat, tools: Sequence[Tool], choice: str | Tool) -> CutToolCall:
    """The cut call in ``text`` (from its opening on): its name if written whole (or the one tool it can be: the
    named choice, the only tool, the one tool its written part begins), its arguments' text as far as written."""
    named = _NAME_SO_FAR.search(text)
    name = named.group(1) if named is not None and named.group(2) else ""
    if not name:
        prefix = named.group(1) if named is not None else ""
        if isinstance(choice, Tool):
            name = choice.name
        else:
            fits = [tool.name for tool in tools if tool.name.startswith(prefix)]
            name = fits[0] if len(fits) == 1 else ""
    key = re.search(r'"' + re.escape(fmt.arguments_key) + r'"\s*:\s*', text) or _ARGUMENTS_SO_FAR.search(text)
    return CutToolCall(name, text[key.end():] if key is not None else "")


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
    """A streamed answer's text with its tool calls held back: what comes before the first place a call may open
    (the template's opening, or a fence, ``{`` or ``[``: the JSON calls :meth:`ToolCallFormat.read` takes) is
    passed on as it arrives (less a tail that may be the start of an opening), nothing after it; the rest of
    the answer's text comes from :meth:`rest` once the calls are read back from the whole answer. Why so wide:
    a call the model writes as JSON is known to be one only once it is complete, and its markup must never be
    streamed as text; prose after a brace reaches the client at the end instead."""

    def __init__(self, fmt: ToolCallFormat):
        self.marker = fmt.begin or '{"' + fmt.name_key + '"'  # the template's own opening
        # and the openings of the JSON calls :meth:`ToolCallFormat.read` also takes (a fence, a bare object or list)
        self.markers = (self.marker, "```", "{", "[")
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
        found = [at for at in (self.seen.find(marker) for marker in self.markers) if at >= 0]
        if found:
            self.calling, safe = True, min(found)
        else:
            held = max(next((n for n in range(min(len(marker) - 1, len(self.seen)), 0, -1)
                             if marker.startswith(self.seen[-n:])), 0) for marker in self.markers)
            safe = len(self.seen) - held
        out = self.seen[self.sent:safe]
        self.sent = max(self.sent, safe)
        return out

    def rest(self, content: str) -> str:
        """What of the answer's final text (its calls taken out) was not passed on yet."""
        sent = self.seen[:self.sent]
        if content.startswith(sent):  # the blank the text went on with was sent already: not twice
            return content[len(sent):]
        sent = sent.strip()  # the final text is stripped
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
