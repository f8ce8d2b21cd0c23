"""What every framework adapter (LangChain, LlamaIndex) needs from the engine, kept in one place.

One default engine per process: adapters built without an engine share it, so an app that uses the
LangChain runnable and the LlamaIndex query engine side by side loads the embedded model and keeps its
KV caches once.
"""

from __future__ import annotations

from functools import lru_cache

from ctx_integrations.engine.core.engine import Engine
from ctx_integrations.errors import InvalidOptionError


@lru_cache(maxsize=1)
def default_engine() -> Engine:
    """The embedded default engine, loaded once per process and shared by every adapter built without one."""
    return Engine.from_pretrained()


def resolve_engine(engine: Engine | None) -> Engine:
    """The given engine, or the shared default (loaded on first use, not when an adapter is built)."""
    return default_engine() if engine is None else engine


def check_engine(engine: object) -> None:
    """Adapters hold the engine as an opaque field; refuse anything else at construction."""
    if engine is not None and not isinstance(engine, Engine):
        raise InvalidOptionError(f"engine must be a ctx_integrations.Engine or None, got {type(engine).__name__}")


def prompt_tokens(engine: Engine, question: str, texts: list[str]) -> int:
    """Tokens of the prompt ``prefix + documents + suffix`` (what frameworks report as input tokens)."""
    layout = engine.layout
    return len(layout.prefix_ids) + sum(len(layout.context_ids(t)) for t in texts) + len(layout.suffix_ids(question))
