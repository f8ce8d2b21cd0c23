"""Shared fixtures: tiny random-weight engines for mechanics, the embedded engine for end-to-end checks."""

from __future__ import annotations

import pytest

from ctx_integrations import Engine
from tests.helpers import tiny_loaded


@pytest.fixture(scope="session")
def embedded_engine() -> Engine:
    """The embedded SmolLM2 engine with in-memory caches (converted once per machine, ~0.3 s after)."""
    return Engine.from_pretrained()


@pytest.fixture
def tiny_engine(tmp_path) -> Engine:
    """A fresh tiny random Llama engine whose caches persist under a per-test folder."""
    return Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")
