"""The declared modes, by name: what a front end checks a mode and its options against, without torch.

The command line, the server and the framework adapters call :func:`check_mode` where a request arrives, so a
mistyped mode or option fails there, before any model loads or any document is retrieved. Nothing here imports
a mode's code: the built-in declarations come from ``engine/modes/specs.py`` (which imports no torch), and a
mode's function is found later by :func:`~ctx_integrations.engine.core.registry.resolve_mode`, which imports the
module its declaration names.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from ctx_integrations.engine.core.mode_spec import ModeSpec
from ctx_integrations.errors import InvalidOptionError, ModeDeclarationError, UnknownModeError

# The module whose BUILTIN_SPECS are the built-in modes (named, not imported: the core imports no mode's code).
_BUILTIN_SPECS = "ctx_integrations.engine.modes.specs"
_DECLARED: dict[str, ModeSpec] = {}


def declare_mode(spec: ModeSpec) -> ModeSpec:
    """Add ``spec`` to the declared modes; a different declaration under a name already taken is refused."""
    if not isinstance(spec, ModeSpec):
        raise ModeDeclarationError(f"a mode is declared with a ModeSpec, got {type(spec).__name__}")
    known = _DECLARED.setdefault(spec.name, spec)
    if known != spec:
        raise ModeDeclarationError(f"mode {spec.name!r} is declared twice, differently (module {known.module} and "
                                   f"{spec.module}): give the new mode a name of its own")
    return spec


@functools.cache
def _declare_builtins() -> None:
    for spec in importlib.import_module(_BUILTIN_SPECS).BUILTIN_SPECS:
        declare_mode(spec)


def available_modes() -> list[str]:
    """The declared modes' names, sorted (the built-in ones are declared on first use)."""
    _declare_builtins()
    return sorted(_DECLARED)


def mode_spec(name: str) -> ModeSpec:
    """The declaration of mode ``name``; an unknown name is an :class:`~ctx_integrations.errors.UnknownModeError`
    listing the modes."""
    modes = available_modes()
    if not isinstance(name, str) or name not in _DECLARED:  # a list or dict would raise TypeError (unhashable)
        raise UnknownModeError(f"unknown mode {name!r}: choose one of {', '.join(modes)}")
    return _DECLARED[name]


def mode_options(name: str) -> dict[str, Any]:
    """The keyword options mode ``name`` accepts, with their defaults."""
    return mode_spec(name).defaults()


def check_mode(mode: str, options: Mapping[str, Any] | None = None) -> None:
    """Refuse an unknown ``mode`` (:class:`~ctx_integrations.errors.UnknownModeError`, listing the modes), an
    option it does not take or a value its declaration does not accept
    (:class:`~ctx_integrations.errors.InvalidOptionError`, naming the mode, the option, what it expected and what
    it got): what a front end checks when it is built or a call arrives, so a typo fails there and not at the
    first answer, after a model has loaded."""
    spec = mode_spec(mode)
    if options is not None and not isinstance(options, Mapping):
        raise InvalidOptionError(f"the options of mode {mode!r} must be a mapping of option names to values, got "
                                 f"{type(options).__name__}")
    spec.check(options or {})
