"""The document type that travels from retrieval to the decoder and back out in the answer.

It is deliberately torch-free so that retrieval and framework adapters can build it cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctx_integrations.errors import EmptyDocumentsError, InvalidScoresError


@dataclass
class Document:
    """A retrieved passage with every score that was computed for it.

    ``score`` is the fused relevance r in [0, 1] that decoding uses as a prior;
    ``scores`` keeps every raw and normalised part (dense, sparse, reranker, ...).
    """

    text: str
    id: str | None = None
    score: float | None = None
    scores: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "score": self.score, "scores": dict(self.scores),
                "metadata": dict(self.metadata)}


def as_document(item: Any) -> Document:
    """Accept a str, a :class:`Document`, a mapping, or any object with ``text``/``score`` attributes."""
    if isinstance(item, Document):
        return Document(item.text, item.id, item.score, dict(item.scores), dict(item.metadata))
    if isinstance(item, str):
        return Document(item)
    if isinstance(item, Mapping):
        return Document(str(item["text"]), item.get("id"), item.get("score"), dict(item.get("scores") or {}),
                        dict(item.get("metadata") or {}))
    text = getattr(item, "text", None)
    if text is None:
        raise EmptyDocumentsError(f"cannot use {type(item).__name__} as a document: give a str, a Document, "
                                  "a mapping with 'text', or an object with a .text attribute")
    return Document(str(text), getattr(item, "id", None), getattr(item, "score", None),
                    dict(getattr(item, "scores", None) or {}), dict(getattr(item, "metadata", None) or {}))


def prepare_documents(documents: Sequence[Any], scores: Sequence[float] | None = None) -> list[Document]:
    """Validate documents and attach relevance scores.

    Scores come from ``scores`` when given, else from each document's own ``score``; a document
    with neither gets r = 1 (no prior), so a user without a retriever still gets plain PCED.
    """
    if isinstance(documents, (str, bytes)) or documents is None:
        raise EmptyDocumentsError("documents must be a list of texts or Document objects, not a single string")
    docs = [as_document(d) for d in documents]
    if not docs:
        raise EmptyDocumentsError("no documents were given: pass at least one document (did retrieval return nothing?)")
    for i, doc in enumerate(docs):
        if not doc.text.strip():
            raise EmptyDocumentsError(f"document {i} (id={doc.id!r}) has empty text: drop it before decoding")
    if scores is not None:
        scores = list(scores)
        if len(scores) != len(docs):
            raise InvalidScoresError(f"got {len(scores)} scores for {len(docs)} documents: give one score per document")
        for doc, s in zip(docs, scores):
            doc.score = s
    for i, doc in enumerate(docs):
        if doc.score is None:
            doc.score = 1.0
        try:
            doc.score = float(doc.score)
        except (TypeError, ValueError):
            raise InvalidScoresError(f"score of document {i} is {doc.score!r}, not a number") from None
        if not 0.0 <= doc.score <= 1.0 or doc.score != doc.score:
            raise InvalidScoresError(
                f"score of document {i} is {doc.score}, outside [0, 1]: normalise retrieval scores first "
                "(see ctx_integrations.retrieval.scores) or pass scores=None")
    return docs
