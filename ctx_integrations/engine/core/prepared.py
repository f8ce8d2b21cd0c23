"""Documents prepared once: a text's context tokens and its cache key, computed the first time the text is seen.

A warm request over 64 x 2048-token documents spent 44 % of its host time tokenising: every document
was tokenised three to four times per request (the loader thread's prefetch, the mode's stream budget,
its cache lookup, the adapters' prompt-token count) and its cache key hashed two to three times. A
request now carries its documents' :class:`PreparedText` from the start (built in the caller's thread,
:class:`~ctx_integrations.engine.core.registry.DecodeContext`), and :class:`PreparedTexts` remembers
them per text, so a document asked about again is neither tokenised nor hashed again: the LRU is the
"reuse from the store by text" of a warm request, bounded by the tokens it holds.

Written by hand: it is a memo over :meth:`PromptLayout.context_ids` and :meth:`KVCacheStore.entry_key`,
whose outputs depend only on the text (for one layout and one store).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ctx_integrations.engine.core.layout import PromptLayout


class KeyedStore(Protocol):
    """What the memo needs of :class:`~ctx_integrations.engine.core.cache.KVCacheStore` (which imports this module)."""

    def entry_key(self, layout: PromptLayout, token_ids: Sequence[int], kind: str = "doc") -> str: ...

# Tokens the memo keeps (least recently used texts dropped first): 64 x 2048-token documents fit four times.
DEFAULT_MEMO_TOKENS = 1 << 19


@dataclass(frozen=True)
class PreparedText:
    """A document's context tokens (``PromptLayout.context_ids``) and its cache key (``KVCacheStore.entry_key``)."""

    ids: tuple[int, ...]
    key: str

    @property
    def tokens(self) -> int:
        return len(self.ids)


class PreparedTexts:
    """The memo of :class:`PreparedText` per text for one layout and one store; safe to call from any thread."""

    def __init__(self, layout: PromptLayout, store: KeyedStore, max_tokens: int = DEFAULT_MEMO_TOKENS):
        self.layout, self.store, self.max_tokens = layout, store, max_tokens
        self._memo: OrderedDict[str, PreparedText] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def prepare(self, text: str) -> PreparedText:
        """The text's tokens and cache key: from the memo, or computed now (and remembered)."""
        with self._lock:
            found = self._memo.get(text)
            if found is not None:
                self._memo.move_to_end(text)
                return found
        ids = tuple(self.layout.context_ids(text))
        prepared = PreparedText(ids, self.store.entry_key(self.layout, ids))
        with self._lock:
            if text not in self._memo and prepared.tokens <= self.max_tokens:
                self._memo[text] = prepared
                self._tokens += prepared.tokens
                while self._tokens > self.max_tokens:
                    _, dropped = self._memo.popitem(last=False)
                    self._tokens -= dropped.tokens
        return prepared

    def prepare_all(self, texts: list[str]) -> list[PreparedText]:
        return [self.prepare(text) for text in texts]

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._tokens = 0
