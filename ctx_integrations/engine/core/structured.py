"""Structured output: an answer held to a JSON schema, to JSON, a regex, a list of choices or a grammar, token by token.

The format is compiled against the model's vocabulary by xgrammar (the constrained-decoding library vLLM and
SGLang use), once per format and model; each answer gets its own matcher, which says before every token
which tokens may come next. :class:`TokenConstraint` turns that into a bitmask that sets every other
token's score to ``-inf`` before the sampler picks (``decoding.TokenSampler``), and takes each chosen token
back into the matcher, so the next mask follows the text so far. Once the format is complete, only an
end-of-sequence token may follow: a constrained answer ends when its text is complete (or at ``max_tokens``,
with ``finish_reason == "length"`` and the text cut short).

JSON comes out compact (``{"a": 1, "b": [2, 3]}``: no free whitespace between tokens, so a small model cannot
spend its budget on blank lines, and no property the schema does not declare (xgrammar's strict mode):
every answer is valid against the schema; a keyword the grammar cannot enforce is refused by name,
:mod:`~ctx_integrations.engine.core.schema_support`). What the schema leaves unbounded is bounded
(:func:`narrowed_schema`; otherwise a model, a small one especially, can write digits or items until
``max_tokens`` and the answer is cut):
an integer to JSON's interoperable range, ±(2**53 - 1) (RFC 8259 section 6: what every JSON reader, JavaScript's
included, takes exactly), a string to 128 characters and an array to 32 items (:class:`SchemaBounds`; overridden
by ``$CTX_SCHEMA_MAX_LENGTH`` / ``$CTX_SCHEMA_MAX_ITEMS``, 0 for none, or by the schema's own ``maxLength`` /
``maxItems``): still valid against the schema. xgrammar is optional (``pip install 'ctx-integrations[structured]'``);
without it, asking for structured output raises :class:`~ctx_integrations.errors.MissingDependencyError` and
everything else works.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ctx_integrations.engine.core.compile_pool import (
    DEFAULT_FORMAT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_FORMAT_BYTES,
    CompileCancelled,
    CompilePool,
    check_format_size,
    pool_for,
)
from ctx_integrations.engine.core.futures import settle
from ctx_integrations.engine.core.schema_support import check_schema
from ctx_integrations.errors import InvalidOptionError, InvalidStructuredOutputError, missing_dependency

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# JSON mode (json_object): any JSON object, with any keys and values
_ANY_OBJECT = json.dumps({"type": "object"})
DEFAULT_FORMAT_CACHE_BYTES = 512 * 1024 * 1024  # compiled formats kept per model, by xgrammar's memory_size_bytes


def load_xgrammar() -> Any:
    """The xgrammar module, or the error naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError:
        raise missing_dependency("xgrammar", "structured") from None
    return xgrammar


