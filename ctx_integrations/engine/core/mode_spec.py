"""A decoding mode's declaration: its name, its typed options and the paper it implements, readable without torch.

A mode is declared once, as a :class:`ModeSpec` (the built-in ones in ``engine/modes/specs.py``), and everything
that needs its options reads that declaration: ``mode_options`` (names and defaults), ``check_mode`` (each value
against its option's type, range or choices, before a request is planned), the command line's ``--option``
(before a model loads), the server (at the request's edge, and ``GET /v1/modes``) and the table in docs/modes.md.
The mode's function keeps its keyword-only signature;
:func:`~ctx_integrations.engine.core.registry.register_mode` refuses a function whose option names or defaults
differ from its declaration, so the two cannot drift.

An :class:`Option` checks what one value may be. Rules between options (PCED's ``switch="word"`` needs
``aggregation="max"``) stay in the mode, which is only ever planned with values its declaration accepted.
Values are checked, never converted: a mode receives exactly what its caller passed.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctx_integrations.errors import InvalidOptionError, ModeDeclarationError

KINDS = (bool, int, float, str, object)
# Where an option comes from: the docs' table and GET /v1/modes say it, so a reader can tell the paper's method
# from what this library added to it.
ORIGINS = {
    "paper": "a knob of the paper's method (the default may be ours, measured)",
    "variant": "our named variant, not in the paper",
    "implementation": "how the answer is computed or reported, not which answer",
}

# What the conformance suite (tests/mode_cases.py) holds every mode to, where a mode may say it does not apply: a mode
# declares each such property it lacks, with why (``ModeSpec.exemptions``), so a test never keeps a list of modes.
CONFORMANCE = {
    "reuses_prepared_texts": "a warm request tokenises no document and hashes no cache key again",
}


def _number(value: float) -> str:
    return "inf" if value == math.inf else f"{value:g}"


@dataclass(frozen=True)
class Option:
    """One keyword option of a mode: its type, default, allowed values, one line of help and its origin.

    ``kind``: ``bool``, ``int``, ``float``, ``str`` or ``object`` (a Python object such as an ``Engine``, which a
    number, string or flag can never be: only Python callers can give one, and the mode checks what it is;
    ``expects`` says what, for the error). ``optional``: ``None`` is accepted too (its meaning is in ``help``).
    ``minimum`` / ``maximum`` bound a number (inclusive unless ``min_inclusive`` / ``max_inclusive`` is false);
    ``allow_inf`` lets a float be ``math.inf``; ``choices`` lists a string's values. An ``int`` accepts an
    integer-valued float (``2.0``, as JSON may write it), like the library's other counts.
    """

    name: str
    kind: type
    default: Any
    help: str
    origin: str = "paper"
    optional: bool = False
    minimum: float | None = None
    maximum: float | None = None
    min_inclusive: bool = True
    max_inclusive: bool = True
    allow_inf: bool = False
    choices: tuple[str, ...] = ()
    expects: str = ""

    def __post_init__(self) -> None:
        where = f"option {self.name!r}"
        if self.kind not in KINDS:
            raise ModeDeclarationError(f"{where}: kind must be one of bool, int, float, str, object, got {self.kind!r}")
        if self.origin not in ORIGINS:
            raise ModeDeclarationError(f"{where}: origin must be one of {', '.join(ORIGINS)}, got {self.origin!r}")
        if not self.help.strip() or "\n" in self.help:
            raise ModeDeclarationError(f"{where}: help must be one line of text")
        if self.choices and self.kind is not str:
            raise ModeDeclarationError(f"{where}: only a str option has choices")
        if (self.minimum is not None or self.maximum is not None or self.allow_inf) and self.kind not in (int, float):
            raise ModeDeclarationError(f"{where}: only an int or float option has a range")
        if (self.kind is object) != bool(self.expects) or (self.kind is object and not self.optional):
            raise ModeDeclarationError(f"{where}: an object option, and only one, says what it expects (expects=...), "
                                       "and takes None (a default JSON can give)")
        if not self.accepts(self.default):
            raise ModeDeclarationError(f"{where}: its default {self.default!r} is not {self.expected()}")

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is one this option takes (bools are never numbers, NaN never in range)."""
        if value is None:
            return self.optional
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if self.kind is object:
            return not isinstance(value, (str, bytes, numbers.Number))
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.kind is int and not isinstance(value, numbers.Integral):
            value = float(value)
            if not math.isfinite(value) or not value.is_integer():
                return False
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not self.allow_inf)):
            return False
        low_ok = self.minimum is None or (value >= self.minimum if self.min_inclusive else value > self.minimum)
        high_ok = self.maximum is None or (value <= self.maximum if self.max_inclusive else value < self.maximum)
        return low_ok and high_ok

    def expected(self) -> str:
        """What the option takes, in words: ``a number in [0, 100]``, ``one of 'max', 'mixture'``, ``... or None``."""
        if self.kind is object:  # its words say what None means
            return self.expects
        if self.kind is bool:
            return "True, False or None" if self.optional else "True or False"
        if self.kind is str:
            text = f"one of {', '.join(map(repr, self.choices))}" if self.choices else "a string"
        else:
            text = ("an integer" if self.kind is int else "a number") + self._range()
        return f"{text}, or None" if self.optional else text

    def _range(self) -> str:
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            return (f" in {'[' if self.min_inclusive else '('}{_number(low)}, {_number(high)}"
                    f"{']' if self.max_inclusive else ')'}")
        if low is not None:
            return f" {'>=' if self.min_inclusive else '>'} {_number(low)}" + (" (inf allowed)" if self.allow_inf
                                                                              else "")
        if high is not None:
            return f" {'<=' if self.max_inclusive else '<'} {_number(high)}"
        return ""

    def describe(self) -> dict[str, Any]:
        """The option as JSON (``GET /v1/modes``): name, type, default, range or choices, help and origin."""
        return {"name": self.name, "type": self.kind.__name__, "optional": self.optional, "default": self.default,
                "expects": self.expected(), "minimum": self.minimum, "maximum": self.maximum,
                "min_inclusive": self.min_inclusive, "max_inclusive": self.max_inclusive,
                "allow_inf": self.allow_inf, "choices": list(self.choices) or None, "help": self.help,
                "origin": self.origin}


