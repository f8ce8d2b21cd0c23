"""Build the ``manuals`` evaluation corpus from the GNU manuals' Info files (``/usr/share/info``).

    python tools/build_manuals_set.py              # writes ctx_integrations/evaluation/data/manuals_passages.jsonl.gz
    python tools/build_manuals_set.py --check      # also recounts every passage with the library's own tokenizer path
    python tools/build_manuals_set.py --info DIR --output FILE

Each Info node becomes plain text: the node header, Info's index markers, menus and heading underlines are
dropped, cross references read "see NODE", and the node's name is kept as the passage title
(``"coreutils: sort invocation"``). Index nodes, the GNU Free Documentation License appendix and the "copying
this manual" nodes are left out (licence text is held out of the evaluation corpora), and so are nodes of
fewer than 10 words (a heading over a menu). Each node's text is split with the library's own
:func:`ctx_integrations.retrieval.ingest.split_passages` so that every passage *as the model reads it*
(``Title: TITLE`` line, then the text: :func:`ctx_integrations.evaluation.nq.passage_text`) is at most 512
tokens of the evaluation model's tokenizer (Qwen2.5-Coder-0.5B, ``ctx-experts models fetch
qwen2.5-coder-0.5b``). Passage ids are ``MANUAL/NODE-SLUG/N`` (N from 1 within the node), e.g.
``coreutils/sort-invocation/2``.

The output is deterministic: the same Info files and tokenizer give the same bytes (gzip without a name or
time stamp, rows in the manuals' own order). The token counter is the ``tokenizers`` library over the
``tokenizer.json`` that the library's GGUF conversion of the fetched model wrote (what ``load_tokenizer``'s
fast tokenizer wraps: ``--check`` confirms the counts with
``token_counter(load_tokenizer("qwen2.5-coder-0.5b"))`` for every passage).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ctx_integrations.retrieval.ingest import split_passages  # noqa: E402

INFO_DIR = Path("/usr/share/info")
OUTPUT = ROOT / "ctx_integrations" / "evaluation" / "data" / "manuals_passages.jsonl.gz"
MAX_TOKENS = 512
MODEL_ALIAS = "qwen2.5-coder-0.5b"
# (name in ids, Info file stem): the manuals that carry the GFDL notice, about 600 KB gzip-compressed in all
MANUALS = (("coreutils", "coreutils"), ("grep", "grep"), ("sed", "sed"), ("gzip", "gzip"),
           ("diffutils", "diffutils"), ("find", "find"), ("wget", "wget"), ("ed", "ed"), ("time", "time"))
_LEFT_OUT = re.compile(r"index$|^GNU Free Documentation License$|^Copying This Manual$", re.IGNORECASE)
MIN_WORDS = 10

TokenCounter = Callable[[str], int]


def info_files(info_dir: Path, stem: str) -> list[Path]:
    """The manual's Info files in order: ``stem.info.gz``, then its split parts ``stem.info-1.gz``, ..."""
    main = info_dir / f"{stem}.info.gz"
    if not main.is_file():
        raise FileNotFoundError(f"{main} not found")
    parts = sorted(info_dir.glob(f"{stem}.info-*.gz"), key=lambda p: int(p.name.split("-")[-1].split(".")[0]))
    return [main, *parts]


def info_nodes(files: list[Path]) -> Iterator[tuple[str, str]]:
    """``(node name, raw body)`` for every node of the files, in order (the tag table and indirect table skipped)."""
    for path in files:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
        for chunk in text.split("\x1f"):
            chunk = chunk.lstrip("\n")
            if not chunk.startswith("File: "):
                continue
            header, _, body = chunk.partition("\n")
            found = re.search(r"Node: ([^,\t]+?)\s*(?:,|$)", header)
            if found:
                yield found.group(1).strip(), body


