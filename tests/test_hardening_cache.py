"""Issue 18, items 6, 7, 8 and 11 (disk): cache entries validated against the model, optional signing,
unwritable folders, a disk budget, orphan temp files, and no document-derived files after deleting a store.

Forged entries get a recomputed checksum, as an attacker (or a buggy writer) would: the bug each row
catches is an entry that passes the checksum but does not fit the model, and was served anyway.
"""

from __future__ import annotations

import errno
import os
import time
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ctx_integrations import Engine
from ctx_integrations.engine.core import disk as disk_module
from ctx_integrations.engine.core.cache import KVCacheStore
from ctx_integrations.engine.core.disk import DiskTier, checksum
from ctx_integrations.errors import CacheStoreError, CacheStoreWarning, CorruptCacheWarning, InvalidOptionError
from tests.helpers import tiny_loaded

DOC = "Marrowgate has three bridges over the river Ast; the oldest was built in 1621."
OTHER = "Velden sits on the Ost, a river the same length as the Ast, with four ferries."
DOCS = [DOC, OTHER, "The third passage is about the harbour of Lisk.", "A fourth one, on the mills of Tarn."]


@pytest.fixture(autouse=True)
def no_ambient_key(monkeypatch, tmp_path):
    """Tests control signing themselves: no key from the environment or the user's config dir."""
    monkeypatch.delenv("CTX_CACHE_KEY", raising=False)
    monkeypatch.setattr(disk_module, "signing_key_file", lambda: tmp_path / "no-key-here", raising=False)


def read_entry(path):
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata(), {name: handle.get_tensor(name) for name in ("kv", "token_ids")}


