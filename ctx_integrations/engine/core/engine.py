"""The one entry point: ``Engine.generate(query, documents, mode=...) -> Answer``, and its async twins.

The engine owns the prompt layout and the KV-cache store over a loaded model; every request is
validated here, in the caller's thread (so bad input fails at once, with a typed error), then handed
to the model's :class:`~ctx_integrations.engine.core.scheduler.Scheduler`, which batches the streams
of all concurrent requests into one forward per step. ``generate`` blocks; ``agenerate`` /
``astream`` await the scheduler without blocking the event loop and without a thread per request.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import CancelledError as CompileCancelledError
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ctx_integrations.documents import Document, prepare_documents, user_text
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.cache import KVCacheStore
from ctx_integrations.engine.core.chat import conversation_ids
from ctx_integrations.engine.core.compile_pool import check_format_size
from ctx_integrations.engine.core.config import EngineConfig
from ctx_integrations.engine.core.decoding import StopCriteria, TokenSampler
from ctx_integrations.engine.core.defaults import DEFAULT_BATCH_MODE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODE
from ctx_integrations.engine.core.handle import AnswerHandle, AnswerStream, Pieces, compiled_off_loop
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.model import LoadedModel, load_model
from ctx_integrations.engine.core.prepared import PreparedTexts
from ctx_integrations.engine.core.registry import (
    DecodeContext,
    answers_many,
    available_modes,
    check_mode,
    check_sampling,
)
from ctx_integrations.engine.core.requests import ChatRequest, ModeRequest, WarmRequest
from ctx_integrations.engine.core.sampling import SamplingParams
from ctx_integrations.engine.core.scheduler import Request, RequestCancelledError, RequestHandle, scheduler_for
from ctx_integrations.engine.core.structured import CompiledFormat
from ctx_integrations.engine.core.tools import tool_request
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


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or timeout != timeout:
        raise InvalidOptionError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return float(timeout)


def _check_callback(on_token: Any) -> Callable[[str], None] | None:
    """Refuse an ``on_token`` that is not callable with one positional str now, in the caller's thread: it would
    fail on the scheduler's, mid-answer, with a ``TypeError`` from inside the decode loop.

    A callable whose signature Python cannot read (some builtins) is taken as it is.
    """
    if on_token is None:
        return None
    if not callable(on_token):
        raise InvalidOptionError(f"on_token must be a callable taking one str (or None), got "
                                 f"{type(on_token).__name__}")
    try:
        signature = inspect.signature(on_token)
    except (TypeError, ValueError):
        return on_token
    try:
        signature.bind("piece")
    except TypeError as error:
        raise InvalidOptionError(f"on_token must take one positional argument (each new piece of text), but "
                                 f"{getattr(on_token, '__qualname__', type(on_token).__name__)}{signature} cannot be "
                                 f"called with one ({error})") from None
    return on_token


def _cache_folder(cache_dir: Any) -> Path | None:
    """``Engine(cache_dir=...)`` as a folder (``None``: memory only); anything but a non-empty path is refused, because
    ``Path(5)`` is a bare ``TypeError`` and ``Path("")`` the current folder."""
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, (str, os.PathLike)) or not str(os.fspath(cache_dir)).strip():
        raise InvalidOptionError(f"cache_dir must be a folder path (a str or os.PathLike) or None for memory only, got "
                                 f"{cache_dir!r:.80}")
    return Path(cache_dir)


def _tee(first: Callable[[str], None], second: Callable[[str], None] | None) -> Callable[[str], None]:
    """``first`` then ``second`` on each piece (the handle's buffer, then the caller's own ``on_token``)."""
    if second is None:
        return first

    def both(piece: str) -> None:
        first(piece)
        second(piece)

    return both


def _in_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (an async caller's, a notebook's), which must not block."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _compiled(compiling: Future) -> CompiledFormat:
    """The format's compile result, waited for here (its error raised; interrupted: the compile stops too)."""
    try:
        return compiling.result()
    except CompileCancelledError:
        raise RequestCancelledError("the request was cancelled while its structured-output format compiled") from None
    except BaseException:
        compiling.cancel()
        raise


