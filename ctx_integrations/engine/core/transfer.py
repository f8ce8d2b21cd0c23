"""Moving KV caches between the device and a pinned host tier without stalling the decode loop.

A copy from pageable host memory to the GPU is synchronous and staged through a bounce buffer; from
page-locked (pinned) memory it is a DMA that can run on a side CUDA stream while the default stream
keeps computing. So the host tier keeps its entries pinned (:func:`to_host`), and a request about
to run prefetches its entries with :func:`to_device_async`; the copies are waited on (on the GPU,
not the CPU) only where the tensors are first used (:meth:`Transfer.wait`).

Without CUDA everything degrades to plain synchronous copies with the same API, so callers have one
code path (and the CPU tests check the bookkeeping). torch offers the primitives (``pin_memory``,
``non_blocking``, streams, events) but no such helper, hence this small module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _cuda_usable() -> bool:
    return torch.cuda.is_available()


@dataclass
class Transfer:
    """A tensor whose copy may still be in flight, with the CUDA event that marks its end (``None``: done)."""

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None

    def ready(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """The tensor, safe to use on the current stream: the stream (not the CPU) waits for the copy."""
        if self.event is not None:
            if self.tensor.device.type == "cuda":
                torch.cuda.current_stream(self.tensor.device).wait_event(self.event)
            else:  # a device-to-host copy: the CPU itself is about to read it
                self.event.synchronize()
            self.event = None
        return self.tensor


def pinned_empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor shaped like ``tensor``, page-locked when CUDA is usable."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=_cuda_usable())


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in page-locked memory when CUDA is usable (a copy unless it already is), else itself."""
    return tensor.pin_memory() if _cuda_usable() and not tensor.is_pinned() else tensor


def to_host(kv: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Transfer:
    """Copy ``kv`` into a new pinned host tensor; from the GPU the copy runs asynchronously on ``stream``.

    The source must stay alive and unmodified until the transfer is waited on (the host tier owns it).
    """
    host = pinned_empty_like(kv)
    if kv.device.type != "cuda":
        host.copy_(kv)
        return Transfer(host)
    stream = stream or _side_stream(kv.device)
    stream.wait_stream(torch.cuda.current_stream(kv.device))  # kv was written on the current stream
    with torch.cuda.stream(stream):
        host.copy_(kv, non_blocking=True)
        kv.record_stream(stream)  # keep the caching allocator from reusing kv's memory before the copy ends
        event = torch.cuda.Event()
        event.record(stream)
    return Transfer(host, event)


def to_device_async(kv: torch.Tensor, device: torch.device | str, stream: torch.cuda.Stream | None = None) -> Transfer:
    """Start copying host tensor ``kv`` to ``device`` on a side stream; ``.wait()`` before using the result.

    ``kv`` should be pinned (from :func:`to_host` or :func:`pinned_empty_like`): from pageable memory
    the copy is still correct but synchronous. On the same device nothing is copied (like ``Tensor.to``).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if kv.device == device:
        return Transfer(kv)
    if device.type != "cuda":
        return Transfer(kv.to(device))
    stream = stream or _side_stream(device)
    with torch.cuda.stream(stream):
        out = kv.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    out.record_stream(torch.cuda.current_stream(device))  # it is used on the current stream after wait()
    return Transfer(out, event)


def prefetch(entries: list[torch.Tensor], device: torch.device | str) -> list[Transfer]:
    """:func:`to_device_async` for every entry, all on one side stream (they queue behind each other)."""
    device = torch.device(device)
    stream = _side_stream(device) if device.type == "cuda" else None
    return [to_device_async(kv, device, stream) for kv in entries]


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per GPU, created on first use."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are the same, ``cuda`` meaning the current CUDA device (``cuda`` != ``cuda:0`` in torch).

    A model loaded on ``torch.device("cuda")`` holds tensors on ``cuda:0``; comparing the two with ``==``
    says they differ.
    """
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
