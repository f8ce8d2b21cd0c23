"""The step scheduler: one background thread owns the model and decides, at every step, what it computes.

Shaped like vLLM v1's engine core, on top of transformers: requests enter a queue; a loader thread
reads their documents' KV caches from disk into the memory tier (so disk reads overlap with the
model's work); at every step the scheduler thread

1. retires cancelled and timed-out requests (their rows leave the batch; a deadline watcher thread has
   already failed a late request on time, even while a long step held the model),
2. plans waiting requests (builds their jobs; cache misses are computed here, on the model's thread)
   and admits them while the batch's KV byte budget allows: a request reserves its KV bytes (prompt +
   ``max_new_tokens``, all its rows) when it joins and frees them when it leaves; the first one that
   does not fit waits, and everything behind it waits too (first come, first served),
3. hands the model runner ONE typed step (:class:`~ctx_integrations.engine.core.step.ScheduledStep`):
   the next tokens of every running pooled row (PCED / Soft-NBCE experts and their context-free rows,
   ``single`` / ``concat`` / chat sequences, IPPD stacks) and the joining rows with their prompts; the
   runner runs one batched forward over the running rows and one prefill forward over the joining
   rows, and each job turns its own rows' logits into tokens with its rule on the device (read back
   once for the whole step),
4. advances each exclusive job (APE on the flex kernel; ``warm``) by one forward of its own,
5. hands finished answers back to their callers.

Why a new request's prefill runs in its own forward rather than inside the decode step: the batch is
padded, so a 40-token suffix in the same forward would make every decoding row take 40 columns of
padding (40x the compute and cache growth for one step); a separate forward costs each running
request one step of latency, once.

Exactness: each request's rows see exactly their own keys (the mask), so a greedy answer is the
same token for token whether the request runs alone or batched (tests/test_scheduler.py). The
scheduler itself never touches the model: tests/test_scheduler_core.py drives it with a fake runner.

A request's own code (its ``on_token`` callback, its mode's rule) can raise anything, ``SystemExit``
and ``GeneratorExit`` included: every call into it is guarded, so it fails that request alone (a
``BaseException`` that is not an ``Exception`` becomes :class:`~ctx_integrations.errors.CallbackError`)
and the thread and the requests beside it go on.

One scheduler per loaded model, shared by every :class:`~ctx_integrations.Engine` built on it, so two
engines on one model never run forward passes at the same time. The thread exits after a short
idle time and starts again with the next request; nothing needs closing for the process to exit.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ctx_integrations.engine.core.compiled_step import resolve_compile_mode
from ctx_integrations.engine.core.flex import resolve_kernel
from ctx_integrations.engine.core.futures import settle
from ctx_integrations.engine.core.heap import release_freed_memory
from ctx_integrations.engine.core.jobs import ExclusiveJob, Job, PooledJob
from ctx_integrations.engine.core.machine import default_threads
from ctx_integrations.engine.core.model import LoadedModel
from ctx_integrations.engine.core.registry import default_batch_bytes, kv_bytes_per_token
from ctx_integrations.engine.core.runner import ModelRunner
from ctx_integrations.engine.core.step import RowTable, Runner, ScheduledStep, StepOutput
from ctx_integrations.errors import (
    CallbackError,
    CtxIntegrationsError,
    EngineOverloadedError,
    InvalidOptionError,
    RequestTimeoutError,
    RequestTooLargeError,
)

IDLE_EXIT_S = 2.0  # the scheduler thread exits after this long without work, and restarts on demand
EXIT_NOTICE_S = 5.0  # at interpreter exit, say why the process still waits for a step after this long


class RequestCancelledError(CtxIntegrationsError, RuntimeError):
    """The request was cancelled by its caller (a closed stream, a cancelled task) before it finished."""


_REQUEST_IDS = itertools.count(1)


class Request:
    """One request on its way through the scheduler (vLLM v1's ``Request``): its id, its work and its status.

    What the request is and asks for lives in its subclass (the engine's :mod:`~ctx_integrations.engine.core.requests`:
    a mode's answer over prepared documents, a chat, a warm-up; RAPID's drafter row): :meth:`plan` builds its
    job on the scheduler thread (it may run the model: cache misses), :meth:`prefetch` runs first on the loader
    thread (disk reads only) and :meth:`finish` turns the finished job's results into what the caller's future
    receives. The scheduler keeps the rest here: ``job`` and ``kv_bytes`` (the KV bytes it reserves while it
    runs) once planned, the deadline, the caller's future and cancellation, and ``status``: ``"waiting"``,
    ``"running"``, then ``"finished"``, ``"failed"``, ``"cancelled"`` or ``"timed_out"``.
    """

    def __init__(self, owner: object, *, timeout: float | None = None, started: float | None = None):
        self.request_id = f"req-{next(_REQUEST_IDS)}"
        self.owner = owner
        self.submitted = time.perf_counter() if started is None else started  # the call's start: its timeout's too
        self.deadline = None if timeout is None else self.submitted + timeout
        self.job: Job | None = None
        self.kv_bytes = 0
        self.waited = False  # held at least once for KV bytes
        self.future: Future = Future()
        self.cancelled = threading.Event()
        self.error: BaseException | None = None  # set during a step, handed to the caller when the step retires it
        self.status = "waiting"

    def plan(self) -> Job:
        """The request's job (on the scheduler's thread)."""
        raise NotImplementedError

    def prefetch(self) -> None:
        """Read what the job needs from slow tiers (on the loader thread, before :meth:`plan`); by default nothing."""

    def finish(self, job: Job) -> Any:
        """What the caller receives once ``job`` (the request's last) is done."""
        raise NotImplementedError

    @property
    def over(self) -> bool:
        """Failed during this step, or already handed back (its caller cancelled the future)."""
        return self.error is not None or self.future.done()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.request_id} {self.status}>"


