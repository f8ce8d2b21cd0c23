"""Shared fixtures: tiny random-weight engines for mechanics, the embedded engine for end-to-end checks."""

from __future__ import annotations

import os
from pathlib import Path


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, give each worker its share of the cores as torch's (OpenMP's) thread count.

    Each worker's torch otherwise takes every core, and ``make test``'s two workers on two cores ran a 2.4 s
    test in 46-50 s (OpenMP's threads spinning against the other worker's). Set before torch is imported:
    OpenMP reads the variable when it loads; subprocesses (the CLI, servers, notebooks) inherit it. A value
    the developer set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


_share_the_cores_between_workers()

import pytest  # noqa: E402
import torch  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:  # torch imported earlier (a plugin) has its count already: set it too
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from ctx_integrations import Engine  # noqa: E402
from ctx_integrations.engine.core.layout import PromptLayout  # noqa: E402
from ctx_integrations.paths import cache_root  # noqa: E402
from tests.helpers import tiny_loaded  # noqa: E402


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


# The slowest modules of `make test`'s main run, slowest first (its --durations on the 2-core CPU: each one minute or
# more, the notebooks and benchmarks ~3-4 minutes in all): scheduled first, so that the two workers of --dist
# loadfile do not end with one of them alone on a long module while the other idles.
SLOWEST_FIRST = ("test_notebooks.py", "test_benchmarks.py", "test_serve_ray.py",
                 "test_cli.py", "test_scheduler_exit.py", "test_scheduler.py", "test_compiled_step.py",
                 "test_serve_http.py", "test_batch_invariance.py", "test_llama_index_patterns.py",
                 "test_soft_nbce_scheduler_batched.py", "test_docs_snippets.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FIRST)))  # stable: each module's own order
