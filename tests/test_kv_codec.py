"""Entries at rest in 16 bits or KIVI int8: round trips, the quantisation axes, bytes per token, the disk tier."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ctx_integrations.engine.core import kv_codec
from ctx_integrations.engine.core.cache import KVCacheStore
from ctx_integrations.engine.core.disk import checksum
from ctx_integrations.engine.core.kv_shape import kv_shape
from ctx_integrations.engine.core.prepared import PreparedTexts
from ctx_integrations.errors import CorruptCacheWarning, InvalidOptionError
from tests.helpers import tiny_loaded

DOC = "Marrowgate has three bridges over the river Ast; the oldest was built in 1621."
SHAPE = (3, 2, 2, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]


def _entry(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _round_trip(kv: torch.Tensor, kv_format: str) -> torch.Tensor:
    return kv_codec.decode(kv_codec.encode(kv, kv_format), kv_format, torch.float32, "cpu")


@pytest.mark.parametrize(("kv_format", "tolerance"), [("native", 0.0), ("fp16", 2e-3), ("bf16", 2e-2), ("int8", 3e-2)])
def test_round_trip_error_is_the_format_rounding(kv_format, tolerance):
    kv = _entry()
    before = kv.clone()
    back = _round_trip(kv, kv_format)
    assert torch.equal(kv, before)  # the input is never edited in place
    assert back.dtype == torch.float32 and back.shape == kv.shape
    error = (back - kv).abs().max().item()
    assert error <= tolerance * kv.abs().max().item()
    if kv_format != "native":
        assert error > 0  # a lossy format that stored the exact tensor would be a format that saves nothing


def test_int8_error_is_within_half_a_step_of_each_slice():
    kv = _entry(1)
    stored = kv_codec.encode(kv, "int8")
    back = _round_trip(kv, "int8")
    key_step, value_step = stored["key_scale"].float(), stored["value_scale"].float()
    assert ((back[:, 0] - kv[:, 0]).abs() <= key_step * 0.5 + 1e-5).all()  # codes use the stored (fp16) scale
    assert ((back[:, 1] - kv[:, 1]).abs() <= value_step * 0.5 + 1e-5).all()


def test_keys_are_quantised_per_channel_and_values_per_token():
    """KIVI's axes: an outlier key *channel* or an outlier value *token* costs the other slices nothing.

    Swapping the axes (keys per token, values per channel) would give every slice the outlier's step.
    """
    kv = _entry(2)
    kv[:, 0, :, :, 0] *= 200  # one outlier key channel
    kv[:, 1, :, 7, :] *= 200  # one outlier value token
    back = _round_trip(kv, "int8")
    typical = kv[:, 0, :, :, 1:].abs().max().item()
    assert (back[:, 0, :, :, 1:] - kv[:, 0, :, :, 1:]).abs().max().item() < typical / 100
    others = torch.cat([kv[:, 1, :, :7], kv[:, 1, :, 8:]], dim=2)
    back_others = torch.cat([back[:, 1, :, :7], back[:, 1, :, 8:]], dim=2)
    assert (back_others - others).abs().max().item() < others.abs().max().item() / 100


def test_int8_bytes_per_token_are_about_a_quarter_of_fp32():
    layers, _, heads, tokens, dim = SHAPE
    stored = kv_codec.encode(_entry(), "int8")
    per_entry = sum(stored[name].nbytes for name in ("key_scale", "key_min"))
    per_token = (sum(t.nbytes for t in stored.values()) - per_entry) / tokens
    assert per_token == kv_codec.bytes_per_token(layers, heads, dim, "int8", torch.float32)
    fp32 = kv_codec.bytes_per_token(layers, heads, dim, "native", torch.float32)
    assert fp32 == layers * 2 * heads * dim * 4
    assert kv_codec.bytes_per_token(layers, heads, dim, "bf16", torch.float32) == fp32 / 2
    # a quarter, plus the values' fp16 scale and minimum (4 bytes) per token of each layer and head
    assert per_token / fp32 == pytest.approx(0.25 + 4 / (2 * dim * 4))


def test_constant_slices_decode_exactly():
    kv = torch.full(SHAPE, 0.5)
    assert torch.equal(_round_trip(kv, "int8"), kv)


@pytest.mark.parametrize("bad", ["int4", None, "", "FP16"])
def test_unknown_formats_are_refused_by_name(bad):
    with pytest.raises(InvalidOptionError, match="kv_format must be one of native, fp16, bf16, int8"):
        kv_codec.check_format(bad)


# -- the disk tier --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


@pytest.fixture(scope="module")
def layout(loaded):
    from ctx_integrations.engine.core.layout import PromptLayout

    return PromptLayout(loaded.tokenizer)


def _files(folder):
    return sorted(p for p in folder.rglob("*.safetensors") if not p.name.startswith(".tmp"))


@pytest.mark.parametrize("kv_format", ["fp16", "bf16", "int8"])
def test_disk_entries_read_back_as_the_format_rounds_them(loaded, layout, tmp_path, kv_format):
    exact = KVCacheStore(loaded, tmp_path / "native").document(layout, DOC)
    KVCacheStore(loaded, tmp_path / "lossy", disk_format=kv_format).document(layout, DOC)
    reader = KVCacheStore(loaded, tmp_path / "lossy", disk_format=kv_format)
    reloaded = reader.document(layout, DOC)
    assert (reader.stats.disk_hits, reader.stats.misses) == (1, 0)
    assert reloaded.kv.dtype == loaded.dtype
    torch.testing.assert_close(reloaded.kv, _round_trip(exact.kv, kv_format), rtol=0, atol=1e-6)
    shape = kv_shape(loaded.model.config)
    ratio = (kv_codec.bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, kv_format, loaded.dtype)
             / kv_codec.bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, "native", loaded.dtype))
    native_bytes, lossy_bytes = (sum(p.stat().st_size for p in _files(tmp_path / name)) for name in ("native", "lossy"))
    assert lossy_bytes < native_bytes * (ratio + 0.1)  # + headers and token ids


def test_a_lossy_format_keeps_a_folder_of_its_own(loaded, layout, tmp_path):
    """An engine that stores exact entries must never be served another engine's rounded ones for the same key."""
    KVCacheStore(loaded, tmp_path, disk_format="int8").document(layout, DOC)
    exact = KVCacheStore(loaded, tmp_path)
    exact.document(layout, DOC)
    assert (exact.stats.hits, exact.stats.misses) == (0, 1)
    folders = sorted({p.parent.parent.name for p in _files(tmp_path)})
    assert len(folders) == 2 and folders[1] == folders[0] + "-int8"