def _schema_text(schema: Any) -> str:
    """A JSON schema given as a dict, a JSON string or a pydantic model class, as JSON text (its key order kept)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    check_schema(schema)  # refuses what xgrammar would drop silently, and schemas too deep for recursive code
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as error:
            raise InvalidStructuredOutputError(f"the JSON schema is not valid JSON: {error}") from None
    else:
        parsed = schema
    if not isinstance(parsed, (Mapping, bool)):
        raise InvalidStructuredOutputError(f"a JSON schema must be a JSON object (a dict, a JSON string or a pydantic "
                                           f"model class), got {type(schema).__name__}")
    try:
        return json.dumps(parsed, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise InvalidStructuredOutputError(f"the JSON schema cannot be written as JSON: {error}") from None


INTEROPERABLE_INTEGERS = (-(2**53) + 1, 2**53 - 1)  # RFC 8259 section 6
# keys whose values are JSON data, not schemas: an integer schema inside them is not to be bounded
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})
# the default bounds of a string's length and an array's items the schema leaves unbounded (0: none)
DEFAULT_MAX_LENGTH, DEFAULT_MAX_ITEMS = 128, 32
MAX_LENGTH_ENV, MAX_ITEMS_ENV = "CTX_SCHEMA_MAX_LENGTH", "CTX_SCHEMA_MAX_ITEMS"


@dataclass(frozen=True)
class SchemaBounds:
    """The bounds :func:`narrowed_schema` gives what a schema leaves unbounded: ``max_length`` characters per
    string, ``max_items`` items per array (``0``: that kind stays unbounded).

    Why: a small model held to a schema can fill an unbounded string (``"1234567890..."``) or array until
    ``max_tokens`` and the answer is cut; a bound makes it close the value. :meth:`from_environment` reads the
    override, ``$CTX_SCHEMA_MAX_LENGTH`` and ``$CTX_SCHEMA_MAX_ITEMS`` (the server's and every process's setting).
    """

    max_length: int = DEFAULT_MAX_LENGTH
    max_items: int = DEFAULT_MAX_ITEMS

    def __post_init__(self) -> None:
        for name in ("max_length", "max_items"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidOptionError(f"SchemaBounds.{name} must be a whole number >= 0 (0: unbounded), "
                                         f"got {value!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> SchemaBounds:
        """The default bounds, less what ``$CTX_SCHEMA_MAX_LENGTH`` / ``$CTX_SCHEMA_MAX_ITEMS`` set (read at each
        compile, so a process can change them; a value that is not a whole number >= 0 is refused, naming it)."""
        values = {}
        for name, variable, default in (("max_length", MAX_LENGTH_ENV, DEFAULT_MAX_LENGTH),
                                        ("max_items", MAX_ITEMS_ENV, DEFAULT_MAX_ITEMS)):
            text = environ.get(variable, "").strip()
            if not text:
                values[name] = default
                continue
            try:
                values[name] = int(text)
            except ValueError:
                values[name] = -1
            if values[name] < 0:
                raise InvalidOptionError(f"${variable} must be a whole number >= 0 (0: unbounded), got {text!r}")
        return cls(**values)


def narrowed_schema(schema_text: str, bounds: SchemaBounds | None = None) -> str:
    """``schema_text`` with what it leaves unbounded bounded: every ``integer`` held to JSON's interoperable range
    (:data:`INTEROPERABLE_INTEGERS`) below and above, every ``string`` to ``bounds.max_length`` characters
    (``maxLength``), every ``array`` to ``bounds.max_items`` items (``maxItems``); ``bounds``: default
    :meth:`SchemaBounds.from_environment`. Bounds the schema gives are kept (a ``pattern``, ``format``, ``enum`` or
    ``const`` string is left as it is: its own rule bounds it).

    What xgrammar compiles, never what :meth:`StructuredOutput.schema` returns or a tool reports: a narrowing, so
    every answer is still valid against the schema as given. (xgrammar writes a string with ``maxLength`` without
    escape sequences: a bounded string holds no ``"``, ``\\`` or line break; ``max_length=0`` lifts the bound.)
    """
    bounds = SchemaBounds.from_environment() if bounds is None else bounds

    def bound(node: Any) -> Any:
        if isinstance(node, list):
            return [bound(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: value if key in _DATA_KEYS else bound(value) for key, value in node.items()}
        kinds = out.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "integer" in kinds:
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = INTEROPERABLE_INTEGERS[0]
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["maximum"] = INTEROPERABLE_INTEGERS[1]
        if ("string" in kinds and bounds.max_length and "maxLength" not in out
                and not _FIXED_STRING_KEYS.intersection(out)):
            out["maxLength"] = max(bounds.max_length, out.get("minLength", 0))
        if "array" in kinds and bounds.max_items and "maxItems" not in out:
            out["maxItems"] = max(bounds.max_items, out.get("minItems", 0))
        return out

    return json.dumps(bound(json.loads(schema_text)), ensure_ascii=False)


# strings whose own rule bounds them (or that xgrammar compiles by their rule, not their length)
_FIXED_STRING_KEYS = frozenset({"pattern", "format", "enum", "const"})
bounded_integers = narrowed_schema  # its older name (GrammarCompiler.compile's): the one narrowing, bounds included


@dataclass(frozen=True)
class StructuredOutput:
    """The format every token of an answer must keep to; exactly one field is set (vLLM's ``StructuredOutputsParams``).

    ``json``: a JSON schema (a dict, a JSON string or a pydantic model class); ``json_object``: any JSON object
    (OpenAI's JSON mode); ``regex``: the whole answer matches it; ``choice``: the answer is one of these
    strings; ``grammar``: an EBNF grammar (xgrammar's GBNF dialect, root rule ``root``); ``structural_tag``:
    xgrammar's structural tag as JSON text (free text with tagged, schema-held parts; how tool calls are
    held to their tools' schemas, :mod:`~ctx_integrations.engine.core.tools`). Frozen and hashable, so a
    compiled format is reused by every answer that asks for it.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidOptionError(f"StructuredOutput takes exactly one of {', '.join(_KINDS)}; got "
                                     f"{', '.join(given) or 'none'}")
        if self.json_object is not False and self.json_object is not True:
            raise InvalidOptionError(f"json_object must be True or False, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidOptionError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choices = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidOptionError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", choices)

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema an answer is valid against (``json``, or any object for ``json_object``), else ``None``."""
        if self.json is not None:
            return json.loads(self.json)
        return json.loads(_ANY_OBJECT) if self.json_object else None

    @classmethod
    def from_response_format(cls, value: Any) -> StructuredOutput | None:
        """OpenAI's ``response_format`` as a :class:`StructuredOutput` (``None`` for text): ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "text"}``, a pydantic
        model class (LangChain's ``ChatOpenAI`` takes one), or a StructuredOutput as it is."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, type) and hasattr(value, "model_json_schema"):
            return cls(json=value)
        kind = value.get("type") if isinstance(value, Mapping) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema" and isinstance(value.get("json_schema"), Mapping):
            return cls(json=value["json_schema"].get("schema", {}))
        raise InvalidOptionError(f'response_format must be {{"type": "text"}}, {{"type": "json_object"}}, {{"type": '
                                 f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}} or a pydantic '
                                 f"model class, got {value!r:.100}")


def output_width(model: torch.nn.Module) -> int:
    """The width of the model's logits (the output embedding's rows; the config's ``vocab_size`` otherwise)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


@dataclass(frozen=True)
class CompiledFormat:
    """A format compiled for one vocabulary, and the tokens it may use at all (``allowed``: a packed bitmask ANDed
    with the matcher's at every step, ``None``: every token; see :meth:`GrammarCompiler.compile`)."""

    grammar: Any
    allowed: torch.Tensor | None = None


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask over the vocabulary ([V]) as xgrammar's packed bitmask ([1, ceil(V / 32)] int32, bit i of word
    w for token 32 w + i)."""
    words = (allowed.shape[0] + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: allowed.shape[0]] = allowed.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).view(1, words)


class GrammarCompiler:
    """Compiles formats for one model's vocabulary (built once per model), within bounds, off the caller's thread.

    :meth:`submit` is the contract: the format's size is checked in the caller's thread (over ``max_bytes``:
    :class:`~ctx_integrations.errors.FormatTooLargeError`, before any compile), then it is compiled on a thread of
    its own through a worker process that is killed past ``timeout_s``
    (:class:`~ctx_integrations.errors.FormatCompileTimeoutError`) or when the returned future is cancelled
    (:mod:`~ctx_integrations.engine.core.compile_pool`: why a process, and why the engine then builds the format
    itself). Compiled formats are kept by content (the format's kind and text; least recently used first out past
    ``cache_bytes`` of xgrammar's own accounting), so a format asked for again costs a dictionary lookup.

    ``stop_token_ids`` are the engine's end-of-sequence ids: the only tokens allowed once a format is complete.
    Built lazily (xgrammar imported, the vocabulary read, the worker started on the first compile's thread), so
    an engine that never asks for structured output never imports xgrammar, and the first format asked for never
    holds the caller's thread (an event loop) for the seconds that takes.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 cache_bytes: int = DEFAULT_FORMAT_CACHE_BYTES):
        if importlib.util.find_spec("xgrammar") is None:
            raise missing_dependency("xgrammar", "structured")
        self.vocab_size, self.stop_token_ids, self.cache_bytes = vocab_size, stop_token_ids, cache_bytes
        self._tokenizer = tokenizer
        self._lock, self._setup_lock = threading.Lock(), threading.Lock()
        self._masks: dict[bytes, torch.Tensor] = {}
        self._formats: OrderedDict[tuple[str, str], CompiledFormat] = OrderedDict()
        self._kept_bytes = 0
        self._pool: CompilePool | None = None

    def _setup(self) -> CompilePool:
        with self._setup_lock:
            if self._pool is None:
                xgr = load_xgrammar()
                self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info, cache_enabled=False)  # cached here
                self._pool = pool_for(self._tokenizer_info.serialize_json())
            return self._pool

    @property
    def _info(self) -> Any:
        """xgrammar's ``TokenizerInfo`` of the vocabulary (built on first use)."""
        self._setup()
        return self._tokenizer_info

    @property
    def pool(self) -> CompilePool:
        """The worker processes (started on first use)."""
        return self._setup()

    def _without_bytes(self, forbidden: bytes) -> torch.Tensor:
        """The packed bitmask of every token whose text holds none of ``forbidden`` (stop tokens always allowed)."""
        if forbidden not in self._masks:
            banned = set(forbidden)
            allowed = torch.tensor([not banned.intersection(token) for token in self._info.decoded_vocab])
            allowed = torch.cat([allowed, torch.zeros(max(0, self.vocab_size - allowed.shape[0]), dtype=torch.bool)])
            allowed[sorted(i for i in self.stop_token_ids if i < self.vocab_size)] = True
            self._masks[forbidden] = pack_bits(allowed[: self.vocab_size])
        return self._masks[forbidden]

    def submit(self, output: StructuredOutput, field: str | None = None, *,
               max_bytes: int = DEFAULT_MAX_FORMAT_BYTES,
               timeout_s: float = DEFAULT_FORMAT_COMPILE_TIMEOUT_S) -> Future[CompiledFormat]:
        """The compiled format of ``output``, as a future: done at once for a format compiled before, else set by
        the compile's own thread (the format's error: ``InvalidStructuredOutputError`` or one of its subclasses).
        Cancelling the future stops the compile (its worker process is killed). ``FormatTooLargeError`` is raised
        here, in the caller's thread, before anything is compiled."""
        key = format_source(output)
        check_format_size(output.kind, key[1], max_bytes, field)
        future: Future[CompiledFormat] = Future()
        with self._lock:
            compiled = self._formats.get(key)
            if compiled is not None:
                self._formats.move_to_end(key)
                future.set_result(compiled)
                return future
        threading.Thread(target=self._build, args=(output, key, field, timeout_s, future), daemon=True,
                         name="ctx-format-compile").start()
        return future

    def compile(self, output: StructuredOutput, field: str | None = None, **limits: Any) -> CompiledFormat:
        """:meth:`submit`, waiting for the result in this thread (``limits``: its ``max_bytes``, ``timeout_s``).

        xgrammar's JSON strings let raw control characters (U+0000-U+001F, which JSON forbids unescaped) through,
        so JSON formats (compact: no token needs one) may use no token that holds one, and a structural tag (free
        text, and wrappers such as ``<tool_call>\\n``) none but tab, line feed and carriage return.
        """
        future = self.submit(output, field, **limits)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt while waiting: the compile stops too
            future.cancel()
            raise

    def _build(self, output: StructuredOutput, key: tuple[str, str], field: str | None, timeout_s: float,
               future: Future[CompiledFormat]) -> None:
        from ctx_integrations.engine.core.compile_worker import build  # imports xgrammar

        try:
            kind, text = key
            if kind == "json":
                text = bounded_integers(text)
            pool = self._setup()
            pool.run(kind, text, timeout_s, future.cancelled, field, output.kind)
            if future.cancelled():
                return
            try:
                grammar = build(self._compiler, kind, text)
            except (RuntimeError, ValueError, TypeError) as error:  # what the worker accepted: not expected
                raise InvalidStructuredOutputError(f"the {output.kind} format cannot be compiled: {error}",
                                                   field) from None
            allowed = None
            if kind in ("json", "json_object"):
                allowed = self._without_bytes(bytes(range(32)))
            elif kind == "structural_tag":
                allowed = self._without_bytes(bytes(b for b in range(32) if b not in b"\t\n\r"))
            compiled = CompiledFormat(grammar, allowed)
            self._keep(key, compiled)
            settle(future, compiled)
        except CompileCancelled:
            pass
        except BaseException as error:
            settle(future, error=error)

    def _keep(self, key: tuple[str, str], compiled: CompiledFormat) -> None:
        size = int(compiled.grammar.memory_size_bytes)
        with self._lock:
            if key in self._formats or size > self.cache_bytes:
                return
            self._formats[key] = compiled
            self._kept_bytes += size
            while self._kept_bytes > self.cache_bytes:
                _, evicted = self._formats.popitem(last=False)
                self._kept_bytes -= int(evicted.grammar.memory_size_bytes)


def format_source(output: StructuredOutput) -> tuple[str, str]:
    """What xgrammar compiles for ``output``: a kind of :data:`~ctx_integrations.engine.core.compile_worker.KINDS`
    and its text (the JSON schema as given: its integers are bounded when it is compiled), the format's identity."""
    if output.json is not None:
        return "json", output.json
    if output.json_object:
        return "json_object", _ANY_OBJECT
    if output.regex is not None:
        return "regex", output.regex
    if output.choice is not None:
        return "grammar", _choice_grammar(output.choice)
    if output.grammar is not None:
        return "grammar", output.grammar
    return "structural_tag", output.structural_tag


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (each a JSON-quoted literal, which EBNF strings accept)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class TokenConstraint:
    """One answer's place in its format: masks the scores of the next token and accepts the token chosen."""

    def __init__(self, compiled: CompiledFormat):
        xgr = load_xgrammar()
        self._xgr, self.vocab_size = xgr, compiled.grammar.tokenizer_info.vocab_size
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.allowed = compiled.allowed
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._filled = False  # whether the bitmask holds this step's allowed tokens

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (``[V]`` or ``[K, V]``) with every token the format does not allow next at ``-inf``, as a new
        float32 tensor (the matcher is asked once per step, however many tensors are masked)."""
        if not self._filled:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            if self.allowed is not None:
                self.bitmask &= self.allowed
            self._filled = True
        masked = scores.float().clone().reshape(-1, scores.shape[-1])
        if masked.shape[1] > self.vocab_size:  # logits wider than the vocabulary compiled: the rest is never allowed
            masked[:, self.vocab_size:] = -float("inf")
        bitmask = self.bitmask.to(masked.device, non_blocking=True).expand(masked.shape[0], -1).contiguous()
        self._xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=min(self.vocab_size, masked.shape[1]))
        return masked.reshape(scores.shape)

    def accept(self, token_id: int) -> None:
        self._filled = False
        if not self.matcher.accept_token(token_id):
            raise InvalidStructuredOutputError(f"token {token_id} was chosen but the format does not allow it here "
                                               "(a decoding loop that picked without the constraint's mask)")
