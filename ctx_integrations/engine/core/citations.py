"""Sentence-level citations from an answer's per-token attribution.

Each generated token has *sources*: the documents it is attributed to (none when it came from the
context-free stream or the mode cannot tell). A sentence cites every document whose share of the
sentence's content tokens (tokens with a letter or digit that are not stop words) is at least
``threshold``; a sentence with no content token is judged on all of its tokens. Sources come from:

* the trace (``Answer.trace[i].document``): PCED's and Soft-NBCE's winning expert, ``single``'s top
  document, APE's document block with the most attention mass (recorded by default on the eager kernel);
* RAPID (``extra["drafted_tokens"]`` and ``extra["chunks"]``): an accepted drafted token comes from
  the drafter's retrieved chunks, so it cites their documents; a token the target chose cites
  nothing specific (the target read every document);
* IPPD (``extra["attribution"] == "context"``): every token is attributed to the question's context.

A token may have several sources and counts fully for each, so a question's whole context is cited
as a whole rather than diluted below the threshold. Written by hand: no library turns a decoding
trace into citations.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ctx_integrations.errors import InvalidOptionError

DEFAULT_THRESHOLD = 0.25
STOPWORDS = frozenset("""a an the and or but of to in on at by for with from as is are was were be been being it its
this that these those he she they them his her their i you we our your who whom which what when where why how
do does did not no yes so than then there here also has have had will would can could may might shall should
about into over after before based documents document query answer""".split())
_PUNCTUATION = string.punctuation + "\u201c\u201d\u2019\u2018"


@dataclass(frozen=True)
class SentenceCitation:
    """One sentence of an answer and the documents it cites.

    ``start`` / ``end``: its token span ``[start, end)`` in ``Answer.token_ids``. ``documents``: cited
    document indices, largest share first. ``shares``: every attributed document's share of the
    sentence's content tokens (cited or not).
    """

    text: str
    start: int
    end: int
    documents: tuple[int, ...]
    shares: dict[int, float]


def is_content(piece: str) -> bool:
    """Whether a token's text carries content: it has a letter or digit and is not a stop word."""
    word = piece.strip().strip(_PUNCTUATION).lower()
    return any(ch.isalnum() for ch in word) and word not in STOPWORDS


def sentence_spans(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Token spans of sentences: a sentence ends after a token ending in . ! ? (followed by whitespace or the
    end, so "3.5" does not split) or containing a newline."""
    spans, start = [], 0
    for i, piece in enumerate(pieces):
        following = pieces[i + 1] if i + 1 < len(pieces) else ""
        ends = piece.rstrip().endswith((".", "!", "?")) and (not following or following[:1].isspace())
        if ends or "\n" in piece:
            if any(p.strip() for p in pieces[start:i + 1]):
                spans.append((start, i + 1))
            start = i + 1
    if any(p.strip() for p in pieces[start:]):
        spans.append((start, len(pieces)))
    return spans


def token_sources(trace: Sequence[Any], n_documents: int, extra: dict[str, Any]) -> list[tuple[int, ...]]:
    """The documents each generated token is attributed to (see the module docstring for each mode)."""
    if "drafted_tokens" in extra and "chunks" in extra:
        drafted_from = tuple(sorted({int(c["document"]) for c in extra["chunks"]}))
        flags = list(extra["drafted_tokens"])
        return [drafted_from if i < len(flags) and flags[i] else () for i in range(len(trace))]
    if extra.get("attribution") == "context":
        return [tuple(range(n_documents))] * len(trace)
    return [() if step.document is None else (int(step.document),) for step in trace]


def sentence_citations(pieces: Sequence[str], sources: Sequence[Sequence[int]], *,
                       threshold: float = DEFAULT_THRESHOLD,
                       join: Callable[[int, int], str] | None = None) -> list[SentenceCitation]:
    """Cite per sentence: documents with a share of the sentence's content tokens >= ``threshold``.

    ``pieces``: each token's text; ``sources``: each token's source documents (same length);
    ``join(start, end)``: the text of a token span (default: the pieces concatenated).
    """
    if len(pieces) != len(sources):
        raise InvalidOptionError(f"sentence_citations got {len(pieces)} token texts for {len(sources)} sources")
    if isinstance(threshold, bool) or not 0 < threshold <= 1:
        raise InvalidOptionError(f"threshold (the share of a sentence's content tokens a document must win) must be "
                                 f"in (0, 1], got {threshold!r}")
    citations = []
    for start, end in sentence_spans(pieces):
        content = [i for i in range(start, end) if is_content(pieces[i])] or list(range(start, end))
        counts: dict[int, int] = {}
        for i in content:
            for doc in set(sources[i]):
                counts[doc] = counts.get(doc, 0) + 1
        shares = {doc: n / len(content) for doc, n in counts.items()}
        cited = tuple(sorted((d for d, s in shares.items() if s >= threshold), key=lambda d: (-shares[d], d)))
        text = join(start, end) if join is not None else "".join(pieces[start:end])
        citations.append(SentenceCitation(text.strip(), start, end, cited, shares))
    return citations


def answer_citations(answer: Any, tokenizer: Any, threshold: float = DEFAULT_THRESHOLD) -> list[SentenceCitation]:
    """Sentence citations of an :class:`~ctx_integrations.engine.core.answer.Answer` (``tokenizer`` decodes its
    tokens; pass ``engine.loaded.tokenizer``)."""
    ids = [step.token_id for step in answer.trace]
    pieces = [tokenizer.decode([t]) for t in ids]
    sources = token_sources(answer.trace, len(answer.documents), answer.extra)
    return sentence_citations(pieces, sources, threshold=threshold,
                              join=lambda start, end: tokenizer.decode(ids[start:end]))


def cited_documents(citations: Sequence[SentenceCitation]) -> list[int]:
    """Every document cited by some sentence, in order of first citation."""
    seen: list[int] = []
    for citation in citations:
        seen.extend(d for d in citation.documents if d not in seen)
    return seen
