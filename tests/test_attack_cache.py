"""Attack suite for the KV-cache folder (issue 28): forged, damaged, truncated, oversized and sparse entries,
wrong dtypes and shapes, things that are not files, and OS errors on write and on read, on a tiny model.

Every case ends in one outcome, and the only acceptable one is ``handled``: the document's cache comes back
equal to a fresh computation, every warning is one of the project's (``CorruptCacheWarning``,
``CacheStoreWarning``, at most one of the latter), no temp file is left and memory does not grow by the size
of what the folder holds. The others name the failure: ``untyped: <error>`` (an exception that is not one of
the project's), ``silent`` (a wrong entry served), ``hang`` (no answer within ``HANG_S``), ``memory`` (the peak
RSS grew by more than ``MEMORY_SLACK``), ``leftover`` (a temp file stayed) and ``warnings: ...``.

Out of scope, by the threat model in ``engine/core/disk.py``: an unsigned entry whose values are forged with
a recomputed checksum and still look like a cache (finite, right dtype and shape: anyone who can write the
folder can do that; a signing key is the defence), so such forgeries appear here only with a signing key.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ctx_integrations.engine.core import disk as disk_module
from ctx_integrations.engine.core.cache import KVCacheStore
from ctx_integrations.engine.core.disk import checksum, signature
from ctx_integrations.errors import CacheStoreWarning, CorruptCacheWarning, CtxIntegrationsError

DOC = "Marrowgate has three bridges over the river Ast; the oldest was built in 1621."
OTHER = "Velden sits on the Ost, a river the same length as the Ast, with four ferries, all of them blue."
HANG_S = 20.0
MEMORY_SLACK = 200 << 20
SPARSE_BYTES = 1536 << 20
KEY = "attack-suite-signing-key"


@pytest.fixture(autouse=True)
def no_ambient_key(monkeypatch, tmp_path):
    monkeypatch.delenv("CTX_CACHE_KEY", raising=False)
    monkeypatch.setattr(disk_module, "signing_key_file", lambda: tmp_path / "no-key-here")


@pytest.fixture(scope="module")
def reference(loaded, layout) -> torch.Tensor:
    """DOC's cache computed in memory, never through a folder: what every case must end up with."""
    return KVCacheStore(loaded).document(layout, DOC).kv


# -- the attacks ----------------------------------------------------------------------------------------------
def read(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {}), {name: handle.get_tensor(name) for name in handle.keys()}


def forged(change: Callable[[dict], dict], sign: bool = False, keep_checksum: bool = False) -> Callable:
    """Rewrite the entry with ``change(tensors)``; the checksum recomputed (as an attacker would), and with
    ``sign`` the signature too (as a writer holding the key would not: the signature is kept as it was)."""
    def attack(path: Path, ctx: Context) -> None:
        metadata, tensors = read(path)
        tensors = change(dict(tensors))
        if not keep_checksum:
            metadata["checksum"] = checksum({k: v for k, v in tensors.items() if k in ("kv", "token_ids")})
        if sign:
            metadata["signature"] = signature(b"another key", metadata["key"], tensors,
                                              metadata.get("kv_format", "native"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)

    return attack


def metadata_edit(change: Callable[[dict], None]) -> Callable:
    def attack(path: Path, ctx: Context) -> None:
        metadata, tensors = read(path)
        change(metadata)
        save_file(tensors, str(path), metadata=metadata)

    return attack


def raw(change: Callable[[bytes], bytes]) -> Callable:
    return lambda path, ctx: path.write_bytes(change(path.read_bytes()))


def header_length(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x55]) + data[at + 1:]


def sparse_zeros(path: Path, ctx: Context) -> None:
    with open(path, "wb") as handle:
        handle.truncate(SPARSE_BYTES)


