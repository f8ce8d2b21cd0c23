"""Files into a :class:`DocumentStore`: every text file and PDF, split into passages, synced by stable ids.

Which files are read and which are left out (hidden, unreadable, symbolic links leaving the corpus) is
:mod:`ctx_integrations.retrieval.corpus`'s job; what is text (by content, whatever the name) is
:mod:`ctx_integrations.retrieval.reading`'s. Why this module works the way it does:

- A passage is at most ``max_tokens`` tokens of the *LLM's* tokenizer, because each passage becomes
  one KV cache and one expert stream: its length is what decoding pays for.
- Passages break at paragraph boundaries where possible, then sentences, then lines, then words
  (a single over-long "word" is cut by characters), so they read well; the limit is never exceeded.
- Splitting costs time linear in the text: no text is counted whole unless it fits; a passage's end is found by
  counting candidate passages near its size (estimated from the tokens per character seen so far), so a
  2 MB line without whitespace costs about as many counted characters as a few copies of it (a search over
  the whole remaining text, as before, made it quadratic: over 600 s for 2 MB).
- Ids are stable per (file, passage index): re-ingesting an unchanged folder changes nothing
  (no re-embedding, no new caches), editing a file re-embeds only the passages whose text changed,
  and stored passages of an ingested file or folder that no longer exist are removed with their caches.
- Nothing is removed because it could not be read: the stored passages of every file or folder the walk or
  the reader skipped (unreadable, binary, a link not followed) are kept, and counted as ``kept``.
"""

from __future__ import annotations

import hashlib
import os
import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.progress import Progress
from ctx_integrations.retrieval.corpus import display_path, find_files
from ctx_integrations.retrieval.reading import read_document

MIN_TOKENS = 8  # room for a few words, and for any single character of a byte-level BPE (<= 4 tokens)

TokenCounter = Callable[[str], int]

# (where to split, how to join) from the coarsest boundary to the finest
_LEVELS = (
    (re.compile(r"\n[ \t]*\n\s*"), "\n\n"),  # paragraphs
    (re.compile(r"(?<=[.!?])\s+"), " "),  # sentences
    (re.compile(r"\n"), "\n"),  # lines
    (re.compile(r"\s+"), " "),  # words
)


