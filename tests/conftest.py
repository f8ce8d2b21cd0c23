"""Shared fixtures: tiny random-weight engines for mechanics, the embedded engine for end-to-end checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.paths import cache_root
from tests.helpers import tiny_loaded


@pytest.fixture(scope="session", autouse=True)
def fresh_cache_root(tmp_path_factory) -> Path:
    """Every test session starts with no KV caches and no stores, whatever the developer ran before (a demo run
    by hand would otherwise leave the demo's caches warm); converted models are shared: ``models/`` links to
    the real cache root's, so the embedded model is not converted again. Subprocesses inherit the variable."""
    models = cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("ctx_cache")
    (root / "models").symlink_to(models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CTX_CACHE_DIR", str(root))
        yield root


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
