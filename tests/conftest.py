"""Shared fixtures: tiny random-weight engines for mechanics, the embedded engine for end-to-end checks."""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.layout import PromptLayout
from tests.helpers import tiny_loaded


@pytest.fixture(scope="session")
def embedded_engine() -> Engine:
    """The embedded SmolLM2 engine with in-memory caches (converted once per machine, ~0.3 s after).

    fp32 whatever the CPU: the parity tests' reference path (a bf16 CPU would default to bf16)."""
    return Engine.from_pretrained(dtype=torch.float32)


@pytest.fixture
def family() -> str:
    """The model family of ``tiny_engine``: Llama, unless a test parametrises ``family`` (e.g. over "qwen2")."""
    return "llama"


@pytest.fixture
def tiny_engine(tmp_path, family) -> Engine:
    """A fresh tiny random engine of ``family`` whose caches persist under a per-test folder."""
    return Engine(tiny_loaded(family), cache_dir=tmp_path / "kv")


@pytest.fixture(scope="module")
def loaded():
    """The tiny random Llama (seed 0) of the cache-store tests, one per test module."""
    return tiny_loaded("llama", seed=0)


@pytest.fixture(scope="module")
def layout(loaded) -> PromptLayout:
    """The default prompt layout over ``loaded``'s tokenizer."""
    return PromptLayout(loaded.tokenizer)