def test_half_on_disk_is_fp16_and_contradictions_are_refused(loaded, tmp_path):
    assert KVCacheStore(loaded, tmp_path, half_on_disk=True).disk_format == "fp16"
    with pytest.raises(InvalidOptionError, match="half_on_disk"):
        KVCacheStore(loaded, tmp_path, half_on_disk=True, disk_format="int8")
    with pytest.raises(InvalidOptionError, match="disk_format must be one of native, fp16, bf16, int8, got 'int4'"):
        KVCacheStore(loaded, tmp_path, disk_format="int4")  # named by its keyword (it said kv_format)
    with pytest.raises(InvalidOptionError, match="host_format must be one of"):
        KVCacheStore(loaded, tmp_path, host_format="int4")


def _rewrite(path, change):
    with safe_open(str(path), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    tensors = change(tensors)
    metadata["checksum"] = checksum(tensors)  # a forger without the signing key can recompute the checksum
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("change", [
    lambda t: {**t, "value_scale": -t["value_scale"]},
    lambda t: {**t, "key_scale": t["key_scale"][:, :, :, :-1].contiguous()},
    lambda t: {**t, "kv_codes": t["kv_codes"].to(torch.int16)},
    lambda t: {k: v for k, v in t.items() if k != "value_min"},
    lambda t: {**t, "kv": torch.ones(3)},
], ids=["negative-scale", "key-scale-shape", "codes-dtype", "missing-tensor", "extra-tensor"])
def test_a_malformed_int8_entry_is_discarded_and_recomputed(loaded, layout, tmp_path, change):
    writer = KVCacheStore(loaded, tmp_path, disk_format="int8")
    writer.document(layout, DOC)
    _rewrite(writer.disk.path(writer.entry_key(layout, layout.context_ids(DOC))), change)
    store = KVCacheStore(loaded, tmp_path, disk_format="int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.document(layout, DOC)
    assert any(issubclass(w.category, CorruptCacheWarning) for w in caught)
    assert (store.stats.corrupt, store.stats.misses) == (1, 1)


# -- the host tier --------------------------------------------------------------------------------------
HOST_DOCS = ["Marrowgate is the capital of Veloria.", "The mayor of Marrowgate is Ilsa Brenn.",
             "The Lantern Fair is held every October in the harbour district.", "The vault code is 4721."]


def test_an_int8_host_tier_holds_about_four_times_the_entries_and_returns_them_rounded(loaded, layout):
    exact = [e.kv for e in KVCacheStore(loaded).documents(layout, HOST_DOCS)]
    native = KVCacheStore(loaded, memory_bytes=0, host_bytes=1 << 30)
    native.documents(layout, HOST_DOCS)
    quantised = KVCacheStore(loaded, memory_bytes=0, host_bytes=1 << 30, host_format="int8")
    quantised.documents(layout, HOST_DOCS)
    # held encoded, not widened: a quarter, plus the keys' per-entry scales (large beside 10-token entries)
    assert quantised.host_used == sum(sum(t.nbytes for t in kv_codec.encode(kv, "int8").values())
                                      for kv in [KVCacheStore(loaded).prefix(layout).kv, *exact])
    assert quantised.host_used < native.host_used * 0.35
    again = quantised.documents(layout, HOST_DOCS)
    assert (quantised.stats.host_hits, quantised.stats.misses) == (len(HOST_DOCS), len(HOST_DOCS))
    for entry, kv in zip(again, exact):
        assert entry.kv.dtype == loaded.dtype
        torch.testing.assert_close(entry.kv, _round_trip(kv, "int8"), rtol=0, atol=1e-6)
        assert not torch.equal(entry.kv, kv)
    # within one budget the quantised tier keeps every entry where the native one keeps only the last ones
    budget = quantised.host_used
    small = KVCacheStore(loaded, memory_bytes=0, host_bytes=budget)
    small.documents(layout, HOST_DOCS)
    assert not small.contains(layout, HOST_DOCS[0])
    assert all(quantised.contains(layout, document) for document in HOST_DOCS)


def test_prefetch_through_an_int8_host_tier_serves_rounded_entries(loaded, layout, tmp_path):
    KVCacheStore(loaded, tmp_path).documents(layout, HOST_DOCS)
    store = KVCacheStore(loaded, tmp_path, memory_bytes=0, host_bytes=1 << 30, host_format="int8")
    store.prefetch(PreparedTexts(layout, store).prepare_all(HOST_DOCS))
    assert 0 < store.host_used and store.memory_used == 0
    exact = KVCacheStore(loaded, tmp_path).documents(layout, HOST_DOCS)
    served = store.documents(layout, HOST_DOCS)
    assert (store.stats.host_hits, store.stats.disk_hits, store.stats.misses) == (len(HOST_DOCS), 0, 0)
    for entry, reference in zip(served, exact):
        torch.testing.assert_close(entry.kv, _round_trip(reference.kv, "int8"), rtol=0, atol=1e-6)


def test_int8_keeps_half_a_step_where_a_slice_is_far_from_zero():
    """A key channel at +-300 with a spread of 0.5: fp16 cannot hold its minimum exactly (spacing 0.25 there).

    A minimum rounded to the nearest fp16 value instead of down would put values below the grid (clamped to
    code 0) with errors of up to an eighth, a hundred times the half step.
    """
    kv = _entry(3) * 0.1
    kv[:, 0, :, :, 0] += 300.0
    kv[:, 1, :, 5, :] -= 300.0
    stored = kv_codec.encode(kv, "int8")
    back = _round_trip(kv, "int8")
    assert ((back[:, 0] - kv[:, 0]).abs() <= stored["key_scale"].float() * 0.5 + 1e-4).all()
    assert ((back[:, 1] - kv[:, 1]).abs() <= stored["value_scale"].float() * 0.5 + 1e-4).all()


def test_int8_computes_in_fp32_whatever_the_entry_dtype():
    # a bf16 entry (a GPU's) quantised in bf16 would place values on bf16's coarse grid before rounding to codes
    kv = (_entry(4) + 40.0).to(torch.bfloat16)
    stored = kv_codec.encode(kv, "int8")
    back = kv_codec.decode(stored, "int8", torch.float32, "cpu")
    assert ((back[:, 1] - kv[:, 1].float()).abs() <= stored["value_scale"].float() * 0.5 + 1e-4).all()
    assert kv_codec.decode(stored, "int8", torch.bfloat16, "cpu").dtype == torch.bfloat16


def _stored(**changes):
    stored = kv_codec.encode(_entry(), "int8")
    return {**stored, **{name: change(stored[name]) for name, change in changes.items()}}


@pytest.mark.parametrize(("changes", "message"), [
    ({"kv_codes": lambda t: t[:, :1].contiguous()}, "not uint8 \\[layers, 2, heads, tokens, dim\\]"),
    ({"kv_codes": lambda t: t.to(torch.int16)}, "not uint8"),
    ({"kv_codes": lambda t: t[0]}, "not uint8"),
    ({"key_scale": lambda t: t.float()}, "key_scale of dtype torch.float32 .* not torch.float16"),
    ({"value_min": lambda t: t[:, :, :-1].contiguous()},
     "value_min of dtype torch.float16 and shape \\(3, 2, 39, 1\\)"),
    ({"value_scale": lambda t: torch.zeros_like(t)}, "not positive and finite"),
    ({"key_scale": lambda t: torch.full_like(t, torch.inf)}, "not positive and finite"),
])
def test_check_stored_names_each_malformation(changes, message):
    assert kv_codec.check_stored(_stored(), "int8", torch.float32) is None
    problem = kv_codec.check_stored(_stored(**changes), "int8", torch.float32)
    assert problem is not None and re.search(message, problem), problem



def test_an_entry_fp16_cannot_hold_is_stored_exact_instead_of_as_inf(loaded, layout, tmp_path):
    """A value beyond 65504 is inf in fp16: written so, the entry would fail the finite check on every load
    and be recomputed forever (found while measuring the formats with benchmarks/kv_formats.py)."""
    ids = tuple(layout.context_ids(DOC))
    big = KVCacheStore(loaded).document(layout, DOC).kv.clone()
    big[0, 0, 0, 0, 0] = 7e4
    store = KVCacheStore(loaded, tmp_path, disk_format="fp16")
    key = store.entry_key(layout, ids)
    store.disk.save(key, ids, big)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCacheWarning)
        back = store.disk.load(key, ids)
    assert back is not None and torch.equal(back, big) and store.stats.corrupt == 0
    assert kv_codec.storable_format(big, "fp16") == "native"
    assert kv_codec.storable_format(big, "bf16") == "bf16" and kv_codec.storable_format(big / 2, "fp16") == "fp16"


def test_a_tier_reads_its_own_format_and_fp16_also_its_native_fallback():
    assert kv_codec.readable_formats("fp16") == ("fp16", "native")
    assert [kv_codec.readable_formats(f) for f in ("native", "bf16", "int8")] == [("native",), ("bf16",), ("int8",)]


def test_each_format_stores_its_own_dtype():
    assert kv_codec.stored_dtype("native", torch.bfloat16) == torch.bfloat16
    assert kv_codec.stored_dtype("native", torch.float32) == torch.float32
    assert kv_codec.stored_dtype("fp16", torch.float32) == torch.float16
    assert kv_codec.stored_dtype("bf16", torch.float32) == torch.bfloat16
    assert kv_codec.stored_dtype("int8", torch.float32) is None


@pytest.mark.parametrize("kv_format", ["native", "fp16", "bf16"])
def test_check_stored_refuses_a_kv_tensor_of_another_formats_dtype(kv_format):
    """An fp32 ``kv`` labelled fp16 (or a bf16 one labelled native) is not that format's entry, whatever its label."""
    stored = kv_codec.encode(_entry(), kv_format)
    assert kv_codec.check_stored(stored, kv_format, torch.float32) is None
    for other in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        wanted = kv_codec.stored_dtype(kv_format, torch.float32)
        problem = kv_codec.check_stored({"kv": stored["kv"].to(other)}, kv_format, torch.float32)
        expected = None if other == wanted else f"kv of dtype {other}, but a {kv_format!r} entry stores {wanted}"
        assert problem == expected
