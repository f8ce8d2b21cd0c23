"""The remote KV tier (engine/core/remote.py) against a real ``redis-server`` on 127.0.0.1: two engines ("replicas")
sharing entries, and its faults (server down at start, killed mid-run, truncated and forged entries, a full store).

Without ``redis-server`` on PATH (or the ``redis`` client) these tests skip, saying how to install it; with
``CTX_REQUIRE_REDIS=1`` (``.ci/run`` sets it) they fail instead, so CI cannot pass without running them.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import load, save

from benchmarks.redis_server import INSTALL_HINT, free_port, start_server, stop_server
from ctx_integrations.engine.core import disk as disk_module
from ctx_integrations.engine.core.disk import checksum, signature
from ctx_integrations.engine.core.engine import Engine
from ctx_integrations.engine.core.remote import parse_entry
from ctx_integrations.errors import CacheStoreWarning, CorruptCacheWarning, InvalidOptionError
from tests.helpers import tiny_loaded

DOCS = [f"Report {i}: the bridge at Marrowgate number {i} was built in {1600 + i} of grey stone." for i in range(3)]
QUESTION = "When was the oldest bridge built?"
KEY = "remote-suite-signing-key"


def _unavailable(reason: str) -> None:
    if os.environ.get("CTX_REQUIRE_REDIS") == "1":
        pytest.fail(f"CTX_REQUIRE_REDIS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def redis_available() -> None:
    """Skip (or, with CTX_REQUIRE_REDIS=1, fail) without the redis client or the redis-server binary."""
    try:
        import redis  # noqa: F401
    except ImportError:
        _unavailable("the redis client is not installed: pip install 'ctx-integrations[remote]'")
    if shutil.which("redis-server") is None:
        _unavailable(f"redis-server is not on PATH: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def server(redis_available, tmp_path_factory) -> Iterator[str]:
    """One server for the module; every test starts from an empty database."""
    process, url = start_server(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop_server(process)


@pytest.fixture
def url(server) -> str:
    import redis

    client = redis.Redis.from_url(server)
    client.flushdb()
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "allkeys-lru")
    return server


@pytest.fixture(autouse=True)
def no_ambient_key(monkeypatch, tmp_path):
    monkeypatch.delenv("CTX_CACHE_KEY", raising=False)
    monkeypatch.setattr(disk_module, "signing_key_file", lambda: tmp_path / "no-key-here")


@pytest.fixture(scope="module")
def replicas():
    """Two copies of one tiny model, loaded apart (as two processes would): same weights, so same entry keys."""
    return tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=0)


@pytest.fixture(scope="module")
def reference(replicas) -> list[int]:
    """The answer computed with no cache tier but memory: what every case must answer."""
    return Engine(tiny_loaded("llama", seed=0), threads=1).generate(QUESTION, DOCS, max_new_tokens=6).token_ids


def ask(engine: Engine):
    return engine.generate(QUESTION, DOCS, max_new_tokens=6)


def test_a_url_that_is_not_redis_is_refused_at_construction(replicas):
    for bad in ("http://127.0.0.1:6379", "127.0.0.1:6379", 6379):
        with pytest.raises(InvalidOptionError, match="remote_cache_url"):
            Engine(replicas[0], remote_cache_url=bad)


def test_a_second_replica_answers_from_what_the_first_computed(url, replicas, reference):
    first, second = (Engine(loaded, remote_cache_url=url, threads=1) for loaded in replicas)
    cold = ask(first)
    assert cold.cache_misses == len(DOCS) and cold.cache_hits_by_tier["remote"] == 0
    warm = ask(second)
    assert warm.cache_hits_by_tier == {"memory": 0, "host": 0, "disk": 0, "remote": len(DOCS)}
    assert warm.cache_misses == 0
    assert warm.token_ids == cold.token_ids == reference
    assert second.stats()["cache"]["hits_by_tier"]["remote"] == len(DOCS)


def test_a_remote_hit_is_kept_on_the_local_disk(url, replicas, tmp_path):
    ask(Engine(replicas[0], remote_cache_url=url, threads=1))
    second = Engine(replicas[1], cache_dir=tmp_path, remote_cache_url=url, threads=1)
    assert ask(second).cache_hits_by_tier["remote"] == len(DOCS)
    second.store.clear_memory()
    assert ask(second).cache_hits_by_tier["disk"] == len(DOCS)


def test_models_never_share_entries(url, replicas):
    import redis

    ask(Engine(replicas[0], remote_cache_url=url, threads=1))
    other = Engine(tiny_loaded("llama", seed=1), remote_cache_url=url, threads=1)
    assert ask(other).cache_hits_by_tier["remote"] == 0
    prefixes = {key.decode().rsplit(":", 1)[0] for key in redis.Redis.from_url(url).keys("*")}
    assert len(prefixes) == 2 and all(prefix.startswith("ctx-kv:tiny-llama-") for prefix in prefixes)


def test_a_server_down_at_start_costs_one_warning_and_one_try_per_interval(redis_available, replicas, reference):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = Engine(replicas[0], remote_cache_url=url, threads=1)
        answers = [ask(engine) for _ in range(3)]
        engine.store.clear_memory()
        answers.append(ask(engine))
        tier = engine.store.remote
        assert tier.failures == 1  # the first lookup failed; none after it within retry_s (no retry storm)
        tier.retry_s = 0.05
        tier._down_until = time.monotonic() + tier.retry_s
        time.sleep(0.1)
        engine.store.clear_memory()
        answers.append(ask(engine))
    assert all(answer.token_ids == reference for answer in answers)
    assert tier.failures == 2  # tried again once the interval passed, and backed off again
    store_warnings = [w for w in seen if issubclass(w.category, CacheStoreWarning)]
    assert len(store_warnings) == 1 and url in str(store_warnings[0].message)
    assert not [w for w in seen if issubclass(w.category, CorruptCacheWarning)]


def test_a_server_killed_mid_run_costs_one_warning(redis_available, replicas, reference, tmp_path):
    process, url = start_server(tmp_path)
    try:
        first, second = (Engine(loaded, remote_cache_url=url, threads=1) for loaded in replicas)
        assert ask(first).token_ids == reference
    finally:
        stop_server(process)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        answers = [ask(second), ask(first)]
        first.store.clear_memory()
        answers.append(ask(first))
    assert all(answer.token_ids == reference for answer in answers)
    assert answers[0].cache_misses == len(DOCS)
    store_warnings = [w for w in seen if issubclass(w.category, CacheStoreWarning)]
    assert len(store_warnings) == 2 and all(url in str(w.message) for w in store_warnings)  # one per replica
    assert second.store.remote.failures == first.store.remote.failures == 1


def _rewrite(url: str, change) -> int:
    """Replace every entry on the server by ``change(bytes)``; how many were changed."""
    import redis

    client = redis.Redis.from_url(url)
    keys = client.keys("ctx-kv:*")
    for key in keys:
        client.set(key, change(client.get(key)))
    return len(keys)


def _refused(engine: Engine, reference, says: str) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        answer = ask(engine)
    corrupt = [str(w.message) for w in seen if issubclass(w.category, CorruptCacheWarning)]
    assert answer.token_ids == reference and answer.cache_hits_by_tier["remote"] == 0
    assert len(corrupt) == len(DOCS) + 1 and all(says in text for text in corrupt), corrupt  # the prefix too
    assert engine.store.stats.corrupt == len(DOCS) + 1


def test_a_truncated_entry_is_refused_and_recomputed(url, replicas, reference):
    ask(Engine(replicas[0], remote_cache_url=url, threads=1))
    assert _rewrite(url, lambda data: data[: len(data) // 2]) == len(DOCS) + 1
    second = Engine(replicas[1], remote_cache_url=url, threads=1)
    _refused(second, reference, "unreadable")
    third = Engine(tiny_loaded("llama", seed=0), remote_cache_url=url, threads=1)
    assert ask(third).cache_hits_by_tier["remote"] == len(DOCS)  # the recomputed entries replaced the truncated


def _forge(data: bytes) -> bytes:
    """The entry with its values changed, its checksum recomputed and a signature made with another key."""
    metadata, tensors, _ = parse_entry(data)
    tensors = {name: (tensor * 0.5 if name == "kv" else tensor) for name, tensor in tensors.items()}
    metadata["checksum"] = checksum(tensors)
    metadata["signature"] = signature(b"another key", metadata["key"], tensors, metadata["kv_format"])
    return save(tensors, metadata=metadata)


def test_a_forged_entry_is_refused_when_a_signing_key_is_set(url, replicas, reference, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_KEY", KEY)
    ask(Engine(replicas[0], remote_cache_url=url, threads=1))
    _rewrite(url, _forge)
    _refused(Engine(replicas[1], remote_cache_url=url, threads=1), reference, "signature mismatch")


def test_an_entry_unchanged_passes_the_signature_check(url, replicas, monkeypatch):
    """The forgery test's control: the same rewrite without changing anything is still served."""
    monkeypatch.setenv("CTX_CACHE_KEY", KEY)
    ask(Engine(replicas[0], remote_cache_url=url, threads=1))
    _rewrite(url, lambda data: save(load(data), metadata=parse_entry(data)[0]))
    assert ask(Engine(replicas[1], remote_cache_url=url, threads=1)).cache_hits_by_tier["remote"] == len(DOCS)