def token_counter(tokenizer: Any) -> TokenCounter:
    """Count tokens of a text with ``tokenizer`` as a document is cached: without special tokens."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- passages --------------------------------------------------------------------------------------------------
def split_passages(text: str, count: TokenCounter, max_tokens: int = 512) -> list[str]:
    """Split ``text`` into passages of at most ``max_tokens`` tokens, at the coarsest boundaries that fit.

    Neighbouring pieces are packed greedily into one passage while the joined text still fits, so a
    passage holds as many whole paragraphs (or sentences, ...) as the limit allows.
    """
    if max_tokens < MIN_TOKENS:
        raise InvalidOptionError(f"passages need at least {MIN_TOKENS} tokens (got {max_tokens})")
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    return _split(text, count, max_tokens, 0) if text else []


def _split(text: str, count: TokenCounter, limit: int, level: int) -> list[str]:
    if _fits(text, count, limit):
        return [text]
    if level == len(_LEVELS):  # no whitespace left: cut by characters
        return _fill(text, range(len(text)), range(1, len(text) + 1), count, limit)
    pattern, joiner = _LEVELS[level]
    pieces = [piece.strip() for piece in pattern.split(text) if piece.strip()]
    if len(pieces) < 2:
        return _split(text, count, limit, level + 1)
    return _pack([part for piece in pieces for part in _split(piece, count, limit, level + 1)], joiner, count, limit)


def _fits(text: str, count: TokenCounter, limit: int) -> bool:
    """Whether ``text`` has at most ``limit`` tokens, counting prefixes of doubling length first.

    A prefix over the limit settles it, so a long text costs about the characters of one passage, not its
    length. (A prefix can count a token more than the whole when the cut splits a merged token; the text is
    then split one level finer than needed, never past the limit.)
    """
    size = limit
    while size < len(text):
        if count(text[:size]) > limit:
            return False
        size *= 2
    return count(text) <= limit


def _pack(parts: list[str], joiner: str, count: TokenCounter, limit: int) -> list[str]:
    """Join neighbouring parts (each within the limit) into the fewest passages that fit, in order."""
    text = joiner.join(parts)
    starts, ends, offset = [], [], 0
    for part in parts:
        starts.append(offset)
        ends.append(offset + len(part))
        offset += len(part) + len(joiner)
    return _fill(text, starts, ends, count, limit)


def _fill(text: str, starts: Sequence[int], ends: Sequence[int], count: TokenCounter, limit: int) -> list[str]:
    """Passages of ``text`` made of whole parts (part ``i`` is ``text[starts[i]:ends[i]]``), greedily from the first.

    Each passage runs from a part's start to the end of the last part that keeps it within ``limit``
    (:func:`_last_fitting`); its length in characters is the next passage's first guess.
    """
    passages, first, guess = [], 0, limit
    while first < len(starts):
        last = _last_fitting(text, starts[first], ends, first, count, limit, guess)
        passages.append(text[starts[first]:ends[last]])
        guess = ends[last] - starts[first]
        first = last + 1
    return passages


def _last_fitting(text: str, start: int, ends: Sequence[int], first: int, count: TokenCounter, limit: int,
                  guess: int) -> int:
    """The last part index whose end keeps ``text[start:ends[index]]`` within ``limit`` tokens (at least ``first``).

    A search over the part boundaries that counts only candidates near the passage's size: each probe is where
    the limit would fall at the tokens per character of the previous probe (a count of exactly ``limit``
    ends the search: the passage is full), alternated with bisection whenever a probe did not halve the
    interval, and never past 4 times the characters known to fit (or the first guess). So a passage
    costs a few counts of about its own length, and splitting stays linear in the text (a bisection over the
    whole remaining text is quadratic). Hand-written: tokenizers have no "longest prefix within n tokens" call.
    """
    low, high = first, len(ends)  # ends[low] fits (a part fits on its own); ends[high] and beyond do not
    target, bisect_next = start + guess, False
    while high - low > 1:
        if bisect_next and high < len(ends):
            probe = (low + high) // 2
        else:
            reach = max(4 * (ends[low] - start), guess)
            probe = bisect_right(ends, min(target, start + reach), low + 1, high) - 1
            probe = min(max(probe, low + 1), high - 1)
        width = high - low
        tokens = count(text[start:ends[probe]])
        if tokens <= limit:
            low = probe
            if tokens == limit:
                break
        else:
            high = probe
        target = start + (ends[probe] - start) * limit // max(tokens, 1)
        bisect_next = not bisect_next and 2 * (high - low) > width
    return low


def passage_id(path: Path, index: int) -> str:
    """Stable id of passage ``index`` of the file at ``path``: the file's name (its first 40 characters, whole: a
    ``GFDL-1.3`` keeps its ``.3``, which a stem would drop as a suffix), a short hash of the path's bytes, the index.

    The hash is over the name's bytes, so two names that differ only in bytes that are not UTF-8 get two ids
    (a UTF-8 name hashes as it always did: its bytes are its UTF-8 encoding).
    """
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:8]
    return f"{Path(display_path(path)).name[:40]}-{digest}#{index}"


def file_passages(path: Path, count: TokenCounter, max_tokens: int = 512) -> list[Document]:
    """A file's passages as documents with stable ids and ``source`` / ``title`` / ``chunk`` metadata."""
    text, title = read_document(path)
    source = display_path(path)
    return [Document(passage, id=passage_id(path, index), metadata={"source": source, "title": title, "chunk": index})
            for index, passage in enumerate(split_passages(text, count, max_tokens))]


