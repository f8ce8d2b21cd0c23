"""Ingestion: walking folders, reading text and PDFs, token-bounded passages in linear time, stable ids, syncing a
store, and the CLI."""

from __future__ import annotations

import json
import random
import re
import string
import sys
from pathlib import Path

import pytest

from ctx_integrations.errors import InvalidOptionError, MissingDependencyError
from ctx_integrations.retrieval import DocumentStore
from ctx_integrations.retrieval.corpus import HIDDEN, FileListing
from ctx_integrations.retrieval.embedders import default_embedder
from ctx_integrations.retrieval.ingest import (
    file_passages,
    find_files,
    ingest,
    passage_id,
    read_document,
    split_passages,
    token_counter,
)
from tests.helpers import embedded_tokenizer, run_cli


def words(text: str) -> int:
    return len(text.split())


def minimal_pdf(pages: list[str], title: str | None = None) -> bytes:
    """A small valid PDF (Helvetica text, one line per page) written by hand, with a correct xref table."""
    n = len(pages)
    objects = ["<< /Type /Catalog /Pages 2 0 R >>",
               f"<< /Type /Pages /Kids [{' '.join(f'{4 + 2 * i} 0 R' for i in range(n))}] /Count {n} >>",
               "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i, text in enumerate(pages):
        content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                       f"/Contents {5 + 2 * i} 0 R >>")
        objects.append(f"<< /Length {len(content)} >>\nstream\n{content}\nendstream")
    if title is not None:
        objects.append(f"<< /Title ({title}) >>")
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    info = f" /Info {len(objects)} 0 R" if title is not None else ""
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R{info} >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


# -- splitting ------------------------------------------------------------------------------------------------
def test_short_and_empty_texts():
    assert split_passages("  One short paragraph.\n", words, 8) == ["One short paragraph."]
    assert split_passages(" \n\n ", words, 8) == []


def test_paragraphs_are_packed_greedily_within_the_limit():
    text = "one two three\n\nfour five six seven\n\n\neight nine ten eleven twelve"
    assert split_passages(text, words, 8) == ["one two three\n\nfour five six seven", "eight nine ten eleven twelve"]
    assert split_passages(text, words, 12) == [text]  # a text that fits is kept as it is


def test_a_long_paragraph_breaks_at_sentences_then_lines_then_words():
    text = "Alpha beta gamma. Delta epsilon zeta eta. Theta iota kappa lambda mu."
    assert split_passages(text, words, 8) == ["Alpha beta gamma. Delta epsilon zeta eta.",
                                              "Theta iota kappa lambda mu."]
    lines = "a b c d e\nf g h i j\nk l"
    assert split_passages(lines, words, 8) == ["a b c d e", "f g h i j\nk l"]
    assert split_passages("w " * 20, words, 8) == ["w " * 7 + "w", "w " * 7 + "w", "w w w w"]


