"""The declared modes, by name: what a front end checks a mode and its options against, without torch.

The command line, the server and the framework adapters call :func:`check_mode` where a request arrives, so a
mistyped mode or option fails there, before any model loads or any document is retrieved. Nothing here imports
a mode's code: every mode, built-in or a third-party package's, is declared by an entry point of the
``ctx_integrations.modes`` group that names its :class:`ModeSpec` (the built-in ones in this library's
pyproject.toml, pointing into ``engine/modes/specs.py``, which imports no torch), so adding a mode edits no file
of the library. A mode's function is found later by
:func:`~ctx_integrations.engine.core.registry.resolve_mode`, which imports the module its declaration names.

An entry point that fails to load is never silently missing: it gives one
:class:`~ctx_integrations.errors.ModeUnavailableWarning`, :func:`unavailable_modes` says why, and asking for
it raises :class:`~ctx_integrations.errors.ModeUnavailableError`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from collections.abc import Mapping
from typing import Any

from ctx_integrations.engine.core.mode_spec import ModeSpec
from ctx_integrations.errors import (
    InvalidOptionError,
    ModeDeclarationError,
    ModeUnavailableError,
    ModeUnavailableWarning,
    UnknownModeError,
)

ENTRY_POINT_GROUP = "ctx_integrations.modes"
_DECLARED: dict[str, ModeSpec] = {}
_UNAVAILABLE: dict[str, str] = {}  # entry point name -> why it is not a mode
_NONE_DECLARED = (f"no mode is declared: no installed package has entry points of the group {ENTRY_POINT_GROUP!r}, "
                  "so ctx-integrations runs uninstalled or from stale metadata (an old ctx_integrations.egg-info ahead "
                  "of the install on sys.path). Reinstall it: pip install -e . (or pip install ctx-integrations)")


def declare_mode(spec: ModeSpec) -> ModeSpec:
    """Add ``spec`` to the declared modes; a different declaration under a name already taken is refused."""
    if not isinstance(spec, ModeSpec):
        raise ModeDeclarationError(f"a mode is declared with a ModeSpec, got {type(spec).__name__}")
    known = _DECLARED.setdefault(spec.name, spec)
    if known != spec:
        raise ModeDeclarationError(f"mode {spec.name!r} is declared twice, differently (module {known.module} and "
                                   f"{spec.module}): give the new mode a name of its own")
    return spec


def _origin(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    package = f"package {dist.name} {dist.version}" if dist is not None else "an installed package"
    return f"entry point {entry_point.name} = {entry_point.value} ({package})"


def _load(entry_point: importlib.metadata.EntryPoint) -> ModeSpec:
    """The ModeSpec ``entry_point`` names, refused unless it is one and is named like its entry point."""
    spec = entry_point.load()
    if not isinstance(spec, ModeSpec):
        raise ModeDeclarationError(f"it names a {type(spec).__name__}, not a ModeSpec")
    if spec.name != entry_point.name:
        raise ModeDeclarationError(f"it names mode {spec.name!r}: name the entry point after its mode")
    return spec


@functools.cache
def _discover() -> None:
    """Declare every entry point's mode, once per process; one that fails is recorded and warned about, once."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            declare_mode(_load(entry_point))
        except Exception as error:  # a plugin's import may raise anything; it must not hide the other modes
            reason = (f"{_origin(entry_point)} failed to load: {type(error).__name__}: {error}. Fix or reinstall "
                      "that package (pip install --force-reinstall ...), or uninstall it")
            _UNAVAILABLE[entry_point.name] = reason
            warnings.warn(f"mode {entry_point.name!r} is unavailable: {reason}", ModeUnavailableWarning, stacklevel=3)
    if not _DECLARED and not _UNAVAILABLE:
        warnings.warn(_NONE_DECLARED, ModeUnavailableWarning, stacklevel=3)


def available_modes() -> list[str]:
    """The declared modes' names, sorted (the entry points are read on first use)."""
    _discover()
    return sorted(_DECLARED)


def unavailable_modes() -> dict[str, str]:
    """``{name: reason}`` of every mode an installed package declares whose entry point failed to load."""
    _discover()
    return {name: _UNAVAILABLE[name] for name in sorted(_UNAVAILABLE) if name not in _DECLARED}


def mode_spec(name: str) -> ModeSpec:
    """The declaration of mode ``name``; an unknown name is an :class:`~ctx_integrations.errors.UnknownModeError`
    listing the modes, a declared one that failed to load a :class:`~ctx_integrations.errors.ModeUnavailableError`
    saying why."""
    modes = available_modes()
    if not isinstance(name, str) or name not in _DECLARED:  # a list or dict would raise TypeError (unhashable)
        if isinstance(name, str) and name in _UNAVAILABLE:
            raise ModeUnavailableError(f"mode {name!r} is declared but unavailable: {_UNAVAILABLE[name]}")
        raise UnknownModeError(f"unknown mode {name!r}: choose one of {', '.join(modes)}" if modes else
                               f"unknown mode {name!r}: {_NONE_DECLARED}")
    return _DECLARED[name]


def describe_modes() -> dict[str, Any]:
    """Every mode's declaration as JSON, and each unavailable mode with its reason: what the server's
    ``GET /v1/modes`` returns and ``ctx-experts modes`` prints (one function, so the two agree)."""
    return {"object": "list", "data": [mode_spec(name).describe() for name in available_modes()],
            "unavailable": [{"name": name, "reason": reason} for name, reason in unavailable_modes().items()]}


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