def forge(path, change):
    """Rewrite an entry with ``change(tensors)`` applied and a recomputed checksum (the signature, if any, kept)."""
    metadata, tensors = read_entry(path)
    tensors = change(dict(tensors))
    metadata["checksum"] = checksum(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def _kv(change):
    return lambda t: {**t, "kv": change(t["kv"])}


FORGERIES = {
    "int8": _kv(lambda kv: kv.to(torch.int8)),
    "int64": _kv(lambda kv: kv.to(torch.int64)),
    "all_zero": _kv(torch.zeros_like),
    "nan": _kv(lambda kv: torch.where(torch.rand_like(kv) < 0.01, torch.nan, kv)),
    "inf": _kv(lambda kv: kv.index_put((torch.tensor([0]),), torch.tensor(float("inf")))),
    "one_layer_missing": _kv(lambda kv: kv[:-1]),
    "extra_layer": _kv(lambda kv: torch.cat([kv, kv[:1]])),
    "one_kv_head_missing": _kv(lambda kv: kv[:, :, :1]),
    "head_dim_halved": _kv(lambda kv: kv[..., : kv.shape[-1] // 2]),
    "token_missing": _kv(lambda kv: kv[:, :, :, :-1]),
    "keys_only": _kv(lambda kv: kv[:, :1]),
    "four_dims": _kv(lambda kv: kv[0]),
    "token_ids_float": lambda t: {**t, "token_ids": t["token_ids"].double()},
    # issue 28 item 10: another document's ids (same length, int64) with the checksum recomputed, no signing key
    "token_ids_of_another_text": lambda t: {**t, "token_ids": t["token_ids"] + 1},
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_entry_that_does_not_fit_the_model_is_discarded_and_recomputed(loaded, layout, tmp_path, name):
    first = KVCacheStore(loaded, tmp_path)
    original = first.document(layout, DOC)
    forge(first.disk.path(original.key), FORGERIES[name])
    second = KVCacheStore(loaded, tmp_path)
    with pytest.warns(CorruptCacheWarning):
        entry = second.document(layout, DOC)
    assert second.stats.corrupt == 1 and second.stats.misses == 1 and second.stats.hits == 0
    assert torch.equal(entry.kv, original.kv)  # recomputed, not served
    third = KVCacheStore(loaded, tmp_path)  # and the rewritten file is valid again
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCacheWarning)
        assert torch.equal(third.document(layout, DOC).kv, original.kv)


def test_entry_from_a_model_with_other_kv_heads_is_recomputed_not_a_runtime_error(layout, tmp_path):
    """Another model's entry relabelled with this key: the bug was a permanent RuntimeError when batching it."""
    small, other = tiny_loaded("llama", seed=0), tiny_loaded("llama", seed=0, num_key_value_heads=4)
    store = KVCacheStore(small, tmp_path)
    entry = store.document(layout, DOC)
    foreign = KVCacheStore(other).document(layout, DOC)
    forge(store.disk.path(entry.key), lambda t: {**t, "kv": foreign.kv.clone()})
    fresh = KVCacheStore(small, tmp_path)
    with pytest.warns(CorruptCacheWarning, match="does not fit this model"):
        assert torch.equal(fresh.document(layout, DOC).kv, entry.kv)


# -- item 7: signing ---------------------------------------------------------------------------------------
def test_signed_entries_round_trip(loaded, layout, tmp_path):
    first = KVCacheStore(loaded, tmp_path)
    first.disk.signing_key = b"k" * 32
    entry = first.document(layout, DOC)
    assert "signature" in read_entry(first.disk.path(entry.key))[0]
    second = KVCacheStore(loaded, tmp_path)
    second.disk.signing_key = b"k" * 32
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCacheWarning)
        assert torch.equal(second.document(layout, DOC).kv, entry.kv)
    assert second.stats.hits == 1


SIGNING_ATTACKS = {
    # another document's keys/values under this document's key, token ids and a recomputed checksum:
    # the checksum and every shape check pass, only the signature can tell
    "other_document": "other",
    "values_nudged": "nudge",
    "unsigned": "unsigned",
    "signed_with_another_key": "other_key",
}


@pytest.mark.parametrize("attack", sorted(SIGNING_ATTACKS))
def test_entry_whose_signature_fails_is_not_served(loaded, layout, tmp_path, attack):
    key = b"shared-store-key"
    writer = KVCacheStore(loaded, tmp_path)
    writer.disk.signing_key = None if SIGNING_ATTACKS[attack] == "unsigned" else key
    if SIGNING_ATTACKS[attack] == "other_key":
        writer.disk.signing_key = b"someone else"
    entry = writer.document(layout, DOC)
    path = writer.disk.path(entry.key)
    if SIGNING_ATTACKS[attack] == "other":
        other_ids = tuple(layout.context_ids(OTHER))[: entry.length]
        other_ids += (other_ids[-1],) * (entry.length - len(other_ids))
        other_kv = KVCacheStore(loaded).document_tokens(layout, other_ids).kv
        forge(path, lambda t: {**t, "kv": other_kv.clone()})
    elif SIGNING_ATTACKS[attack] == "nudge":
        forge(path, _kv(lambda kv: kv * 1.01))
    reader = KVCacheStore(loaded, tmp_path)
    reader.disk.signing_key = key
    with pytest.warns(CorruptCacheWarning, match="signature|unsigned"):
        served = reader.document(layout, DOC)
    assert torch.equal(served.kv, KVCacheStore(loaded).document(layout, DOC).kv)
    # the shared prefix entry was written by the same writer: it is refused too when unsigned or signed otherwise
    assert reader.stats.corrupt == (2 if SIGNING_ATTACKS[attack] in ("unsigned", "other_key") else 1)


def test_signing_key_comes_from_the_environment_or_the_config_file(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("CTX_CACHE_KEY", "from-env")
    assert DiskTier(tmp_path / "a", loaded).signing_key == b"from-env"
    monkeypatch.delenv("CTX_CACHE_KEY")
    key_file = tmp_path / "config" / "cache-signing.key"
    key_file.parent.mkdir()
    key_file.write_bytes(b"from-file\n")
    monkeypatch.setattr(disk_module, "signing_key_file", lambda: key_file)
    assert DiskTier(tmp_path / "b", loaded).signing_key == b"from-file"
    key_file.unlink()
    assert DiskTier(tmp_path / "c", loaded).signing_key is None


# -- item 8: folders that cannot be written ----------------------------------------------------------------
def _raise(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT])
@pytest.mark.parametrize("where", ["save_file", "mkstemp"])
def test_full_or_read_only_folder_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch, code, where):
    """The bug: ENOSPC/EROFS from the write escaped mid-answer as an untyped OSError."""
    import tempfile

    import safetensors.torch

    engine = Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")
    target = (safetensors.torch, "save_file") if where == "save_file" else (tempfile, "mkstemp")
    monkeypatch.setattr(*target, _raise(code))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = engine.generate("How many bridges?", DOCS, mode="pced", max_new_tokens=3)
        engine.generate("And the ferries?", DOCS[:2], mode="concat", max_new_tokens=2)
    assert answer.text is not None and len(answer.token_ids) >= 1
    assert [w.category for w in caught if issubclass(w.category, CacheStoreWarning)] == [CacheStoreWarning]
    assert engine.store.disk.writable is False
    assert not list((tmp_path / "kv").rglob(".tmp-*"))


def test_directory_at_an_entry_path_is_a_miss_and_one_warning(loaded, layout, tmp_path):
    store = KVCacheStore(loaded, tmp_path)
    key = store.entry_key(layout, layout.context_ids(DOC))
    store.disk.path(key).mkdir(parents=True)
    (store.disk.path(key) / "keep.txt").write_text("not ours")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = store.document(layout, DOC)
        store.document(layout, OTHER)  # other entries still go to disk
        store.forget(layout, DOC)  # deleting it is not an untyped IsADirectoryError either
    assert [w.category for w in caught] == [CacheStoreWarning]
    assert first.length > 0 and store.disk.contains(store.entry_key(layout, layout.context_ids(OTHER)))
    assert (store.disk.path(key) / "keep.txt").read_text() == "not ours"  # never deletes a user's folder


def test_cache_dir_that_is_a_file_is_a_typed_error(tmp_path):
    blocker = tmp_path / "kv"
    blocker.write_text("a file")
    with pytest.raises(CacheStoreError, match="is a file"):
        Engine(tiny_loaded("llama"), cache_dir=blocker)


@pytest.mark.parametrize("cache_dir", [5, b"kv", "", ["kv"]])
def test_cache_dir_that_is_no_path_is_a_typed_error(cache_dir, monkeypatch):
    """Issue 58: ``Engine(loaded, cache_dir=5)`` was ``Path(5)``'s bare TypeError; ``""`` the current folder."""
    with pytest.raises(InvalidOptionError, match=r"^cache_dir must be a folder path \(a str or os.PathLike\) or None"):
        Engine(tiny_loaded("llama"), cache_dir=cache_dir)
    from ctx_integrations.engine.core import engine as engine_module

    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(InvalidOptionError, match="^cache_dir must be"):
        Engine.from_pretrained(cache_dir=cache_dir)


def test_cache_dir_that_cannot_be_created_is_a_typed_error(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.setattr(Path, "mkdir", _raise(errno.EACCES))
    with pytest.raises(CacheStoreError, match="cannot be created"):
        DiskTier(tmp_path / "new" / "kv", tiny_loaded("llama"))


def test_corrupt_entry_in_a_read_only_folder_is_never_served(loaded, layout, tmp_path, monkeypatch):
    store = KVCacheStore(loaded, tmp_path)
    entry = store.document(layout, DOC)
    forge(store.disk.path(entry.key), _kv(torch.zeros_like))
    reader = KVCacheStore(loaded, tmp_path)
    from pathlib import Path

    monkeypatch.setattr(Path, "unlink", _raise(errno.EROFS))
    monkeypatch.setattr(os, "utime", _raise(errno.EROFS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(reader.document(layout, DOC).kv, entry.kv)
    assert {w.category for w in caught} == {CorruptCacheWarning, CacheStoreWarning}


# -- item 11: disk budget, orphans, deleting a store -------------------------------------------------------
def test_disk_budget_evicts_least_recently_used_entries(loaded, layout, tmp_path):
    probe = KVCacheStore(loaded, tmp_path / "probe")
    probe.documents(layout, DOCS)
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "probe").rglob("*.safetensors")}
    budget = sum(sizes.values()) - min(sizes.values())  # everything minus (at least) one document
    store = KVCacheStore(loaded, tmp_path / "kv", disk_bytes=budget)
    keys = [store.entry_key(layout, layout.context_ids(text)) for text in DOCS]
    store.documents(layout, DOCS[:3])
    for age, key in enumerate(keys[:3]):  # explicit ages: DOCS[0] oldest, then 1, then 2
        os.utime(store.disk.path(key), (time.time() - 1000 + age, time.time() - 1000 + age))
    os.utime(store.disk.path(store.prefix(layout).key), (time.time() - 500,) * 2)
    store.clear_memory()
    store.document(layout, DOCS[0])  # a load touches it: now the most recently used
    store.document(layout, DOCS[3])  # does not fit: the least recently used (DOCS[1]) goes
    assert store.disk.used_bytes() <= budget
    assert store.disk.contains(keys[0]) and store.disk.contains(keys[3])
    assert not store.disk.contains(keys[1])
    assert store.disk.evicted >= 1


def test_entry_larger_than_the_whole_budget_stays_in_memory(loaded, layout, tmp_path):
    store = KVCacheStore(loaded, tmp_path, disk_bytes=1000)
    entry = store.document(layout, DOC)
    assert store.disk.used_bytes() == 0 and store.document(layout, DOC) is entry


@pytest.mark.parametrize("budget", [-1, 1.5, float("nan"), "1GB", True])
def test_bad_disk_budget_is_a_typed_error(loaded, tmp_path, budget):
    from ctx_integrations.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="disk_bytes"):
        KVCacheStore(loaded, tmp_path, disk_bytes=budget)


def _aged(path, age_s: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"half an entry")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_orphan_temp_files_older_than_an_hour_are_removed_when_an_engine_starts(loaded, tmp_path):
    """The bug: orphans at the top of the model's folder and in the legacy layout's folders (``<root>/<key[:2]>/``,
    where engines before per-model folders wrote) were never removed; and one a minute old could still be written.
    """
    folder = disk_module.model_directory(tmp_path, loaded)
    orphans = [_aged(folder / "ab" / ".tmp-shard.safetensors", 7200), _aged(folder / ".tmp-top.safetensors", 7200),
               _aged(tmp_path / "ab" / ".tmp-legacy.safetensors", 7200)]
    kept = [_aged(folder / "ab" / ".tmp-ten-minutes.safetensors", 600),  # perhaps a slow writer: not an hour yet
            _aged(folder / "ab" / ".tmp-just-under-an-hour.safetensors", 3500),
            _aged(tmp_path / "ab" / "not-a-temp-file.txt", 7200),  # not ours to judge
            _aged(tmp_path / "notes" / ".tmp-not-a-shard.safetensors", 7200),  # a folder the layout never made
            _aged(tmp_path / "other-model-0123456789abcdef" / "ab" / ".tmp-x.safetensors", 7200)]  # its own engine's
    Engine(loaded, cache_dir=tmp_path)
    assert [p for p in orphans if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []


@pytest.mark.parametrize("attached", [True, False])
def test_deleting_every_document_leaves_no_cache_files(tmp_path, monkeypatch, attached):
    """The bug: without an engine attached, a deleted document's entry stayed on disk for good.

    The KV root is shared by every store (one entry per text and model), so what stays is the prompt prefix's
    entry only: it derives from the system prompt, not from any document.
    """
    from ctx_integrations.retrieval import DocumentStore

    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    location = tmp_path / "store"
    store = DocumentStore(location)
    store.engine = Engine(tiny_loaded("llama"), cache_dir=store.kv_dir)
    store.add([{"id": f"d{i}", "text": text} for i, text in enumerate(DOCS)])
    prefix = store.engine.store.disk.path(store.engine.store.prefix(store.engine.layout).key)
    assert len(list(store.kv_dir.rglob("*.safetensors"))) == len(DOCS) + 1
    store.delete(["d0"])
    if not attached:
        store = DocumentStore(location)  # reopened without an engine
    store.delete(["d1", "d2", "d3"])
    assert store.count() == 0
    assert [p for p in store.kv_dir.rglob("*") if p.is_file()] == [prefix]


# -- issue 28 items 5 and 8: full disk as safetensors reports it, OS errors on read, size before reading ----------
ENOSPC_FROM_SAFETENSORS = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                           'left on device" })')


def _half_written_then(error):
    """A save_file that writes half a file to its temp path, then fails as a full disk makes it fail."""
    def fail(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 100)
        raise error

    return fail


@pytest.mark.parametrize("failure", ["safetensors_error", "replace_enospc", "replace_eio"])
def test_a_full_disk_keeps_entries_in_memory_with_one_warning_and_no_temp_file(tmp_path, monkeypatch, failure):
    """The bug: safetensors' own ``SafetensorError: No space left on device`` (not an OSError) escaped from
    ``generate``; a failed ``os.replace`` must not leave the temp file behind either."""
    import safetensors.torch
    from safetensors import SafetensorError

    engine = Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")
    if failure == "safetensors_error":
        full = SafetensorError(ENOSPC_FROM_SAFETENSORS)
        monkeypatch.setattr(safetensors.torch, "save_file", _half_written_then(full))
    else:
        code = errno.ENOSPC if failure == "replace_enospc" else errno.EIO
        monkeypatch.setattr(disk_module.os, "replace", _raise(code))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = engine.generate("How many bridges?", DOCS, mode="pced", max_new_tokens=3)
        again = engine.generate("How many bridges?", DOCS, mode="pced", max_new_tokens=3)
    assert len(answer.token_ids) >= 1 and again.token_ids == answer.token_ids and again.cache_misses == 0
    assert [w.category for w in caught if issubclass(w.category, CacheStoreWarning)] == [CacheStoreWarning]
    assert engine.store.disk.writable is (failure == "replace_eio")  # a full disk stops further writes
    assert not [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]


def test_an_os_error_while_reading_an_entry_is_a_miss_and_one_warning(loaded, layout, tmp_path, monkeypatch):
    import safetensors

    original = KVCacheStore(loaded, tmp_path).document(layout, DOC)
    monkeypatch.setattr(safetensors, "safe_open", _raise(errno.EIO))
    reader = KVCacheStore(loaded, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(reader.document(layout, DOC).kv, original.kv)
        reader.clear_memory()
        reader.document(layout, DOC)
    assert [w.category for w in caught] == [CacheStoreWarning]
    assert reader.disk.contains(original.key)  # an unreadable disk is not a corrupt entry: the file stays


def _rss_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_sparse_entry(path, key, token_ids, size):
    """A sparse file of ``size`` bytes with a well-formed entry header (format, key) for a huge ``kv``: checking
    its checksum reads (and copies) all of it."""
    import json

    elements = (size - 4096) // 4
    header = {"__metadata__": {"format": disk_module.FORMAT_VERSION, "key": key, "checksum": "0" * 32},
              "kv": {"dtype": "F32", "shape": [elements], "data_offsets": [0, elements * 4]},
              "token_ids": {"dtype": "I64", "shape": [len(token_ids)],
                            "data_offsets": [elements * 4, elements * 4 + 8 * len(token_ids)]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        handle.truncate(8 + len(raw) + elements * 4 + 8 * len(token_ids))


def test_a_sparse_file_in_place_of_an_entry_is_refused_before_it_is_read(loaded, layout, tmp_path, monkeypatch):
    """The bug: a sparse 1.5 GB file at an entry's path raised RSS by 3 GB before it was refused."""
    import safetensors

    original = KVCacheStore(loaded, tmp_path).document(layout, DOC)
    store = KVCacheStore(loaded, tmp_path)
    path = store.disk.path(original.key)
    write_sparse_entry(path, original.key, original.token_ids, 1536 << 20)
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    before = _rss_peak_bytes()
    with pytest.warns(CorruptCacheWarning, match="more than an entry"):
        assert torch.equal(store.document(layout, DOC).kv, original.kv)
    assert (str(path),) not in opened  # refused from its size alone
    assert _rss_peak_bytes() - before < 200 << 20
    assert path.stat().st_size < 1 << 20  # and replaced by the recomputed entry


# -- issue 27 item 4: metadata that is not content reaches neither the model nor the cache key ------------------
def test_a_file_path_is_neither_shown_to_the_model_nor_part_of_the_cache_key(loaded, tmp_path):
    """The bug: LlamaIndex's ``file_path`` (an absolute path) was in the decoder's text, so the model quoted it and
    the same file in another folder was computed again."""
    from llama_index.core.schema import TextNode

    from ctx_integrations.llama_index import KVCacheWarmer, node_text

    def node(folder, **extra):
        return TextNode(text=DOC, metadata={"file_path": f"/home/{folder}/LICENSE.txt", "title": "Bridges"}, **extra)

    assert node_text(node("a")) == node_text(node("b")) == "title: Bridges\n\n" + DOC
    assert node_text(node("a"), show_metadata=["file_path"]).startswith("file_path: /home/a/LICENSE.txt")
    assert node_text(node("a", excluded_llm_metadata_keys=["title"])) == DOC  # LlamaIndex's own switch holds
    warmer = KVCacheWarmer(Engine(loaded, cache_dir=tmp_path))
    warmer([node("a")])
    warmer([node("b")])
    assert warmer.stats["misses"] == 1 and warmer.stats["hits"] == 1


def test_a_forged_entry_record_cannot_delete_files_outside_the_kv_root(tmp_path, monkeypatch):
    """Entry files are recorded in Chroma metadata (a shared server is writable by others): deleting a document
    removes only recorded paths that are entries inside ``kv_dir``."""
    import json

    from ctx_integrations.retrieval import DocumentStore
    from ctx_integrations.retrieval.store import ENTRIES_KEY

    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "cache"))
    victim = tmp_path / ("a" * 64 + ".safetensors")  # an entry's name, outside the KV root
    victim.write_text("not an entry of this store")
    store = DocumentStore(tmp_path / "store")
    store.add([{"id": "d0", "text": DOC}])
    store._collection.update(ids=["d0"], metadatas=[{ENTRIES_KEY: json.dumps([str(victim)])}])
    assert "ctx_kv_entries" not in store.get(["d0"])[0].metadata  # never shown to readers
    store.delete(["d0"])
    assert victim.read_text() == "not an entry of this store"


# -- reliability issue, item 6: an entry is served only by a tier of its own format --------------------------------
FORMATS = ("native", "fp16", "bf16", "int8")
COPIES = [(reader, writer) for reader in FORMATS for writer in FORMATS if reader != writer]


@pytest.mark.parametrize(("reader", "writer"), COPIES, ids=[f"{w}-entry-in-a-{r}-folder" for r, w in COPIES])
def test_an_entry_of_another_format_is_a_miss(loaded, layout, tmp_path, reader, writer):
    """The bug: a native (exact) engine served int8 / fp16 / bf16 entries copied into its folder, their rounded values
    as if exact. The one exception: an fp16 tier writes (and so reads) native entries fp16 cannot hold."""
    written = KVCacheStore(loaded, tmp_path / "w", disk_format=writer)
    entry = written.document(layout, DOC)
    store = KVCacheStore(loaded, tmp_path / "r", disk_format=reader)
    store.disk.path(entry.key).parent.mkdir(parents=True, exist_ok=True)
    store.disk.path(entry.key).write_bytes(written.disk.path(entry.key).read_bytes())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = store.disk.load(entry.key, entry.token_ids)
    if (reader, writer) == ("fp16", "native"):
        assert served is not None and torch.equal(served, entry.kv) and not caught
    else:
        assert served is None and store.stats.corrupt == 1 and not store.disk.contains(entry.key)
        assert [str(w.message) for w in caught if f"stored as {writer!r}" in str(w.message)], caught


@pytest.mark.parametrize("kv_format", FORMATS)
def test_an_entry_of_its_own_format_is_served(loaded, layout, tmp_path, kv_format):
    store = KVCacheStore(loaded, tmp_path, disk_format=kv_format)
    entry = store.document(layout, DOC)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCacheWarning)
        assert store.disk.load(entry.key, entry.token_ids) is not None and store.stats.corrupt == 0
