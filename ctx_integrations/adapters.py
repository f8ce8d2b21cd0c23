"""What every framework adapter (LangChain, LlamaIndex) needs from the engine, kept in one place.

One embedded model per process: adapters built without an engine share it, so an app that uses the
LangChain runnable and the LlamaIndex query engine side by side loads the embedded model once. An adapter
built with ``model=`` (a local folder, a ``.gguf`` file, a cached hub id, a fetched catalog alias) loads
that model, once per process per name; a name this machine does not hold is refused when the adapter is
built (:func:`check_model`), never answered by the embedded model under that name.

KV caches persist by default. An adapter built without an engine (and without ``cache_dir``) uses an
engine whose document caches live under the user cache dir's KV root (``$CTX_CACHE_DIR/kv``, one folder
per model beneath it, the same root ``ctx-experts ingest`` and ``serve`` use), so an app restarted over the
same index finds them on disk. ``cache_dir=<folder>`` keeps them elsewhere and
``cache_dir=None`` in memory only; each choice gets its own engine over the same loaded model. Cache
keys hash the model identity, the prompt layout and the tokens (``engine.core.cache``), so one folder
can safely serve several models.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.paths import kv_root

if TYPE_CHECKING:
    from ctx_integrations import Engine, LoadedModel


class UserCacheDir:
    """The default of every ``cache_dir`` argument: the user cache dir, read when the engine is built."""

    def __repr__(self) -> str:
        return "USER_CACHE_DIR"


USER_CACHE_DIR = UserCacheDir()
CacheDir = str | os.PathLike | UserCacheDir | None

_engines: dict[tuple[str, str], Engine] = {}
_engines_lock = threading.Lock()
_loaded: dict[str, LoadedModel] = {}
_loaded_lock = threading.Lock()


def shared_cache_dir() -> Path:
    """Where the shared engine keeps KV caches: the KV root ``$CTX_CACHE_DIR/kv`` (or the platform's cache dir)."""
    return kv_root()


def resolve_cache_dir(cache_dir: CacheDir) -> Path | None:
    """A ``cache_dir`` argument as a folder (``None``: memory only)."""
    if isinstance(cache_dir, UserCacheDir):
        return shared_cache_dir()
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise InvalidOptionError(f"cache_dir must be a folder path, None (memory only) or left out (the user cache "
                                 f"dir), got {type(cache_dir).__name__}")
    return Path(cache_dir).expanduser().resolve()


@lru_cache(maxsize=1)
def default_loaded() -> LoadedModel:
    """The embedded model, loaded once per process and shared by every default engine."""
    from ctx_integrations import load_model

    return load_model(None)


def named_loaded(model: str | None) -> LoadedModel:
    """The model an adapter's ``model=`` names (``None``: the embedded one), loaded once per process per name.

    Loaded with ``local_files_only``: adapters take only what :func:`check_model` found on this machine.
    """
    if model is None:
        return default_loaded()
    from ctx_integrations import load_model

    with _loaded_lock:
        if model not in _loaded:
            _loaded[model] = load_model(model, local_files_only=True)
        return _loaded[model]


def shared_engine(cache_dir: CacheDir = USER_CACHE_DIR, model: str | None = None) -> Engine:
    """The engine over ``model`` (``None``: the embedded one) whose caches live in ``cache_dir`` (one per model and
    folder, built on first use)."""
    from ctx_integrations import Engine

    folder = resolve_cache_dir(cache_dir)
    key = ("" if folder is None else str(folder), model or "")
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(named_loaded(model), cache_dir=folder)
        return _engines[key]


def default_engine() -> Engine:
    """The embedded default engine (caches under the user cache dir), shared by every adapter built without one."""
    return shared_engine()


def resolve_engine(engine: Engine | None, cache_dir: CacheDir = USER_CACHE_DIR, model: str | None = None) -> Engine:
    """The given engine, or the shared one for ``model`` and ``cache_dir`` (loaded on first use, not when an adapter
    is built)."""
    return shared_engine(cache_dir, model) if engine is None else engine


def check_model(model: Any, engine: Any = None) -> str | None:
    """An adapter's ``model=`` as the name to load (``None``: the embedded model), checked when the adapter is
    built: a name this machine does not hold is a typed error listing the accepted ones, without a network call
    (:func:`~ctx_integrations.local_model_name`); with ``engine=`` it must be that engine's."""
    from ctx_integrations import local_model_name

    if engine is not None:
        if model is not None and model != engine.loaded.name:
            raise InvalidOptionError(f"engine= serves {engine.loaded.name!r}, not model={model!r}: give one of them")
        return None
    return local_model_name(model)


def check_engine(engine: object, cache_dir: Any = USER_CACHE_DIR) -> None:
    """Adapters hold the engine as an opaque field; refuse anything else (and an ambiguous ``cache_dir``)."""
    from ctx_integrations import Engine

    if engine is not None and not isinstance(engine, Engine):
        raise InvalidOptionError(f"engine must be a ctx_integrations.Engine or None, got {type(engine).__name__}")
    if engine is not None and not isinstance(cache_dir, UserCacheDir):
        raise InvalidOptionError("give either engine= or cache_dir=, not both: an engine keeps its caches where it "
                                 "was built (Engine(..., cache_dir=...))")
    if engine is None:
        resolve_cache_dir(cache_dir)


def aliased(options: Mapping[str, Any], name: str, alias: str) -> dict[str, Any]:
    """``options`` (a call's or a constructor's keywords) with ``alias``, another framework's word for option
    ``name``, renamed ``name``: ``max_tokens`` is OpenAI's and LangChain's, ``max_new_tokens`` transformers',
    LlamaIndex's and the engine's; ``model`` / ``model_name`` likewise. Each adapter takes both words for its
    options at its edge, and only there.

    A key whose value is ``None`` counts as not given. Both given is refused
    (:class:`~ctx_integrations.errors.InvalidOptionError`, ``name`` first, in the edge's own words): which one was
    meant cannot be told, and taking either would silently drop the other.
    """
    if alias not in options:
        return dict(options)
    renamed = {key: value for key, value in options.items() if key != alias}
    if options[alias] is not None and renamed.get(name) is not None:
        raise InvalidOptionError(f"give {name} or its alias {alias}, not both")
    if options[alias] is not None or name not in renamed:
        renamed[name] = options[alias]
    return renamed


def length_budget(options: Mapping[str, Any], default: Any = None, *, name: str = "max_tokens") -> Any:
    """The answer's length budget in a call's keywords, given as ``max_tokens`` or as ``max_new_tokens`` (never
    both, :func:`aliased`); ``default`` when neither is given (or it is ``None``). ``name``: the edge's own word
    for it (LangChain's ``max_tokens``, LlamaIndex's ``max_new_tokens``), which the refusal names first."""
    alias = {"max_tokens": "max_new_tokens", "max_new_tokens": "max_tokens"}[name]
    budget = aliased(options, name, alias).get(name)
    return default if budget is None else budget
