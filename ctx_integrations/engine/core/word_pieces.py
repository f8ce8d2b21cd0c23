"""Which vocabulary tokens continue a word, and after which tokens a word may go on.

PCED's ``switch="word"`` keeps a word with the expert that began it; to know where words begin it needs,
per token id, whether the token's text starts with a letter or digit (no leading space or punctuation:
it continues the word before it) and whether it ends with one (a word may continue after it). Written
by hand: tokenizers expose no such table (byte-level BPE marks a leading space as ``Ġ``, SentencePiece
as ``▁``; decoding each id is the one way that works for both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WordPieces:
    """Per token id (the model's whole output vocabulary): ``continues`` (its text starts with a letter or
    digit) and ``inside`` (its text ends with one). Ids the tokenizer cannot decode are neither."""

    continues: torch.Tensor  # [V] bool
    inside: torch.Tensor  # [V] bool

    def continues_word(self, last_token: int | None) -> torch.Tensor | None:
        """The tokens that would continue the word ``last_token`` is in; ``None`` if no word is open."""
        if last_token is None or not bool(self.inside[last_token]):
            return None
        return self.continues


def word_pieces(tokenizer: object, vocab_size: int) -> WordPieces:
    """Build the table for ``tokenizer`` over ``vocab_size`` output ids (the LM head's rows, which may
    outnumber the tokenizer's ids: the extra ids are padding and continue nothing)."""
    decodable = min(vocab_size, len(tokenizer))  # type: ignore[arg-type]
    texts = tokenizer.batch_decode([[i] for i in range(decodable)])  # type: ignore[attr-defined]
    continues = torch.zeros(vocab_size, dtype=torch.bool)
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    continues[:decodable] = torch.tensor([bool(t) and t[0].isalnum() for t in texts])
    inside[:decodable] = torch.tensor([bool(t) and t[-1].isalnum() for t in texts])
    return WordPieces(continues, inside)