class RequestHandle:
    """The caller's side of a request: wait for it (sync or async) or cancel it."""

    def __init__(self, request: Request, scheduler: Scheduler):
        self._request, self._scheduler = request, scheduler

    @property
    def future(self) -> Future:
        return self._request.future

    def cancel(self) -> None:
        """Stop the request at the next step boundary and free its rows (a no-op once it finished)."""
        self._request.cancelled.set()
        self._scheduler.wake()

    def result(self) -> Any:
        """Block until the request is done; re-raises its error.

        A callback's ``SystemExit`` / ``KeyboardInterrupt`` (contained on the scheduler's thread as a
        :class:`CallbackError`) is re-raised as itself here, in the caller's thread, as if the callback
        had run there: a ``sys.exit()`` in ``on_token`` must not turn into an ``Exception`` that an
        ``except Exception`` swallows (``concurrent.futures`` hands it back the same way).
        """
        try:
            return self.future.result()
        except CallbackError as error:
            self.cancel()
            if isinstance(error.original, (SystemExit, KeyboardInterrupt)):
                raise error.original from error
            raise
        except BaseException:
            self.cancel()
            raise

    async def wait(self) -> Any:
        """Await the request without blocking the event loop (no thread per request); cancelling the await
        cancels the request.

        A callback's ``SystemExit`` / ``KeyboardInterrupt`` stays a :class:`CallbackError` here: raised
        inside a task, either would stop the whole event loop and every other request it serves.
        """
        waiting = asyncio.wrap_future(self.future)
        try:
            return await asyncio.shield(waiting)
        except asyncio.CancelledError:
            self.cancel()
            waiting.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: no log noise
            raise


