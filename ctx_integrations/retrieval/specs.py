"""Embedder specs: the string a store records so a reopened store rebuilds the embedder that built it.

Kept apart from ``embedders`` and ``flag`` because it names both (the embedded MiniLM and BGE-M3):
each of those two modules stays free of the other.
"""

from __future__ import annotations

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.retrieval.embedders import Embedder, TransformerEmbedder, default_embedder


def embedder_spec(embedder: Embedder) -> str:
    """The spec a store records so that ``ask`` can rebuild its embedder without being told."""
    return getattr(embedder, "spec", None) or f"custom:{embedder.name}"


def embedder_from_spec(spec: str, device: str = "cpu") -> Embedder:
    """Rebuild an embedder from a spec: ``minilm``, ``hf:<folder>`` or ``bge-m3:<hub id or folder>``."""
    kind, _, argument = spec.partition(":")
    if kind == "minilm":
        return default_embedder(device)
    if kind == "hf" and argument:
        return TransformerEmbedder(argument, device=device)
    if kind == "bge-m3" and argument:
        from ctx_integrations.retrieval.flag import BGEM3Embedder  # optional extra: imported on use

        return BGEM3Embedder(argument, device=device)
    raise InvalidOptionError(f"cannot rebuild embedder {spec!r} by name: pass the embedder object that built the "
                             "store (DocumentStore(..., embedder=...))")
