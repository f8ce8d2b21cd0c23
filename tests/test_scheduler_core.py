"""The scheduler's decisions, without a model: a fake runner stands in for the model runner.

The fake runner remembers which request each batch row belongs to (a label carried by the row's
cached piece when it joins) and answers every row with that label, so a job that is handed another
request's logits notices. Admission is checked against the byte budget step by step from the runner's
log. Bugs these catch: a wrong row offset when jobs of different row counts share the batch, wrong
rows kept after a request (or part of one) leaves, a request admitted past the KV budget, a small
request overtaking a held large one, a held request that cannot be cancelled or timed out, a failed
forward failing the wrong requests.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ctx_integrations.engine.core.choice import ScheduledRequest, choose, per_request
from ctx_integrations.engine.core.jobs import ExclusiveJob, PooledJob
from ctx_integrations.engine.core.rows import Piece, Run
from ctx_integrations.engine.core.scheduler import Request, RequestCancelledError, Scheduler
from ctx_integrations.engine.core.step import RowTable, ScheduledStep, StepLogits, StepOutput
from ctx_integrations.errors import EngineOverloadedError, RequestTimeoutError, RequestTooLargeError

WAIT_S = 20


class FakeRunner:
    """Keeps one label per batch row; answers each row's runs with ``[label, runs]`` rows of 'logits'."""

    attention_kernel = "eager"

    def __init__(self, fail_decode_at: int | None = None, fail_join_of: int | None = None):
        self.labels: list[int] = []
        self.log: list[tuple[list[int], list[int]]] = []  # per step: labels decoded, labels joining
        self.fail_decode_at, self.fail_join_of = fail_decode_at, fail_join_of
        self.running = threading.Event()  # cleared: the next step waits (requests pile up in the queue)
        self.running.set()
        self.forwards = 0
        self.attention: list[tuple[int, object]] = []  # (row label, its own attention rule) as rows joined
        self.rewinds: list[dict[int, int]] = []  # per step, the batch rows that drop columns first
        self.requests: list[tuple[list, list]] = []  # per step, (request id, rows) decoding and joining

    def execute(self, step: ScheduledStep) -> StepOutput:
        time.sleep(0.001)  # a step takes time, so requests arrive while others run
        assert self.running.wait(WAIT_S)
        out, taking = StepOutput(), []
        joining = [int(pieces[0].kv.flatten()[0]) for pieces in step.joining]
        self.log.append((list(self.labels) if step.decode else [], joining))
        self.rewinds.append(dict(step.rewind))
        self.requests.append(([r[:2] for r in step.decode_requests], [r[:2] for r in step.joining_requests]))
        assert sum(r.rows for r in step.decode_requests) == len(step.decode)  # ids cover exactly the rows
        assert sum(r.rows for r in step.joining_requests) == len(step.joining)
        self.attention.extend(zip(joining, step.joining_attention, strict=True))
        if step.decode:
            assert len(step.decode) == len(self.labels), "the step's rows are not the batch's rows"
            if self.fail_decode_at == len(self.log):
                out.decode_error = RuntimeError("decode broke")
            else:
                decoded = [torch.tensor([[label, len(runs)]] * max(len(runs), 1), dtype=torch.float)
                           for label, runs in zip(self.labels, step.decode)]
                taking += per_request(step.decode_requests, decoded)
            out.forwards += 1
        if joining:
            if self.fail_join_of in joining:
                out.join_error = RuntimeError("prefill broke")
            else:
                joined = [torch.tensor([[label, len(runs)]], dtype=torch.float)
                          for label, runs in zip(joining, step.joining_runs)]
                taking += per_request(step.joining_requests, joined)
                self.labels.extend(joining)
            out.forwards += 1
        out.chosen, out.failed = choose(taking)  # as the model runner chooses: each job from its own rows
        out.rows = len(self.labels)
        out.forward_s = 0.5 * out.forwards  # what the scheduler adds up into its stats
        self.forwards += out.forwards
        return out

    def keep_rows(self, keep: list[int]) -> None:
        self.labels = [self.labels[i] for i in keep]

    def steps_with(self, *labels: int) -> list[int]:
        """Steps in which any of these labels was decoded or joined."""
        return [i for i, (decoded, joined) in enumerate(self.log) if set(labels) & set(decoded + joined)]


