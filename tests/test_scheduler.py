"""The step scheduler: concurrent requests batched into one forward per step, answers unchanged.

Exactness is the contract: with greedy decoding every answer equals the answer the same request gets
alone, token for token (fp32), whatever else runs beside it. A bug in the row pool (a row seeing
another request's keys, a wrong position after a merge or a pack, logits handed to the wrong job)
changes some of these answers.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core import scheduler as scheduler_module
from ctx_integrations.engine.core.jobs import FusedJob
from ctx_integrations.engine.core.model import default_dtype
from ctx_integrations.engine.core.runner import ModelRunner
from ctx_integrations.engine.core.scheduler import RequestCancelledError
from ctx_integrations.errors import EngineOverloadedError, InvalidOptionError, RequestTimeoutError
from tests.helpers import greedy_reference, loop_ticks, tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019. She grew up in the harbour district.",
    "The Lantern Fair is held every October; smoked eel with plums is served there.",
    "Quillby is a fishing town north of Marrowgate whose harbour master is Aled Venn.",
    "The secret code of the vault is 4721.",
]

# mixed modes, document counts and lengths, answer budgets (APE's rows with their own attention rule, RAPID's
# target and drafter rows, MapReduce's map rows then its reduce row: all share the batch)
REQUESTS = [
    dict(query="Who is the mayor?", documents=DOCS[:2], mode="pced", max_new_tokens=12),
    dict(query="What is the secret code?", documents=DOCS, mode="pced", max_new_tokens=20, gamma=0.0),
    dict(query="Where is Quillby?", documents=DOCS[2:4], mode="concat", max_new_tokens=9),
    dict(query="When is the fair?", documents=DOCS[1:], mode="single", max_new_tokens=15),
    dict(query="Who is the harbour master?", documents=DOCS[3:], mode="soft_nbce", max_new_tokens=7, chunk_tokens=8),
    dict(query="What river?", documents=DOCS[:3], mode="nbce", max_new_tokens=11),
    dict(query="Tell me about the city.", documents=DOCS[:3], mode="ape", max_new_tokens=10),
    dict(query="What is served at the fair?", documents=[DOCS[2]] * 2 + DOCS[:1], mode="rapid", max_new_tokens=14,
         draft_context_tokens=16, chunk_tokens=8),
    dict(query="Who is the mayor and where?", documents=DOCS[:3], mode="map_reduce", max_new_tokens=8,
         summary_tokens=5),
]


def _call(request: dict) -> dict:
    request = dict(request)
    return dict(query=request.pop("query"), documents=request.pop("documents"), **request)


LEG_DTYPE = default_dtype(torch.device("cpu"))  # the library's default here, or $CTX_DTYPE's (make test's dtype leg)


@pytest.fixture
def engine(family) -> Engine:
    """The position-sensitive tiny model (a position bug changes its answers) in the library's default dtype: the
    concurrency tests marked ``dtype_legs`` run in it and in the other one (``make test``), exactness promised in
    both."""
    return Engine(tiny_loaded(family, seed=3, position_sensitive=True, dtype=LEG_DTYPE))


@pytest.fixture
def reference_engine(family) -> Engine:
    """The same model in fp32: the reference path, for comparisons with transformers' own ``generate``."""
    return Engine(tiny_loaded(family, seed=3, position_sensitive=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.dtype_legs
def test_concurrent_mixed_requests_equal_their_answers_alone(engine):
    alone = [engine.generate(**_call(r)).token_ids for r in REQUESTS]
    assert all(len(ids) >= 5 for ids in alone) and len({tuple(ids) for ids in alone}) == len(alone)
    engine.store.clear_memory()  # the concurrent run also meets cold caches, computed on the model's thread

    async def together():
        return await asyncio.gather(*(engine.agenerate(**_call(r)) for r in REQUESTS))

    peak = engine.scheduler.stats.peak_rows
    answers = asyncio.run(together())
    assert [a.token_ids for a in answers] == alone
    assert engine.scheduler.stats.peak_rows > peak  # several requests really shared a forward
    assert engine.stats()["active_requests"] == 0


@pytest.mark.dtype_legs
def test_threads_calling_generate_at_once_get_their_answers_alone(engine):
    alone = [engine.generate(**_call(r)).token_ids for r in REQUESTS[:6]]
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:
        results[i] = engine.generate(**_call(REQUESTS[i])).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [results[i] for i in range(6)] == alone


@pytest.mark.dtype_legs
def test_a_stream_closed_midway_frees_its_rows_and_disturbs_nobody(engine):
    long_request = dict(query="Describe everything.", documents=DOCS, mode="pced", max_new_tokens=48)
    alone_long = engine.generate(**_call(long_request)).token_ids
    assert len(alone_long) > 10
    others = REQUESTS[:4]
    alone = [engine.generate(**_call(r)).token_ids for r in others]

    async def run():
        stream = engine.astream(**_call(long_request))
        pieces = []

        async def read_two():
            async for piece in stream:
                pieces.append(piece)
                if len(pieces) == 2:
                    break
            await stream.aclose()

        results = await asyncio.gather(read_two(), *(engine.agenerate(**_call(r)) for r in others))
        return pieces, results[1:]

    forwards = engine.scheduler.stats.forwards
    pieces, answers = asyncio.run(run())
    assert len(pieces) == 2
    assert [a.token_ids for a in answers] == alone
    assert engine.scheduler.stats.forwards - forwards < len(alone_long) + max(len(a) for a in alone) + 4
    deadline = time.time() + 5
    while engine.stats()["active_requests"] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats()["active_requests"] == 0 and engine.stats()["active_rows"] == 0


def test_cancelling_an_agenerate_task_cancels_the_request(engine):
    async def run():
        task = asyncio.create_task(engine.agenerate("Describe everything.", DOCS, max_new_tokens=200))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ok = await engine.agenerate("Who is the mayor?", DOCS[:2], max_new_tokens=5)
        return ok

    assert len(asyncio.run(run()).token_ids) > 0
    assert engine.scheduler.stats.cancelled >= 1
    assert engine.stats()["active_requests"] == 0


def test_a_timeout_fails_only_its_own_request(engine):
    async def run():
        slow = engine.agenerate("Describe everything.", DOCS, max_new_tokens=400, timeout=0.05)
        fine = engine.agenerate("Who is the mayor?", DOCS[:2], max_new_tokens=6)
        return await asyncio.gather(slow, fine, return_exceptions=True)

    slow, fine = asyncio.run(run())
    assert isinstance(slow, RequestTimeoutError) and isinstance(slow, TimeoutError)
    assert fine.token_ids == engine.generate("Who is the mayor?", DOCS[:2], max_new_tokens=6).token_ids
    with pytest.raises(InvalidOptionError, match="timeout"):
        engine.generate("Who?", DOCS, timeout=float("nan"))


def test_a_full_queue_refuses_at_once_with_a_typed_error(monkeypatch):
    engine = Engine(tiny_loaded("llama", seed=3), max_queued_requests=1)
    release = threading.Event()
    monkeypatch.setattr(engine.store, "prefetch", lambda prepared: release.wait(10))  # hold the queue
    first = engine.submit("Who?", DOCS[:1], max_new_tokens=4)
    with pytest.raises(EngineOverloadedError, match="max_queued_requests=1"):
        engine.generate("Who else?", DOCS[:1], max_new_tokens=4)
    release.set()
    assert len(first.result().token_ids) > 0


def test_async_calls_keep_the_loop_free_and_take_no_thread_each(engine):
    async def run():
        before = threading.active_count()
        async with loop_ticks() as ticks:
            answers = await asyncio.gather(*(engine.agenerate("Who is the mayor?", DOCS[:2], max_new_tokens=8)
                                             for _ in range(12)))
        return answers, ticks, threading.active_count() - before

    answers, ticks, new_threads = asyncio.run(run())
    assert len(answers) == 12 and len({tuple(a.token_ids) for a in answers}) == 1
    assert new_threads <= 2  # the scheduler and its loader thread, not one per request
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 5 and max(gaps) < 0.5


@pytest.mark.dtype_legs
def test_generate_many_in_any_mode_equals_one_by_one(engine):
    questions = ["Who is the mayor?", "What is the code?", "Where is Quillby?"]
    alone = [engine.generate(q, DOCS, mode="single", max_new_tokens=8).token_ids for q in questions]
    assert [a.token_ids for a in engine.generate_many(questions, DOCS, mode="single", max_new_tokens=8)] == alone


@pytest.mark.dtype_legs
def test_two_engines_on_one_model_run_ape_and_pced_side_by_side():
    loaded = tiny_loaded("llama", seed=3, dtype=LEG_DTYPE)
    first, second = Engine(loaded), Engine(loaded)
    assert first.scheduler is second.scheduler
    ape_alone = first.generate("Who is the mayor?", DOCS, mode="ape", max_new_tokens=10).token_ids
    pced_alone = second.generate("Who is the mayor?", DOCS, mode="pced", max_new_tokens=10).token_ids
    results: dict[str, list[int]] = {}

    def ape() -> None:
        results["ape"] = [first.generate("Who is the mayor?", DOCS, mode="ape", max_new_tokens=10).token_ids
                          for _ in range(3)][-1]

    def pced() -> None:
        results["pced"] = [second.generate("Who is the mayor?", DOCS, mode="pced", max_new_tokens=10).token_ids
                           for _ in range(3)][-1]

    threads = [threading.Thread(target=ape), threading.Thread(target=pced)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {"ape": ape_alone, "pced": pced_alone}


def test_an_error_in_one_request_fails_it_alone(engine):
    def explode(piece: str) -> None:
        raise RuntimeError("the caller's callback broke")

    async def run():
        bad = asyncio.to_thread(engine.generate, "Who?", DOCS[:2], max_new_tokens=6, on_token=explode)
        good = engine.agenerate("Who is the mayor?", DOCS[:2], max_new_tokens=6)
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, RuntimeError) and "callback" in str(bad)
    assert len(good.token_ids) == 6


def test_the_scheduler_thread_exits_when_idle_and_comes_back(engine, monkeypatch):
    monkeypatch.setattr(scheduler_module, "IDLE_EXIT_S", 0.05)
    engine.generate("Who?", DOCS[:1], max_new_tokens=2)
    deadline = time.time() + 5
    while engine.scheduler._thread is not None and time.time() < deadline:
        time.sleep(0.02)
    assert engine.scheduler._thread is None
    assert len(engine.generate("Who?", DOCS[:1], max_new_tokens=2).token_ids) > 0


def test_stats_report_tiers_bytes_and_answers(engine, tmp_path):
    disk_engine = Engine(engine.loaded, cache_dir=tmp_path)
    first = disk_engine.generate("Who?", DOCS[:2], max_new_tokens=3)
    assert (first.cache_hits, first.cache_misses) == (0, 2)
    again = disk_engine.generate("Who?", DOCS[:2], max_new_tokens=3)
    assert again.cache_hits_by_tier == {"memory": 2, "host": 0, "disk": 0, "remote": 0}
    disk_engine.store.clear_memory()
    from_disk = disk_engine.generate("Who?", DOCS[:2], max_new_tokens=3)
    assert from_disk.cache_hits_by_tier == {"memory": 0, "host": 0, "disk": 2, "remote": 0}
    assert from_disk.cache_misses == 0
    stats = disk_engine.stats()
    assert stats["bytes"]["disk"] > 0 and stats["bytes"]["memory"] > 0 and stats["answered"] >= 3
    assert stats["cache"]["hits_by_tier"]["disk"] >= 2


def test_close_refuses_new_requests(engine):
    engine.generate("Who?", DOCS[:1], max_new_tokens=2)
    engine.close()
    with pytest.raises(InvalidOptionError, match="closed"):
        engine.generate("Who?", DOCS[:1], max_new_tokens=2)


def test_cancelled_error_is_typed():
    assert issubclass(RequestCancelledError, RuntimeError)


# Qwen2 runs concat (plain rows) and pced (fused streams); single's rows are concat's with one document
@pytest.mark.parametrize(("family", "mode"), [("llama", "concat"), ("llama", "single"), ("llama", "pced"),
                                              ("qwen2", "concat"), ("qwen2", "pced")])
def test_pooled_answers_equal_transformers_greedy_generate(reference_engine, mode):
    """The reference outside the pool: a wrong position, a row reading another row's keys, or a cache piece at
    the wrong offset changes the position-sensitive model's answer (comparing concurrent with alone cannot
    see a bug both share). fp32: transformers' own kernels round otherwise in bf16."""
    engine = reference_engine
    layout = engine.layout
    document = DOCS[1]
    prompt = layout.prefix_ids + layout.context_ids(document) + layout.suffix_ids("Who is the mayor?")
    expected = greedy_reference(engine.loaded, prompt, 12)
    options = dict(beta=0.0, gamma=0.0) if mode == "pced" else {}

    async def together():
        others = [engine.agenerate(**_call(r)) for r in REQUESTS[:3]]  # rows of other requests beside it
        mine = engine.agenerate("Who is the mayor?", [document], mode=mode, max_new_tokens=12, **options)
        return (await asyncio.gather(mine, *others))[0]

    assert len(set(expected)) > 3
    assert engine.generate("Who is the mayor?", [document], mode=mode, max_new_tokens=12, **options).token_ids == \
        expected
    assert asyncio.run(together()).token_ids == expected


def test_a_script_that_exits_right_after_an_answer_exits_cleanly():
    """The scheduler's daemon thread must not be inside torch while the interpreter finalises: without the
    atexit join the process aborted ("terminate called without an active exception", exit 134) about one
    run in three."""
    import os
    import subprocess
    import sys

    from tests.serve_support import ROOT

    script = ("from ctx_integrations import Engine\nfrom tests.helpers import tiny_loaded\n"
              "engine = Engine(tiny_loaded('llama'))\n"
              "print(len(engine.generate('Who?', ['The code is 4721.'], max_new_tokens=4).token_ids))\n")
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        assert (done.returncode, done.stdout.strip()) == (0, "4"), done.stderr[-500:]


def test_the_flex_pool_gives_the_eager_pools_answers(monkeypatch):
    # The row pool under FlexAttention's block mask (the CUDA default; here its unfused reference on CPU) must
    # batch exactly like the boolean mask: concurrent pooled requests get the eager engine's answers alone.
    from ctx_integrations.engine.core import flex as flex_module

    flex_calls = []
    run_flex = flex_module.run_flex
    monkeypatch.setattr(flex_module, "run_flex", lambda *a, **k: flex_calls.append(1) or run_flex(*a, **k))
    eager = Engine(tiny_loaded("llama", seed=3, position_sensitive=True), attention_kernel="eager")
    flex = Engine(tiny_loaded("llama", seed=3, position_sensitive=True), attention_kernel="flex")
    assert (eager.scheduler.attention_kernel, flex.scheduler.attention_kernel) == ("eager", "flex")
    pooled = REQUESTS[:7]  # APE's row with its own rule included: on a flex batch it gets its own boolean mask row
    alone = [eager.generate(**_call(r)) for r in pooled]

    async def together():
        return await asyncio.gather(*(flex.agenerate(**_call(r)) for r in pooled))

    assert not flex_calls  # the eager engine never took the flex path
    answers = asyncio.run(together())
    assert [a.token_ids for a in answers] == [a.token_ids for a in alone]
    assert flex.stats()["exclusive_s"] == 0  # APE too ran in the shared batch
    ape, ape_alone = answers[-1], alone[-1]
    assert ape.mode == "ape" and ape.extra["attention_mass"]  # its citations too
    assert [(t.token_id, t.document) for t in ape.trace] == [(t.token_id, t.document) for t in ape_alone.trace]
    assert [t.score for t in ape.trace] == pytest.approx([t.score for t in ape_alone.trace], abs=1e-4)
    assert len(flex_calls) >= 2 * flex.scheduler.stats.forwards  # every layer of every pooled forward
    assert flex.scheduler.stats.peak_rows > 2  # the requests shared forwards
    with pytest.raises(InvalidOptionError, match="attention_kernel='flex'.*share"):
        Engine(flex.loaded, attention_kernel="eager")  # one pool per model: a second kernel is refused
    assert Engine(flex.loaded, attention_kernel="flex").scheduler is flex.scheduler
    with pytest.raises(InvalidOptionError, match="attention_kernel must be one of"):
        Engine(tiny_loaded("llama", seed=3), attention_kernel="fast")


def test_a_job_that_breaks_while_being_admitted_fails_alone(engine, monkeypatch):
    # A pooled job whose rows() raises (a bug in a mode) must fail its own request, not end the scheduler thread
    # (which would leave every caller waiting forever); a request of another job type (IPPD's) admitted beside
    # it is answered.
    from ctx_integrations.engine.core.jobs import FusedJob

    def broken_rows(self):
        raise RuntimeError("rows broke")

    monkeypatch.setattr(FusedJob, "rows", broken_rows)

    async def run():
        return await asyncio.wait_for(asyncio.gather(
            engine.agenerate("Who is the mayor?", DOCS[:2], max_new_tokens=4),
            engine.agenerate("Tell me about the city.", DOCS[:2], mode="ippd", max_new_tokens=4),
            return_exceptions=True), timeout=60)

    broken, stacked = asyncio.run(run())
    assert isinstance(broken, RuntimeError) and "rows broke" in str(broken)
    assert len(stacked.token_ids) == 4
    monkeypatch.undo()
    assert len(engine.generate("Who is the mayor?", DOCS[:2], max_new_tokens=4).token_ids) == 4


def test_an_unexpected_error_in_a_step_fails_the_running_requests_and_serving_goes_on(engine, monkeypatch):
    consume = scheduler_module.Scheduler._consume
    calls = []

    def consume_once_broken(self, output, joining):
        calls.append(1)
        if len(calls) == 2:  # the first decode step after both requests were admitted
            raise RuntimeError("the step broke")
        consume(self, output, joining)

    monkeypatch.setattr(scheduler_module.Scheduler, "_consume", consume_once_broken)

    async def run():
        return await asyncio.wait_for(asyncio.gather(
            *(engine.agenerate(q, DOCS[:2], max_new_tokens=8) for q in ("Who is the mayor?", "Where is it?")),
            return_exceptions=True), timeout=60)

    results = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) and "the step broke" in str(r) for r in results)
    assert engine.stats()["active_requests"] == 0 and engine.stats()["active_rows"] == 0
    assert len(engine.generate("Who is the mayor?", DOCS[:2], max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("batched", [False, True])
def test_the_batch_reads_its_chosen_tokens_back_once_per_step(monkeypatch, batched):
    # gpt-fast / nano-vllm: tokens are chosen on the device and read back in one transfer for the whole batch.
    # Counting every tensor-to-Python read while the runner steps and the jobs take their tokens: a job that read
    # its own token (or its winner, or its score) back would add reads per job per step. Soft-NBCE's paper rule (the
    # default) and its hard limit build the support of the nuclei on the device too, one by one (the CPU's path) and
    # batched (an accelerator's: PCED's and Soft-NBCE's greedy requests choose their tokens together).
    monkeypatch.setattr(FusedJob, "batch_on_cpu", batched)
    engine = Engine(tiny_loaded("llama", seed=3))
    inside, reads, steps, batches = [False], [0], [0], [0]
    propose_batch = FusedJob.propose_batch.__func__

    def counted_batch(cls, jobs, logits):
        batches[0] += 1
        return propose_batch(cls, jobs, logits)

    monkeypatch.setattr(FusedJob, "propose_batch", classmethod(counted_batch))
    execute, consume = ModelRunner.execute, scheduler_module.Scheduler._consume

    def counted_execute(self, step):  # the forwards and the choice of the step's tokens
        inside[0] = True
        try:
            output = execute(self, step)
        finally:
            inside[0] = False
        steps[0] += bool(output.chosen)
        return output

    def counted_consume(self, output, joining):  # the jobs taking what was chosen
        inside[0] = True
        try:
            consume(self, output, joining)
        finally:
            inside[0] = False

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads[0] += inside[0] and threading.current_thread().name == "ctx-scheduler"
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        counting(name)
    monkeypatch.setattr(scheduler_module.Scheduler, "_consume", counted_consume)
    monkeypatch.setattr(ModelRunner, "execute", counted_execute)

    async def run():
        return await asyncio.gather(
            *(engine.agenerate(q, DOCS[:3], max_new_tokens=6) for q in ("Who is the mayor?", "Where is it?")),
            engine.agenerate("What river?", DOCS[:2], mode="soft_nbce", max_new_tokens=6, rule="nbce_code"),
            engine.agenerate("What river?", DOCS[:3], mode="soft_nbce", max_new_tokens=6),
            engine.agenerate("Where is the fair?", DOCS[1:3], mode="soft_nbce", max_new_tokens=6, gamma=1.0),
            engine.agenerate("Who is the mayor?", DOCS[1:4], mode="nbce", max_new_tokens=6),
            engine.agenerate_many(["When is the fair?", "Who is the harbour master?"], DOCS[2:4], max_new_tokens=6),
            engine.agenerate("Who is it?", DOCS[:3], mode="rapid", gamma=3, max_new_tokens=6, draft_context_tokens=16,
                             chunk_tokens=8, ranking="scores"))

    answers = asyncio.run(run())
    assert all(len(a.token_ids) == 6 for a in answers[:6]) and steps[0] >= 6
    assert answers[-1].extra["drafted"] > 0  # RAPID's drafts and verdicts were read with the batch's tokens
    assert reads[0] == steps[0]
    assert (batches[0] >= 2 * 6) == batched  # PCED's pair and Soft-NBCE's pair each chose their tokens together


def test_map_reduce_runs_both_steps_in_the_shared_batch():
    engine = Engine(tiny_loaded("llama", seed=3))
    answer = engine.generate("Who is the mayor?", DOCS[:3], mode="map_reduce", summary_tokens=5, max_new_tokens=6)
    stats = engine.stats()
    assert len(answer.token_ids) == 6 and len(answer.extra["summaries"]) == 3
    assert stats["exclusive_s"] == 0 and stats["kv_bytes"]["peak"] > 0  # no exclusive step ran
    assert engine.scheduler.stats.peak_rows == 3  # the three map rows, then the reduce row


def test_ape_runs_as_a_row_of_the_shared_batch_with_its_own_attention():
    # On the eager kernel APE is one row with its own attention rule: no exclusive step runs, and an APE
    # request beside a PCED request shares its forwards (the batch held both rows at once).
    engine = Engine(tiny_loaded("llama", seed=3, position_sensitive=True))
    alone = [engine.generate("Who is the mayor?", DOCS[:3], mode="ape", max_new_tokens=8).token_ids,
             engine.generate("Where is it?", DOCS[:2], max_new_tokens=8).token_ids]

    async def together():
        return await asyncio.gather(engine.agenerate("Who is the mayor?", DOCS[:3], mode="ape", max_new_tokens=8),
                                    engine.agenerate("Where is it?", DOCS[:2], max_new_tokens=8))

    assert [a.token_ids for a in asyncio.run(together())] == alone
    assert engine.stats()["exclusive_s"] == 0 and engine.scheduler.stats.peak_rows >= 4  # 1 APE row + 3 PCED