@dataclass
class SchedulerStats:
    """Counters since the scheduler was created (``Engine.stats()`` adds the cache tiers)."""

    answered: int = 0
    failed: int = 0
    cancelled: int = 0
    timed_out: int = 0
    steps: int = 0
    forwards: int = 0
    forward_s: float = 0.0  # the runner's batched forwards (pooled jobs)
    exclusive_s: float = 0.0  # exclusive jobs' own steps (flex APE, warm), forwards included
    busy_s: float = 0.0  # whole steps: the above plus the scheduler's and the pooled jobs' own work
    rows_stepped: int = 0  # rows summed over steps (divided by steps: how many rows a step carried)
    peak_rows: int = 0  # most rows one forward pass carried (how much batching really happened)
    peak_kv_bytes: int = 0  # most KV bytes the running requests had reserved at once
    held: int = 0  # requests that waited at the head of the queue for KV bytes to free up


def contained(error: BaseException) -> BaseException:
    """The error a request fails with when its own code raised ``error`` on the scheduler's thread.

    An ``Exception`` is handed to the caller as it is. Any other ``BaseException`` (``GeneratorExit``,
    ``SystemExit``, ``KeyboardInterrupt`` raised by a callback; the scheduler's thread never receives a
    signal's ``KeyboardInterrupt``, only the main thread does) would end the scheduler's thread and
    strand every request in flight, so it is wrapped in a typed :class:`CallbackError`.
    """
    if isinstance(error, Exception):
        return error
    wrapped = CallbackError(
        f"a callback of this request (e.g. on_token) raised {type(error).__name__}{f': {error}' if str(error) else ''}"
        " on the scheduler's thread: the request was stopped and its rows freed (other requests go on); raise an "
        "Exception in a callback to stop a request", error)
    wrapped.__cause__ = error
    return wrapped


def _timeout_error(request: Request) -> RequestTimeoutError:
    return RequestTimeoutError(
        f"the request ran past its timeout ({request.deadline - request.submitted:.3g} s) and was "
        "cancelled: raise timeout=..., lower max_new_tokens, or send fewer concurrent requests")


