"""The document type that travels from retrieval to the decoder and back out in the answer.

It is deliberately torch-free so that retrieval and framework adapters can build it cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctx_integrations.errors import EmptyDocumentsError, InvalidDocumentError, InvalidScoresError


def user_text(value: Any, where: str) -> str:
    """``value`` when it is text a tokenizer can encode; ``None``, numbers, bytes and lone surrogates are refused.

    ``str(None)`` would silently become the document "None", so nothing is coerced. Every piece of user
    text (documents, queries, chat messages) passes here before it meets a tokenizer.
    """
    if isinstance(value, bytes):
        raise InvalidDocumentError(f"{where} is bytes: decode it first (e.g. value.decode('utf-8', errors='replace'))")
    if not isinstance(value, str):
        raise InvalidDocumentError(f"{where} must be a str, got {type(value).__name__} {value!r:.60}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidDocumentError(
            f"{where} holds {value[error.start:error.end]!r} at character {error.start}, which is not valid Unicode "
            "text (a lone surrogate): decode the source with errors='replace' first") from None
    return value


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

    def __post_init__(self) -> None:
        # refused here, naming the argument, instead of as a TypeError from dict() when the document is used
        self.scores = _mapping(self.scores, "scores")
        self.metadata = _mapping(self.metadata, "metadata")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "score": self.score, "scores": dict(self.scores),
                "metadata": dict(self.metadata)}


def as_document(item: Any) -> Document:
    """Accept a str, a :class:`Document`, a mapping, or any object with ``text``/``score`` attributes."""
    if isinstance(item, Document):  # scores and metadata checked again: they may have been reassigned since
        return Document(user_text(item.text, "a Document's text"), item.id, item.score, item.scores, item.metadata)
    if isinstance(item, str):
        return Document(user_text(item, "a document"))
    if isinstance(item, Mapping):
        if "text" not in item:
            raise InvalidDocumentError(f"a document mapping needs a 'text' key, got keys {sorted(map(str, item))}")
        return Document(user_text(item["text"], "a document mapping's 'text'"), item.get("id"), item.get("score"),
                        _mapping(item.get("scores"), "scores"), _mapping(item.get("metadata"), "metadata"))
    text = getattr(item, "text", None)
    if text is None:
        raise InvalidDocumentError(f"cannot use {type(item).__name__} as a document: give a str, a Document, "
                                   "a mapping with 'text', or an object with a .text attribute")
    return Document(user_text(text, f"the .text of a {type(item).__name__}"), getattr(item, "id", None),
                    getattr(item, "score", None), _mapping(getattr(item, "scores", None), "scores"),
                    _mapping(getattr(item, "metadata", None), "metadata"))


_MAPPING_HINTS = {"scores": ": the parts of its relevance by name, e.g. {'dense': 0.8, 'rerank': 0.6} (the fused "
                           "relevance r in [0, 1] is score=)",
                 "metadata": ", e.g. {'source': 'a.txt'}"}


def _mapping(value: Any, name: str) -> dict[str, Any]:
    """A copy of a document's ``scores`` / ``metadata`` mapping (``None``: empty); anything else is refused by name."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidDocumentError(f"a document's {name} (Document({name}=...)) must be a mapping"
                                   f"{_MAPPING_HINTS[name]}; got {type(value).__name__} {value!r:.60}")
    return dict(value)


def prepare_documents(documents: Sequence[Any], scores: Sequence[float] | None = None) -> list[Document]:
    """Validate documents and attach relevance scores.

    Scores come from ``scores`` when given, else from each document's own ``score``; a document
    with neither gets r = 1 (no prior), so a user without a retriever still gets plain PCED.
    """
    if isinstance(documents, (str, bytes)) or documents is None:
        raise EmptyDocumentsError("documents must be a list of texts or Document objects, not a single string")
    if isinstance(documents, (Mapping, Document)):  # iterating a dict would give its keys as documents
        raise InvalidDocumentError(f"documents must be a list of documents, got one {type(documents).__name__}: "
                                   "wrap it in a list ([document])")
    try:
        items = list(documents)
    except TypeError:
        raise InvalidDocumentError(f"documents must be a list of texts or Document objects, got "
                                   f"{type(documents).__name__}") from None
    docs = []
    for i, item in enumerate(items):
        try:
            docs.append(as_document(item))
        except InvalidDocumentError as error:
            raise InvalidDocumentError(f"document {i}: {error}") from None
    if not docs:
        raise EmptyDocumentsError("no documents were given: pass at least one document (did retrieval return nothing?)")
    for i, doc in enumerate(docs):
        if not doc.text.strip():
            raise EmptyDocumentsError(f"document {i} (id={doc.id!r}) has empty text: drop it before decoding")
    if scores is not None:
        if isinstance(scores, (str, bytes, Mapping)):
            raise InvalidScoresError(f"scores must be a list of numbers, got {type(scores).__name__}")
        try:
            scores = list(scores)
        except TypeError:
            raise InvalidScoresError(f"scores must be a list of numbers, got {type(scores).__name__}") from None
        if len(scores) != len(docs):
            raise InvalidScoresError(f"got {len(scores)} scores for {len(docs)} documents: give one score per document")
        for doc, s in zip(docs, scores):
            doc.score = s
    for i, doc in enumerate(docs):
        if doc.score is None:
            doc.score = 1.0
        if isinstance(doc.score, (bool, str, bytes)):
            raise InvalidScoresError(f"score of document {i} is {doc.score!r}, not a number")
        try:
            doc.score = float(doc.score)
        except (TypeError, ValueError, OverflowError):
            raise InvalidScoresError(f"score of document {i} is {doc.score!r}, not a number") from None
        if not 0.0 <= doc.score <= 1.0 or doc.score != doc.score:
            raise InvalidScoresError(
                f"score of document {i} is {doc.score}, outside [0, 1]: normalise retrieval scores first "
                "(see ctx_integrations.retrieval.scores) or pass scores=None")
    return docs
