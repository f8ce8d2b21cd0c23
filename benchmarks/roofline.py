"""Bytes a decoder reads, memory it needs, and how close a decode step comes to the memory-bandwidth limit.

A batch-1 decode step of a transformer is memory-bound: it reads every weight once (the input embedding
excepted: a lookup reads one row per token) and every cached key and value once, and does little
arithmetic per byte. So the fastest a step can be is ``bytes per step / memory bandwidth``, and a
measured rate divided by that limit (the *roofline fraction*) says how much of the GPU a decode loop
uses; the rest is launch overhead, host work between steps, and kernels below peak bandwidth.

- :func:`param_count`, :func:`weight_bytes`, :func:`kv_bytes_per_token`: from a Llama-style shape
  (the ``transformers.LlamaConfig`` fields), so docs/gpu.md's memory table is computed, not typed;
- :func:`weights_read_per_step`: the same from a built model (what ``benchmarks/gpu.py`` measures);
- :func:`decode_step_bytes`, :func:`roofline_fraction`: the arithmetic of the roofline;
- :func:`measure_bandwidth`: device-to-device copy bandwidth measured in the run, and
  :func:`spec_bandwidth`: the datasheet figure when the device's name is one we know.

Written by hand: this is a few lines of arithmetic over the config, not worth a dependency.
``python benchmarks/roofline.py`` prints the memory table of docs/gpu.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

# Datasheet memory bandwidth (bytes/s) by the name torch reports (torch.cuda.get_device_name), longest match
# first. NVIDIA's product pages: H200 (SXM and NVL) 4.8 TB/s; H100 SXM 3.35, NVL 3.9, PCIe 2.0; A100 80GB SXM
# 2.039, 80GB PCIe 1.935, 40GB 1.555; L40S 0.864; L4 0.3.
SPEC_BANDWIDTH: dict[str, float] = {
    "H200": 4.8e12,
    "H100 80GB HBM3": 3.35e12,  # the SXM card's name
    "H100 SXM": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100-SXM4-40GB": 1.555e12,
    "A100-PCIE-40GB": 1.555e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def head_dim(shape: Mapping[str, Any]) -> int:
    return int(shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"])


def param_count(shape: Mapping[str, Any], tied: bool) -> int:
    """Parameters of a Llama-style decoder: embeddings, per layer q/k/v/o + gated MLP + two norms, final norm.

    ``tied``: the output projection shares the input embedding (Llama-3.2-1B does, Llama-3.1-8B does not).
    """
    hidden, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads, kv_heads, dim = shape["num_attention_heads"], shape["num_key_value_heads"], head_dim(shape)
    attention = hidden * heads * dim * 2 + hidden * kv_heads * dim * 2  # q and o, k and v (no biases)
    mlp = 3 * hidden * shape["intermediate_size"]  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # + input and post-attention RMSNorm weights
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + embeddings + hidden


def weight_bytes(shape: Mapping[str, Any], tied: bool, dtype_bytes: int) -> int:
    return param_count(shape, tied) * dtype_bytes


def kv_bytes_per_token(shape: Mapping[str, Any], dtype_bytes: int) -> int:
    """One token's keys and values in every layer: layers x 2 x kv_heads x head_dim x dtype bytes."""
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim(shape) * dtype_bytes


def weights_read_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter, less an untied input embedding (a row lookup)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() lists a tied one once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is not None and output.weight is embedding:
        return total
    return total - embedding.numel() * embedding.element_size()


def decode_step_bytes(weights: int, kv_per_token: int, cached_tokens: Iterable[int]) -> int:
    """Bytes one decode step must read: the weights once plus every row's cached tokens' keys and values."""
    return weights + kv_per_token * sum(cached_tokens)


def roofline_fraction(steps_per_s: float, bytes_per_step: float, bandwidth: float) -> float:
    """Measured steps/s over the bandwidth limit ``bandwidth / bytes_per_step`` (1.0: every byte at full speed)."""
    if bandwidth <= 0 or bytes_per_step <= 0:
        raise ValueError(f"bandwidth and bytes per step must be > 0, got {bandwidth} and {bytes_per_step}")
    return steps_per_s * bytes_per_step / bandwidth


def spec_bandwidth(device_name: str | None) -> float | None:
    """The datasheet bandwidth of a device torch names ``device_name`` (None when it is not in the table)."""
    if not device_name:
        return None
    for key in sorted(SPEC_BANDWIDTH, key=len, reverse=True):
        if key in device_name:
            return SPEC_BANDWIDTH[key]
    return None


def measure_bandwidth(device: torch.device, megabytes: int = 2048, copies: int = 10) -> float:
    """Bytes/s of a large same-device copy (each copy reads and writes ``megabytes``: 2x the bytes moved).

    That is the figure a memory-bound kernel can reach in practice (typically 85-92% of the datasheet's on
    HBM). On CPU (the dry run) it measures host memory with whatever size is given.
    """
    count = megabytes << 20
    source = torch.empty(count, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch, allocation
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(copies):
        target.copy_(source)
    sync()
    seconds = time.perf_counter() - start
    del source, target
    return 2 * count * copies / seconds


# -- docs/gpu.md's memory table ---------------------------------------------------------------------
# The published configs (config.json of meta-llama/Llama-3.1-8B and Llama-3.2-1B), with their tying.
PUBLISHED = {
    "Llama-3.1-8B": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}, False),
    "Llama-3.2-1B": ({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}, True),
}
GIB = 1 << 30
POOL_BLOCK = 512  # the row pool's capacity grows by whole 512-column blocks (docs/scheduler.md)


def memory_rows(documents: Iterable[int] = (8, 16, 32, 64), doc_tokens: int = 2048, dtype: str = "bfloat16",
                prompt_tokens: int = 512) -> list[dict[str, Any]]:
    """GiB of weights and KV per model and document count, for one warm PCED request.

    ``kv_documents``: the documents' caches once (what the memory tier stores); ``kv_rows``: the row pool's
    copy while the request runs, N + 1 rows (one per document and the no-context row) of ``doc_tokens`` plus
    the prompt's own tokens and the answer (``prompt_tokens`` at most), rounded up to whole 512-column
    blocks; ``total``: weights + both (activations not included).
    """
    size = DTYPE_BYTES[dtype]
    out = []
    for model, (shape, tied) in PUBLISHED.items():
        weights = weight_bytes(shape, tied, size)
        per_token = kv_bytes_per_token(shape, size)
        row_columns = -(-(doc_tokens + prompt_tokens) // POOL_BLOCK) * POOL_BLOCK
        for n in documents:
            stored = n * doc_tokens * per_token
            rows = (n + 1) * row_columns * per_token
            out.append({"model": model, "documents": n, "weights_gib": weights / GIB,
                        "kv_per_token_kib": per_token / 1024, "kv_documents_gib": stored / GIB,
                        "kv_rows_gib": rows / GIB, "total_gib": (weights + stored + rows) / GIB})
    return out


def memory_table(rows: list[dict[str, Any]] | None = None, doc_tokens: int = 2048) -> str:
    """docs/gpu.md's table (Markdown) of :func:`memory_rows`."""
    rows = memory_rows(doc_tokens=doc_tokens) if rows is None else rows
    lines = [f"| model | documents x {doc_tokens} | weights (GiB) | KV per token (KiB) | documents' KV (GiB) | "
             "pool rows while answering (GiB) | total (GiB) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['documents']} | {r['weights_gib']:.1f} | {r['kv_per_token_kib']:.0f} | "
              f"{r['kv_documents_gib']:.1f} | {r['kv_rows_gib']:.1f} | {r['total_gib']:.1f} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(memory_table())
