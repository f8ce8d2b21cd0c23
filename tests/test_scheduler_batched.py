"""Greedy PCED requests of one step choose their tokens in one batched rule evaluation (``FusedJob.propose_batch``).

The answers must not move: concurrent requests of different document counts, priors, gammas and betas, some
joining while others decode, get token for token and score for score the answers they get alone, and the answers
the one-by-one path gives (``FusedJob.batch_key`` forced to ``None``), fp32. And the point of it: the tensor
operations the step's proposals dispatch stay constant as requests are added, where the one-by-one path pays
them per request.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.host_reads import Operations as CountOps  # the benchmark's count, the same in the tests
from ctx_integrations import Engine
from ctx_integrations.engine.core import runner as runner_module
from ctx_integrations.engine.core.decoding import FIRST_STEP
from ctx_integrations.engine.core.jobs import FusedJob
from tests.helpers import tiny_loaded
from tests.test_scheduler import DOCS

# documents 1 to 5, every prior, gammas 0 to 6, dynamic / fixed betas, both score spaces (two batches), and two
# requests beside them that do not join those batches (the mixture rule: one by one; a sampled answer: a batch of
# its own knobs, tests/test_sampled_batch.py)
FIRST_WAVE = [
    dict(query="Who is the mayor?", documents=DOCS[:2], scores=[0.9, 0.3], max_new_tokens=14),
    dict(query="What is the secret code?", documents=DOCS, scores=[0.2, 0.4, 0.6, 0.8, 0.95], max_new_tokens=18,
         gamma=0.0, prior="softmax"),
    dict(query="Where is Quillby?", documents=DOCS[3:4], max_new_tokens=16, beta=0.4, gamma=6.0),
    dict(query="When is the fair?", documents=DOCS[1:4], scores=[0.7, 0.5, 0.1], max_new_tokens=12, prior="rank",
         beta=0.0),
    dict(query="What river?", documents=DOCS[:3], max_new_tokens=10, score_space="logits", beta=0.2),
    dict(query="Tell me about the city.", documents=DOCS[:3], max_new_tokens=10, aggregation="mixture"),
    dict(query="Who is the harbour master?", documents=DOCS[2:], max_new_tokens=9, temperature=0.8, seed=5),
    # the question's likelihood on each stream in the prior (its first step's runs cut at each question token)
    dict(query="Which town has a harbour master?", documents=DOCS[1:5], scores=[0.6, 0.62, 0.58, 0.61],
         max_new_tokens=12, query_likelihood=0.3),
]
# joining while the first wave decodes: their first step's JSD beside the others' carried betas
SECOND_WAVE = [
    dict(query="Who grew up in the harbour district?", documents=DOCS[1:3], scores=[0.4, 0.9], max_new_tokens=12,
         prior="minmax"),
    dict(query="What is served at the fair?", documents=DOCS[2:], max_new_tokens=11, score_space="logits"),
    dict(query="Who is it?", documents=DOCS[:4], scores=[0.3, 0.9, 0.5, 0.6], max_new_tokens=13, gamma=2.0),
    dict(query="What is the vault's code?", documents=DOCS[2:], scores=[0.5, 0.52, 0.49], max_new_tokens=10,
         query_likelihood=2.0),
]
# every request is PCED's, named (the default mode is another): its rule is the one batched across requests here
FIRST_WAVE, SECOND_WAVE = ([{"mode": "pced", **r} for r in wave] for wave in (FIRST_WAVE, SECOND_WAVE))


@pytest.fixture(autouse=True)
def batch_on_cpu(monkeypatch):
    """The CPU proposes one by one in production (``FusedJob.batch_on_cpu``); its exactness is what is tested here."""
    monkeypatch.setattr(FusedJob, "batch_on_cpu", True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """fp32, with the batch-invariant kernels: scores are compared bit for bit, and without them a row's logits
    in fp32 round by the forward's height (~3e-6 on a score, seen here): the forward's business, not the rule's."""
    return Engine(tiny_loaded("llama", seed=3, position_sensitive=True), batch_invariant=True)


def _answer(answer) -> tuple:
    """Everything a request reads back from its steps: tokens, winning documents, scores, the beta it used, the
    question's likelihood on each document (``query_likelihood``)."""
    return (answer.token_ids, [(s.token_id, s.document, s.score) for s in answer.trace], answer.extra.get("beta"),
            answer.extra.get("query_loglik"))


