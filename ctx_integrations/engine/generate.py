"""The one entry point: ``Engine.generate(query, documents, mode=...) -> Answer``.

The engine owns a loaded model, the prompt layout and the KV-cache store; every mode runs through
``generate`` so validation, timing and cache accounting live in one place.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch

from ctx_integrations.documents import prepare_documents
from ctx_integrations.engine.answer import Answer
from ctx_integrations.engine.cache import KVCacheStore
from ctx_integrations.engine.layout import PCED_QUESTION_TEMPLATE, PCED_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.model import LoadedModel, load_model
from ctx_integrations.engine.modes import DecodeContext, available_modes, check_options, resolve_mode
from ctx_integrations.engine.streams import StopCriteria, TokenSampler
from ctx_integrations.engine.token_stream import iter_tokens
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError


class Engine:
    """A local decoder with per-document KV caches and every decoding mode.

    ``cache_dir`` is where document caches persist (``None``: memory only). One engine serves one
    request at a time (a lock serialises calls from threads or async adapters).
    """

    def __init__(self, loaded: LoadedModel, *, cache_dir: str | os.PathLike | None = None,
                 half_on_disk: bool = False, memory_entries: int = 256,
                 system_prompt: str = PCED_SYSTEM_PROMPT, question_template: str = PCED_QUESTION_TEMPLATE):
        self.loaded = loaded
        self.layout = PromptLayout(loaded.tokenizer, system_prompt, question_template)
        self.layout.prefix_ids  # fail early on a model without a usable chat template  # noqa: B018
        self.store = KVCacheStore(loaded, Path(cache_dir) if cache_dir is not None else None, half_on_disk,
                                  memory_entries)
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, adapter: str | os.PathLike | None = None,
                        **engine_options: Any) -> Engine:
        """Load the embedded default (no argument) or an HF id, a local directory or a ``.gguf`` file.

        ``adapter``: a LoRA folder from ``ctx-experts distill``, merged into the weights.
        """
        return cls(load_model(name_or_path, device=device, dtype=dtype, adapter=adapter), **engine_options)

    @property
    def modes(self) -> list[str]:
        return available_modes()

    def warm(self, documents: Sequence[Any]) -> dict[str, int]:
        """Compute (or load) the KV cache of every document now, e.g. at ingestion; returns hits/misses."""
        docs = prepare_documents(documents)
        with self._lock:
            before = self.store.stats.as_dict()
            self.store.documents(self.layout, [doc.text for doc in docs])
            after = self.store.stats.as_dict()
        return {k: after[k] - before[k] for k in after}

    def generate(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
                 mode: str = "pced", *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | str = (),
                 on_token: Callable[[str], None] | None = None, **options: Any) -> Answer:
        """Answer ``query`` from ``documents`` with decoding ``mode``.

        ``documents``: strings, :class:`~ctx_integrations.Document` objects or retrieved objects with
        ``text``/``score``; ``scores`` (one r in [0, 1] per document) overrides their scores.
        ``on_token`` receives each new piece of text as it is decoded. ``options`` are the mode's
        knobs (see ``ctx_integrations.engine.modes.mode_options(mode)``).
        """
        run = resolve_mode(mode)
        check_options(mode, options)
        if not isinstance(query, str) or not query.strip():
            raise InvalidOptionError("query must be a non-empty string")
        docs = prepare_documents(documents, scores)
        ctx = DecodeContext(self, query, docs, TokenSampler(temperature, top_p, seed),
                            StopCriteria(self.loaded.eos_token_ids, max_new_tokens, stop), on_token)
        with self._lock:
            before = self.store.stats.as_dict()
            ctx.started = time.perf_counter()
            result = run(ctx, **options)
            total = time.perf_counter() - ctx.started
            after = self.store.stats.as_dict()
        decode_s = max(total - result.ttft_s, 1e-9)
        timings = {"ttft_s": result.ttft_s, "total_s": total, "decode_s": decode_s,
                   "tokens_per_s": (len(result.token_ids) - 1) / decode_s if len(result.token_ids) > 1 else 0.0,
                   "new_tokens": float(len(result.token_ids)), **ctx.timings}
        return Answer(text=result.text, token_ids=result.token_ids, trace=result.trace, timings=timings,
                      documents=docs, mode=mode, cache_hits=after["hits"] - before["hits"],
                      cache_misses=after["misses"] - before["misses"], finish_reason=result.finish_reason,
                      options=dict(options), extra=result.extra)

    def stream(self, query: str, documents: Sequence[Any], **kwargs: Any) -> Generator[str, None, Answer]:
        """Yield text pieces as they are decoded; the final :class:`Answer` is the generator's return value.

        Closing the generator early stops decoding at the next token.
        """
        if "on_token" in kwargs:
            raise InvalidOptionError("stream() delivers tokens itself; use generate(on_token=...) for a callback")
        if not documents:
            raise EmptyDocumentsError("no documents were given: pass at least one document")
        return (yield from iter_tokens(lambda on_token: self.generate(query, documents, on_token=on_token, **kwargs)))
