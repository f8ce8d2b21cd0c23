"""Sealed document blocks: documents written into prompt text so that only the blocks written here come back out.

LangChain's RAG tutorial puts ``format_docs``'s string into the same prompt as the question and the chat
history, so :class:`~ctx_integrations.langchain.ChatContextOfExperts` has to find the documents' boundaries in
one text that also holds user text. Reading back every ``<document ...>`` block of that text let a question, a
pasted message or a retrieved document's own text forge a document with any id and score. So each block that
:func:`write_blocks` makes carries a seal, an HMAC-SHA256 under a key drawn once per process
(:func:`secrets.token_bytes`, never written anywhere), and :func:`read_blocks` recovers only blocks whose seal
verifies: marker-like text anywhere else (unsealed, sealed wrongly, or inside a sealed block's text) is plain
text.

A block is ``<document id="vault" score="0.78" chars="37" seal="...">``, a newline, the text, a newline and
``</document>``. ``chars`` (the text's length) finds the block's end, so the text may hold any ``</document>``.
The seal has two parts: ``head`` (16 hex digits) covers the id, the score and ``chars`` and is checked before
the text is read, so a forged opening costs one short HMAC; ``body`` (32 hex digits) covers the id, the score
and the text. Without ``head``, many forged openings pointing at one closing tag would have the text hashed once
per opening (quadratic in the prompt's length).

What the seal does not stop: a block copied verbatim from an earlier prompt of this process (a model asked to
repeat its context can echo one; LangChain's callbacks and traces carry the prompt as it was) is recovered as
the genuine document it is, with its own id, score and text. What a replay cannot do: change that id, score or
text, or count twice. A block is one document however often it appears (its seal is its identity: the same
id, score and text), so pasting a block seen once twenty times into a question gives one expert, not twenty
that outvote the retrieved documents; its repeats are taken out of the text as well. A prompt formatted in
another process is plain text here (its key differs).

Written by hand: neither LangChain nor the standard library has an authenticated inline document format.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

_KEY = secrets.token_bytes(32)  # this process's: blocks sealed elsewhere (or with a guessed key) are plain text
_HEAD = 16  # hex digits of the seal covering id, score and length
_BODY = 32  # hex digits of the seal covering id, score and text
_CLOSE = "\n</document>"
_SEPARATOR = "\n\n"
_OPENING = re.compile(r'<document(?P<attributes>(?: [a-z]+="[^"<>]*")*)>\n')
_ATTRIBUTE = re.compile(r'([a-z]+)="([^"]*)"')
_SEAL = re.compile(f"[0-9a-f]{{{_HEAD + _BODY}}}")


@dataclass(frozen=True)
class Block:
    """One document as a block carries it: its id, its relevance r (``None``: none given) and its text."""

    id: str
    score: float | None
    text: str


def _mac(size: int, *parts: str) -> str:
    return hmac.new(_KEY, json.dumps(parts).encode(), hashlib.sha256).hexdigest()[:size]


def _write(block: Block) -> str:
    score = "" if block.score is None else repr(float(block.score))
    chars = str(len(block.text))
    seal = _mac(_HEAD, "head", block.id, score, chars) + _mac(_BODY, "body", block.id, score, block.text)
    attributes = f' id="{html.escape(block.id)}"' + (f' score="{score}"' if score else "")
    return f'<document{attributes} chars="{chars}" seal="{seal}">\n{block.text}{_CLOSE}'


def write_blocks(blocks: Sequence[Block]) -> str:
    """The blocks as one string, blank-line separated, each sealed so that :func:`read_blocks` recovers it."""
    return _SEPARATOR.join(_write(block) for block in blocks)


def _verified(text: str, opening: re.Match[str]) -> tuple[Block, str, int] | None:
    """The block this opening starts, its seal and where it ends, or ``None`` when its seal does not verify."""
    attributes = dict(_ATTRIBUTE.findall(opening["attributes"]))
    if not {"id", "chars", "seal"} <= attributes.keys() or not _SEAL.fullmatch(attributes["seal"]):
        return None
    seal, chars = attributes["seal"], attributes["chars"]
    identifier, score = html.unescape(attributes["id"]), attributes.get("score", "")
    if not hmac.compare_digest(seal[:_HEAD], _mac(_HEAD, "head", identifier, score, chars)):
        return None
    start = opening.end()
    end = start + int(chars)  # a number this process wrote: the head verified
    body = text[start:end]
    if not text.startswith(_CLOSE, end) or not hmac.compare_digest(seal[_HEAD:], _mac(_BODY, "body", identifier,
                                                                                      score, body)):
        return None
    return Block(identifier, float(score) if score else None, body), seal, end + len(_CLOSE)


def read_blocks(text: str, seen: set[str] | None = None) -> tuple[list[Block], str]:
    """The sealed blocks in ``text``, in order, each once, and the text without them.

    A run of blocks goes with the whitespace between them; the text around a run is kept as it is. Text
    inside a recovered block is never searched for more blocks. A block that appears again (the same seal:
    the same id, score and text) is taken out of the text but not returned again; ``seen`` holds the seals
    already returned (for the other messages of one prompt) and gets this text's.
    """
    seen = set() if seen is None else seen
    blocks: list[Block] = []
    kept: list[str] = []
    position = last = 0
    found_any = False
    while (opening := _OPENING.search(text, position)) is not None:
        found = _verified(text, opening)
        if found is None:
            position = opening.start() + 1
            continue
        block, seal, end = found
        between = text[last:opening.start()]
        if not found_any or between.strip():
            kept.append(between)
        found_any = True
        if seal not in seen:
            seen.add(seal)
            blocks.append(block)
        position = last = end
    kept.append(text[last:])
    return blocks, "".join(kept)