class FakeJob(PooledJob):
    """``rows`` rows labelled ``label * 100 + row``; done after ``steps`` steps (and once ``gate`` is set).

    ``drop``: {step: rows} -- rows (original indices) that finish at that step while the job goes on.
    """

    def __init__(self, label: int, rows: int = 1, steps: int = 3, kv_tokens: int = 10,
                 gate: threading.Event | None = None, drop: dict[int, list[int]] | None = None):
        super().__init__([])
        self.labels = [label * 100 + row for row in range(rows)]
        self.live = list(self.labels)
        self.steps, self.tokens, self.gate, self.drop = steps, kv_tokens, gate, drop or {}
        self.seen: list[list[int]] = []  # per step, the labels of the logits this job was handed
        self._dropping: list[int] = []

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.steps and (self.gate is None or self.gate.is_set())

    def rows(self) -> list[list[Piece]]:
        return [[Piece(torch.full((1, 2, 1, 1, 1), float(label)), 0)] for label in self.labels]

    def runs(self) -> list[list[Run]]:
        return [[Run((1,), len(self.seen))] for _ in self.live]

    def propose(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([row[-1, 0] for row in logits])  # the labels of the rows it was handed

    def accept(self, values: list[float]) -> None:
        labels = [int(value) for value in values]
        if labels != self.live:
            raise AssertionError(f"job handed rows {labels}, its own are {self.live}")
        self.seen.append(labels)
        gone = [self.labels[i] for i in self.drop.get(len(self.seen), [])]
        self._dropping = [self.live.index(label) for label in gone]

    def take_finished_rows(self) -> list[int]:
        rows, self._dropping = self._dropping, []
        self.live = [label for i, label in enumerate(self.live) if i not in rows]
        return rows

    def kv_tokens(self) -> int:
        return self.tokens

    def row_attention(self) -> list:
        return [f"rule of {label}" if label % 2 else None for label in self.labels]

    def results(self) -> list:
        return []


class FakeTwoStepJob(FakeJob):
    """A job whose request goes on in a follow-up job (as MapReduce's map step is followed by its reduce)."""

    def __init__(self, label: int, then: FakeJob | Exception, **kwargs):
        super().__init__(label, **kwargs)
        self.then = then

    def follow_up(self) -> FakeJob:
        if isinstance(self.then, Exception):
            raise self.then
        return self.then


class FakeExclusive(ExclusiveJob):
    def __init__(self, steps: int, kv_tokens: int, gate: threading.Event | None = None, step_s: float = 0.0):
        def run():
            for _ in range(steps):
                time.sleep(step_s)
                yield
            while gate is not None and not gate.is_set():
                yield
            return []

        super().__init__([], run())
        self.tokens = kv_tokens

    def kv_tokens(self) -> int:
        return self.tokens


class JobRequest(Request):
    """A request whose job is given, or made by ``plan`` on the scheduler's thread (the engine's requests plan
    theirs from a mode); ``prefetch`` runs on the loader thread; its result is the job."""

    def __init__(self, job=None, *, plan=None, prefetch=None, **kwargs):
        super().__init__("tests", **kwargs)
        self.given, self.make, self.read = job, plan, prefetch

    def plan(self):
        return self.make() if self.make is not None else self.given

    def prefetch(self):
        if self.read is not None:
            self.read()

    def finish(self, job):
        return job


def submission(job, **kwargs) -> Request:
    return JobRequest(job, **kwargs)


@pytest.fixture
def scheduler():
    made = []

    def make(runner=None, budget=100, bytes_per_token=1):
        made.append(Scheduler(runner or FakeRunner(), bytes_per_token, budget))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def wait_until(condition, what: str) -> None:
    deadline = time.perf_counter() + WAIT_S
    while not condition():
        assert time.perf_counter() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def start_gated(sched: Scheduler, label: int, kv_tokens: int, **kwargs):
    """Run a request that stays until its gate is set; returns (handle, gate) once it runs."""
    gate = threading.Event()
    handle = sched.submit(submission(FakeJob(label, kv_tokens=kv_tokens, gate=gate), **kwargs))
    wait_until(lambda: sched.active()[0] >= 1, "the gated request to run")
    return handle, gate


def submit_held(sched: Scheduler, job, max_queued: int | None = None):
    """Submit a request that does not fit beside the running ones; returns its handle once it is held."""
    held_before = sched.stats.held
    handle = sched.submit(submission(job), max_queued=max_queued)
    wait_until(lambda: sched.stats.held > held_before, "the request to wait for KV bytes")
    return handle


def test_each_job_gets_its_own_rows_as_jobs_of_any_size_join_and_leave(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=10_000)
    jobs = [FakeJob(1, rows=1, steps=2), FakeJob(2, rows=3, steps=6), FakeJob(3, rows=2, steps=3),
            FakeJob(4, rows=4, steps=8, drop={2: [0, 2], 5: [3]}), FakeJob(5, rows=2, steps=4)]
    handles = [sched.submit(submission(job)) for job in jobs[:3]]
    wait_until(lambda: any(joined for _, joined in runner.log), "the first requests to join")
    handles += [sched.submit(submission(job)) for job in jobs[3:]]  # join a running batch
    for handle, job in zip(handles, jobs):
        assert handle.future.result(timeout=WAIT_S) is job
        assert len(job.seen) == job.steps
    four = jobs[3].seen  # rows 400 and 402 left after step 2, row 403 after step 5; the rest went on
    assert four[0] == four[1] == [400, 401, 402, 403] and four[2] == [401, 403] and four[5] == [401]
    # each joining row reached the runner with its own attention rule (odd labels have one here)
    assert sorted(runner.attention, key=lambda pair: pair[0]) == [
        (label, f"rule of {label}" if label % 2 else None) for job in jobs for label in job.labels]
    assert runner.labels == [] and sched.active() == (0, 0)
    assert sched.stats.peak_rows >= 5  # the batch did hold several requests at once


def test_a_joining_request_takes_its_first_token_from_its_prefill(scheduler):
    # The joint prefill's logits are the joining rows' first ones: a job done after one token never reaches a decode
    # step. A scheduler that did not hand them to the job would decode it once more (a real answer would lose the
    # token its prompt predicts).
    runner = FakeRunner()
    sched = scheduler(runner)
    job = FakeJob(1, steps=1)
    assert sched.submit(submission(job)).future.result(timeout=WAIT_S) is job
    assert job.seen == [[100]] and [runner.log[i] for i in runner.steps_with(100)] == [([], [100])]


def test_a_request_waits_for_kv_bytes_and_joins_when_they_free(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    first, gate = start_gated(sched, 1, 60)
    second = submit_held(sched, FakeJob(2, kv_tokens=60))
    assert sched.queue_depth() == 1 and sched.reserved_bytes() == 60 and sched.active()[0] == 1
    gate.set()
    first.future.result(timeout=WAIT_S)
    second.future.result(timeout=WAIT_S)
    assert max(runner.steps_with(100)) < min(runner.steps_with(200))  # never in the batch together
    assert sched.stats.peak_kv_bytes == 60 and sched.reserved_bytes() == 0


def test_requests_that_fit_together_run_together(scheduler):
    sched = scheduler(budget=100)
    first, gate = start_gated(sched, 1, 50)
    second = sched.submit(submission(FakeJob(2, kv_tokens=50)))
    second.future.result(timeout=WAIT_S)  # answered while the first still runs: 50 + 50 fits 100
    assert not first.future.done() and sched.stats.held == 0 and sched.stats.peak_kv_bytes == 100
    gate.set()
    first.future.result(timeout=WAIT_S)


def test_a_small_request_does_not_overtake_a_held_one(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    _, gate = start_gated(sched, 1, 60)
    held = submit_held(sched, FakeJob(2, kv_tokens=60))
    small = sched.submit(submission(FakeJob(3, kv_tokens=10)))  # would fit now, but waits its turn
    time.sleep(0.05)
    assert not small.future.done() and sched.queue_depth() == 2
    gate.set()
    held.future.result(timeout=WAIT_S)
    small.future.result(timeout=WAIT_S)
    assert min(runner.steps_with(300)) >= min(runner.steps_with(200))


def test_the_requests_behind_a_held_one_keep_their_order_ahead_of_later_arrivals(scheduler):
    # B and C were planned behind H in the step that held H, and D and E arrived while H's plan ran (a plan may
    # compute caches for seconds). First come, first served: once bytes free, the rows join in the order
    # H, B, C, D, E. Catches B and C sent to the back of the queue (behind D and E) or put back reversed.
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    late: list = []
    arrived = threading.Event()

    def plan_held():  # on the scheduler's thread: two requests arrive and are ready before H is held
        late.extend(sched.submit_all([submission(FakeJob(5, kv_tokens=10)),
                                      submission(FakeJob(6, kv_tokens=10), prefetch=arrived.set)]))
        assert arrived.wait(WAIT_S)  # the loader reads in order: D is in the queue once E's read begins
        return FakeJob(2, kv_tokens=100)

    held = JobRequest(plan=plan_held)
    behind = [submission(FakeJob(label, kv_tokens=10)) for label in (3, 4)]
    handles, running, gate = paused_with_queue(sched, runner, [held, *behind])  # 1 byte runs: H (100) cannot join
    runner.running.set()
    wait_until(lambda: sched.stats.held == 1 and len(late) == 2, "H to be held with D and E queued")
    gate.set()
    for handle in (*handles, *late):
        handle.future.result(timeout=WAIT_S)
    running.future.result(timeout=WAIT_S)
    joined = [label for _, labels in runner.log for label in labels if label != 900]
    assert joined == [200, 300, 400, 500, 600]


def test_a_request_larger_than_the_whole_budget_fails_with_a_typed_error(scheduler):
    sched = scheduler(budget=100)
    big = sched.submit(submission(FakeJob(1, kv_tokens=101)))
    with pytest.raises(RequestTooLargeError, match=r"max_batch_bytes"):
        big.future.result(timeout=WAIT_S)
    assert sched.submit(submission(FakeJob(2, kv_tokens=100))).future.result(timeout=WAIT_S).steps == 3


def test_bytes_are_tokens_times_the_models_bytes_per_token(scheduler):
    sched = scheduler(budget=100, bytes_per_token=4)
    with pytest.raises(RequestTooLargeError):
        sched.submit(submission(FakeJob(1, kv_tokens=26))).future.result(timeout=WAIT_S)  # 104 bytes
    sched.submit(submission(FakeJob(2, kv_tokens=25))).future.result(timeout=WAIT_S)  # 100 bytes


def test_the_queue_limit_counts_a_held_request(scheduler):
    sched = scheduler(budget=100)
    _, gate = start_gated(sched, 1, 60)
    submit_held(sched, FakeJob(2, kv_tokens=60), max_queued=1)
    with pytest.raises(EngineOverloadedError):
        sched.submit(submission(FakeJob(3, kv_tokens=1)), max_queued=1)
    gate.set()


def test_a_held_request_can_be_cancelled_or_time_out(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    first, gate = start_gated(sched, 1, 60)
    cancelled = submit_held(sched, FakeJob(2, kv_tokens=60))
    cancelled.cancel()
    with pytest.raises(RequestCancelledError):
        cancelled.future.result(timeout=WAIT_S)
    late = submission(FakeJob(3, kv_tokens=60))
    late.deadline = late.submitted + 0.2
    late_handle = sched.submit(late)
    with pytest.raises(RequestTimeoutError):
        late_handle.future.result(timeout=WAIT_S)
    gate.set()
    first.future.result(timeout=WAIT_S)
    assert runner.steps_with(200, 300) == [] and sched.queue_depth() == 0


def test_an_exclusive_job_reserves_its_bytes_too(scheduler):
    runner, gate = FakeRunner(), threading.Event()
    sched = scheduler(runner, budget=100)
    exclusive = sched.submit(submission(FakeExclusive(steps=2, kv_tokens=70, gate=gate)))
    wait_until(lambda: sched.active()[0] == 1, "the exclusive request to run")
    pooled = submit_held(sched, FakeJob(2, kv_tokens=40))
    assert runner.steps_with(200) == []
    gate.set()
    exclusive.future.result(timeout=WAIT_S)
    pooled.future.result(timeout=WAIT_S)


def test_a_failed_decode_fails_the_running_requests_and_a_failed_prefill_only_the_joining(scheduler):
    runner = FakeRunner(fail_join_of=300)
    sched = scheduler(runner, budget=10_000)
    running, _ = start_gated(sched, 1, 10)
    broken = sched.submit(submission(FakeJob(3)))
    with pytest.raises(RuntimeError, match="prefill broke"):
        broken.future.result(timeout=WAIT_S)
    assert 300 not in runner.labels and not running.future.done()  # the joiner's rows never joined
    runner.fail_decode_at = len(runner.log) + 1
    with pytest.raises(RuntimeError, match="decode broke"):
        running.future.result(timeout=WAIT_S)
    assert runner.labels == []
    assert sched.submit(submission(FakeJob(4))).future.result(timeout=WAIT_S).steps == 3  # serving goes on


def test_the_row_table_maps_rows_to_requests():
    table = RowTable()
    a, b = FakeJob(1, rows=2), FakeJob(2, rows=3, drop={1: [1]})
    table.entries += [(a, "a", 2), (b, "b", 3)]
    requests = table.requests()
    assert requests == [("a", 2, a), ("b", 3, b)]
    over = SimpleNamespace(request_id="gone", over=True)  # failed this step: its rows run, nobody chooses for them
    assert RowTable([(a, over, 2)]).requests() == [ScheduledRequest("gone", 2, None)]
    assert [(r.request_id, rows) for r, rows in per_request(requests, ["a0", "a1", "b0", "b1", "b2"])] == [
        ("a", ["a0", "a1"]), ("b", ["b0", "b1", "b2"])]
    with pytest.raises(AssertionError, match="4 rows of output for requests of 5 rows"):
        per_request(requests, [0, 1, 2, 3])
    assert table.retire(lambda job, s: False) == (None, [])  # nobody leaves: keep everything as it is
    b.accept([200.0, 201.0, 202.0])  # row 201 finishes
    keep, left = table.retire(lambda job, s: s == "a")
    assert keep == [2, 4] and left == [(a, "a")] and table.entries == [(b, "b", 2)]


def test_a_steps_logits_become_its_output_with_every_count_and_error_kept():
    decode, join = RuntimeError("decode"), RuntimeError("join")
    logits = StepLogits(decode_error=decode, join_error=join, forwards=3, forward_s=0.25, rows=7,
                        decoded=[torch.zeros(1, 2)])
    chosen, failed = {"req-1": [1.0, 2.0]}, {"req-2": ValueError("rule")}
    assert logits.chose(chosen, failed) == StepOutput(decode_error=decode, join_error=join, forwards=3, forward_s=0.25,
                                                      rows=7, chosen=chosen, failed=failed)


def test_the_row_table_offsets_each_requests_rewinds_by_every_row_before_it_and_names_its_requests():
    class Rewinding(FakeJob):
        def __init__(self, label: int, rows: int, rewind: dict[int, int]):
            super().__init__(label, rows=rows)
            self.rewind = rewind

        def rewinds(self) -> dict[int, int]:
            return self.rewind

    table = RowTable()
    table.entries += [(Rewinding(1, 2, {}), "a", 2), (Rewinding(2, 1, {0: 5}), "b", 1),
                      (Rewinding(3, 3, {2: 9}), "c", 3)]
    assert table.rewinds() == {2: 5, 2 + 1 + 2: 9}  # offsets 0, 2 and 3
    # a submission without a request id (a test's label) is named by itself
    assert [r[:2] for r in table.requests()] == [("a", 2), ("b", 1), ("c", 3)]


def test_a_follow_up_job_carries_the_request_on_in_new_rows(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    reduce = FakeJob(2, rows=1, steps=2, kv_tokens=80)  # more than the map step's 60 + the other's 30
    other_gate = threading.Event()
    other = sched.submit(submission(FakeJob(3, kv_tokens=30, gate=other_gate)))
    wait_until(lambda: sched.active()[0] == 1, "the other request to run")
    mapped = sched.submit(submission(FakeTwoStepJob(1, reduce, rows=3, steps=2, kv_tokens=60)))
    wait_until(lambda: sched.stats.held >= 1, "the follow-up to wait for the other request's bytes")
    assert not mapped.future.done() and 100 not in runner.labels  # the map rows left; the reduce waits
    other_gate.set()
    assert mapped.future.result(timeout=WAIT_S) is reduce and len(reduce.seen) == 2  # finish gets the last job
    assert max(runner.steps_with(100, 101, 102)) < min(runner.steps_with(200))
    assert sched.stats.peak_kv_bytes == 90 and sched.reserved_bytes() == 0
    other.future.result(timeout=WAIT_S)


@pytest.mark.parametrize("then, error", [(RuntimeError("reduce prompt too long"), RuntimeError),
                                         (FakeJob(2, kv_tokens=101), RequestTooLargeError)])
def test_a_follow_up_that_cannot_run_fails_its_request_alone(scheduler, then, error):
    sched = scheduler(budget=100)
    failing = sched.submit(submission(FakeTwoStepJob(1, then, rows=2)))
    with pytest.raises(error):
        failing.future.result(timeout=WAIT_S)
    assert sched.submit(submission(FakeJob(3))).future.result(timeout=WAIT_S).steps == 3
    assert sched.active() == (0, 0) and sched.queue_depth() == 0


def paused_with_queue(sched: Scheduler, runner: FakeRunner, submissions: list[Request]):
    """Queue ``submissions`` while a running request holds the step loop inside a paused step, so that the
    next step plans them all together; returns their handles and the running request's gate."""
    running, gate = start_gated(sched, 9, 1)
    runner.running.clear()
    time.sleep(0.01)  # the loop is now inside (or entering) a paused step
    handles = sched.submit_all(submissions)
    wait_until(lambda: not sched._loading, "the queued requests to be ready")
    return handles, running, gate


def test_requests_admitted_in_one_step_count_each_others_bytes(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    handles, running, gate = paused_with_queue(sched, runner, [submission(FakeJob(i, kv_tokens=40)) for i in (1, 2, 3)])
    runner.running.set()
    for handle in handles:
        handle.future.result(timeout=WAIT_S)
    gate.set()
    running.future.result(timeout=WAIT_S)
    assert sched.stats.peak_kv_bytes == 81 and sched.stats.held == 1  # 1 + 40 + 40; the third waited once
    assert not any({100, 200, 300} <= set(decoded + joined) for decoded, joined in runner.log)


@pytest.mark.parametrize("how", ["cancelled", "plan raises", "timed out while planned"])
def test_a_request_that_drops_out_while_planned_leaves_the_ones_behind_it_planned(scheduler, how):
    runner = FakeRunner()
    sched = scheduler(runner, budget=100)
    first = submission(FakeJob(1))
    if how == "plan raises":
        first.plan = lambda: (_ for _ in ()).throw(RuntimeError("cannot plan"))
    elif how == "timed out while planned":
        job = first.plan()
        first.plan = lambda: first.future.set_exception(RequestTimeoutError("late")) or job
    second = submission(FakeJob(2))
    (first_handle, second_handle), running, gate = paused_with_queue(sched, runner, [first, second])
    if how == "cancelled":
        first_handle.cancel()
    runner.running.set()
    assert second_handle.future.result(timeout=WAIT_S).steps == 3
    with pytest.raises((RequestCancelledError, RuntimeError, RequestTimeoutError)):
        first_handle.future.result(timeout=WAIT_S)
    gate.set()
    running.future.result(timeout=WAIT_S)


def test_an_exclusive_job_that_raises_fails_its_own_request_alone(scheduler):
    class Broken(FakeExclusive):
        def step(self):
            raise RuntimeError("exclusive step broke")

    sched = scheduler(budget=100)
    broken = sched.submit(submission(Broken(steps=1, kv_tokens=1)))
    fine = sched.submit(submission(FakeJob(2)))
    with pytest.raises(RuntimeError, match="exclusive step broke"):
        broken.future.result(timeout=WAIT_S)
    assert fine.future.result(timeout=WAIT_S).steps == 3


def test_the_stats_add_up_the_runners_forwards_and_the_exclusive_steps(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=1000)
    started = time.perf_counter()
    for label in (1, 2):
        sched.submit(submission(FakeJob(label, rows=2))).future.result(timeout=WAIT_S)
    assert sched.stats.forwards == runner.forwards >= 6 and sched.stats.forward_s == 0.5 * runner.forwards
    assert sched.stats.steps == len(runner.log) and sched.stats.rows_stepped >= 2 * 3
    assert sched.stats.exclusive_s == 0  # no exclusive job ran: not even the loop's own time is counted
    assert 0.001 * sched.stats.steps <= sched.stats.busy_s <= time.perf_counter() - started  # each step sleeps 1 ms
    for _ in range(2):
        sched.submit(submission(FakeExclusive(steps=3, kv_tokens=1, step_s=0.02))).future.result(timeout=WAIT_S)
    assert 0.12 <= sched.stats.exclusive_s <= sched.stats.busy_s <= time.perf_counter() - started


class FailingJob(FakeJob):
    """A job whose rule breaks (in ``propose``) or whose emitter breaks (in ``accept``) at its second step."""

    def __init__(self, label: int, where: str, **kwargs):
        super().__init__(label, **kwargs)
        self.where = where

    def propose(self, logits):
        if self.where == "propose" and len(self.seen) == 1:
            raise ValueError("the rule broke")
        return super().propose(logits)

    def accept(self, values):
        if self.where == "accept" and len(self.seen) == 1:
            raise ValueError("the emitter broke")
        super().accept(values)


@pytest.mark.parametrize("where", ["propose", "accept"])
def test_a_job_that_breaks_while_choosing_its_token_fails_alone(scheduler, where):
    runner = FakeRunner()
    sched = scheduler(runner, budget=1000)
    broken, fine = FailingJob(1, where, rows=2), FakeJob(2, rows=3, steps=4)
    handles = sched.submit_all([submission(broken), submission(fine)])
    with pytest.raises(ValueError, match="broke"):
        handles[0].future.result(timeout=WAIT_S)
    assert handles[1].future.result(timeout=WAIT_S) is fine and len(fine.seen) == 4
    assert sched.stats.failed == 1 and runner.labels == []


class FakeBatchJob(FailingJob):
    """A job whose proposals a step chooses for all such jobs at once (``propose_batch``), as greedy PCED's do;
    ``batches`` logs each batch's labels. A batch with a job whose ``where`` is "propose" breaks at its second step
    (then that job's own ``propose`` breaks too, as the batch's error was its own)."""

    batches: list[list[int]] = []

    def batch_key(self):
        return "fake rule"

    @classmethod
    def propose_batch(cls, jobs, logits):
        cls.batches.append([job.labels[0] for job in jobs])
        if any(job.where == "propose" and len(job.seen) == 1 for job in jobs):
            raise ValueError("the batched rule broke")
        return [torch.stack([row[-1, 0] for row in rows]) for rows in logits]


def test_jobs_sharing_a_batch_key_propose_together_and_a_broken_batch_fails_only_its_own_request(scheduler):
    FakeBatchJob.batches = []
    runner = FakeRunner()
    sched = scheduler(runner, budget=1000)
    broken = FakeBatchJob(1, "propose", rows=2, steps=3)
    batched = [FakeBatchJob(label, "nowhere", rows=label, steps=4) for label in (2, 3)]
    alone = FakeJob(4, rows=2, steps=4)
    handles, running, gate = paused_with_queue(sched, runner, [submission(job) for job in (broken, *batched, alone)])
    runner.running.set()
    with pytest.raises(ValueError, match="the rule broke"):  # its own error, from its own propose
        handles[0].future.result(timeout=WAIT_S)
    for handle, job in zip(handles[1:], (*batched, alone), strict=True):
        assert handle.future.result(timeout=WAIT_S) is job and len(job.seen) == 4  # each got its own rows
    assert FakeBatchJob.batches[:2] == [[100, 200, 300], [100, 200, 300]]  # the second one broke: retried alone
    assert FakeBatchJob.batches[2:] == [[200, 300]] * 2  # the jobs without a batch key never joined a batch
    gate.set()
    running.future.result(timeout=WAIT_S)
    assert sched.stats.failed == 1 and runner.labels == []


def test_a_request_too_large_for_the_batch_says_how_large_and_what_to_do(scheduler):
    sched = scheduler(budget=3 * 2**20, bytes_per_token=2**20)
    with pytest.raises(RequestTooLargeError) as refused:
        sched.submit(submission(FakeJob(1, kv_tokens=4))).future.result(timeout=WAIT_S)
    assert str(refused.value) == (
        "this request needs 4.0 MiB of KV cache (its prompt and max_new_tokens, all its streams), more than the "
        "3.0 MiB all running requests may hold together: retrieve fewer documents (top_k), lower max_new_tokens, "
        "or raise Engine(max_batch_bytes=...) (--max-batch-bytes on the command line)")


class FakeDraftingJob(FakeJob):
    """A job that sleeps (``waiting``) until ``arrived`` is set, as RAPID's target row waits for a drafter on another
    scheduler; ``rewind``: {step: {row: position}} it asks for; ``broken_prepare``: its ``prepare`` raises."""

    def __init__(self, label: int, arrived: threading.Event | None = None, rewind: dict | None = None,
                 broken_prepare: bool = False, **kwargs):
        super().__init__(label, **kwargs)
        self.arrived, self.rewind, self.broken_prepare = arrived, rewind or {}, broken_prepare
        self.closed = 0

    @property
    def waiting(self) -> bool:
        return self.arrived is not None and not self.arrived.is_set()

    def prepare(self) -> None:
        if self.broken_prepare:
            raise RuntimeError("the drafter's answer could not be taken up")

    def runs(self):
        return [[] for _ in self.live] if self.waiting else super().runs()

    def rewinds(self) -> dict[int, int]:
        return self.rewind.get(len(self.seen), {})

    def propose(self, logits):
        return torch.empty(0) if self.waiting else super().propose(logits)

    def accept(self, values) -> None:
        if values:
            super().accept(values)

    def close(self) -> None:
        self.closed += 1


def test_a_batch_of_waiting_jobs_sleeps_until_woken_and_never_lets_its_rows_go(scheduler, monkeypatch):
    # Catches a loop that spins empty steps while every job waits on another scheduler, and a thread that exits
    # after its idle time while rows are still in the batch (the waiting request would never be answered).
    monkeypatch.setattr("ctx_integrations.engine.core.scheduler.IDLE_EXIT_S", 0.05)
    runner = FakeRunner()
    sched = scheduler(runner)
    arrived = threading.Event()
    job = FakeDraftingJob(1, arrived=arrived, steps=2)
    handle = sched.submit(submission(job))
    wait_until(lambda: sched.active() == (1, 1), "the waiting job to join")
    steps = len(runner.log)
    time.sleep(0.3)  # six idle times
    assert len(runner.log) == steps and sched._thread is not None and sched._thread.is_alive()
    arrived.set()
    sched.wake()
    assert handle.future.result(timeout=WAIT_S) is job and len(job.seen) == 2
    assert job.closed == 1  # told once that its request left


def test_rewinds_reach_the_runner_as_batch_rows(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=10_000)
    gate = threading.Event()
    first = sched.submit(submission(FakeJob(1, rows=3, steps=1, gate=gate)))
    wait_until(lambda: sched.active() == (1, 3), "the first job to run")
    second = sched.submit(submission(FakeDraftingJob(2, rows=2, steps=4, rewind={2: {1: 7}})))
    wait_until(lambda: any(r for r in runner.rewinds), "a rewind")
    assert [r for r in runner.rewinds if r] == [{3 + 1: 7}]  # after the first job's three rows
    gate.set()
    first.future.result(timeout=WAIT_S)
    second.future.result(timeout=WAIT_S)


def test_a_job_whose_prepare_raises_fails_alone_and_is_closed(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner, budget=10_000)
    broken = FakeDraftingJob(1, broken_prepare=True)
    fine = FakeDraftingJob(2)
    handles, running, gate = paused_with_queue(sched, runner, [submission(job) for job in (broken, fine)])
    runner.running.set()
    with pytest.raises(RuntimeError, match="could not be taken up"):
        handles[0].future.result(timeout=WAIT_S)
    assert handles[1].future.result(timeout=WAIT_S) is fine
    # the step in which the broken request failed (both joined in it, the broken one first) still gave the fine
    # one its values: it took a token in every step that carried its row
    assert len(fine.seen) == len(runner.steps_with(200)) == fine.steps
    gate.set()
    running.future.result(timeout=WAIT_S)
    wait_until(lambda: broken.closed == 1 and fine.closed == 1, "both jobs to be closed")
    assert sched.active() == (0, 0)


def test_a_request_is_running_from_its_admission_until_it_is_answered(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner)
    gate = threading.Event()
    request = submission(FakeJob(1, gate=gate))
    assert request.status == "waiting"
    sched.submit(request)
    wait_until(lambda: sched.active()[0] >= 1, "the request to run")
    assert request.status == "running"
    gate.set()
    request.future.result(timeout=WAIT_S)
    assert request.status == "finished"


def test_every_step_names_the_requests_whose_rows_it_carries(scheduler):
    runner = FakeRunner()
    sched = scheduler(runner)
    first, second = submission(FakeJob(1, rows=2)), submission(FakeJob(2, rows=3))
    for request in (first, second):
        sched.submit(request).future.result(timeout=WAIT_S)
    named = {request_id for decoding, joining in runner.requests for request_id, _ in decoding + joining}
    assert named == {first.request_id, second.request_id} and first.request_id != second.request_id
    assert (first.request_id, 2) in runner.requests[0][1]  # joined with its 2 rows
    assert (first.status, second.status) == ("finished", "finished")
