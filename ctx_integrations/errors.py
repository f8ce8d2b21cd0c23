"""Typed errors: every message says what went wrong and what to do about it.

All errors derive from :class:`CtxIntegrationsError`, and each also derives from the
built-in exception a Python user would expect (``ValueError`` for bad arguments,
``ImportError`` for a missing package), so existing ``except`` clauses keep working.
"""

from __future__ import annotations


class CtxIntegrationsError(Exception):
    """Base class of every error this library raises on purpose."""


class UnknownModeError(CtxIntegrationsError, ValueError):
    """A decoding mode name that is not registered."""


class ModeUnavailableError(UnknownModeError):
    """A mode some installed package declares (an entry point of the ``ctx_integrations.modes`` group) that could
    not be loaded: the message names the entry point, its package and the error its import raised."""


class ModeUnavailableWarning(UserWarning):
    """A declared mode's entry point failed to load; it is left out of the modes (once per process) and asking
    for it raises :class:`ModeUnavailableError`. Fix or reinstall the package that declares it."""


class InvalidOptionError(CtxIntegrationsError, ValueError):
    """An option a mode does not accept, or a value outside its range."""


class ModeDeclarationError(CtxIntegrationsError, TypeError):
    """A mode's declaration that does not hold: an option whose default is outside its own range, a function whose
    keyword options differ from its declaration, a name declared twice. A bug in the mode, not in the request."""


class EmptyDocumentsError(CtxIntegrationsError, ValueError):
    """No documents, or a document whose text is empty."""


class InvalidScoresError(CtxIntegrationsError, ValueError):
    """Relevance scores of the wrong length or outside [0, 1]."""


class DocumentTooLongError(CtxIntegrationsError, ValueError):
    """A prompt that does not fit the model's context window."""


class ChatTemplateError(CtxIntegrationsError, ValueError):
    """A tokenizer without a usable chat template, or one the layout cannot split."""


class ModelLoadError(CtxIntegrationsError, OSError):
    """A model that cannot be found or loaded."""


class MissingDependencyError(CtxIntegrationsError, ImportError):
    """An optional package that a feature needs is not installed."""


class CorruptCacheWarning(UserWarning):
    """A KV cache file failed its checks; it was discarded and recomputed."""


class UndecodedContextWarning(UserWarning):
    """Retrieved context reached the model as plain prompt text, not as documents the decoder can recover.

    It is answered as plain chat: no per-document KV caches, relevance priors or citations. Raised by the
    LangChain chat model (a chained prompt that speaks of context but carries no documents) and by the
    LlamaIndex LLM (a stock response synthesizer stuffing nodes into its prompt), once per model.
    """


def missing_dependency(package: str, extra: str | None = None, pip_name: str | None = None) -> MissingDependencyError:
    """Build the error for a missing optional package, naming the exact install command."""
    how = f"pip install 'ctx-integrations[{extra}]'" if extra else f"pip install {pip_name or package}"
    return MissingDependencyError(f"{package!r} is not installed. Install it with: {how}")


class EngineOverloadedError(CtxIntegrationsError, RuntimeError):
    """The engine's request queue is full (``max_queued_requests``): retry later or raise the limit."""


class RequestTimeoutError(CtxIntegrationsError, TimeoutError):
    """A request ran past its ``timeout``; it was cancelled and its rows freed."""


class InvalidDocumentError(CtxIntegrationsError, ValueError):
    """A document (or query) that is not text a tokenizer can encode: ``None``, a number, a lone surrogate."""


class RequestTooLargeError(CtxIntegrationsError, ValueError):
    """A request whose KV caches would exceed the per-request memory budget (``Engine(max_request_bytes=...)``)."""


class CacheStoreError(CtxIntegrationsError, OSError):
    """The KV-cache folder cannot be written or read (read-only, full, or a directory where an entry belongs)."""


class TrustRemoteCodeError(ModelLoadError):
    """A model folder that needs its own Python code; loading it runs that code, so it is an explicit opt-in."""


class ModelNotFoundError(ModelLoadError):
    """A model name that names nothing this machine holds (no local folder or file, no cached hub id, no fetched
    catalog alias): refused rather than answered by another model under that name."""