# -- ingestion -------------------------------------------------------------------------------------------------
@dataclass
class IngestReport:
    """What :func:`ingest` did: files read, passages now stored for them, what changed, and what was not read.

    ``files`` counts the files read. ``skipped`` lists every file or folder not read, with the reason (hidden,
    binary, unreadable, a symbolic link not followed, ...); ``kept`` counts the stored passages of those,
    left as they were instead of removed.
    """

    files: int = 0
    passages: int = 0
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    removed: int = 0
    kept: int = 0
    cache_misses: int = 0
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``ingest --json``); paths as :func:`~.corpus.display_path` shows them."""
        counts = {name: getattr(self, name) for name in ("files", "passages", "added", "updated", "unchanged",
                                                         "removed", "kept", "cache_misses")}
        return {**counts, "skipped": [{"path": display_path(path), "reason": reason} for path, reason in self.skipped]}


def ingest(store: Any, paths: Sequence[str | os.PathLike], count: TokenCounter, max_tokens: int = 512, *,
           warm: bool = True, progress: bool | None = None, follow_symlinks: bool = False) -> IngestReport:
    """Sync ``store`` with the files under ``paths``; with ``warm`` and an engine on the store, cache them.

    Every text file (recognised by content, whatever its name) and PDF is read. Whatever is not read is listed
    in the report's ``skipped`` with the reason, and its stored passages are kept: hidden entries, binary files,
    damaged or encrypted PDFs, files and folders that cannot be read, symbolic links leaving a folder given
    (followed only with ``follow_symlinks``). A file without text (a scanned PDF) simply has no passages.
    ``progress`` shows on stderr the files read, the passages embedded and the KV caches computed
    (:class:`~ctx_integrations.progress.Progress`): ``None`` tqdm bars on a terminal and a plain line every few
    seconds elsewhere (a log, CI), ``True`` bars, ``False`` nothing.
    """
    if max_tokens < MIN_TOKENS:
        raise InvalidOptionError(f"passages need at least {MIN_TOKENS} tokens (got {max_tokens})")
    listing = find_files(paths, follow_symlinks=follow_symlinks)
    report, documents = IngestReport(skipped=list(listing.skipped)), []
    with Progress("reading", "file", len(listing.files), show=progress) as reading:
        for path in listing.files:
            try:
                documents.extend(file_passages(path, count, max_tokens))
            except _unreadable() as error:
                report.skipped.append((path, f"{type(error).__name__}: {error}"))
            else:
                report.files += 1
            reading.advance()
    report.skipped.sort()
    # the caches are computed on the engine's scheduler thread: Progress prints their counts from its own
    with Progress("embedding", "passage", len(documents), show=progress) as embedding, \
            Progress("kv caches", "document", show=progress) as caches:
        added = store.add(documents, warm=warm, progress=embedding.advance, kv_progress=caches.update)
    report.passages, report.cache_misses = len(documents), added.cache_misses
    report.added, report.updated, report.unchanged = added.added, added.updated, added.unchanged
    read = {doc.id for doc in documents}
    scope = {display_path(Path(p).expanduser().resolve()) for p in paths}
    held = {display_path(path) for path, _ in report.skipped}
    stale = []
    for doc in store.all_documents():
        source = doc.metadata.get("source")
        if doc.id in read or not _within(source, scope):
            continue
        if _within(source, held):
            report.kept += 1  # its file or folder could not be read this time: kept as it was
        else:
            stale.append(doc.id)
    report.removed = store.delete(stale)
    return report


def _unreadable() -> tuple[type[Exception], ...]:
    """The errors that mean "this file cannot be read" (pypdf's own only when pypdf is installed)."""
    try:
        from pypdf.errors import PyPdfError
    except ImportError:
        return (OSError, ValueError)  # ValueError includes BinaryFileError
    return (PyPdfError, OSError, ValueError)


def _within(source: Any, roots: set[str]) -> bool:
    """Whether the path ``source`` is one of ``roots`` or lies under one (paths as :func:`display_path` shows them)."""
    if not isinstance(source, str) or not source:
        return False
    path = Path(source)
    return any(str(folder) in roots for folder in (path, *path.parents))
