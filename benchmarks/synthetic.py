"""The PCED paper's synthetic latency set: N documents of exactly L tokens, one holds a secret code.

Filler is made of words that are one token each (with their leading space) in byte-level BPE
vocabularies, so adding a word adds exactly one token and every document can be cut to exactly L
tokens as the engine's layout tokenises it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ctx_integrations.engine.core.layout import PromptLayout

_FILLER = ("the river town market people water city day year time house school road field work light house "
           "tree hill stone wind rain bridge north south east west small large old new green blue red morning "
           "evening night week summer winter garden table window door street wall farm village").split()
QUESTION = "What is the secret code? Answer with the code only."


@dataclass
class SecretCodeExample:
    documents: list[str]
    needle_index: int
    code: str
    question: str = QUESTION

    @property
    def answers(self) -> list[str]:
        return [self.code]


def _single_token_words(layout: PromptLayout) -> list[str]:
    encode = layout.tokenizer
    words = [w for w in dict.fromkeys(_FILLER) if len(encode(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    if len(words) < 10:
        raise RuntimeError("tokenizer has too few single-token filler words for the synthetic set")
    return words


def _fit(layout: PromptLayout, head: str, words: list[str], length: int) -> str:
    """``head`` followed by filler words, cut so the document is exactly ``length`` tokens."""
    text = head
    for word in words:
        if len(layout.context_ids(text)) >= length:
            break
        text += " " + word
    n = len(layout.context_ids(text))
    if n != length:
        raise RuntimeError(f"could not fit a document to {length} tokens (got {n}); raise the length")
    return text


def secret_code_example(layout: PromptLayout, n_documents: int, length: int, seed: int = 0) -> SecretCodeExample:
    rng = random.Random(seed)
    vocab = _single_token_words(layout)
    code = str(rng.randint(10000, 99999))
    needle = rng.randrange(n_documents)
    documents = []
    for i in range(n_documents):
        words = [rng.choice(vocab) for _ in range(length + 8)]
        if i == needle:
            cut = rng.randrange(1, max(2, length // 2))
            head = "Note:" + "".join(" " + w for w in words[:cut]) + f". The secret code is {code}."
            documents.append(_fit(layout, head, words[cut:], length))
        else:
            documents.append(_fit(layout, "Note:", words, length))
    return SecretCodeExample(documents, needle, code)