@dataclass(frozen=True)
class ModeSpec:
    """A mode's declaration: name, one-line summary, the paper it implements, its options, and how it runs.

    ``module``: the module whose import registers the mode's function (the registry imports it the first time the
    mode is used; ``None``: whoever declares the mode registers it). ``many``: the function takes every question's
    context at once (IPPD); ``picks_each_token=False``: it does not choose each token from one score vector with
    the request's sampler (RAPID), so settings that act on that vector are refused for it. ``exemptions``:
    ``(property, why)`` for each property of :data:`CONFORMANCE` the mode does not have (MapReduce's summaries are
    new text on every request).
    """

    name: str
    summary: str
    paper: str
    options: tuple[Option, ...] = ()
    module: str | None = None
    many: bool = False
    picks_each_token: bool = True
    exemptions: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        names = [option.name for option in self.options]
        if len(set(names)) != len(names):
            raise ModeDeclarationError(f"mode {self.name!r} declares an option twice: {', '.join(names)}")
        for exempt in self.exemptions:
            if (not isinstance(exempt, tuple) or len(exempt) != 2 or exempt[0] not in CONFORMANCE
                    or not isinstance(exempt[1], str) or not exempt[1].strip()):
                raise ModeDeclarationError(f"mode {self.name!r}: an exemption is (property, why), the property one of "
                                           f"{', '.join(CONFORMANCE)} and why a line of text; got {exempt!r}")

    def exemption(self, property_name: str) -> str | None:
        """Why this mode does not have conformance property ``property_name``, or ``None``: it has it."""
        return dict(self.exemptions).get(property_name)

    def defaults(self) -> dict[str, Any]:
        """``{option: default}``, in the order declared."""
        return {option.name: option.default for option in self.options}

    def check(self, options: Mapping[str, Any]) -> None:
        """Refuse an option this mode does not take (with the closest name) or a value its option does not accept,
        as an :class:`~ctx_integrations.errors.InvalidOptionError` naming the mode, the option, what it expected
        and what it got."""
        declared = {option.name: option for option in self.options}
        unknown = sorted(set(options) - set(declared))
        if unknown:
            close = difflib.get_close_matches(unknown[0], declared, 1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise InvalidOptionError(f"mode {self.name!r} does not accept {', '.join(unknown)}; "
                                     f"its options are: {', '.join(sorted(declared)) or 'none'}{hint}")
        for name, option in declared.items():
            if name in options and not option.accepts(options[name]):
                raise InvalidOptionError(f"mode {self.name!r}: option {name} must be {option.expected()}, "
                                         f"got {options[name]!r}")

    def options_text(self) -> str:
        """The options in one line (what an adapter's option docs show): ``"gamma: a number >= 0, default 1.0 (the
        prior's sharpness); ..."``, or ``"none"``."""
        return "; ".join(f"{o.name}: {o.expected()}, default {o.default!r} ({o.help})" for o in self.options) or "none"

    def describe(self) -> dict[str, Any]:
        """The mode as JSON (``GET /v1/modes``)."""
        return {"name": self.name, "summary": self.summary, "paper": self.paper, "answers_many": self.many,
                "picks_each_token": self.picks_each_token, "options": [o.describe() for o in self.options],
                "exemptions": dict(self.exemptions)}