def _full(url: str, policy: str, loaded) -> tuple[Engine, list, int]:
    """An engine writing 40 documents into a server with room for a few of them."""
    import redis

    client = redis.Redis.from_url(url)
    client.config_set("maxmemory-policy", policy)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (160 << 10))
    engine = Engine(loaded, remote_cache_url=url, threads=1)
    docs = [f"Ledger {i}: {' '.join(['grain'] * 20)} shipped on day {i}." for i in range(40)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for start in range(0, len(docs), 8):
            answer = engine.generate(QUESTION, docs[start:start + 8], max_new_tokens=2)
            assert answer.token_ids
    return engine, seen, len(client.keys("ctx-kv:*"))


def test_a_full_store_evicts_and_no_error_reaches_the_caller(url, replicas):
    import redis

    _, seen, kept = _full(url, "allkeys-lru", replicas[0])
    assert 0 < kept < 40 and redis.Redis.from_url(url).info("stats")["evicted_keys"] > 0
    assert not [w for w in seen if issubclass(w.category, (CacheStoreWarning, CorruptCacheWarning))]


def test_a_full_store_that_refuses_writes_costs_one_warning(url, replicas):
    _, seen, kept = _full(url, "noeviction", replicas[0])
    assert kept < 40
    store_warnings = [str(w.message) for w in seen if issubclass(w.category, CacheStoreWarning)]
    assert len(store_warnings) == 1 and "allkeys-lru" in store_warnings[0]


def test_an_entry_round_trips_through_its_bytes(replicas):
    """The remote tier stores exactly the disk tier's entry: same tensors and metadata after a round trip."""
    loaded = replicas[0]
    kv = torch.randn(2, 2, 2, 5, 16)
    tensors, metadata = disk_module.entry_tensors("k" * 64, (1, 2, 3, 4, 5), kv, "native", None)
    parsed, back, problem = parse_entry(save(tensors, metadata=metadata))
    assert problem is None and parsed == metadata and torch.equal(back["kv"], kv)
    kv_out, why = disk_module.read_entry(loaded, "native", None, parsed, back, "k" * 64, (1, 2, 3, 4, 5), None)
    assert why is None and torch.equal(kv_out, kv)


def test_forget_removes_the_entry_from_the_server_too(url, replicas):
    """Bug caught: a changed or deleted document still served to every other replica from the server."""
    engine = Engine(replicas[0], remote_cache_url=url, threads=1)
    ask(engine)
    store, layout = engine.store, engine.layout
    assert store.remote.contains(store.entry_key(layout, layout.context_ids(DOCS[0])))
    store.forget(layout, DOCS[0])
    assert not store.contains(layout, DOCS[0]) and store.contains(layout, DOCS[1])
