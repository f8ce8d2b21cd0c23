"""The registry of decoding modes and the context every mode runs in.

A mode is a function ``plan(ctx, **options) -> Job`` registered under its declaration
(:class:`~ctx_integrations.engine.core.mode_spec.ModeSpec`: name, typed options, paper): it declares the
streams the request needs (cached pieces per row, the prompt after them) and its per-step rule, and
the scheduler runs the job (``engine/core/jobs.py``). ``plan`` runs on the scheduler's thread, so it
may compute missing KV caches. Its keyword options, with their defaults, are its declared knobs; the
declarations live in :mod:`~ctx_integrations.engine.core.mode_catalog`, which imports no torch, and
``check_mode`` (re-exported here, with ``mode_options`` and ``available_modes``) refuses an unknown option or
a value outside its declared type, range or choices before the request is planned, so a typo never silently
falls back to a default.

A mode declared with ``many=True`` answers several questions in one job (IPPD): its function is
``plan(contexts, **options) -> Job``, one context per question. The engine calls it with one context
for ``generate`` and with all of them for ``generate_many``; every other mode answers the questions
of ``generate_many`` as concurrent requests, which the scheduler batches.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.cache import KVCacheStore
from ctx_integrations.engine.core.decoding import StopCriteria, TokenSampler
from ctx_integrations.engine.core.disk import CacheStats
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.mode_catalog import available_modes as available_modes
from ctx_integrations.engine.core.mode_catalog import check_mode as check_mode
from ctx_integrations.engine.core.mode_catalog import declare_mode, mode_spec
from ctx_integrations.engine.core.mode_catalog import mode_options as mode_options
from ctx_integrations.engine.core.mode_spec import ModeSpec
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.prepared import PreparedText, PreparedTexts
from ctx_integrations.errors import (
    DocumentTooLongError,
    ModeDeclarationError,
    ModeUnavailableError,
    RequestTooLargeError,
    UnsupportedSamplingError,
)

# Per-request KV budget when the engine sets none (``Engine(max_request_bytes=...)``): 2 GiB on CPU, half the
# accelerator's memory elsewhere. 2000 tiny documents with the embedded model would otherwise allocate 6.4 GB.
DEFAULT_CPU_REQUEST_BYTES = 2 * 1024**3


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Bytes one token's keys and values take in every layer (layers x 2 x kv_heads x head_dim x dtype bytes)."""
    return loaded.kv_shape.bytes_per_token(loaded.dtype)


def default_request_bytes(loaded: LoadedModel) -> int:
    if loaded.device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(loaded.device).total_memory // 2
    return DEFAULT_CPU_REQUEST_BYTES


