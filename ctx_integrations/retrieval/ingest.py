"""Files into a :class:`DocumentStore`: read .txt / .md / .pdf, split into passages, sync by stable ids.

Why it works this way:

- A passage is at most ``max_tokens`` tokens of the *LLM's* tokenizer, because each passage becomes
  one KV cache and one expert stream: its length is what decoding pays for.
- Passages break at paragraph boundaries where possible, then sentences, then lines, then words
  (a single over-long "word" is cut by characters), so they read well; the limit is never exceeded.
- Ids are stable per (file, passage index): re-ingesting an unchanged folder changes nothing
  (no re-embedding, no new caches), editing a file re-embeds only the passages whose text changed,
  and stored passages of an ingested file or folder that no longer exist are removed with their caches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError, missing_dependency


class BinaryFileError(EmptyDocumentsError):
    """A .txt / .md file whose content is binary: ingesting it would store garbage passages."""

SUFFIXES = (".txt", ".md", ".pdf")
MIN_TOKENS = 8  # room for a few words, and for any single character of a byte-level BPE (<= 4 tokens)

TokenCounter = Callable[[str], int]
_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file (git's rule)

# (where to split, how to join) from the coarsest boundary to the finest
_LEVELS = (
    (re.compile(r"\n[ \t]*\n\s*"), "\n\n"),  # paragraphs
    (re.compile(r"(?<=[.!?])\s+"), " "),  # sentences
    (re.compile(r"\n"), "\n"),  # lines
    (re.compile(r"\s+"), " "),  # words
)
_MD_TITLE = re.compile(r"^#[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def token_counter(tokenizer: Any) -> TokenCounter:
    """Count tokens of a text with ``tokenizer`` as a document is cached: without special tokens."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- files -----------------------------------------------------------------------------------------------------
def find_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The supported files named in ``paths`` or found under its folders (hidden entries skipped), sorted."""
    found: set[Path] = set()
    for given in paths:
        path = Path(given).expanduser().resolve()
        if path.is_dir():
            found.update(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                         and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise InvalidOptionError(f"{path} is not a {', '.join(SUFFIXES)} file: give such files or folders")
            found.add(path)
        else:
            raise InvalidOptionError(f"{given} does not exist: give existing files or folders")
    return sorted(found)


def read_document(path: Path) -> tuple[str, str]:
    """The text and title of a file: a Markdown file's first ``# `` heading, a PDF's title, else the file name."""
    if path.suffix.lower() == ".pdf":
        return _read_pdf(path)
    raw = path.read_bytes()
    if b"\x00" in raw[:_SNIFF_BYTES]:
        raise BinaryFileError(f"{path} has binary content (NUL bytes), not {path.suffix} text: convert it to text or "
                              "leave it out")
    text = raw.decode("utf-8-sig", errors="replace")
    heading = _MD_TITLE.search(text) if path.suffix.lower() == ".md" else None
    return text, heading.group(1).strip() if heading else path.stem


def _read_pdf(path: Path) -> tuple[str, str]:
    try:
        from pypdf import PdfReader
    except ImportError as error:
        raise missing_dependency("pypdf", extra="retrieval") from error
    pypdf_log = logging.getLogger("pypdf")
    level = pypdf_log.level
    pypdf_log.setLevel(logging.ERROR)  # pypdf logs every repaired xref as a warning: noise in a CLI transcript
    try:
        reader = PdfReader(path)
        text = "\n\n".join((page.extract_text() or "").strip() for page in reader.pages)
        title = reader.metadata.title if reader.metadata is not None else None
    finally:
        pypdf_log.setLevel(level)
    return text, str(title).strip() if title and str(title).strip() else path.stem


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
    if count(text) <= limit:
        return [text]
    if level == len(_LEVELS):
        return _cut(text, count, limit)
    pattern, joiner = _LEVELS[level]
    pieces = [piece.strip() for piece in pattern.split(text) if piece.strip()]
    if len(pieces) < 2:
        return _split(text, count, limit, level + 1)
    return _pack([part for piece in pieces for part in _split(piece, count, limit, level + 1)], joiner, count, limit)


def _pack(parts: list[str], joiner: str, count: TokenCounter, limit: int) -> list[str]:
    passages, current = [], parts[0]
    for part in parts[1:]:
        candidate = f"{current}{joiner}{part}"
        if count(candidate) <= limit:
            current = candidate
        else:
            passages.append(current)
            current = part
    return [*passages, current]


def _cut(text: str, count: TokenCounter, limit: int) -> list[str]:
    """Cut text without any whitespace into the longest prefixes that fit (binary search on length)."""
    pieces = []
    while text:
        low, high = 1, len(text)
        while low < high:
            middle = (low + high + 1) // 2
            if count(text[:middle]) <= limit:
                low = middle
            else:
                high = middle - 1
        pieces.append(text[:low])
        text = text[low:]
    return pieces


def passage_id(path: Path, index: int) -> str:
    """Stable id of passage ``index`` of the file at ``path``: readable stem, short path hash, index."""
    digest = hashlib.sha256(str(path).encode("utf-8")).hexdigest()[:8]
    return f"{path.stem[:40]}-{digest}#{index}"


def file_passages(path: Path, count: TokenCounter, max_tokens: int = 512) -> list[Document]:
    """A file's passages as documents with stable ids and ``source`` / ``title`` / ``chunk`` metadata."""
    text, title = read_document(path)
    return [Document(passage, id=passage_id(path, index), metadata={"source": str(path), "title": title,
                                                                    "chunk": index})
            for index, passage in enumerate(split_passages(text, count, max_tokens))]