def sparse_with_header(path: Path, ctx: Context) -> None:
    """A well-formed entry header (format, key) for a 1.5 GB ``kv`` over a sparse file: checking its checksum
    reads (and copies) all of it."""
    elements, ids = (SPARSE_BYTES - 4096) // 4, len(ctx.token_ids)
    header = {"__metadata__": {"format": disk_module.FORMAT_VERSION, "key": ctx.key, "checksum": "0" * 32},
              "kv": {"dtype": "F32", "shape": [elements], "data_offsets": [0, elements * 4]},
              "token_ids": {"dtype": "I64", "shape": [ids], "data_offsets": [elements * 4, elements * 4 + 8 * ids]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        handle.truncate(8 + len(text) + elements * 4 + 8 * ids)


def huge_header(path: Path, ctx: Context) -> None:
    data = path.read_bytes()
    length = header_length(data)
    padded = data[8:8 + length] + b" " * (10 << 20)
    path.write_bytes(len(padded).to_bytes(8, "little") + padded + data[8 + length:])


def replace_with(make: Callable[[Path, Context], None]) -> Callable:
    def attack(path: Path, ctx: Context) -> None:
        path.unlink()
        make(path, ctx)

    return attack


def other_entry(path: Path, ctx: Context) -> None:
    """Another document's (valid) entry copied or linked at this key's path."""
    path.unlink()
    path.symlink_to(ctx.other_path)


def os_error(code: int) -> Callable:
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def safetensors_full(*args, **kwargs):
    filename = args[1] if len(args) > 1 else kwargs["filename"]
    Path(filename).write_bytes(b"\0" * 64)  # half written
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


def _kv(change):
    return lambda t: {**t, "kv": change(t["kv"])}


FILE_ATTACKS: dict[str, Callable] = {
    # forged, checksum recomputed, no signing key: anything that does not fit the document or the model
    "token_ids_of_another_text": forged(lambda t: {**t, "token_ids": t["token_ids"] + 1}),
    "token_ids_one_longer": forged(lambda t: {**t, "token_ids": torch.cat([t["token_ids"], t["token_ids"][:1]])}),
    "token_ids_one_shorter": forged(lambda t: {**t, "token_ids": t["token_ids"][:-1]}),
    "token_ids_int32": forged(lambda t: {**t, "token_ids": t["token_ids"].int()}),
    "token_ids_float": forged(lambda t: {**t, "token_ids": t["token_ids"].double()}),
    "token_ids_2d": forged(lambda t: {**t, "token_ids": t["token_ids"][None]}),
    "token_ids_missing": forged(lambda t: {"kv": t["kv"]}),
    "kv_missing": forged(lambda t: {"token_ids": t["token_ids"]}),
    "extra_tensor": forged(lambda t: {**t, "evil": torch.ones(3)}),
    "key_of_another_entry": metadata_edit(lambda m: m.update(key="0" * 64)),
    "format_unknown": metadata_edit(lambda m: m.update(format="ctx-kv-0")),
    "checksum_missing": metadata_edit(lambda m: m.pop("checksum")),
    "checksum_wrong": forged(_kv(lambda kv: kv * 2), keep_checksum=True),
    "dtype_int8": forged(_kv(lambda kv: kv.to(torch.int8))),
    "dtype_uint8": forged(_kv(lambda kv: kv.to(torch.uint8))),
    "dtype_int64": forged(_kv(lambda kv: kv.to(torch.int64))),
    "dtype_bool": forged(_kv(lambda kv: kv > 0)),
    "dtype_float8": forged(_kv(lambda kv: kv.to(torch.float8_e4m3fn))),
    "shape_one_layer_missing": forged(_kv(lambda kv: kv[:-1])),
    "shape_extra_layer": forged(_kv(lambda kv: torch.cat([kv, kv[:1]]))),
    "shape_keys_only": forged(_kv(lambda kv: kv[:, :1])),
    "shape_one_kv_head_missing": forged(_kv(lambda kv: kv[:, :, :1])),
    "shape_head_dim_halved": forged(_kv(lambda kv: kv[..., : kv.shape[-1] // 2])),
    "shape_token_missing": forged(_kv(lambda kv: kv[:, :, :, :-1])),
    "shape_token_extra": forged(_kv(lambda kv: torch.cat([kv, kv[:, :, :, :1]], dim=3))),
    "shape_tokens_and_head_dim_swapped": forged(_kv(lambda kv: kv.transpose(3, 4).contiguous())),
    "shape_flat": forged(_kv(lambda kv: kv.reshape(-1))),
    "shape_six_dims": forged(_kv(lambda kv: kv[None])),
    "values_nan": forged(_kv(lambda kv: kv.index_put((torch.tensor([0]),), torch.tensor(float("nan"))))),
    "values_inf": forged(_kv(lambda kv: kv.index_put((torch.tensor([0]),), torch.tensor(float("inf"))))),
    "values_all_zero": forged(_kv(torch.zeros_like)),
    # damaged or truncated
    "empty_file": raw(lambda d: b""),
    "truncated_to_7_bytes": raw(lambda d: d[:7]),
    "truncated_in_header": raw(lambda d: d[: 8 + header_length(d) // 2]),
    "truncated_in_data": raw(lambda d: d[: (8 + header_length(d) + len(d)) // 2]),
    "truncated_by_one_byte": raw(lambda d: d[:-1]),
    "bit_flip_in_data": raw(lambda d: flip(d, len(d) - 17)),
    "bit_flip_in_header": raw(lambda d: flip(d, 12)),
    "header_length_u64_max": raw(lambda d: (2**64 - 1).to_bytes(8, "little") + d[8:]),
    "header_length_past_the_end": raw(lambda d: (len(d) + 1).to_bytes(8, "little") + d[8:]),
    "random_bytes": raw(lambda d: os.urandom(len(d))),
    "text_file": raw(lambda d: b"this is not a cache entry\n" * 40),
    "small_junk_appended": raw(lambda d: d + b"\0" * 64),
    # oversized and sparse
    "megabyte_appended": raw(lambda d: d + b"\0" * (1 << 20)),
    "header_padded_to_10_mb": huge_header,
    "sparse_1_5_gb_of_zeros": replace_with(sparse_zeros),
    "sparse_1_5_gb_with_a_valid_header": replace_with(sparse_with_header),
    # not a regular file
    "directory": replace_with(lambda path, ctx: path.mkdir()),
    "fifo": replace_with(lambda path, ctx: os.mkfifo(path)),
    "symlink_to_dev_zero": replace_with(lambda path, ctx: path.symlink_to("/dev/zero")),
    "dangling_symlink": replace_with(lambda path, ctx: path.symlink_to(path.parent / "nowhere")),
    "symlink_to_another_entry": other_entry,
}

SIGNED_ATTACKS: dict[str, Callable] = {
    "signed_values_scaled": forged(_kv(lambda kv: kv * 1.01)),
    "signed_tokens_reversed": forged(_kv(lambda kv: kv.flip(3))),
    "signed_resigned_with_another_key": forged(_kv(lambda kv: kv * 1.01), sign=True),
    "signed_signature_removed": metadata_edit(lambda m: m.pop("signature")),
}

# (what to patch, how it fails) while the first store computes and writes DOC's entry
WRITE_FAULTS: dict[str, tuple[tuple[object, str], Callable]] = {
    "save_enospc": (("safetensors.torch", "save_file"), os_error(errno.ENOSPC)),
    "save_eio": (("safetensors.torch", "save_file"), os_error(errno.EIO)),
    "save_safetensors_error_enospc": (("safetensors.torch", "save_file"), safetensors_full),
    "replace_enospc": ((disk_module.os, "replace"), os_error(errno.ENOSPC)),
    "replace_exdev": ((disk_module.os, "replace"), os_error(errno.EXDEV)),
    "mkstemp_erofs": ((tempfile, "mkstemp"), os_error(errno.EROFS)),
    "mkstemp_edquot": ((tempfile, "mkstemp"), os_error(errno.EDQUOT)),
}

# (what to patch, how it fails) while a second store reads the entry the first one wrote
READ_FAULTS: dict[str, tuple[tuple[object, str], Callable]] = {
    "open_eio": (("safetensors", "safe_open"), os_error(errno.EIO)),
    "open_eacces": (("safetensors", "safe_open"), os_error(errno.EACCES)),
    "utime_erofs": ((disk_module.os, "utime"), os_error(errno.EROFS)),
}


# -- running one case -----------------------------------------------------------------------------------------
@dataclass
class Context:
    key: str
    token_ids: tuple[int, ...]
    other_path: Path


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def outcome(run: Callable[[], list[torch.Tensor]], reference: torch.Tensor, folder: Path) -> str:
    """Run ``run`` on a thread (so a hang is seen) and name what happened; ``handled`` is the only good one."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["kv"] = run()
        except BaseException as error:  # noqa: BLE001 - the point is to name whatever escapes
            result["error"] = error

    before = _peak_rss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = threading.Thread(target=target, daemon=True)
        worker.start()
        worker.join(HANG_S)
    if worker.is_alive():
        return "hang"
    error = result.get("error")
    if error is not None:
        return f"typed: {type(error).__name__}" if isinstance(error, CtxIntegrationsError) else \
            f"untyped: {type(error).__name__}: {error}"
    if not all(torch.equal(kv, reference) for kv in result["kv"]):
        return "silent"
    if _peak_rss() - before > MEMORY_SLACK:
        return "memory"
    if [p for p in folder.rglob(".tmp-*")]:
        return "leftover"
    categories = [w.category for w in caught]
    if any(not issubclass(c, (CorruptCacheWarning, CacheStoreWarning)) for c in categories) \
            or categories.count(CacheStoreWarning) > 1:
        return f"warnings: {[c.__name__ for c in categories]}"
    return "handled"


def _patch(monkeypatch, target: tuple[object, str], replacement: Callable) -> None:
    owner, name = target
    if isinstance(owner, str):
        monkeypatch.setattr(f"{owner}.{name}", replacement)
    else:
        monkeypatch.setattr(owner, name, replacement)


def _twice(store: KVCacheStore, layout) -> list[torch.Tensor]:
    """Ask for DOC twice (the second from wherever the first left it): both must be right."""
    first = store.document(layout, DOC).kv
    store.clear_memory()
    return [first, store.document(layout, DOC).kv]


@pytest.mark.parametrize("name", sorted(FILE_ATTACKS) + sorted(SIGNED_ATTACKS))
def test_a_damaged_or_forged_entry_is_never_served(loaded, layout, reference, tmp_path, monkeypatch, name):
    if name in SIGNED_ATTACKS:
        monkeypatch.setenv("CTX_CACHE_KEY", KEY)
    writer = KVCacheStore(loaded, tmp_path)
    entry, other = writer.document(layout, DOC), writer.document(layout, OTHER)
    path = writer.disk.path(entry.key)
    attack = FILE_ATTACKS.get(name) or SIGNED_ATTACKS[name]
    attack(path, Context(entry.key, entry.token_ids, writer.disk.path(other.key)))
    reader = KVCacheStore(loaded, tmp_path)
    assert outcome(lambda: _twice(reader, layout), reference, tmp_path) == "handled"


@pytest.mark.parametrize("name", sorted(WRITE_FAULTS))
def test_an_os_error_while_writing_keeps_the_entry_in_memory(loaded, layout, reference, tmp_path, monkeypatch, name):
    target, failure = WRITE_FAULTS[name]
    _patch(monkeypatch, target, failure)
    store = KVCacheStore(loaded, tmp_path)
    assert outcome(lambda: _twice(store, layout), reference, tmp_path) == "handled"


@pytest.mark.parametrize("name", sorted(READ_FAULTS))
def test_an_os_error_while_reading_is_a_miss(loaded, layout, reference, tmp_path, monkeypatch, name):
    KVCacheStore(loaded, tmp_path).document(layout, DOC)
    target, failure = READ_FAULTS[name]
    _patch(monkeypatch, target, failure)
    reader = KVCacheStore(loaded, tmp_path)
    assert outcome(lambda: _twice(reader, layout), reference, tmp_path) == "handled"


# -- reliability issue, items 6 and 8: entries of another format (the bug: a native engine served the int8 / fp16 /
#    bf16 entry copied into its folder, signed or not; the signature covered the key and tensors, not the format)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("kv_format", ["fp16", "bf16", "int8"])
def test_an_entry_of_another_format_copied_into_the_folder_is_never_served(loaded, layout, reference, tmp_path,
                                                                           monkeypatch, kv_format, signed):
    if signed:
        monkeypatch.setenv("CTX_CACHE_KEY", KEY)
    lossy = KVCacheStore(loaded, tmp_path / "lossy", disk_format=kv_format)
    entry = lossy.document(layout, DOC)
    exact = KVCacheStore(loaded, tmp_path / "exact")
    exact.disk.path(entry.key).parent.mkdir(parents=True, exist_ok=True)
    exact.disk.path(entry.key).write_bytes(lossy.disk.path(entry.key).read_bytes())
    assert outcome(lambda: _twice(exact, layout), reference, tmp_path) == "handled"


def test_a_signed_entry_relabelled_as_another_format_fails_its_signature(loaded, layout, tmp_path, monkeypatch):
    """An fp16 tier also reads "native" entries (those fp16 cannot hold), so a signed fp16 entry relabelled native
    passes the format check: only a signature that covers the format refuses it first."""
    monkeypatch.setenv("CTX_CACHE_KEY", KEY)
    store = KVCacheStore(loaded, tmp_path, disk_format="fp16")
    entry = store.document(layout, DOC)
    path = store.disk.path(entry.key)
    metadata_edit(lambda m: m.update(kv_format="native"))(path, Context(entry.key, entry.token_ids, path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.disk.load(entry.key, entry.token_ids) is None
    assert [w for w in caught if "signature mismatch" in str(w.message)], [str(w.message) for w in caught]
    tensors = {"kv": entry.kv.half(), "token_ids": torch.tensor(entry.token_ids)}
    assert len({signature(KEY.encode(), entry.key, tensors, kv_format) for kv_format in ("native", "fp16")}) == 2