def default_batch_bytes(loaded: LoadedModel) -> int:
    """The KV bytes all running requests may reserve together when the engine sets none
    (``Engine(max_batch_bytes=...)``): half the accelerator's memory, or half the host's RAM on CPU
    (8 GiB where the platform does not say), and never less than one request's default budget."""
    if loaded.device.type == "cuda":
        return default_request_bytes(loaded)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
        ram = 16 * 1024**3
    return max(ram // 2, DEFAULT_CPU_REQUEST_BYTES)


@runtime_checkable
class EngineParts(Protocol):
    """What a mode needs of an engine: the model, the prompt layout and the KV-cache store.

    Modes depend on this protocol, not on :class:`~ctx_integrations.engine.core.engine.Engine`, so the
    engine can import the modes and no mode imports the engine.
    """

    loaded: LoadedModel
    layout: PromptLayout
    store: KVCacheStore
    texts: PreparedTexts  # documents' tokens and cache keys, computed once per text
    scheduler: Any  # the model's scheduler (RAPID hands its drafter row to the drafter model's own)


ModeFunction = Callable[..., Any]  # returns a ``jobs.Job`` (jobs.py imports this module, not the reverse)
_MODES: dict[str, ModeFunction] = {}


def register_mode(spec: ModeSpec) -> Callable[[ModeFunction], ModeFunction]:
    """Register ``function`` as the mode ``spec`` declares (its name, options and paper; :mod:`.mode_spec`).

    The function's keyword-only parameters must be the declared options, in the declared order, with the declared
    defaults: a :class:`~ctx_integrations.errors.ModeDeclarationError` at import otherwise, so what
    ``mode_options``, the command line and the server check is what the function takes. ``spec.many``: the
    function takes a list of contexts (see the module doc).
    """
    declare_mode(spec)

    def decorate(function: ModeFunction) -> ModeFunction:
        parameters = [p for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY]
        taken = [(p.name, p.default) for p in parameters]
        declared = [(option.name, option.default) for option in spec.options]
        if taken != declared:
            raise ModeDeclarationError(
                f"mode {spec.name!r}: {function.__qualname__} takes the keyword options {taken}, its declaration "
                f"{declared}: declare each keyword-only parameter of the function, in order, with its default")
        _MODES[spec.name] = function
        return function

    return decorate


def check_sampling(name: str, sampling: Any) -> None:
    """Refuse the sampling settings mode ``name`` cannot honour (``UnsupportedSamplingError`` naming them)."""
    unsupported = [] if mode_spec(name).picks_each_token else sampling.beyond_plain_sampling()
    if unsupported:
        raise UnsupportedSamplingError(
            f"mode {name!r} cannot honour {', '.join(unsupported)}: its speculative acceptance draws each token from "
            "the target's plain temperature / top_p distribution, so these settings would be ignored. Leave them "
            "out, or use a mode that picks every token itself (pced, concat, ape, soft_nbce, ippd, chat...)",
            unsupported[0])


def answers_many(name: str) -> bool:
    """Whether mode ``name`` decodes several questions together (its function takes a list of contexts)."""
    return mode_spec(name).many


def resolve_mode(name: str) -> ModeFunction:
    """Mode ``name``'s function, its module imported the first time (the one its declaration names)."""
    spec = mode_spec(name)
    if name not in _MODES and spec.module is not None:
        try:
            importlib.import_module(spec.module)
        except ImportError as error:  # a plugin's dependency missing: say which mode needs it, and what to do
            raise ModeUnavailableError(f"mode {name!r}: its module {spec.module} failed to import: {error}. Install "
                                       "what it needs, or reinstall the package that declares the mode") from error
    if name not in _MODES:
        raise ModeDeclarationError(f"mode {name!r} is declared, but no function is registered for it: its module "
                                   f"({spec.module}) must decorate one with @register_mode(its ModeSpec)")
    return _MODES[name]


@dataclass
class DecodeContext:
    """What a mode gets: the engine, the question, the validated documents and the decoding settings.

    Computed once per request, before it is planned: ``prepared``, each document's context tokens and cache
    key (:mod:`~ctx_integrations.engine.core.prepared`; from the engine's memo when the text was seen before;
    :meth:`prepare`), and ``suffix_ids``, the question suffix's tokens (in the caller's thread). Modes read them
    instead of tokenising again; :attr:`prompt_tokens` is the prompt's length as one concatenation (what usage
    reports).
    """

    engine: EngineParts
    query: str
    documents: list[Document]
    sampler: TokenSampler
    stop: StopCriteria
    on_token: Callable[[str], None] | None = None
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    cache: CacheStats = field(default_factory=CacheStats)  # this request's own cache lookups
    kv_tokens: int = 0  # the most KV tokens the mode declared it holds at once (check_streams)
    prepared: list[PreparedText] = field(default_factory=list)  # one per document, in order
    suffix_ids: tuple[int, ...] = ()

    def prepare(self) -> None:
        """Tokenise and key the documents (from the engine's memo when seen before), once: in the caller's thread
        for a blocking call, on the scheduler's loader thread for an async one (its event loop never tokenises)."""
        if len(self.prepared) != len(self.documents):
            self.prepared = self.engine.texts.prepare_all([d.text for d in self.documents])

    @property
    def prompt_tokens(self) -> int:
        """``prefix + documents + question suffix`` as one prompt: the tokens a concatenation would read."""
        return len(self.engine.layout.prefix_ids) + sum(p.tokens for p in self.prepared) + len(self.suffix_ids)

    def check_window(self, prompt_tokens: int, what: str, new_tokens: int | None = None,
                     new_tokens_name: str = "max_new_tokens") -> None:
        """Refuse a prompt that, with the answer budget (``new_tokens``, default max_new_tokens), would run
        past the model's positions."""
        window = self.engine.loaded.max_positions
        new = self.stop.max_new_tokens if new_tokens is None else new_tokens
        needed = prompt_tokens + new
        if needed > window:
            raise DocumentTooLongError(
                f"{what} needs {prompt_tokens} prompt tokens + {new_tokens_name}={new} = {needed} "
                f"positions, but the model's window is {window}. Split long documents into chunks "
                f"(`ctx-experts ingest` chunks by tokens), retrieve fewer documents, or lower {new_tokens_name}.")

    def stream_tokens(self, contexts: list[PreparedText]) -> int:
        """Tokens of the longest ``prefix + context + suffix + answer`` stream over ``contexts`` (none: no context)."""
        longest = max((p.tokens for p in contexts), default=0)
        return len(self.engine.layout.prefix_ids) + longest + len(self.suffix_ids) + self.stop.max_new_tokens

    def check_streams(self, streams: int, tokens_per_stream: int, what: str,
                      advice: str = "Retrieve fewer documents (top_k), split the question into several "
                                    "requests") -> None:
        """Refuse, before anything is allocated, a request whose KV caches would exceed the per-request budget.

        The budget is ``engine.max_request_bytes`` (bytes; default 2 GiB on CPU, half the GPU's memory on CUDA);
        the request needs layers x 2 x kv_heads x head_dim x dtype bytes x tokens_per_stream x streams.
        ``advice``: what the caller can lower (the error adds raising the budget).
        """
        loaded = self.engine.loaded
        budget = getattr(self.engine, "max_request_bytes", None) or default_request_bytes(loaded)
        tokens = int(tokens_per_stream) * int(streams)
        self.kv_tokens = max(self.kv_tokens, tokens)
        needed = kv_bytes_per_token(loaded) * tokens
        if needed > budget:
            raise RequestTooLargeError(
                f"{what}: {streams} stream(s) of up to {tokens_per_stream} tokens need {needed / 2**20:.1f} MiB of KV "
                f"cache, more than this engine's per-request budget of {budget / 2**20:.1f} MiB. {advice}, or raise "
                "Engine(max_request_bytes=...) (--max-request-bytes on the command line).")