def in_two_waves(engine: Engine, first_wave: list[dict], second_wave: list[dict]) -> list:
    """The answers of ``first_wave``'s requests submitted together and of ``second_wave``'s, joining three steps
    into the first wave's decode (their first steps beside the others' later ones), in the waves' order."""
    async def run():
        first = [asyncio.create_task(engine.agenerate(**r)) for r in first_wave]
        steps = engine.scheduler.stats.steps
        while engine.scheduler.stats.steps < steps + 3:
            await asyncio.sleep(0.001)
        second = [asyncio.create_task(engine.agenerate(**r)) for r in second_wave]
        return await asyncio.gather(*first, *second)

    return asyncio.run(run())


def _together(engine: Engine) -> list:
    return [_answer(a) for a in in_two_waves(engine, FIRST_WAVE, SECOND_WAVE)]


def test_concurrent_pced_requests_chosen_in_one_batch_get_their_answers_alone_and_one_by_one(engine, monkeypatch):
    requests = FIRST_WAVE + SECOND_WAVE
    alone = [_answer(engine.generate(**r)) for r in requests]
    assert all(len(answer[0]) >= 5 for answer in alone) and len({tuple(a[0]) for a in alone}) == len(alone)
    # per batched proposal that returned (one that raises is retried job by job, with the same answers), which of
    # its jobs were at their first step, and which of those measured the question's likelihood there
    batches: list[list[tuple[bool, bool]]] = []
    propose_batch = FusedJob.propose_batch.__func__

    def spied(cls, jobs, logits):
        seen = [(job.state is FIRST_STEP, job.state is FIRST_STEP and job._scored is not None) for job in jobs]
        values = propose_batch(cls, jobs, logits)
        batches.append(seen)
        return values

    monkeypatch.setattr(FusedJob, "propose_batch", classmethod(spied))
    assert _together(engine) == alone
    assert max(map(len, batches)) >= 4  # several requests really shared a batched evaluation
    firsts = [[first for first, _ in batch] for batch in batches]
    assert any(any(first) and not all(first) for first in firsts)  # a joining request beside decoding ones
    assert sum(scored for batch in batches for _, scored in batch) == 2  # both likelihoods measured in a batch

    monkeypatch.setattr(FusedJob, "batch_key", lambda self: None)  # the one-by-one path
    batches.clear()
    assert [_answer(engine.generate(**r)) for r in requests] == alone
    assert _together(engine) == alone and batches == []


def proposal_ops(engine: Engine, requests: int, monkeypatch, seed_each: bool = False, **options) -> int:
    """The fewest operations a step's choice (the proposals and their one read) dispatched while ``requests``
    requests over 3 documents (``options``: their mode and settings; ``seed_each``: request i seeded with i) took a
    token."""
    counts: list[tuple[int, int]] = []
    choose = runner_module.choose

    def counted(taking):
        with CountOps() as ops:
            choice = choose(taking)
        counts.append((len(taking), ops.count))
        return choice

    monkeypatch.setattr(runner_module, "choose", counted)

    async def run():
        return await asyncio.gather(*(engine.agenerate(f"Question {i}?", DOCS[:3], max_new_tokens=5, **options,
                                                       **({"seed": i} if seed_each else {}))
                                      for i in range(requests)))

    asyncio.run(run())
    monkeypatch.setattr(runner_module, "choose", choose)
    return min(ops for taking, ops in counts if taking == requests)


def operations_per_step(engine: Engine, monkeypatch, **options) -> tuple[int, int, int, int]:
    """A step's proposal operations for 1 and 8 requests (``options``), batched then one by one; printed."""
    one, eight = proposal_ops(engine, 1, monkeypatch, **options), proposal_ops(engine, 8, monkeypatch, **options)
    monkeypatch.setattr(FusedJob, "batch_key", lambda self: None)
    one_by_one = proposal_ops(engine, 1, monkeypatch, **options)
    eight_one_by_one = proposal_ops(engine, 8, monkeypatch, **options)
    print(f"operations per step: batched 1 request {one}, 8 requests {eight}; "
          f"one by one 1 request {one_by_one}, 8 requests {eight_one_by_one}")
    return one, eight, one_by_one, eight_one_by_one


def test_the_operations_of_a_steps_proposals_do_not_grow_with_its_requests(engine, monkeypatch):
    one, eight, one_by_one, eight_one_by_one = operations_per_step(engine, monkeypatch, beta=0.5)
    assert eight == one
    assert eight_one_by_one - 1 == 8 * (one_by_one - 1)  # one shared operation: the cat of the step's one read
