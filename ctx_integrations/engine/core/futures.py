"""Completing a ``concurrent.futures.Future`` that its caller may have cancelled meanwhile."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import Any


def settle(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Complete a future once (whether this call did); a future its caller already cancelled is left alone."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True