# -- ingestion -------------------------------------------------------------------------------------------------
@dataclass
class IngestReport:
    """What :func:`ingest` did: files read, passages now stored for them, what changed, and files skipped.

    ``files`` counts the files read; a file that could not be read is in ``skipped`` (path, reason) only.
    """

    files: int = 0
    passages: int = 0
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    removed: int = 0
    cache_misses: int = 0
    skipped: list[tuple[Path, str]] = field(default_factory=list)


    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``ingest --json``)."""
        counts = {name: getattr(self, name) for name in ("files", "passages", "added", "updated", "unchanged",
                                                         "removed", "cache_misses")}
        return {**counts, "skipped": [{"path": str(path), "reason": reason} for path, reason in self.skipped]}


def ingest(store: Any, paths: Sequence[str | os.PathLike], count: TokenCounter, max_tokens: int = 512, *,
           warm: bool = True, progress: bool | None = None) -> IngestReport:
    """Sync ``store`` with the files under ``paths``; with ``warm`` and an engine on the store, cache them.

    A file that cannot be read (a damaged or encrypted PDF, binary content in a .txt / .md) is skipped
    and listed in the report; one without text (a scanned PDF) simply has no passages. ``progress``
    shows tqdm bars on stderr over files and embedded passages (``None``: only when stderr is a terminal).
    """
    from tqdm.auto import tqdm

    files = find_files(paths)
    report, documents = IngestReport(), []
    disable = None if progress is None else not progress  # tqdm's None: off unless stderr is a TTY
    for path in tqdm(files, desc="reading", unit="file", disable=disable, leave=False):
        try:
            documents.extend(file_passages(path, count, max_tokens))
        except _unreadable() as error:
            report.skipped.append((path, f"{type(error).__name__}: {error}"))
        else:
            report.files += 1
    with tqdm(total=len(documents), desc="embedding", unit="passage", disable=disable, leave=False) as bar:
        added = store.add(documents, warm=warm, progress=bar.update)
    report.passages, report.cache_misses = len(documents), added.cache_misses
    report.added, report.updated, report.unchanged = added.added, added.updated, added.unchanged
    keep = {doc.id for doc in documents} | {_id for path, _ in report.skipped for _id in _ids_of(store, path)}
    scope = [Path(p).expanduser().resolve() for p in paths]
    report.removed = store.delete([doc.id for doc in store.all_documents()
                                   if doc.id not in keep and _within(doc.metadata.get("source"), scope)])
    return report


def _unreadable() -> tuple[type[Exception], ...]:
    """The errors that mean "this file cannot be read" (pypdf's own only when pypdf is installed)."""
    try:
        from pypdf.errors import PyPdfError
    except ImportError:
        return (OSError, ValueError)  # ValueError includes BinaryFileError
    return (PyPdfError, OSError, ValueError)


def _ids_of(store: Any, path: Path) -> list[str]:
    """Stored passages of a file that could not be read this time: kept as they were."""
    return [doc.id for doc in store.where({"source": str(path)})]


def _within(source: Any, scope: list[Path]) -> bool:
    if not isinstance(source, str) or not source:
        return False
    path = Path(source)
    return any(path == root or root in path.parents for root in scope)
