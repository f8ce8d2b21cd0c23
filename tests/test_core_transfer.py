"""The host-tier transfer helpers (``engine/core/transfer.py``) on CPU; their CUDA behaviour is in test_cuda.py."""

from __future__ import annotations

import torch

from ctx_integrations.engine.core.transfer import (
    Transfer,
    pinned_empty_like,
    prefetch,
    same_device,
    to_device_async,
    to_host,
)


def test_to_host_is_an_independent_copy_with_the_same_values_and_dtype():
    # A helper that returned a view of the source (or dropped bf16 to fp32) would let the device tier's later
    # writes leak into the host tier, or change the logits of a cache that comes back.
    kv = torch.randn(2, 2, 3, 5, 4).to(torch.bfloat16)
    moved = to_host(kv)
    assert moved.ready()
    host = moved.wait()
    assert host.dtype == torch.bfloat16 and host.device.type == "cpu" and torch.equal(host, kv)
    kv.add_(1)
    assert not torch.equal(host, kv)


def test_to_device_on_the_same_device_copies_nothing_and_prefetch_keeps_the_order():
    entries = [torch.full((2, 3), float(i)) for i in range(4)]
    same = to_device_async(entries[0], "cpu")
    assert same.wait() is entries[0] and same.ready()
    moved = [t.wait() for t in prefetch(entries, torch.device("cpu"))]
    assert [float(t[0, 0]) for t in moved] == [0.0, 1.0, 2.0, 3.0]


def test_pinned_buffers_are_pinned_exactly_when_cuda_is_usable():
    buffer = pinned_empty_like(torch.zeros(3, 4, dtype=torch.float16))
    assert buffer.shape == (3, 4) and buffer.dtype == torch.float16
    assert buffer.is_pinned() == torch.cuda.is_available()
    assert Transfer(buffer).wait() is buffer


def test_cuda_without_an_index_is_the_current_cuda_device():
    # torch says cuda != cuda:0, so a model loaded on "cuda" (tensors on cuda:0) looked like another device to IPPD's
    # device check, which then refused every request on a GPU.
    assert torch.device("cuda:0") != torch.device("cuda")
    assert same_device("cuda:0", torch.device("cuda")) and same_device("cuda", "cuda")
    assert same_device("cpu", "cpu") and not same_device("cpu", "meta") and not same_device("cpu", "cuda")
    assert not same_device("cuda:1", "cuda:0")
