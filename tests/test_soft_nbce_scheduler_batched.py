"""Greedy Soft-NBCE, NBCE and PCW requests of one step choose their tokens in one batched rule evaluation per batch
key (``FusedJob.propose_batch`` over ``SoftNBCEFusion.fuse_batch``).

The answers must not move: concurrent requests of different document and chunk counts, taus, betas, rhos, gammas
and priors, both rules, some joining while others decode, get token for token, chunk for chunk and score for score
the answers they get alone and the one-by-one path's (``FusedJob.batch_key`` forced to ``None``), fp32. And the point
of it: the tensor operations a step's proposals dispatch stay constant as requests are added, where the one-by-one
path pays them per request.
"""

from __future__ import annotations

import pytest

from ctx_integrations import Engine
from ctx_integrations.engine.core.decoding import FIRST_STEP
from ctx_integrations.engine.core.jobs import FusedJob
from ctx_integrations.engine.modes.soft_nbce import SoftNBCEFusion
from tests.helpers import tiny_loaded
from tests.test_scheduler import DOCS
from tests.test_scheduler_batched import in_two_waves, operations_per_step

# 1 to 5 documents, cut into 1 to 14 chunks (chunk_tokens); the paper's rule and nbce_code; taus, betas, rhos,
# gammas and priors apart; NBCE and PCW (batches of their own); a sampled request that goes one by one beside them;
# a question likelihood prior in each wave (measured at a request's first step, beside requests that decode)
FIRST_WAVE = [
    dict(query="Who is the mayor?", documents=DOCS[:2], mode="soft_nbce", max_new_tokens=14),
    dict(query="What is the secret code?", documents=DOCS, scores=[0.2, 0.4, 0.6, 0.8, 0.95], mode="soft_nbce",
         max_new_tokens=18, chunk_tokens=6, tau=0.5, beta=0.18, rho=0.8, gamma=2.0, prior="rank"),
    dict(query="Where is Quillby?", documents=DOCS[3:4], mode="soft_nbce", max_new_tokens=16, beta=0.43, rho=1.0),
    dict(query="When is the fair?", documents=DOCS[1:4], scores=[0.7, 0.5, 0.1], mode="soft_nbce",
         max_new_tokens=12, chunk_tokens=9, tau=2.0, gamma=0.5, prior="minmax"),
    dict(query="What river?", documents=DOCS[:3], mode="soft_nbce", max_new_tokens=10, rule="nbce_code",
         chunk_tokens=8, tau=0.3),
    dict(query="Tell me about the city.", documents=DOCS[:4], mode="nbce", max_new_tokens=10, chunk_tokens=7),
    dict(query="Who is the harbour master?", documents=DOCS[2:], mode="pcw", max_new_tokens=9, beta=0.25),
    dict(query="Who is it?", documents=DOCS[2:], mode="soft_nbce", max_new_tokens=9, temperature=0.8, seed=5),
    dict(query="Who keeps the lighthouse?", documents=DOCS[:4], scores=[0.8, 0.7, 0.75, 0.6], mode="soft_nbce",
         max_new_tokens=12, chunk_tokens=10, query_likelihood=0.5),
]
# joining while the first wave decodes
SECOND_WAVE = [
    dict(query="Who grew up in the harbour district?", documents=DOCS[1:3], scores=[0.4, 0.9], mode="soft_nbce",
         max_new_tokens=12, chunk_tokens=5, gamma=1.0, prior="paper"),
    dict(query="What is served at the fair?", documents=DOCS[2:], mode="soft_nbce", max_new_tokens=11,
         rule="nbce_code", beta=0.0),
    dict(query="Where is the vault?", documents=DOCS[:4], mode="nbce", max_new_tokens=13, beta=0.43),
    dict(query="Which town?", documents=DOCS[:2], mode="pcw", max_new_tokens=8, chunk_tokens=6),
    dict(query="What does the mayor sell?", documents=DOCS[1:], mode="soft_nbce", max_new_tokens=10, tau=0.3,
         query_likelihood=2.0),
]


@pytest.fixture(autouse=True)
def batch_on_cpu(monkeypatch):
    """The CPU proposes one by one in production (``FusedJob.batch_on_cpu``); its exactness is what is tested here."""
    monkeypatch.setattr(FusedJob, "batch_on_cpu", True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """fp32, with the batch-invariant kernels: scores are compared bit for bit (the forward's rounding by the
    batch's height is the forward's business, not the rule's)."""
    return Engine(tiny_loaded("llama", seed=3, position_sensitive=True), batch_invariant=True)


def _answer(answer) -> tuple:
    """Everything a request reads back from its steps: tokens, winning documents and chunks, scores, likelihoods."""
    return (answer.token_ids, [(s.token_id, s.document, s.score) for s in answer.trace],
            answer.extra["trace_chunks"], answer.extra["n_chunks"], answer.extra.get("query_loglik"))


def _together(engine: Engine) -> list:
    return [_answer(a) for a in in_two_waves(engine, FIRST_WAVE, SECOND_WAVE)]


def test_concurrent_chunk_fusion_requests_chosen_in_batches_get_their_answers_alone_and_one_by_one(engine,
                                                                                                   monkeypatch):
    requests = FIRST_WAVE + SECOND_WAVE
    alone = [_answer(engine.generate(**r)) for r in requests]
    assert all(len(answer[0]) >= 5 for answer in alone) and len({tuple(a[0]) for a in alone}) == len(alone)
    assert len({answer[3] for answer in alone}) >= 5  # chunk counts apart: the batches pad
    batches: list[tuple[tuple, list[bool]]] = []  # per batched proposal: its key, which jobs were at their first step

    propose_batch = FusedJob.propose_batch.__func__

    measured = []  # per batched proposal that returned: how many jobs were given their likelihood in it

    def spied(cls, jobs, logits):
        batches.append((jobs[0].batch_key()[0], [job.state is FIRST_STEP for job in jobs]))  # the rule's key
        before = [job.likelihood is None for job in jobs]
        values = propose_batch(cls, jobs, logits)
        measured.append(sum(b and job.likelihood is not None for b, job in zip(before, jobs, strict=True)))
        return values

    monkeypatch.setattr(FusedJob, "propose_batch", classmethod(spied))
    assert _together(engine) == alone
    sizes = {}
    for key, first in batches:
        sizes[key] = max(sizes.get(key, 0), len(first))
    assert sizes[(SoftNBCEFusion, "paper")] >= 4  # several requests really shared an evaluation
    assert len(sizes) == 4  # the paper's rule, nbce_code, NBCE and PCW: a batch each
    assert any(any(first) and not all(first) for _, first in batches)  # a joining request beside decoding ones
    assert sum(measured) == 2 and sum(alone_answer[4] is not None for alone_answer in alone) == 2

    monkeypatch.setattr(FusedJob, "batch_key", lambda self: None)  # the one-by-one path
    batches.clear()
    assert [_answer(engine.generate(**r)) for r in requests] == alone
    assert _together(engine) == alone and batches == []


def test_the_operations_of_a_steps_proposals_do_not_grow_with_its_requests(engine, monkeypatch):
    # Soft-NBCE with the paper's rule and its defaults, 3 documents
    one, eight, one_by_one, eight_one_by_one = operations_per_step(engine, monkeypatch, mode="soft_nbce")
    assert eight == one
    assert eight_one_by_one - 1 == 8 * (one_by_one - 1)  # one shared operation: the cat of the step's one read
