"""One file's text and title, text told from binary by its content, never by its name.

A file starting with ``%PDF-`` is a PDF whatever its name, read with pypdf. Any other file is text when
:func:`decode_text` finds an encoding for it, by these rules in order:

1. A byte-order mark names the encoding (UTF-8, UTF-16, UTF-32); decoding strictly with it must succeed.
2. A NUL byte in the first 8 KiB marks a binary file (git's rule). Only the first 8 KiB of such a file is read.
3. Valid UTF-8 (ASCII included) is text.
4. Otherwise the file is in a legacy encoding or binary. Windows-1252 (Latin-1's superset, what old Western
   files are in) is taken when every byte is defined in it, at most 30 % are non-ASCII (Western prose: a few
   accented letters) and the text it gives passes rule 5; else charset_normalizer's detection (Cyrillic,
   Greek, legacy CJK pages, UTF-16 without a byte-order mark and without NULs), which finds none in random
   bytes or compressed data (a PNG, a zip) of 64 bytes or more: binary. Windows-1252 comes first because
   charset_normalizer's guess on a short Western text is often wrong (``café`` in Latin-1 detected as UTF-16
   or as Urdu's cp1006). UTF-16 text of ASCII characters without a byte-order mark has NULs: rule 2 refuses
   it (save it as UTF-8).
5. Decoded text in which more than 1 % of the characters are control characters (other than tab, the line
   and page breaks, backspace, escape and DOS's end-of-file) is binary after all: a NUL-free file of 7-bit
   bytes that no one would call text.

Written by hand around charset_normalizer: it guesses an encoding for any bytes it can, and ingestion needs
a refusal for binary content (a garbage passage costs a KV cache and pollutes retrieval) and a stable
answer for the common case (UTF-8) without guessing.
"""

from __future__ import annotations

import codecs
import io
import logging
import re
from pathlib import Path

from ctx_integrations.errors import EmptyDocumentsError, missing_dependency
from ctx_integrations.retrieval.corpus import display_path


class BinaryFileError(EmptyDocumentsError):
    """A file whose content is binary (not text in any encoding, not a PDF): ingesting it would store garbage."""


SNIFF_BYTES = 8192
MAX_NON_ASCII = 0.30  # share of non-ASCII bytes up to which a non-UTF-8 file is taken as Windows-1252
MAX_CONTROLS = 0.01  # share of control characters above which decoded text is binary after all
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))  # UTF-32 LE's BOM starts with UTF-16 LE's
_HIGH_BYTES = bytes(range(128, 256))
# C0 controls but \b \t \n \v \f \r, SUB (^Z, DOS's end of file) and ESC (terminal colours in logs); DEL; C1
_CONTROL = re.compile(r"[\x00-\x07\x0e-\x19\x1c-\x1f\x7f-\x9f]")
_MD_TITLE = re.compile(r"^#[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
_MARKDOWN = (".md", ".markdown")


def decode_text(raw: bytes) -> str:
    """The text of a file's bytes by the module's rules; :class:`BinaryFileError` (without a path) when binary."""
    codec = _bom_codec(raw)
    if codec is not None:
        try:
            return _checked(raw.decode(codec))
        except UnicodeDecodeError:
            raise BinaryFileError(f"not {codec} text although it starts with its byte-order mark") from None
    if b"\x00" in raw[:SNIFF_BYTES]:
        raise BinaryFileError("NUL bytes")
    try:
        return _checked(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return _checked(_legacy(raw))


def _bom_codec(raw: bytes) -> str | None:
    return next((codec for bom, codec in _BOMS if raw.startswith(bom)), None)


def _legacy(raw: bytes) -> str:
    high = len(raw) - len(raw.translate(None, _HIGH_BYTES))
    if high <= MAX_NON_ASCII * len(raw):
        try:
            return _checked(raw.decode("cp1252"))
        except (UnicodeDecodeError, BinaryFileError):
            pass  # a byte Windows-1252 leaves undefined, or control characters: another encoding, or binary
    from charset_normalizer import from_bytes

    best = from_bytes(raw).best()
    if best is None:
        raise BinaryFileError("not UTF-8, and no other text encoding fits")
    return str(best)


def _checked(text: str) -> str:
    controls = sum(1 for _ in _CONTROL.finditer(text))
    if controls > MAX_CONTROLS * len(text):
        raise BinaryFileError(f"{controls} control characters in {len(text)}")
    return text


def read_document(path: Path) -> tuple[str, str]:
    """The text and title of a file: a Markdown file's first ``# `` heading, a PDF's title, else the file name.

    :class:`BinaryFileError` names a file whose content is binary; ``OSError`` (and pypdf's errors) one that
    cannot be read.
    """
    with open(path, "rb") as handle:
        raw = handle.read(SNIFF_BYTES)
        if b"\x00" in raw and _bom_codec(raw) is None and not _is_pdf(path, raw):
            raise _binary(path, "NUL bytes")  # rule 2 on the first 8 KiB: the rest of a binary file is not read
        raw += handle.read()
    if _is_pdf(path, raw):
        return _read_pdf(path, raw)
    try:
        text = decode_text(raw)
    except BinaryFileError as error:
        raise _binary(path, str(error)) from None
    heading = _MD_TITLE.search(text) if path.suffix.lower() in _MARKDOWN else None
    return text, heading.group(1).strip() if heading else _stem(path)


def _binary(path: Path, why: str) -> BinaryFileError:
    return BinaryFileError(f"{display_path(path)} has binary content ({why}), not text: convert it to text or leave "
                           "it out")


def _is_pdf(path: Path, head: bytes) -> bool:
    """A PDF by content: ``%PDF-`` at the start, or within the first KiB of a ``.pdf`` file (readers allow that)."""
    return head.startswith(b"%PDF-") or (path.suffix.lower() == ".pdf" and b"%PDF-" in head[:1024])


def _stem(path: Path) -> str:
    """The file's name without a suffix that names a format (``notes.txt``: ``notes``); a suffix with no letter is
    part of the name (``GFDL-1.3`` stays ``GFDL-1.3``, a version, not a format)."""
    shown = Path(display_path(path))
    return shown.stem if any(char.isalpha() for char in shown.suffix) else shown.name


def _read_pdf(path: Path, raw: bytes) -> tuple[str, str]:
    try:
        from pypdf import PdfReader
    except ImportError as error:
        raise missing_dependency("pypdf", extra="retrieval") from error
    pypdf_log = logging.getLogger("pypdf")
    level = pypdf_log.level
    pypdf_log.setLevel(logging.ERROR)  # pypdf logs every repaired xref as a warning: noise in a CLI transcript
    try:
        reader = PdfReader(io.BytesIO(raw))
        text = "\n\n".join((page.extract_text() or "").strip() for page in reader.pages)
        title = reader.metadata.title if reader.metadata is not None else None
    finally:
        pypdf_log.setLevel(level)
    return text, str(title).strip() if title and str(title).strip() else _stem(path)