def _no_callback(method: str, settings: dict[str, Any]) -> None:
    if "on_token" in settings:
        raise InvalidOptionError(f"{method}() delivers tokens itself; use generate(on_token=...) or chat(on_token=...) "
                                 "for a callback")


class Engine:
    """A local decoder with per-document KV caches and every decoding mode, serving concurrent requests.

    ``Engine(loaded, config=None, *, cache_dir=None, **settings)``: ``cache_dir`` is where document caches persist
    (the disk tier; ``None``: memory only). Every other setting is a field of
    :class:`~ctx_integrations.engine.core.config.EngineConfig`, which documents them: the cache tiers'
    budgets and formats (``memory_bytes``, ``disk_bytes``, ``disk_format``, ``host_bytes``, ``host_format``) and the
    shared remote tier (``remote_cache_url``), the
    scheduler (``max_request_bytes``, ``max_batch_bytes``, ``max_queued_requests``, ``request_timeout_s``,
    ``attention_kernel``, ``threads``, ``compile_mode``, ``batch_invariant``) and the prompt (``system_prompt``,
    ``question_template``, ``context_template``). Give them as a ``config``, as keywords (``Engine(loaded,
    threads=1)``), or both: the keywords apply over the config. ``half_on_disk=True`` is accepted as the older
    spelling of ``disk_format="fp16"``. An unknown keyword is an
    :class:`~ctx_integrations.errors.InvalidOptionError` listing the valid ones, and every value is checked before
    any work. :attr:`config` is the :class:`EngineConfig` the engine runs with. Every answer's ``timings`` reports
    the ``threads`` and ``dtype`` it was computed with.

    Engines built on one loaded model share its scheduler: their requests are batched together and
    never run forward passes at the same time.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, *,
                 cache_dir: str | os.PathLike | None = None, **settings: Any):
        self.config = config = EngineConfig.resolve(config, settings)
        folder = _cache_folder(cache_dir)
        self.loaded = loaded
        self.layout = PromptLayout(loaded.tokenizer, config.system_prompt, config.question_template,
                                   config.context_template)
        self.layout.prefix_ids  # fail early on a model without a usable chat template  # noqa: B018
        self.layout.context_ids("")  # builds the user-text tokenizer copy now (~0.5 s), not in a first caller's
        # thread (an async caller's would hold its event loop): documents are tokenised where requests are made
        self.store = KVCacheStore(loaded, folder,
                                  disk_format=config.disk_format, memory_bytes=config.memory_bytes,
                                  disk_bytes=config.disk_bytes, host_bytes=config.host_bytes,
                                  host_format=config.host_format, remote_url=config.remote_cache_url)
        self.texts = PreparedTexts(self.layout, self.store)  # documents tokenised and keyed once per text
        self.max_request_bytes = config.max_request_bytes
        self.max_queued_requests = config.max_queued_requests
        self.request_timeout_s = config.request_timeout_s
        self.scheduler = scheduler_for(loaded, config.attention_kernel, config.max_batch_bytes, config.threads,
                                       config.compile_mode, config.batch_invariant)
        self._closed = False

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, adapter: str | os.PathLike | None = None,
                        trust_remote_code: bool = False, config: EngineConfig | None = None,
                        cache_dir: str | os.PathLike | None = None, tensor_parallel: int | None = None,
                        **settings: Any) -> Engine:
        """Load the embedded default (no argument) or an HF id, a local directory or a ``.gguf`` file.

        ``adapter``: a LoRA folder from ``ctx-experts distill``, merged into the weights.
        ``trust_remote_code``: run the model folder's own Python code (opt-in, only for folders you trust).
        ``config``, ``cache_dir`` and ``settings``: as for :class:`Engine`, checked before the model loads.
        ``tensor_parallel``: split the model over this many ranks of a ``torchrun`` job (SPMD: every rank makes
        the same calls; :func:`~ctx_integrations.engine.core.model.load_model`).
        """
        config = EngineConfig.resolve(config, settings)
        _cache_folder(cache_dir)
        return cls(load_model(name_or_path, device=device, dtype=dtype, adapter=adapter,
                              trust_remote_code=trust_remote_code, tensor_parallel=tensor_parallel), config,
                   cache_dir=cache_dir)

    @property
    def modes(self) -> list[str]:
        return available_modes()

    # -- requests ------------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float | None:
        return _check_timeout(timeout) if timeout is not None else self.request_timeout_s

    def _submit(self, request: Request) -> RequestHandle:
        if self._closed:
            raise InvalidOptionError("this engine was closed: build a new Engine to send more requests")
        return self.scheduler.submit(request, self.max_queued_requests)

    def _handle(self, request: Request, pieces: Pieces, start: bool, contexts: Sequence[DecodeContext] = (),
                sampling: SamplingParams | None = None, compiling: Future | None = None) -> AnswerHandle:
        """The request's handle; with ``compiling`` (its format, compiling on its own thread), the contexts get their
        samplers from the compiled format when the request is queued (:class:`AnswerHandle`)."""
        if compiling is None:
            return self._handle_now(request, pieces, start)

        def queue() -> RequestHandle:
            grammar = _compiled(compiling)
            for index, ctx in enumerate(contexts):
                ctx.sampler = sampling.sampler(index, grammar)
            return self._submit(request)

        handle = AnswerHandle(queue, pieces, request.request_id, compiling=compiling)
        return handle.start() if start else handle

    def _handle_now(self, request: Request, pieces: Pieces, start: bool) -> AnswerHandle:
        handle = AnswerHandle(lambda: self._submit(request), pieces, request.request_id)
        return handle.start() if start else handle

    def _format(self, sampling: SamplingParams, start: bool,
                field: str | None = None) -> tuple[Future | None, CompiledFormat | None]:
        """``sampling.structured`` compiling, and compiled when this call may wait for it: ``(None, format)``, or
        ``(future, None)`` when the compile goes on off this thread (a thread running an event loop never waits for
        it, and a request not started yet waits for it only when it is read); ``(None, None)`` without a format.
        A format over ``max_format_bytes`` is refused here (:class:`~ctx_integrations.errors.FormatTooLargeError`)."""
        compiling = self._compiling(sampling, field)
        if compiling is None:
            return None, None
        if compiling.done() or (start and not _in_event_loop()):
            return None, _compiled(compiling)
        return compiling, None

    def submit(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
               mode: str = DEFAULT_MODE, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | str = (),
               on_token: Callable[[str], None] | None = None, timeout: float | None = None,
               sampling: SamplingParams | None = None, start: bool = True, **options: Any) -> AnswerHandle:
        """Validate one request here (bad input raises a typed error now, in the caller's thread) and queue it;
        returns its :class:`~ctx_integrations.engine.core.handle.AnswerHandle`: ``result()``, ``await handle``,
        ``stream()``, ``astream()``, ``cancel()``. Every other request method is this handle used one way.

        ``documents``: strings, :class:`~ctx_integrations.Document` objects or retrieved objects with
        ``text``/``score``; ``scores`` (one r in [0, 1] per document) overrides their scores. ``mode``: the
        decoding mode; ``options`` are its knobs (``ctx_integrations.engine.core.registry.mode_options(mode)``).
        ``sampling``: a :class:`SamplingParams` instead of max_new_tokens / temperature / top_p / seed / stop.
        ``on_token`` receives each new piece of text as it is decoded (on the scheduler's thread: keep it
        quick). ``timeout``: seconds before the request is cancelled with ``RequestTimeoutError`` (default: the
        engine's ``request_timeout_s``). ``start=False``: queue it only when the handle is first read (a stream
        nobody iterates never runs). The documents are tokenised and keyed here, except on a thread that runs an
        event loop, whose loop must not block: there the scheduler's loader thread does it. A structured-output
        format over ``max_format_bytes`` is refused here; it is compiled here too, except on such a thread or with
        ``start=False``: then it compiles on its own thread (a worker process; cancelling the handle stops it), the
        request is queued once it has compiled, and its error (e.g. past ``format_compile_timeout_s``) is raised
        when the handle is read.
        """
        settings = SamplingParams.resolve(sampling, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_p=top_p, seed=seed, stop=stop)
        self._check_call(mode, options, settings)
        pieces = Pieces()
        compiling, grammar = self._format(settings, start)
        sampler = settings.sampler(0, grammar) if compiling is None else TokenSampler()  # set once it compiled
        ctx = self._context(query, prepare_documents(documents, scores), sampler,
                            settings.stop_criteria(self.loaded.eos_token_ids),
                            _tee(pieces.push, _check_callback(on_token)), prepare=not _in_event_loop())
        request = ModeRequest(self, [ctx], mode, options, timeout=self._timeout(timeout))
        return self._handle(request, pieces, start, [ctx], settings, compiling)

    def generate(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
                 mode: str = DEFAULT_MODE, **settings: Any) -> Answer:
        """Answer ``query`` from ``documents`` with decoding ``mode``, blocking until the answer is done.

        ``settings``: :meth:`submit`'s (max_new_tokens, temperature, top_p, seed, stop, on_token, timeout,
        sampling and the mode's options).
        """
        return self.submit(query, documents, scores, mode, **settings).result()

    async def agenerate(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
                        mode: str = DEFAULT_MODE, **settings: Any) -> Answer:
        """:meth:`generate` for async callers: awaits the scheduler without blocking the event loop (the documents
        are tokenised on the scheduler's loader thread, a structured-output format compiled off it). Cancelling the
        awaiting task cancels the request (its rows leave the batch at the next step; a compile stops)."""
        return await self.submit(query, documents, scores, mode, start=False, **settings)

    def stream(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
               mode: str = DEFAULT_MODE, **settings: Any) -> Generator[str, None, Answer]:
        """Yield text pieces as they are decoded; the final :class:`Answer` is the generator's return value.

        The request is validated and queued at the first ``next()``. Closing the generator early stops decoding
        at the next step.
        """
        _no_callback("stream", settings)
        return (yield from self.submit(query, documents, scores, mode, start=False, **settings).stream())

    def astream(self, query: str, documents: Sequence[Any], scores: Sequence[float] | None = None,
                mode: str = DEFAULT_MODE, **settings: Any) -> AnswerStream:
        """Async token streaming: ``async for piece in engine.astream(...)``, then the stream's ``.answer``.

        The request is validated now and queued when iteration starts; leaving the loop early cancels it. Its
        structured-output format (over ``max_format_bytes``: refused now) compiles off this thread: a format xgrammar
        refuses, or one past ``format_compile_timeout_s``, is raised by the first iteration.
        """
        _no_callback("astream", settings)
        return self.submit(query, documents, scores, mode, start=False, **settings).astream()

    def _many(self, questions: Sequence[str], documents: Sequence[Any], scores: Sequence[float] | None, mode: str,
              sampling: SamplingParams, timeout: float | None, options: dict[str, Any],
              prepare: bool = True, grammar: CompiledFormat | None = None) -> list[RequestHandle]:
        """The questions' requests, queued; ``grammar``: ``sampling.structured`` compiled (by the caller, which may
        wait for it: :meth:`_batch_format`)."""
        started = time.perf_counter()
        self._check_call(mode, options, sampling)
        if isinstance(questions, (str, bytes)) or not isinstance(questions, Sequence) or not questions:
            got = "a single string" if isinstance(questions, (str, bytes)) else (
                f"a {type(questions).__name__}" if not isinstance(questions, Sequence) else "nothing")
            raise InvalidOptionError(f"questions must be a non-empty list of strings (got {got})")
        per_question = _documents_per_question(documents, len(questions))
        if per_question is None:
            shared = prepare_documents(documents, scores)
            per_question = [shared] * len(questions)
        else:
            if scores is not None:
                raise InvalidScoresError("with one document list per question, give the scores inside the documents")
            per_question = [prepare_documents(docs) for docs in per_question]
        contexts = [self._context(q, list(docs), sampling.sampler(i, grammar),
                                  sampling.stop_criteria(self.loaded.eos_token_ids), None, started, prepare)
                    for i, (q, docs) in enumerate(zip(questions, per_question))]
        timeout = self._timeout(timeout)
        if answers_many(mode):
            return [self._submit(ModeRequest(self, contexts, mode, options, timeout=timeout))]
        if self._closed:
            raise InvalidOptionError("this engine was closed: build a new Engine to send more requests")
        # independent requests, which the scheduler batches; queued all or nothing, so an overload refusal
        # leaves none of them running for nobody
        return self.scheduler.submit_all([ModeRequest(self, [ctx], mode, options, timeout=timeout) for ctx in contexts],
                                         self.max_queued_requests)

    def generate_many(self, questions: Sequence[str], documents: Sequence[Any], scores: Sequence[float] | None = None,
                      mode: str = DEFAULT_BATCH_MODE, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                      stop: Sequence[str] | str = (), timeout: float | None = None,
                      sampling: SamplingParams | None = None, **options: Any) -> list[Answer]:
        """Answer every question in ``questions``; one :class:`Answer` per question, in order.

        ``documents`` is either one list of documents shared by every question, or one list per
        question (``len(documents) == len(questions)``, each element a list). ``mode="ippd"`` (the
        default) decodes all questions in one stacked prompt, one forward pass per step for every
        answer; any other mode sends the questions as concurrent requests, which the scheduler batches
        (``mode="concat"``: the independent baseline). With a ``seed``, question i samples with seed
        ``seed + i``. ``sampling``: a :class:`SamplingParams` instead of the separate settings.
        """
        settings = SamplingParams.resolve(sampling, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_p=top_p, seed=seed, stop=stop)
        self._check_call(mode, options, settings)  # refused before anything compiles
        grammar = self._grammar(settings)
        handles = self._many(questions, documents, scores, mode, settings, timeout, options, grammar=grammar)
        try:
            return [answer for handle in handles for answer in handle.result()]
        except BaseException:  # one question failed: the others stop too instead of decoding for nobody
            for handle in handles:
                handle.cancel()
            raise

    async def agenerate_many(self, questions: Sequence[str], documents: Sequence[Any],
                             scores: Sequence[float] | None = None, mode: str = DEFAULT_BATCH_MODE, *,
                             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                             stop: Sequence[str] | str = (), timeout: float | None = None,
                             sampling: SamplingParams | None = None, **options: Any) -> list[Answer]:
        """:meth:`generate_many` for async callers."""
        settings = SamplingParams.resolve(sampling, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_p=top_p, seed=seed, stop=stop)
        self._check_call(mode, options, settings)  # refused before anything compiles
        compiling = self._compiling(settings)
        grammar = None
        if compiling is not None:  # compiled off the event loop; cancelling the task stops the compile
            await compiled_off_loop(compiling)
            grammar = _compiled(compiling)
        handles = self._many(questions, documents, scores, mode, settings, timeout, options, prepare=False,
                             grammar=grammar)
        try:
            return [answer for handle in handles for answer in await handle.wait()]
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise

    # -- chat (no documents) -------------------------------------------------------------------------
    def submit_chat(self, messages: Sequence[dict[str, Any]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                    temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                    stop: Sequence[str] | str = (), on_token: Callable[[str], None] | None = None,
                    timeout: float | None = None, sampling: SamplingParams | None = None,
                    tools: Sequence[Any] | None = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
                    start: bool = True) -> AnswerHandle:
        """Validate a conversation (``[{"role": ..., "content": ...}, ...]``, no documents: mode ``"chat"``), template
        and tokenise it here, and queue it; returns its :class:`~ctx_integrations.engine.core.handle.AnswerHandle`.

        ``tools`` (OpenAI's tool objects), ``tool_choice`` (``"auto"``, the default with tools; ``"none"``,
        ``"required"`` or a tool's name) and ``parallel_tool_calls``: the model may call tools, in its chat
        template's call format, each call's arguments valid against its tool's schema
        (:mod:`~ctx_integrations.engine.core.tools`); the calls are ``Answer.tool_calls`` and ``Answer.text`` is the
        rest of the answer (a streamed answer's pieces are the raw text, calls included). Messages may carry
        OpenAI's ``tool_calls`` (assistant) and ``tool`` results. The other settings are :meth:`submit`'s.
        """
        started = time.perf_counter()
        sampling = SamplingParams.resolve(sampling, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_p=top_p, seed=seed, stop=stop)
        tools_asked = tool_request(tools, tool_choice, parallel_tool_calls, sampling)
        ids = conversation_ids(self.layout, messages, tools_asked.tools if tools_asked is not None else ())
        if tools_asked is not None:
            for tool in tools_asked.tools:  # before xgrammar parses their schemas into the structural tag
                check_format_size(f"tool {tool.name!r} parameters", tool.parameters, self.config.max_format_bytes,
                                  "tools")
            sampling = tools_asked.sampling(sampling, self.layout.tool_format)
        if len(ids) + sampling.max_tokens > self.loaded.max_positions:
            raise DocumentTooLongError(
                f"the conversation has {len(ids)} tokens + max_new_tokens={sampling.max_tokens}, more than the "
                f"model's window of {self.loaded.max_positions}: drop earlier turns or lower max_new_tokens")
        pieces = Pieces()
        compiling, grammar = self._format(sampling, start, "tools" if tools_asked is not None else None)
        sampler = sampling.sampler(0, grammar) if compiling is None else TokenSampler()  # set once it compiled
        ctx = DecodeContext(self, "", [], sampler, sampling.stop_criteria(self.loaded.eos_token_ids),
                            _tee(pieces.push, _check_callback(on_token)), started=started)
        # the per-request KV budget binds a conversation as it binds documents (checked before anything is queued)
        ctx.check_streams(1, len(ids) + sampling.max_tokens, "the conversation",
                          "Drop earlier turns or lower max_new_tokens")
        request = ChatRequest(self, ctx, ids, timeout=self._timeout(timeout), tools=tools_asked)
        return self._handle(request, pieces, start, [ctx], sampling, compiling)

    def chat(self, messages: Sequence[dict[str, Any]], **settings: Any) -> Answer:
        """Answer a conversation with no documents, blocking until the answer is done (``settings``:
        :meth:`submit_chat`'s)."""
        return self.submit_chat(messages, **settings).result()

    async def achat(self, messages: Sequence[dict[str, Any]], **settings: Any) -> Answer:
        """:meth:`chat` for async callers (no thread per request; cancelling the task cancels the request).

        The conversation is templated and tokenised on a worker thread, so a long one never stalls the
        event loop (and every other request an async server runs on it); a structured-output format (tools
        included) compiles off both, and stops when the task is cancelled.
        """
        handle = await asyncio.to_thread(self.submit_chat, messages, start=False, **settings)
        return await handle

    def stream_chat(self, messages: Sequence[dict[str, Any]], **settings: Any) -> Generator[str, None, Answer]:
        """:meth:`chat` as a generator of text pieces; the :class:`Answer` is its return value."""
        _no_callback("stream_chat", settings)
        return (yield from self.submit_chat(messages, start=False, **settings).stream())

    def astream_chat(self, messages: Sequence[dict[str, Any]], **settings: Any) -> AnswerStream:
        """:meth:`chat` as an async stream of text pieces, then the stream's ``.answer``: validated (and tokenised)
        now, queued when iteration starts."""
        _no_callback("astream_chat", settings)
        return self.submit_chat(messages, start=False, **settings).astream()

    # -- caches, state -------------------------------------------------------------------------------
    def warm(self, documents: Sequence[Any], progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
        """Compute (or load) the KV cache of every document now, e.g. at ingestion; returns the lookup counts.

        Runs on the scheduler's thread like every use of the model (between other requests' steps).
        ``progress(done, total)``: called on that thread after each batched forward, with how many of the
        ``total`` documents have their cache; it must return at once (record the counts, print them from another
        thread: :class:`~ctx_integrations.progress.Progress` does), since every other request waits meanwhile.
        """
        if progress is not None and not callable(progress):
            raise InvalidOptionError(f"progress must be a callable taking (done, total), got {type(progress).__name__}")
        docs = prepare_documents(documents)
        ctx = DecodeContext(self, "", docs, TokenSampler(), StopCriteria(self.loaded.eos_token_ids, 1),
                            prepared=self.texts.prepare_all([doc.text for doc in docs]))
        return self._submit(WarmRequest(self, ctx, progress)).result()

    def stats(self) -> dict[str, Any]:
        """Serving and cache counters: queue depth, running requests and rows, answers, cache hits per tier,
        bytes per tier, and the scheduler's time split (forward passes vs its own work)."""
        running, rows = self.scheduler.active(self)
        scheduler = self.scheduler.stats
        cache = self.store.stats.as_dict()
        return {"queue_depth": self.scheduler.queue_depth(self), "active_requests": running, "active_rows": rows,
                "answered": scheduler.answered, "failed": scheduler.failed, "cancelled": scheduler.cancelled,
                "timed_out": scheduler.timed_out, "steps": scheduler.steps, "forwards": scheduler.forwards,
                "forward_s": scheduler.forward_s, "exclusive_s": scheduler.exclusive_s, "busy_s": scheduler.busy_s,
                "step_overhead_s": max(0.0, scheduler.busy_s - scheduler.forward_s - scheduler.exclusive_s),
                "rows_stepped": scheduler.rows_stepped,
                "kv_bytes": {"reserved": self.scheduler.reserved_bytes(), "budget": self.scheduler.max_batch_bytes,
                             "peak": scheduler.peak_kv_bytes, "bytes_per_token": self.scheduler.bytes_per_token},
                "cache": {**cache, "hits_by_tier": self.store.stats.by_tier()},
                "bytes": {"memory": self.store.memory_used, "host": self.store.host_used,
                          "disk": self.store.disk_used()},
                "budgets": {"memory": self.store.memory_bytes, "host": self.store.host_bytes,
                            "disk": self.store.disk_bytes}}

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests and wait (up to ``timeout`` seconds) for this engine's requests in flight."""
        self._closed = True
        deadline = None if timeout is None else time.perf_counter() + timeout
        while self.scheduler.queue_depth(self) or self.scheduler.active(self)[0]:
            if deadline is not None and time.perf_counter() > deadline:
                break
            time.sleep(0.01)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- validation ----------------------------------------------------------------------------------
    def _check_call(self, mode: str, options: dict[str, Any], sampling: SamplingParams) -> None:
        check_mode(mode, options)
        check_sampling(mode, sampling)

    def _compiling(self, sampling: SamplingParams, field: str | None = None) -> Future | None:
        """``sampling.structured`` compiling for this model on a thread of its own, bounded by ``max_format_bytes``
        (refused here, before anything compiles) and ``format_compile_timeout_s``
        (:meth:`GrammarCompiler.submit <ctx_integrations.engine.core.structured.GrammarCompiler.submit>`; a format
        compiled before is a done future), or ``None``."""
        if sampling.structured is None:
            return None
        return self.loaded.grammars.submit(sampling.structured, field, max_bytes=self.config.max_format_bytes,
                                           timeout_s=self.config.format_compile_timeout_s)

    def _grammar(self, sampling: SamplingParams) -> CompiledFormat | None:
        """``sampling.structured`` compiled for this model, waited for in the caller's thread (a bad format fails
        here), or ``None``; a format compiled before costs a lookup."""
        compiling = self._compiling(sampling)
        return None if compiling is None else _compiled(compiling)

    def _context(self, query: str, documents: list[Document], sampler: TokenSampler, stop: StopCriteria,
                 on_token: Callable[[str], None] | None, started: float | None = None,
                 prepare: bool = True) -> DecodeContext:
        """The request's context: the question suffix's tokens, and (``prepare``) its documents' tokens and cache keys
        (from the memo when seen before), computed here once; otherwise :meth:`DecodeContext.prepare` computes
        them on the scheduler's loader thread. ``started``: the call's start (default now): the request's clock
        (TTFT, timeout) includes preparing it, and the questions of one call share one clock."""
        started = time.perf_counter() if started is None else started
        if not isinstance(query, str) or not query.strip():
            raise InvalidOptionError("query must be a non-empty string")
        for index, document in enumerate(documents):  # what tokenising would refuse, refused now in any case
            user_text(document.text, f"document {index}'s text")
        ctx = DecodeContext(self, query, documents, sampler, stop, on_token, started=started,
                            suffix_ids=tuple(self.layout.suffix_ids(query)))
        if prepare:
            ctx.prepare()
        return ctx
