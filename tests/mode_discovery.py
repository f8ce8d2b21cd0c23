"""A broken mode's entry point, for the discovery tests: the entry points the catalog reads, plus ones that fail.

:func:`discovering` re-reads the entry points inside a ``with`` block through a patched
``importlib.metadata.entry_points`` and restores the catalog's state after, so the other tests see the real modes.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ctx_integrations.engine.core import mode_catalog

GROUP = mode_catalog.ENTRY_POINT_GROUP
MISSING = "ctx_no_such_plugin_module"


def entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=GROUP)


BROKEN = entry_point("broken", f"{MISSING}:SPEC")  # its load() raises ModuleNotFoundError


@contextmanager
def discovering(*extra: importlib.metadata.EntryPoint, before: tuple[importlib.metadata.EntryPoint, ...] = (),
                real: bool = True) -> Iterator[None]:
    """The catalog reads, afresh, ``before``, the installed entry points (none unless ``real``) and ``extra``, in
    that order; as before after the block."""
    installed = [*before, *(importlib.metadata.entry_points(group=GROUP) if real else [])]
    declared, unavailable = dict(mode_catalog._DECLARED), dict(mode_catalog._UNAVAILABLE)
    mode_catalog._DECLARED.clear()
    mode_catalog._UNAVAILABLE.clear()
    mode_catalog._discover.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(importlib.metadata, "entry_points",
                          lambda **selection: [*installed, *extra] if selection == {"group": GROUP} else [])
            yield
    finally:
        mode_catalog._DECLARED.clear()
        mode_catalog._DECLARED.update(declared)
        mode_catalog._UNAVAILABLE.clear()
        mode_catalog._UNAVAILABLE.update(unavailable)
        mode_catalog._discover.cache_clear()  # the next call reads the real entry points again (the same specs)
