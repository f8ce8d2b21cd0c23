"""The one entry point: ``Engine.generate(query, documents, mode=...) -> Answer``.

The engine owns a loaded model, the prompt layout and the KV-cache store; every mode runs through
``generate`` so validation, timing and cache accounting live in one place.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from ctx_integrations.documents import Document, prepare_documents
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.cache import KVCacheStore, StreamBatch
from ctx_integrations.engine.core.chat import CHAT_MODE, conversation_ids
from ctx_integrations.engine.core.layout import (
    DEFAULT_CONTEXT_TEMPLATE,
    PCED_QUESTION_TEMPLATE,
    PCED_SYSTEM_PROMPT,
    PromptLayout,
)
from ctx_integrations.engine.core.model import LoadedModel, load_model
from ctx_integrations.engine.core.registry import (
    DecodeContext,
    answers_many,
    available_modes,
    check_options,
    resolve_mode,
)
from ctx_integrations.engine.core.streams import (
    DecodeResult,
    StopCriteria,
    TokenSampler,
    decode_fused,
    forward_streams,
    single_stream,
)
from ctx_integrations.engine.core.token_stream import AnswerStream, aiter_tokens, iter_tokens
from ctx_integrations.errors import DocumentTooLongError, EmptyDocumentsError, InvalidOptionError, InvalidScoresError


def _documents_per_question(documents: Any, count: int) -> list[Sequence[Any]] | None:
    """``documents`` as one list per question when it is given that way, else ``None`` (shared)."""
    if isinstance(documents, (str, bytes)) or not documents:
        return None
    if not all(isinstance(d, (list, tuple)) for d in documents):
        return None
    if len(documents) != count:
        raise EmptyDocumentsError(f"got {len(documents)} document lists for {count} questions: give one list per "
                                  "question, or one list shared by all")
    return list(documents)


def _answer(ctx: DecodeContext, result: DecodeResult, mode: str, options: dict[str, Any], total: float,
            hits: int, misses: int) -> Answer:
    decode_s = max(total - result.ttft_s, 1e-9)
    timings = {"ttft_s": result.ttft_s, "total_s": total, "decode_s": decode_s,
               "tokens_per_s": (len(result.token_ids) - 1) / decode_s if len(result.token_ids) > 1 else 0.0,
               "new_tokens": float(len(result.token_ids)), **ctx.timings}
    return Answer(text=result.text, token_ids=result.token_ids, trace=result.trace, timings=timings,
                  documents=ctx.documents, mode=mode, cache_hits=hits, cache_misses=misses,
                  finish_reason=result.finish_reason, options=dict(options), extra=result.extra)


class Engine:
    """A local decoder with per-document KV caches and every decoding mode.

    ``cache_dir`` is where document caches persist (``None``: memory only). One engine serves one
    request at a time (a lock serialises calls from threads or async adapters).
    """

    def __init__(self, loaded: LoadedModel, *, cache_dir: str | os.PathLike | None = None,
                 half_on_disk: bool = False, memory_entries: int = 256,
                 system_prompt: str = PCED_SYSTEM_PROMPT, question_template: str = PCED_QUESTION_TEMPLATE,
                 context_template: str = DEFAULT_CONTEXT_TEMPLATE):
        self.loaded = loaded
        self.layout = PromptLayout(loaded.tokenizer, system_prompt, question_template, context_template)
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
        knobs (see ``ctx_integrations.engine.core.registry.mode_options(mode)``).
        """
        run = self._check_call(mode, options)
        ctx = self._context(query, prepare_documents(documents, scores), TokenSampler(temperature, top_p, seed),
                            StopCriteria(self.loaded.eos_token_ids, max_new_tokens, stop), on_token)
        return self._decode(run, mode, [ctx], options)[0]

    def generate_many(self, questions: Sequence[str], documents: Sequence[Any], scores: Sequence[float] | None = None,
                      mode: str = "ippd", *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                      seed: int | None = None, stop: Sequence[str] | str = (), **options: Any) -> list[Answer]:
        """Answer every question in ``questions``; one :class:`Answer` per question, in order.

        ``documents`` is either one list of documents shared by every question, or one list per
        question (``len(documents) == len(questions)``, each element a list). ``mode="ippd"`` (the
        default) decodes all questions in one stacked prompt, one forward pass per step for every
        answer; any other mode answers the questions one by one (``mode="concat"``: the independent
        baseline). With a ``seed``, question i samples with seed ``seed + i``.
        """
        run = self._check_call(mode, options)
        if isinstance(questions, str) or not questions:
            raise InvalidOptionError("questions must be a non-empty list of strings (got "
                                     f"{'a single string' if isinstance(questions, str) else 'nothing'})")
        per_question = _documents_per_question(documents, len(questions))
        if per_question is None:
            shared = prepare_documents(documents, scores)
            per_question = [shared] * len(questions)
        else:
            if scores is not None:
                raise InvalidScoresError("with one document list per question, give the scores inside the documents")
            per_question = [prepare_documents(docs) for docs in per_question]
        contexts = [self._context(q, list(docs),
                                  TokenSampler(temperature, top_p, None if seed is None else seed + i),
                                  StopCriteria(self.loaded.eos_token_ids, max_new_tokens, stop), None)
                    for i, (q, docs) in enumerate(zip(questions, per_question))]
        if answers_many(mode):
            return self._decode(run, mode, contexts, options)
        return [self._decode(run, mode, [ctx], options)[0] for ctx in contexts]

    def _check_call(self, mode: str, options: dict[str, Any]) -> Callable[..., Any]:
        run = resolve_mode(mode)
        check_options(mode, options)
        return run

    def _context(self, query: str, documents: list[Document], sampler: TokenSampler, stop: StopCriteria,
                 on_token: Callable[[str], None] | None) -> DecodeContext:
        if not isinstance(query, str) or not query.strip():
            raise InvalidOptionError("query must be a non-empty string")
        return DecodeContext(self, query, documents, sampler, stop, on_token)

    def _decode(self, run: Callable[..., Any], mode: str, contexts: list[DecodeContext],
                options: dict[str, Any]) -> list[Answer]:
        """Run ``mode`` over ``contexts`` (several only for a mode that answers many questions at once)."""
        with self._lock:
            before = self.store.stats.as_dict()
            started = time.perf_counter()
            for ctx in contexts:
                ctx.started = started
            results = run(contexts, **options) if answers_many(mode) else [run(contexts[0], **options)]
            total = time.perf_counter() - started
            after = self.store.stats.as_dict()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        return [_answer(ctx, result, mode, options, total, hits, misses) for ctx, result in zip(contexts, results)]

    async def agenerate(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
                        mode: str = "pced", **kwargs: Any) -> Answer:
        """:meth:`generate` for async callers: awaits the answer without blocking the event loop."""
        return await asyncio.to_thread(self.generate, query, documents, scores, mode, **kwargs)

    def astream(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
                mode: str = "pced", **kwargs: Any) -> AnswerStream:
        """Async token streaming: ``async for piece in engine.astream(...)``, then the stream's ``.answer``.

        Leaving the loop early cancels the request.
        """
        if "on_token" in kwargs:
            raise InvalidOptionError("astream() delivers tokens itself; use generate(on_token=...) for a callback")
        sink: dict[str, Any] = {}
        call = functools.partial(self.generate, query, documents, scores, mode, **kwargs)
        return AnswerStream(aiter_tokens(lambda on_token: call(on_token=on_token), sink), sink)

    async def agenerate_many(self, questions: Sequence[str], documents: Sequence[Any],
                             scores: Sequence[float] | None = None, mode: str = "ippd", **kwargs: Any) -> list[Answer]:
        """:meth:`generate_many` for async callers."""
        return await asyncio.to_thread(self.generate_many, questions, documents, scores, mode, **kwargs)

    def chat(self, messages: Sequence[dict[str, str]], *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | str = (),
             on_token: Callable[[str], None] | None = None) -> Answer:
        """Answer a conversation (``[{"role": ..., "content": ...}, ...]``) with no documents (mode ``"chat"``)."""
        ids = conversation_ids(self.loaded.tokenizer, messages)
        if len(ids) + max_new_tokens > self.loaded.max_positions:
            raise DocumentTooLongError(
                f"the conversation has {len(ids)} tokens + max_new_tokens={max_new_tokens}, more than the model's "
                f"window of {self.loaded.max_positions}: drop earlier turns or lower max_new_tokens")
        sampler = TokenSampler(temperature, top_p, seed)
        criteria = StopCriteria(self.loaded.eos_token_ids, max_new_tokens, stop)
        loaded, device = self.loaded, self.loaded.device
        with self._lock:
            started = time.perf_counter()
            streams = StreamBatch(DynamicCache(), torch.zeros(1, 0, dtype=torch.long, device=device),
                                  torch.zeros(1, dtype=torch.long, device=device))
            first_logits = forward_streams(loaded.model, streams, torch.tensor([ids], device=device))
            ctx = DecodeContext(self, "", [], sampler, criteria, on_token, started)
            ctx.timings.update(prefill_s=time.perf_counter() - started, prompt_tokens=float(len(ids)))
            result = decode_fused(loaded.model, loaded.tokenizer, streams, first_logits, single_stream, sampler,
                                  criteria, on_token, started)
            total = time.perf_counter() - started
        return _answer(ctx, result, CHAT_MODE, {}, total, 0, 0)

    async def achat(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> Answer:
        """:meth:`chat` for async callers."""
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    def stream_chat(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> Generator[str, None, Answer]:
        """:meth:`chat` as a generator of text pieces; the :class:`Answer` is its return value."""
        return (yield from iter_tokens(lambda on_token: self.chat(messages, on_token=on_token, **kwargs)))

    def astream_chat(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> AnswerStream:
        """:meth:`chat` as an async stream of text pieces, then the stream's ``.answer``."""
        sink: dict[str, Any] = {}
        return AnswerStream(aiter_tokens(lambda on_token: self.chat(messages, on_token=on_token, **kwargs), sink),
                            sink)

    def stream(self, query: str, documents: Sequence[Any], **kwargs: Any) -> Generator[str, None, Answer]:
        """Yield text pieces as they are decoded; the final :class:`Answer` is the generator's return value.

        Closing the generator early stops decoding at the next token.
        """
        if "on_token" in kwargs:
            raise InvalidOptionError("stream() delivers tokens itself; use generate(on_token=...) for a callback")
        if not documents:
            raise EmptyDocumentsError("no documents were given: pass at least one document")
        return (yield from iter_tokens(lambda on_token: self.generate(query, documents, on_token=on_token, **kwargs)))
