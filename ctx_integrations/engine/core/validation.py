"""Pure validators for user-given numbers and names: every bad value becomes a typed error naming the argument.

Python's comparisons let bad values through silently: ``nan < 0`` and ``nan > 1`` are both false, so a
range check written as ``if x < 0: raise`` accepts NaN; ``True`` is an ``int``; ``1.5`` passes ``>= 1``
and then decodes two tokens. These helpers refuse all of that in one place, so every ``__init__`` that
checks its arguments says the same thing the same way. Written by hand: pydantic would validate, but
not with this library's error types and messages, and the core must stay free of it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ctx_integrations.errors import InvalidOptionError


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def real_number(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
                min_inclusive: bool = True, max_inclusive: bool = True, allow_inf: bool = False,
                hint: str = "") -> float:
    """``value`` as a float, refusing bools, strings, NaN, infinities (unless ``allow_inf``) and out-of-range values."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidOptionError(f"{name} must be a number, got {_describe(value)}{hint}")
    number = float(value)
    if math.isnan(number):
        raise InvalidOptionError(f"{name} must be a number, got NaN{hint}")
    if math.isinf(number) and not allow_inf:
        raise InvalidOptionError(f"{name} must be finite, got {number}{hint}")
    low_ok = minimum is None or (number >= minimum if min_inclusive else number > minimum)
    high_ok = maximum is None or (number <= maximum if max_inclusive else number < maximum)
    if not (low_ok and high_ok):
        low = "-inf" if minimum is None else f"{minimum:g}"
        high = "inf" if maximum is None else f"{maximum:g}"
        interval = f"{'[' if min_inclusive else '('}{low}, {high}{']' if max_inclusive else ')'}"
        raise InvalidOptionError(f"{name} must be in {interval}, got {number}{hint}")
    return number


def whole_number(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
                 hint: str = "") -> int:
    """``value`` as an int: refuses bools, NaN, non-integer floats (``1.5``) and out-of-range counts.

    An integer-valued float (``2.0``, e.g. from JSON) is accepted as the int it equals.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidOptionError(f"{name} must be an integer, got {_describe(value)}{hint}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    else:
        as_float = float(value)
        if not math.isfinite(as_float) or not as_float.is_integer():
            raise InvalidOptionError(f"{name} must be an integer, got {_describe(value)}{hint}")
        number = int(as_float)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        low = "-inf" if minimum is None else str(minimum)
        high = "inf" if maximum is None else str(maximum)
        raise InvalidOptionError(f"{name} must be an integer in [{low}, {high}], got {number}{hint}")
    return number


def optional_whole_number(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
                          hint: str = "") -> int | None:
    """``None`` or :func:`whole_number`."""
    return None if value is None else whole_number(name, value, minimum=minimum, maximum=maximum, hint=hint)


def flag(name: str, value: Any) -> bool:
    """``True`` or ``False`` (not ``1``, ``"yes"`` or ``None``, which would be read as one silently)."""
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {_describe(value)}")
    return value


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (strings only: ``[]`` or ``None`` is refused with the list, not a ``TypeError``)."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidOptionError(f"{name} must be one of {', '.join(choices)}, got {_describe(value)}")
    return value


def text(name: str, value: Any) -> str:
    """A string (a prompt): ``None`` or a number would reach the chat template and be rendered as a word."""
    if not isinstance(value, str):
        raise InvalidOptionError(f"{name} must be a string, got {_describe(value)}")
    return value


def context_template_text(value: Any) -> str:
    """A context template: a string holding ``{context}`` exactly once (each document is put where it stands)."""
    if not isinstance(value, str) or value.count("{context}") != 1:
        raise InvalidOptionError(f"context_template must contain '{{context}}' exactly once, got {value!r}")
    return value


def question_template_text(value: Any) -> str:
    """A question template: a string holding ``{question}`` and no other ``str.format`` field.

    Without ``{question}`` every prompt would silently leave the question out; another field (``{q}``)
    or a stray brace would fail later inside ``str.format`` with a ``KeyError`` / ``ValueError``.
    Literal braces are written ``{{`` and ``}}``.
    """
    import string

    if not isinstance(value, str):
        raise InvalidOptionError(f"question_template must be a string holding '{{question}}', got {_describe(value)}")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(value) if field is not None]
    except ValueError as error:
        raise InvalidOptionError(f"question_template {value!r} is not a valid template ({error}): write literal "
                                 "braces as '{{' and '}}'") from None
    if "question" not in fields or set(fields) != {"question"}:
        raise InvalidOptionError(f"question_template must contain '{{question}}' and no other '{{...}}' field "
                                 f"(write literal braces as '{{{{' and '}}}}'), got {value!r}")
    return value


def torch_device(value: Any) -> Any:
    """A ``torch.device`` from a string or device; one torch cannot parse or this machine lacks is a typed error."""
    import torch

    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError) as error:
            raise InvalidOptionError(f"device {value!r} is not a torch device ({error}); use 'cpu', 'cuda', "
                                     "'cuda:0' or 'mps'") from None
    else:
        raise InvalidOptionError(f"device must be a string such as 'cpu' or 'cuda:0', got {_describe(value)}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidOptionError(f"device {value!r}: CUDA is not available on this machine; use device='cpu'")
        if device.index is not None and device.index >= count:
            raise InvalidOptionError(f"device {value!r}: this machine has {count} CUDA device(s), "
                                     f"numbered 0..{count - 1}")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise InvalidOptionError(f"device {value!r}: MPS is not available on this machine; use device='cpu'")
    elif device.type != "cpu":
        raise InvalidOptionError(f"device {value!r} is not supported: use 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return device