def plain_text(body: str) -> str:
    """One node's body as plain text: no index markers, no menu, no heading underlines, "see X" references."""
    body = re.sub(r"\x00\x08\[[^\x00]*\x00\x08\]", "", body)
    body = body.replace("\x7f", "").replace("\x00", "")
    kept, in_menu = [], False
    for line in body.split("\n"):
        if line.startswith("* Menu:"):
            in_menu = True
        elif in_menu and re.match(r" {3}\S", line):  # a paragraph after the menu (a footnote, a last remark)
            in_menu = False
        if not in_menu and not _underline(line, kept[-1] if kept else ""):
            kept.append(line.rstrip())
    text = "\n".join(kept)
    # cross references: "*note Node::" / "*note Label: (file)Node." -> "see Node" / "see Label"
    see = r"(?:\b([Ss]ee)[ \n]+)?\*([Nn])ote[ \n]+"  # "see *note X::" reads "see X", not "see see X"
    text = re.sub(see + r"([^:*]+?)::", lambda m: f"{_see(m)} {m.group(3)}", text)
    text = re.sub(see + r"([^:*]+?):[ \n]+(?:\([^)]*\))?[^.,:;]*?([.,])",
                  lambda m: f"{_see(m)} {m.group(3)}{m.group(4)}", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _see(match: re.Match) -> str:
    return match.group(1) or ("See" if match.group(2) == "N" else "see")


def _underline(line: str, previous: str) -> bool:
    """A heading's underline: one of ``=*-.`` repeated under a line of about its length (not a diff's ``***``)."""
    return bool(re.fullmatch(r"([=*\-.])\1{2,}", line.strip())) and previous.strip() != "" \
        and abs(len(line.strip()) - len(previous.strip())) <= 2


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "node"


def manual_passages(manual: str, files: list[Path], count: TokenCounter,
                    max_tokens: int = MAX_TOKENS) -> Iterator[dict[str, str]]:
    """Rows ``{"id", "title", "text"}`` of one manual, each within ``max_tokens`` as the model reads it."""
    seen: set[str] = set()
    for node, body in info_nodes(files):
        if _LEFT_OUT.search(node):
            continue
        text = plain_text(body)
        if len(text.split()) < MIN_WORDS:
            continue
        base = slug(node)
        while base in seen:  # two node names with one slug: the later one gets a suffix
            base += "-x"
        seen.add(base)
        title = f"{manual}: {node}"
        room = max_tokens - count(f"Title: {title}\n")
        for number, passage in enumerate(split_passages(text, count, max_tokens=room), 1):
            yield {"id": f"{manual}/{base}/{number}", "title": title, "text": passage}


def build(info_dir: Path, count: TokenCounter, manuals=MANUALS) -> list[dict[str, str]]:
    return [row for manual, stem in manuals for row in manual_passages(manual, info_files(info_dir, stem), count)]


def encode(rows: list[dict[str, str]]) -> bytes:
    """The rows as gzip-compressed jsonl, byte for byte the same for the same rows (no name, time stamp 0)."""
    raw = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buffer, mtime=0) as sink:
        sink.write(raw)
    return buffer.getvalue()


def tokenizer_file() -> Path:
    """The evaluation model's ``tokenizer.json``, where the library's conversion of the fetched GGUF keeps it
    (``<cache>/models/<gguf stem>-<sha256[:16]>/``, as ``engine.core.model.converted_gguf_dir`` names it)."""
    from ctx_integrations.model_catalog import CATALOG
    from ctx_integrations.paths import cache_root

    entry = CATALOG[MODEL_ALIAS]
    return cache_root() / "models" / f"{Path(entry.file_name).stem}-{entry.sha256[:16]}" / "tokenizer.json"


def fast_counter(path: Path | None = None) -> TokenCounter:
    """Tokens of a text without special tokens, by the ``tokenizers`` library over ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path or tokenizer_file()))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def library_counter() -> TokenCounter:
    """The library's own counter: ``token_counter(load_tokenizer(alias))`` (converts the GGUF if needed)."""
    from ctx_integrations.engine.core.model import load_tokenizer
    from ctx_integrations.retrieval.ingest import token_counter

    return token_counter(load_tokenizer(MODEL_ALIAS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--info", type=Path, default=INFO_DIR, help="folder of the Info files (/usr/share/info)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the passages file to write")
    parser.add_argument("--check", action="store_true",
                        help="recount every passage with token_counter(load_tokenizer(...)) (slower)")
    args = parser.parse_args(argv)
    if not tokenizer_file().is_file():
        library_counter()  # converts the fetched model, which writes tokenizer.json
    count = fast_counter()
    rows = build(args.info, count)
    data = encode(rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(data)
    longest = max(count(f"Title: {row['title']}\n{row['text']}") for row in rows)
    print(f"{args.output}: {len(rows)} passages, {len(data):,} bytes, longest {longest} tokens")
    if args.check:
        slow = library_counter()
        bad = [row["id"] for row in rows if slow(f"Title: {row['title']}\n{row['text']}") != count(
            f"Title: {row['title']}\n{row['text']}")]
        print(f"library counter: {len(rows) - len(bad)} of {len(rows)} passages counted alike"
              + (f"; differ: {bad[:5]}" if bad else ""))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