def test_text_without_whitespace_is_cut_by_characters():
    assert split_passages("x" * 25, len, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert split_passages("x" * 513, len) == ["x" * 512, "x"]  # 512 tokens by default


def test_a_paragraph_too_long_breaks_at_its_sentences_before_its_lines():
    text = "One two three four. Five six seven eight\nnine ten eleven twelve.\n\nThirteen."
    assert split_passages(text, words, 8) == ["One two three four.", "Five six seven eight\nnine ten eleven twelve.",
                                              "Thirteen."]
    assert split_passages("AAAA\n\n\n\n\nBBBB", len, 10) == ["AAAA\n\nBBBB"]  # two paragraphs joined as such


def test_a_prefix_at_the_limit_does_not_decide_that_a_text_is_over_it():
    """Counting doubling prefixes first must not refuse a text whose prefix (cut inside a word) already counts
    as many tokens as the limit: the whole text may count no more (and is then kept as it is: its double space
    would not survive a split and a repacking)."""
    text = "a  b c d e f g " + "h" * 19
    assert split_passages(text, words, 8) == [text]


def test_line_endings_become_newlines():
    assert split_passages("a b\r\nc d\re f", words, 8) == ["a b\nc d\ne f"]


def test_passages_never_exceed_the_limit_with_the_llm_tokenizer():
    count = token_counter(embedded_tokenizer())
    paragraphs = [" ".join(f"Sentence {i}.{j} talks about topic {i * j} in some detail." for j in range(i % 7 + 1))
                  for i in range(40)]
    text = "# Title\n\n" + "\n\n".join(paragraphs) + "\n\n" + "x9" * 300 + "\n\nThe end."
    for limit in (16, 64, 200):
        passages = split_passages(text, count, limit)
        assert all(count(p) <= limit for p in passages)
        assert "".join("".join(p.split()) for p in passages) == "".join(text.split())  # nothing lost or added
        assert len(passages) > 1
    assert split_passages(text, count, 64)[0].startswith("# Title\n\nSentence 0.0")  # whole paragraphs packed


def test_a_long_line_without_whitespace_costs_linear_work_with_the_llm_tokenizer():
    """Bug caught: a line without whitespace was cut by bisecting the whole remaining text for each passage
    (quadratic: over 600 s for 2 MB). With the LLM's tokenizer, 100 KB of letters: passages full to the limit,
    nothing lost, and the tokenizer asked to count at most 5 times the text (about 3 counts a passage)."""
    tokens = token_counter(embedded_tokenizer())
    text, counted = "".join(random.Random(0).choices(string.ascii_letters, k=100_000)), [0]

    def count(piece: str) -> int:
        counted[0] += len(piece)
        assert counted[0] <= 5 * len(text), "not linear: counted more than 5 times the text"
        return tokens(piece)

    passages = split_passages(text, calls_counted(count, calls := []), 256)
    assert "".join(passages) == text and all(tokens(p) <= 256 for p in passages)
    assert sum(tokens(p) == 256 for p in passages) >= len(passages) - 1  # full, but for the last
    assert len(calls) <= 3.5 * len(passages)  # each passage's end found in about 3 counts (2.98 here)


def calls_counted(count, calls: list):
    """``count``, recording the length of each text it is asked to count in ``calls``."""
    def counting(piece: str) -> int:
        calls.append(len(piece))
        return count(piece)

    return counting


def test_too_small_a_limit_is_refused():
    with pytest.raises(InvalidOptionError, match="at least 8 tokens"):
        split_passages("text", words, 4)


# -- files -----------------------------------------------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "notes.txt").write_text("Plain notes.\n\nSecond paragraph.")
    (root / "guide.md").write_text("Intro line.\n\n# The Guide  \n\nBody text.")
    (root / "sub" / "paper.pdf").write_bytes(minimal_pdf(["First page text.", "Second page text."], "A PDF title"))
    (root / "data.csv").write_text("a,b")
    (root / ".hidden" / "secret.txt").write_text("not ingested")
    return root


def test_find_files_walks_folders_and_checks_paths(corpus, tmp_path):
    expected = [corpus / "data.csv", corpus / "guide.md", corpus / "notes.txt", corpus / "sub" / "paper.pdf"]
    assert find_files([corpus]) == FileListing(expected, [(corpus / ".hidden", HIDDEN)])  # any name; hidden listed
    listing = find_files([corpus / "notes.txt", corpus, str(corpus / "guide.md")])
    assert listing.files == expected  # unique, sorted
    assert find_files([corpus / "data.csv"]).files == [corpus / "data.csv"]
    named = find_files([corpus / ".hidden" / "secret.txt", corpus])  # a hidden file named on its own is read
    assert corpus / ".hidden" / "secret.txt" in named.files and named.skipped == [(corpus / ".hidden", HIDDEN)]
    with pytest.raises(InvalidOptionError, match="does not exist"):
        find_files([tmp_path / "absent"])


def test_read_documents_and_their_titles(corpus):
    assert read_document(corpus / "notes.txt") == ("Plain notes.\n\nSecond paragraph.", "notes")
    assert read_document(corpus / "guide.md")[1] == "The Guide"
    text, title = read_document(corpus / "sub" / "paper.pdf")
    assert title == "A PDF title" and text == "First page text.\n\nSecond page text."
    (corpus / "untitled.pdf").write_bytes(minimal_pdf(["Only page."]))
    assert read_document(corpus / "untitled.pdf") == ("Only page.", "untitled")


def test_a_missing_pypdf_names_the_extra(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "pypdf", None)
    with pytest.raises(MissingDependencyError, match=r"ctx-integrations\[retrieval\]"):
        read_document(corpus / "sub" / "paper.pdf")
    assert read_document(corpus / "notes.txt")[1] == "notes"  # text files need no pypdf


def test_passages_carry_stable_ids_and_metadata(corpus):
    path = corpus / "notes.txt"
    docs = file_passages(path, words, 8)
    assert [d.text for d in docs] == ["Plain notes.\n\nSecond paragraph."]
    docs = file_passages(path, len, 17)
    assert [d.text for d in docs] == ["Plain notes.", "Second paragraph."]
    assert [d.id for d in docs] == [passage_id(path, 0), passage_id(path, 1)]
    assert docs[1].metadata == {"source": str(path), "title": "notes", "chunk": 1}
    assert passage_id(path, 0) == passage_id(Path(str(path)), 0) != passage_id(corpus / "sub" / "notes.txt", 0)
    assert passage_id(path, 0).startswith("notes.txt-")
    assert passage_id(corpus / "GFDL-1.3", 2).startswith("GFDL-1.3-") and passage_id(path, 2).endswith("#2")


# -- syncing a store -------------------------------------------------------------------------------------------
class CountingEmbedder:
    """The embedded MiniLM, counting the texts it embeds."""

    def __init__(self):
        self.inner, self.embedded = default_embedder(), 0
        self.name = self.inner.name

    identity = property(lambda self: self.inner.identity)
    dimension = property(lambda self: self.inner.dimension)
    spec = property(lambda self: self.inner.spec)

    def embed_documents(self, texts):
        self.embedded += len(texts)
        return self.inner.embed_documents(texts)

    def embed_query(self, text):
        return self.inner.embed_query(text)


def test_ingest_syncs_files_with_the_store(corpus, tmp_path):
    embedder = CountingEmbedder()
    store = DocumentStore(tmp_path / "store", embedder=embedder)
    other = tmp_path / "other.txt"
    other.write_text("A file ingested on its own.")
    assert ingest(store, [other], words, 8).added == 1

    first = ingest(store, [corpus], len, 20)
    assert (first.files, first.added, first.updated, first.unchanged, first.removed) == (4, first.passages, 0, 0, 0)
    assert first.passages == 8 and embedder.embedded == 9  # notes 2, guide 3 (heading alone), pdf 2, csv 1

    again = ingest(store, [corpus], len, 20)
    assert (again.added, again.updated, again.unchanged, again.removed) == (0, 0, 8, 0) and embedder.embedded == 9

    (corpus / "notes.txt").write_text("Changed notes.")  # passage 0 changes, passage 1 disappears
    (corpus / "guide.md").unlink()
    (corpus / "sub" / "paper.pdf").write_bytes(b"%PDF-1.4\ndamaged\n")
    edited = ingest(store, [corpus], len, 20)
    assert (edited.added, edited.updated, edited.unchanged, edited.removed, edited.kept) == (0, 1, 1, 4, 2)
    assert [path for path, _ in edited.skipped] == [corpus / ".hidden", corpus / "sub" / "paper.pdf"]
    assert edited.skipped[1][1].startswith("Pdf")  # pypdf's own error, named
    assert embedder.embedded == 10
    sources = sorted({d.metadata["source"] for d in store.all_documents()})
    assert sources == sorted([str(other), str(corpus / "data.csv"), str(corpus / "notes.txt"),
                              str(corpus / "sub" / "paper.pdf")])
    assert len(store.where({"source": str(corpus / "sub" / "paper.pdf")})) == 2  # unreadable now: kept as it was
    assert store.get([passage_id(corpus / "notes.txt", 0)])[0].text == "Changed notes."


# -- the command line ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_ingest_then_ask(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "harbour.md").write_text("# Harbour\n\nThe harbour master of Quillby is Orla Venn.\n\n"
                                     "Ships from Quillby sail north every spring.")
    (docs / "bakery.txt").write_text("The oldest bakery in Quillby sells rye bread since 1820.")
    store = tmp_path / "store"

    assert run_cli("ingest", str(docs), "--store", str(store), "--chunk-tokens", "16") == 0
    line = capsys.readouterr().out.strip()
    match = re.fullmatch(r"ingested 2 files into (.+): (\d+) passages \((\d+) added, 0 updated, 0 unchanged, "
                         r"0 removed\); KV caches: (\d+) computed in (.+); [\d.]+ s", line)
    assert match and match.group(1) == str(store) and match.group(2) == match.group(3) == match.group(4)
    assert match.group(5) == str(DocumentStore(store).kv_dir)  # the KV root, named for `serve --cache-dir`
    assert int(match.group(2)) >= 3  # 16 tokens split the harbour file
    count = token_counter(embedded_tokenizer())  # the LLM's tokenizer sized the passages
    assert all(count(doc.text) <= 16 for doc in DocumentStore(store).all_documents())

    assert run_cli("ingest", str(docs), "--store", str(store), "--chunk-tokens", "16") == 0
    assert f"(0 added, 0 updated, {match.group(2)} unchanged, 0 removed); KV caches: 0 computed" in (
        capsys.readouterr().out)

    assert run_cli("ask", "Who is the harbour master of Quillby?", "--store", str(store), "--top-k", "2",
               "--max-new-tokens", "4") == 0
    out = capsys.readouterr().out
    sources = [line for line in out.splitlines() if re.match(r"\s+\d+\. ", line)]
    assert len(sources) == 2 and any(str(docs / "harbour.md") in line for line in sources)
    assert "r=" in sources[0] and "dense=" in sources[0]
    assert "KV cache 2 hits / 0 misses" in out  # the caches computed at ingestion are the ones used

    questions = ["Who is the harbour master of Quillby?", "Since when does the bakery sell rye bread?"]
    assert run_cli("ask", *questions, "--store", str(store), "--top-k", "2", "--max-new-tokens", "4", "--mode", "ippd",
               "--json") == 0
    answers = json.loads(capsys.readouterr().out)
    assert [a["question"] for a in answers] == questions and {a["mode"] for a in answers} == {"ippd"}
    assert all(len(a["token_ids"]) == 4 and len(a["documents"]) == 2 for a in answers)
    assert answers[0]["timings"]["stacks"] == 1  # both questions were decoded in one stacked prompt

    assert run_cli("ingest", str(docs / "bakery.txt"), "--store", str(tmp_path / "plain"), "--no-cache") == 0
    assert "1 passages (1 added" in capsys.readouterr().out

    assert run_cli("ingest", str(tmp_path / "absent"), "--store", str(store)) == 2
    assert "does not exist" in capsys.readouterr().err