class Scheduler:
    """The owner of one model: a queue, a loader thread, and the step loop on its own thread.

    ``runner`` computes the steps (:class:`~ctx_integrations.engine.core.runner.ModelRunner`, or a fake
    in tests); ``bytes_per_token`` is the model's KV bytes per token (``registry.kv_bytes_per_token``);
    ``max_batch_bytes`` the KV bytes the running requests may reserve together. ``threads``: torch's
    CPU threads for the forwards, set on the step loop's own thread each time it starts (torch's OpenMP
    thread count belongs to the thread that sets it, so ``torch.set_num_threads`` in the caller's thread
    does not reach a loop that is already running; ``None``: leave the count the thread inherits).
    """

    def __init__(self, runner: Runner, bytes_per_token: int, max_batch_bytes: int, threads: int | None = None):
        self.runner, self.bytes_per_token, self.max_batch_bytes = runner, bytes_per_token, max_batch_bytes
        self.threads = threads
        self.stats = SchedulerStats()
        self._cond = threading.Condition()
        self._loading: list[Request] = []  # on the loader thread
        self._ready: deque[Request] = deque()  # prefetched, waiting for admission
        self._held: Request | None = None  # planned, waiting for KV bytes (the head of the queue)
        self._batch: RowTable[PooledJob, Request] = RowTable()  # the running pooled jobs, in row order
        self._exclusive: list[tuple[ExclusiveJob, Request]] = []
        self._dropped: list[Request] = []  # failed this step, settled when the step retires them
        self._deadlines: list[Request] = []  # requests with a deadline, until they are over (the watcher's)
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = False
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctx-kv-loader")

    # -- the caller's side ---------------------------------------------------------------------------
    def submit(self, request: Request, max_queued: int | None = None) -> RequestHandle:
        """Queue a request; refuse it at once with :class:`EngineOverloadedError` when its owner's queue is full."""
        return self.submit_all([request], max_queued)[0]

    def submit_all(self, requests: list[Request], max_queued: int | None = None) -> list[RequestHandle]:
        """Queue several requests all or nothing (``generate_many``): when they do not all fit in their owner's
        queue, none is queued and :class:`EngineOverloadedError` is raised, so a refusal leaves no request
        behind running for nobody."""
        with self._cond:
            owner = requests[0].owner
            waiting = len(self._waiting(owner))
            if max_queued is not None and waiting + len(requests) > max_queued:
                many = f"these {len(requests)} requests do not fit: " if len(requests) > 1 else ""
                raise EngineOverloadedError(
                    f"{many}{waiting} requests are already waiting (max_queued_requests={max_queued}): retry later, "
                    "send fewer at once, or raise Engine(max_queued_requests=...)")
            self._loading.extend(requests)
            self._deadlines.extend(s for s in requests if s.deadline is not None)
            self._ensure_thread()
            self._cond.notify_all()  # the watcher may need to wake earlier for a new deadline
        for request in requests:
            self._loader.submit(self._prefetch, request)
        return [RequestHandle(request, self) for request in requests]

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def attention_kernel(self) -> str:
        """The batch's attention kernel, the runner's (resolved by ``scheduler_for``): ``"eager"`` or ``"flex"``."""
        return self.runner.attention_kernel

    def _waiting(self, owner: object | None) -> list[Request]:
        """Requests not running yet (holding ``_cond``): loading, ready, or planned and waiting for KV bytes."""
        held = [self._held] if self._held is not None and not self._held.over else []  # timed out: dropped next step
        return [s for s in (*self._loading, *self._ready, *held) if owner is None or s.owner is owner]

    def queue_depth(self, owner: object | None = None) -> int:
        with self._cond:
            return len(self._waiting(owner))

    def active(self, owner: object | None = None) -> tuple[int, int]:
        """Running requests and their pooled rows (of ``owner``'s requests, or of all)."""
        with self._cond:
            pooled = [(s, rows) for _, s, rows in self._batch.entries if owner is None or s.owner is owner]
            exclusive = [s for _, s in self._exclusive if owner is None or s.owner is owner]
            return len(pooled) + len(exclusive), sum(rows for _, rows in pooled)

    def reserved_bytes(self) -> int:
        """The KV bytes the running requests have reserved (never more than ``max_batch_bytes``)."""
        with self._cond:
            return self._reserved()

    def _reserved(self) -> int:
        return sum(s.kv_bytes for _, s, _ in self._batch.entries) + sum(s.kv_bytes for _, s in self._exclusive)

    def _prefetch(self, request: Request) -> None:
        try:
            if not (request.cancelled.is_set() or request.over):
                request.prefetch()
        except Exception:  # noqa: BLE001 - a failed read is retried (and reported) by the job's own lookup
            pass
        with self._cond:
            if request in self._loading:
                self._loading.remove(request)
                self._ready.append(request)
            self._cond.notify_all()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ctx-scheduler", daemon=True)
            self._thread.start()
        if self._deadlines and (self._watcher is None or not self._watcher.is_alive()):
            self._watcher = threading.Thread(target=self._watch_deadlines, name="ctx-deadlines", daemon=True)
            self._watcher.start()

    def _watch_deadlines(self) -> None:
        """Fail every request whose deadline passed, at its deadline, whatever the model's thread is doing.

        The step loop checks deadlines only between steps, and one step can be long (``warm()`` or a
        request's cold cache computed in one go, a long prefill): a request with ``timeout=0.5`` queued
        behind such a step would get its error minutes late. This thread (one per scheduler, alive only
        while some request has a deadline; it never touches the model) settles the request's future
        with :class:`RequestTimeoutError` on time and takes a waiting request out of the queue; a running
        one leaves the pool at the next step boundary.
        """
        with self._cond:
            while not self._stopping:
                now = time.perf_counter()
                for request in self._deadlines:
                    if not request.over and request.deadline <= now:
                        self._time_out_now(request)
                self._deadlines = [s for s in self._deadlines if not s.over]
                if not self._deadlines:
                    break
                self._cond.wait(timeout=min(s.deadline for s in self._deadlines) - now)
            self._watcher = None

    def _time_out_now(self, request: Request) -> None:
        """The watcher's side of a timeout (holding ``_cond``): a request still waiting leaves the queue now."""
        if request in self._loading:
            self._loading.remove(request)
        elif request in self._ready:
            self._ready.remove(request)
        # a held request stays where it is: the step loop drops it (and closes its job) at its next step
        if settle(request.future, error=_timeout_error(request)):
            request.status = "timed_out"
            self.stats.timed_out += 1
        self._cond.notify_all()  # a step loop asleep over waiting jobs retires a running one now

    # -- the model's side ----------------------------------------------------------------------------
    def stop(self, notice_after: float = EXIT_NOTICE_S) -> None:
        """Stop the step loop at its next step boundary and wait for the thread (at interpreter exit).

        A daemon thread still inside torch while the interpreter finalises aborts the process
        ("terminate called without an active exception": CPython ends such a thread with pthread_exit
        when it takes the GIL back, and that unwinding through torch's C++ frames calls
        std::terminate). So the loop is joined with no time limit: a step always ends, and on a busy
        CPU one prefill can outlast any fixed limit (a 10 s limit aborted runs on a loaded machine).
        Past ``notice_after`` seconds the wait is explained on stderr.
        """
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(notice_after)
            if thread.is_alive():
                print("ctx-integrations: waiting for the model's current step to end before exiting",
                      file=sys.stderr, flush=True)
                thread.join()
        self._loader.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while (admit := self._wait_for_work()) is not None:
            started = time.perf_counter()
            try:
                self._step(admit, started)
            except BaseException as error:  # noqa: BLE001 - a bug outside any one request: fail what runs, keep serving
                self._fail_all(admit, contained(error))
                self._count(StepOutput(), 0.0, started)
        if not self._stopping:  # idle: give the memory a burst of requests grew back to the system
            release_freed_memory()

    def _wait_for_work(self) -> list[Request] | None:
        """The requests to admit at the next step, or None when the loop ends (stopping, or idle for a while).

        A batch whose every job is :attr:`~PooledJob.waiting` (on a drafter running on another model's
        scheduler) is no work: the thread sleeps until something wakes it (the drafter's answer, a
        cancellation, a deadline) instead of stepping empty forwards; it never exits while it holds rows.
        """
        with self._cond:
            while not self._has_work() or self._stopping:
                if self._stopping or (not self._cond.wait(timeout=IDLE_EXIT_S) and not (
                        self._ready or self._loading or self._batch.entries)):
                    self._thread = None
                    return None
            return self._take_ready()

    def _has_work(self) -> bool:
        """Whether a step has something to do (holding ``_cond``)."""
        return bool(self._ready or self._held or self._exclusive or any(
            not job.waiting or request.over or request.cancelled.is_set()
            for job, request, _ in self._batch.entries))

    def _fail_all(self, admit: list[Request], error: BaseException) -> None:
        """Fail every running request and the ones being admitted, and start over with an empty pool.

        The last guard of the step loop: without it an unexpected error would end the thread and every
        caller would wait forever. Errors of one request are caught closer to it and fail it alone.
        """
        with self._cond:
            running = [s for _, s, _ in self._batch.entries] + [s for _, s in self._exclusive]
            held, self._held = self._held, None
            self._batch, self._exclusive = RowTable(), []
        self.runner.keep_rows([])
        for request in (*running, *admit, *([held] if held is not None else [])):
            if request.job is not None:
                request.job.close()
            self._fail(request, error)
        dropped, self._dropped = self._dropped, []
        for request in dropped:
            settle(request.future, error=request.error)

    def _take_ready(self) -> list[Request]:
        """The requests to plan this step, in queue order: the held one first, then every ready one."""
        admit = [self._held] if self._held is not None else []
        self._held = None
        admit.extend(self._ready)
        self._ready.clear()
        return admit

    def _step(self, admit: list[Request], started: float) -> None:
        self._expire()
        joining = self._plan(admit)
        for job, request, _ in (*self._batch.entries, *joining.entries):
            if not request.over:
                self._guard(request, job.prepare)
        output = self.runner.execute(ScheduledStep(
            decode=self._batch.runs(), joining=[row for job, _, _ in joining.entries for row in job.rows()],
            joining_runs=joining.runs(),
            joining_attention=[rule for job, _, _ in joining.entries for rule in job.row_attention()],
            rewind=self._batch.rewinds(), decode_requests=self._batch.requests(),
            joining_requests=joining.requests()))
        self._consume(output, joining)
        exclusive_started = time.perf_counter()
        for job, request in list(self._exclusive):
            if not self._expired(request):
                self._guard(request, job.step)
        self._count(output, time.perf_counter() - exclusive_started if self._exclusive else 0.0, started)
        self._retire()

    def _count(self, output: StepOutput, exclusive_s: float, started: float) -> None:
        """Add the step's times, all at once and before any caller is woken (``_retire``), so a reading of
        ``stats`` never sees a step's forwards without its busy time."""
        self.stats.forward_s += output.forward_s
        self.stats.exclusive_s += exclusive_s
        self.stats.busy_s += time.perf_counter() - started
        self.stats.steps += 1
        self.stats.forwards += output.forwards
        self.stats.peak_rows = max(self.stats.peak_rows, output.rows)
        self.stats.rows_stepped += output.rows

    def _plan(self, admit: list[Request]) -> RowTable[PooledJob, Request]:
        """Plan the waiting requests in order and admit them while their KV bytes fit the batch's budget.

        The first request that does not fit is held (planned, its bytes known) and the ones behind it go
        back to the queue: nothing overtakes it, so a large request is never starved by small ones.
        Exclusive jobs join the exclusive list; pooled ones are returned, to be prefilled this step.
        """
        joining: RowTable[PooledJob, Request] = RowTable()
        reserved = self._reserved()
        for index, request in enumerate(admit):
            if self._expired(request):
                if request.job is not None:
                    request.job.close()
                continue
            if request.job is None:
                self._build(request)
            job = request.job
            if request.over:  # could not be built, or timed out (the watcher) while its plan computed caches
                if job is not None:
                    job.close()
                continue
            if reserved + request.kv_bytes > self.max_batch_bytes and (reserved or joining.entries):
                with self._cond:
                    self._held = request
                    self._ready.extendleft(reversed(admit[index + 1:]))
                self.stats.held += not request.waited  # requests that waited, not the steps they waited
                request.waited = True
                break
            reserved += request.kv_bytes
            request.status = "running"
            if isinstance(job, ExclusiveJob):
                with self._cond:
                    self._exclusive.append((job, request))
            else:
                joining.entries.append((job, request, len(job.rows())))
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, reserved)
        return joining

    def _build(self, request: Request) -> None:
        """Plan the request's job and size its KV bytes; a job that cannot be built, or never fits, fails alone."""
        try:
            job = request.plan()
            needed = self._bytes_needed(job)
            if not isinstance(job, ExclusiveJob):
                job.rows()  # a mode whose rows cannot be laid out fails here, alone
        except BaseException as error:  # noqa: BLE001 - a request that cannot be planned fails alone
            self._fail(request, contained(error))
            return
        request.job, request.kv_bytes = job, needed

    def _consume(self, output: StepOutput, joining: RowTable[PooledJob, Request]) -> None:
        """Each request accepts what its job chose on the device (the runner read every choice back in one
        transfer), or fails with its forward's or its rule's error; joining jobs become running ones."""
        running = list(self._batch.entries)
        if output.decode_error is not None:  # a failed batched forward fails every request in it
            for _, request, _ in running:
                self._fail(request, output.decode_error)
        if output.join_error is not None:  # the joint prefill failed: fail the requests it held
            for _, request, _ in joining.entries:
                self._fail(request, output.join_error)
        else:
            with self._cond:
                self._batch.extend(joining)
        for job, request, _ in (*running, *joining.entries):
            if request.over:
                continue
            if request.request_id in output.failed:  # its rule raised: this request alone
                self._fail(request, contained(output.failed[request.request_id]))
            elif request.request_id in output.chosen:
                self._guard(request, job.accept, output.chosen[request.request_id])

    def _guard(self, request: Request, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except BaseException as error:  # noqa: BLE001 - a request's own failure (e.g. its on_token raised)
            self._fail(request, contained(error))

    def _expired(self, request: Request) -> bool:
        """Whether the request must not run on: over already, or cancelled / timed out (then failed now)."""
        if request.over:
            return True
        if request.cancelled.is_set():
            self.stats.cancelled += 1
            self._fail(request, RequestCancelledError("the request was cancelled by its caller"), count=False)
        elif request.deadline is not None and time.perf_counter() > request.deadline:
            self.stats.timed_out += 1
            self._fail(request, _timeout_error(request), count=False)
        return request.over

    def _expire(self) -> None:
        for _, request, _ in self._batch.entries:
            self._expired(request)
        for _, request in self._exclusive:
            self._expired(request)

    def _fail(self, request: Request, error: BaseException, count: bool = True) -> None:
        """Mark a request failed; its caller gets the error when the step retires it (never before its rows left).

        ``count``: an error of the request itself (not a cancellation or a timeout, counted apart).
        """
        if not request.over:
            request.error = error
            request.status = ("cancelled" if isinstance(error, RequestCancelledError) else
                              "timed_out" if isinstance(error, RequestTimeoutError) else "failed")
            self.stats.failed += count
            self._dropped.append(request)

    def _retire(self) -> None:
        """Hand back finished answers and errors; drop the rows of every request that is over, and the rows a
        running job has finished with (:meth:`PooledJob.take_finished_rows`).

        The bookkeeping is updated before any caller is woken, so a caller that reads ``stats()`` right
        after its answer arrives no longer sees its own request running.
        """
        with self._cond:
            keep, finished = self._batch.retire(lambda job, request: request.over or job.done)
            still = []
            for job, request in self._exclusive:
                if request.over or job.done:
                    finished.append((job, request))
                else:
                    still.append((job, request))
            self._exclusive = still
        if keep is not None:
            self.runner.keep_rows(keep)
        for job, _ in finished:
            job.close()
        for job, request in finished:
            if not request.over and not self._follow_up(job, request):
                self._finish(job, request)
        dropped, self._dropped = self._dropped, []
        for request in dropped:
            settle(request.future, error=request.error)

    def _follow_up(self, job: Job, request: Request) -> bool:
        """Queue the job that carries the request on (:meth:`Job.follow_up`) at the head of the queue; whether
        there was one (a follow-up that cannot be built, or can never fit, fails the request)."""
        try:
            follow = job.follow_up()
            if follow is None:
                return False
            request.job, request.kv_bytes = follow, self._bytes_needed(follow)
        except BaseException as error:  # noqa: BLE001 - e.g. the reduce prompt does not fit the window
            self._fail(request, contained(error))  # settled with the step's other failures, right after
            return True
        with self._cond:
            self._ready.appendleft(request)
        return True

    def _bytes_needed(self, job: Job) -> int:
        """The KV bytes ``job`` reserves; :class:`RequestTooLargeError` when even alone it could never fit."""
        needed = job.kv_tokens() * self.bytes_per_token
        if needed > self.max_batch_bytes:
            job.close()
            raise RequestTooLargeError(
                f"this request needs {needed / 2**20:.1f} MiB of KV cache (its prompt and max_new_tokens, all its "
                f"streams), more than the {self.max_batch_bytes / 2**20:.1f} MiB all running requests may hold "
                "together: retrieve fewer documents (top_k), lower max_new_tokens, or raise "
                "Engine(max_batch_bytes=...) (--max-batch-bytes on the command line)")
        return needed

    def _finish(self, job: Job, request: Request) -> None:
        try:
            result = request.finish(job)
        except BaseException as error:  # noqa: BLE001 - e.g. a mode's result hook or on_token failed: this request alone
            self.stats.failed += 1
            request.status = "failed"
            settle(request.future, error=contained(error))
            return
        self.stats.answered += 1
        request.status = "finished"
        settle(request.future, result)


_SCHEDULERS: weakref.WeakKeyDictionary[torch.nn.Module, Scheduler] = weakref.WeakKeyDictionary()
_SCHEDULERS_LOCK = threading.Lock()
# every scheduler alive, also one whose model is gone from _SCHEDULERS (its thread keeps it alive)
_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Join every scheduler's thread before the interpreter finalises (see :meth:`Scheduler.stop`)."""
    with _SCHEDULERS_LOCK:
        schedulers = list(_LIVE)
    for scheduler in schedulers:
        scheduler.stop()


def scheduler_for(loaded: LoadedModel, attention_kernel: str = "auto",
                  max_batch_bytes: int | None = None, threads: int | None = None,
                  compile_mode: str | None = None, batch_invariant: bool = False) -> Scheduler:
    """The scheduler that owns ``loaded.model`` (one per model, shared by every engine built on it).

    ``attention_kernel`` is the row pool's (``flex.resolve_kernel``), ``max_batch_bytes`` the KV bytes
    its running requests may reserve together (``None``: ``registry.default_batch_bytes`` for a new
    scheduler, whatever the existing one has otherwise) and ``threads`` its torch CPU threads (``None``:
    :func:`~ctx_integrations.engine.core.machine.default_threads` for a new scheduler). Engines sharing a
    model share all three, so a second engine asking for other values is refused rather than silently ignored.
    """
    kernel = resolve_kernel(attention_kernel, loaded.device)
    compiled = resolve_compile_mode(compile_mode, loaded.device)
    with _SCHEDULERS_LOCK:
        scheduler = _SCHEDULERS.get(loaded.model)
        if scheduler is None:
            budget = max_batch_bytes if max_batch_bytes is not None else default_batch_bytes(loaded)
            scheduler = _SCHEDULERS[loaded.model] = Scheduler(ModelRunner(loaded, kernel, compiled,
                                                                                      batch_invariant),
                                                              kv_bytes_per_token(loaded), budget,
                                                              threads or default_threads())
            _LIVE.add(scheduler)
        elif threads is not None and scheduler.threads != threads:
            raise InvalidOptionError(
                f"this model's scheduler already runs with threads={scheduler.threads}, and every engine on one "
                f"model shares it: build this engine with the same value (or none), or load the model again for "
                f"threads={threads}")
        elif max_batch_bytes is not None and scheduler.max_batch_bytes != max_batch_bytes:
            raise InvalidOptionError(
                f"this model's scheduler already runs with max_batch_bytes={scheduler.max_batch_bytes}, and every "
                f"engine on one model shares it: build this engine with the same value (or none), or load the model "
                f"again for max_batch_bytes={max_batch_bytes}")
        elif scheduler.runner.compile_mode != compiled:
            raise InvalidOptionError(
                f"this model's scheduler already runs its decode step with compile_mode="
                f"{scheduler.runner.compile_mode!r}, and every engine on one model shares it: build this engine with "
                f"the same compile_mode, or load the model again for compile_mode={compile_mode!r}")
        elif scheduler.runner.batch_invariant != batch_invariant:
            raise InvalidOptionError(
                f"this model's scheduler already runs with batch_invariant={scheduler.runner.batch_invariant}, and "
                f"every engine on one model shares it: build this engine with the same value, or load the model "
                f"again for batch_invariant={batch_invariant}")
        elif scheduler.attention_kernel != kernel:
            raise InvalidOptionError(
                f"this model's scheduler already runs its row pool with attention_kernel="
                f"{scheduler.attention_kernel!r}, and every engine on one model shares it: build this engine "
                f"with the same attention_kernel, or load the model again for attention_kernel={kernel!r}")
        return scheduler
