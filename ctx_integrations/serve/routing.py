"""Cache affinity: which replica most likely holds a request's document KV caches.

Written by hand because it is a dozen lines on top of Ray Serve's router: a consistent-hash ring
(``vnodes`` points per replica on a 64-bit ring) maps each document's *content* (the KV store is
keyed by content, not by id) to the replica that owns it, and a request goes to the replica owning
the largest share of its documents' text. Adding or removing a replica moves only the documents
whose arc changed owner, so the other replicas' in-memory caches stay valid.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over replica names."""

    def __init__(self, nodes: Iterable[str], vnodes: int = 64):
        self.nodes = sorted(set(nodes))
        points = sorted((_point(f"{node}#{v}"), node) for node in self.nodes for v in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def owner(self, key: str) -> str:
        """The node owning ``key``: the first point clockwise from the key's hash."""
        if not self.nodes:
            raise ValueError("the ring has no nodes")
        index = bisect.bisect(self._keys, _point(key)) % len(self._keys)
        return self._owners[index]


def job_documents(job: Any) -> list[str]:
    """The document texts of a job (answer or batch, shared or per-question lists); none for a chat."""
    if not isinstance(job, dict):
        return []
    texts: list[str] = []

    def visit(item: Any) -> None:
        if isinstance(item, dict) and "text" in item:
            texts.append(str(item["text"]))
        elif isinstance(item, str):
            texts.append(item)
        elif isinstance(item, (list, tuple)):
            for inner in item:
                visit(inner)

    visit(job.get("documents") or [])
    return texts


def affinity_ranking(ring: HashRing, texts: Sequence[str]) -> list[str]:
    """Nodes ordered by how much of ``texts`` (in characters) they own; nodes owning none are left out."""
    share: dict[str, int] = {}
    for text in dict.fromkeys(texts):
        node = ring.owner(text)
        share[node] = share.get(node, 0) + len(text)
    return sorted(share, key=lambda n: (-share[n], n))