class ModelFetchError(ModelLoadError):
    """A catalog model that is unknown, not fetched yet, or whose download does not match its pinned hashes."""


class CacheStoreWarning(UserWarning):
    """The KV-cache folder could not be written; the entry (or every entry from now on) is kept in memory only."""


class StoreConnectionError(CtxIntegrationsError, ConnectionError):
    """A document store server (a Chroma URL) that cannot be reached."""


class CallbackError(CtxIntegrationsError, RuntimeError):
    """A request's own callback (``on_token``) raised a ``BaseException`` that is not an ``Exception``
    (``GeneratorExit``, ``SystemExit``, ``KeyboardInterrupt``) on the scheduler's thread.

    The request is stopped and its rows freed; the requests beside it go on. ``original`` is what the
    callback raised (also the ``__cause__``). A synchronous caller (``generate``, ``chat``,
    ``generate_many``) gets ``SystemExit`` / ``KeyboardInterrupt`` re-raised as such in its own thread,
    as if the callback had run there; everything else (and async callers) gets this error.
    """

    def __init__(self, message: str, original: BaseException):
        super().__init__(message)
        self.original = original


class NonFiniteScoresError(CtxIntegrationsError, FloatingPointError):
    """The scores a token is chosen from became NaN or infinite (all ``-inf``, or ``+inf``) during decoding.

    Raised instead of emitting token id 0 (what ``argmax`` returns over NaN) again and again.
    """


class UnsupportedSamplingError(InvalidOptionError):
    """A sampling setting the chosen decoding mode cannot honour (RAPID's speculative acceptance and structured
    output, penalties, top_k or min_p): refused instead of silently ignored. ``field`` names the setting."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class InvalidStructuredOutputError(InvalidOptionError):
    """A structured-output request (JSON schema, regex, grammar, tools) the grammar compiler cannot build.
    ``field`` names the request field it came from (``response_format``, ``tools``...)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class FormatTooLargeError(InvalidStructuredOutputError):
    """A structured-output format (schema, regex, grammar, choices, tools) over the engine's ``max_format_bytes``
    (the server's ``--max-format-bytes``), refused before anything is compiled: send a smaller one or raise the
    limit."""


class FormatCompileTimeoutError(InvalidStructuredOutputError):
    """A structured-output format that did not compile within the engine's ``format_compile_timeout_s`` (the
    server's ``--format-compile-timeout-s``); the compile was stopped (its process killed): send a simpler format
    or raise the limit."""


class IncompleteStructuredOutputError(CtxIntegrationsError, ValueError):
    """A structured answer (a JSON value or a tool call) asked to be parsed was cut before it was complete: by
    ``max_tokens`` (``finish_reason == "length"``) or a stop string. Raised instead of parsing what is there
    (nothing, or a partial object): raise ``max_tokens``, drop the stop string, or bound the schema's strings and
    arrays (``maxLength``, ``maxItems``). ``text`` is the cut answer."""

    def __init__(self, message: str, text: str = ""):
        super().__init__(message)
        self.text = text


class NoToolCallError(CtxIntegrationsError, ValueError):
    """A tool call was asked for (``get_tool_calls_from_response``, ``predict_and_call``) but the model, offered tools
    with ``tool_choice="auto"``, answered in text: require a call (``tool_required=True`` or ``tool_choice=<name>``,
    held by constrained decoding), or take the text."""


class NoAllowedTokenError(NonFiniteScoresError):
    """Structured output: the mode's fused scores give every token the format allows next a score of ``-inf``
    (a mode whose rule keeps only a nucleus of the vocabulary, e.g. Soft-NBCE), so no valid token can be chosen."""


class UnsupportedSchemaError(InvalidStructuredOutputError):
    """A JSON schema that uses a keyword (or a combination of keywords) the grammar cannot enforce, or that nests
    deeper than the limit: refused, as OpenAI's strict mode refuses one, because answers held to the rest of the
    schema could break it. ``keyword`` names it (``"depth"`` for the nesting), ``path`` is where (``#/properties/x``);
    the message says what to do. What is enforced: docs/python.md, ``engine/core/schema_support.py``."""

    def __init__(self, message: str, keyword: str, path: str, field: str | None = None):
        super().__init__(message, field)
        self.keyword, self.path = keyword, path
