"""What ingestion takes for text: the rules of ``retrieval.reading`` one by one, on bytes and on files.

The rules are decided by content, never by a file's name (the users issue, item 1: LICENSE, README and
copyright were dropped for their names; the reliability issue, item 4: NUL-free binaries became passages).
"""

from __future__ import annotations

import codecs
import random

import pytest
from pypdf.errors import PyPdfError

from ctx_integrations.retrieval.reading import MAX_CONTROLS, BinaryFileError, decode_text, read_document
from tests.test_retrieval_ingest import minimal_pdf

JAPANESE = "日本語のテキストです。改行なし。" * 3
RUSSIAN = "Маяк Квиллби построен в 1871 году. Его смотритель живёт у гавани и ведёт журнал погоды. " * 4


@pytest.mark.parametrize(("raw", "text"), [
    (b"Plain ASCII.\n", "Plain ASCII.\n"),
    ("Grüße aus Köln — 東京.".encode(), "Grüße aus Köln — 東京."),
    (codecs.BOM_UTF8 + b"With a BOM.", "With a BOM."),
    (codecs.BOM_UTF16_LE + "Notepad's UTF-16.".encode("utf-16-le"), "Notepad's UTF-16."),
    (codecs.BOM_UTF16_BE + "Big-endian UTF-16.".encode("utf-16-be"), "Big-endian UTF-16."),
    (codecs.BOM_UTF32_LE + "UTF-32.".encode("utf-32-le"), "UTF-32."),
    ("café".encode("cp1252"), "café"),  # charset_normalizer alone says cp1006 (Urdu) for these 4 bytes
    ("It’s a “quoted” word – in Windows-1252.".encode("cp1252"), "It’s a “quoted” word – in Windows-1252."),
    (RUSSIAN.encode("cp1251"), RUSSIAN),  # mostly non-ASCII: detected, not taken for Windows-1252
    (b"caf\xe9 \xe0 \xe8xy", "café à èxy"),  # 30 % non-ASCII, the most taken for Windows-1252 (not UTF-16 mojibake)
    (JAPANESE.encode("utf-16-le"), JAPANESE),  # UTF-16 without a BOM, detected (it has no NUL byte)
    (b"\x1b[32mok\x1b[0m build finished\n" * 3, "\x1b[32mok\x1b[0m build finished\n" * 3),  # a coloured log
    (b"page one\fpage two\x1a", "page one\fpage two\x1a"),  # form feed, DOS end-of-file mark
    (b"", ""),
], ids=["ascii", "utf8", "utf8_bom", "utf16le_bom", "utf16be_bom", "utf32_bom", "latin1_short", "cp1252_quotes",
        "cp1251", "cp1252_at_30_percent", "utf16_without_bom", "ansi_colours", "form_feed_and_eof", "empty"])
def test_text_in_any_common_encoding_is_read(raw, text):
    assert decode_text(raw) == text


_RANDOM = random.Random(0)


@pytest.mark.parametrize(("raw", "why"), [
    (b"text\x00more text", "NUL bytes"),
    ("Notepad's UTF-16 without its BOM".encode("utf-16-le"), "NUL bytes"),
    (bytes(_RANDOM.randrange(128, 256) for _ in range(256)), "not UTF-8, and no other text encoding fits"),
    (bytes(_RANDOM.randrange(1, 128) for _ in range(256)), r"\d+ control characters in 256"),
    (codecs.BOM_UTF16_LE + b"\x00\xd8", "not utf-16 text although it starts with its byte-order mark"),
], ids=["nul", "utf16_ascii_without_bom", "high_bytes", "seven_bit_controls", "broken_utf16"])
def test_binary_content_is_refused_with_the_reason(raw, why):
    with pytest.raises(BinaryFileError, match=f"^{why}$"):
        decode_text(raw)


def test_one_control_character_in_a_hundred_is_text_and_more_is_binary():
    assert decode_text(b"a" * 99 + b"\x01") == "a" * 99 + "\x01"
    assert MAX_CONTROLS == 0.01
    with pytest.raises(BinaryFileError, match="2 control characters in 100"):
        decode_text(b"a" * 98 + b"\x01\x02")
    with pytest.raises(BinaryFileError, match="1 control characters in 99"):
        decode_text(b"a" * 98 + b"\x7f")  # DEL counts; so do C1 characters
    with pytest.raises(BinaryFileError, match="control characters"):
        decode_text("x\u0085".encode())


def test_a_file_is_judged_by_its_content_not_its_name(tmp_path):
    (tmp_path / "LICENSE").write_text("MIT License\n\nPermission is hereby granted.")
    assert read_document(tmp_path / "LICENSE") == ("MIT License\n\nPermission is hereby granted.", "LICENSE")
    (tmp_path / "GFDL-1.3").write_text("GNU Free Documentation License")
    assert read_document(tmp_path / "GFDL-1.3")[1] == "GFDL-1.3"  # a version is part of the name, not a suffix
    (tmp_path / "paper").write_bytes(minimal_pdf(["A PDF without a suffix."], "Its title"))
    assert read_document(tmp_path / "paper") == ("A PDF without a suffix.", "Its title")
    (tmp_path / "notes.pdf").write_text("Plain text saved with the wrong suffix.")
    assert read_document(tmp_path / "notes.pdf") == ("Plain text saved with the wrong suffix.", "notes")
    (tmp_path / "late.pdf").write_bytes(b"junk before the header\n" + minimal_pdf(["Header after junk."]))
    assert read_document(tmp_path / "late.pdf")[0] == "Header after junk."  # within the first KiB of a .pdf
    (tmp_path / "edge.pdf").write_bytes(b"x" * 1019 + minimal_pdf(["Header ending at byte 1024."]))
    with pytest.raises(PyPdfError):  # a PDF (its offsets broken by the junk), not text
        read_document(tmp_path / "edge.pdf")
    (tmp_path / "past.pdf").write_bytes(b"x" * 1020 + minimal_pdf(["Header past the first KiB."]))
    assert read_document(tmp_path / "past.pdf")[0].startswith("x" * 1020 + "%PDF-1.4")  # text, not a PDF
    (tmp_path / "mentions.txt").write_text("A note on the format: files start with %PDF-1.7 and then...")
    assert read_document(tmp_path / "mentions.txt")[0].startswith("A note")  # not a PDF: the header is not first
    (tmp_path / "guide.markdown").write_text("# The Guide\n\nBody.")
    assert read_document(tmp_path / "guide.markdown")[1] == "The Guide"
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(BinaryFileError, match=r"image\.txt has binary content \(NUL bytes\), not text"):
        read_document(tmp_path / "image.txt")
