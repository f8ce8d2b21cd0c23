"""Sampled answers choose together too: one batched rule and one pick for every request with one sampler's knobs.

vLLM's sampler draws a batch's tokens in one pass and a seeded request's noise from that request's own generator;
``batch_proposals`` does the same over a batched rule's fused scores (PCED, Soft-NBCE, and the identity rule of
concat, single, APE and chat). Every value a sampled request reads back must be bit for bit what its own
``propose_token`` gives with its own generator, and its generator must be left where one by one leaves it. Bugs
these catch: one request's noise drawn from another's generator, or in another order; a knob of one request used
for another; a nucleus, top_k or min_p cut over the whole batch instead of per row; the score to check taken at the
token (greedy's) instead of the maximum; a batch that fails and leaves the generators moved, so the one-by-one retry
draws other tokens.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.decoding import (
    FIRST_STEP,
    SingleStream,
    TokenSampler,
    batch_proposals,
    generators_kept,
    propose_token,
    race_noises,
    single_stream,
)
from ctx_integrations.engine.core.jobs import FusedJob
from ctx_integrations.engine.modes.pced import PCEDFusion
from tests.helpers import tiny_loaded
from tests.test_pced_batched import step_logits
from tests.test_scheduler import DOCS
from tests.test_scheduler_batched import operations_per_step

KNOBS = [dict(temperature=0.7), dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=5),
         dict(temperature=1.0, min_p=0.2), dict(temperature=0.6, top_p=0.9, top_k=12, min_p=0.05)]


def samplers(knobs: dict, count: int, first_seed: int = 0) -> list[TokenSampler]:
    return [TokenSampler(seed=first_seed + j, **knobs) for j in range(count)]


@pytest.mark.parametrize("knobs", KNOBS)
def test_sampled_pced_requests_picked_together_get_what_each_gets_alone_draw_for_draw(knobs):
    rules = [PCEDFusion(scores, prior="softmax") for scores in ([0.9, 0.2, 0.6], [0.7], [0.3, 0.8, 0.5, 0.1, 0.9],
                                                               [0.6, 0.4])] * 3
    together, alone = samplers(knobs, len(rules)), samplers(knobs, len(rules))
    for step in range(4):  # several draws: each generator must stay where its own draws leave it
        rows = [step_logits(10 * step + j, len(rule.relevance)) for j, rule in enumerate(rules)]
        fused = PCEDFusion.fuse_batch(rules, rows, [FIRST_STEP] * len(rules))
        values = batch_proposals(fused, together)
        for j, rule in enumerate(rules):
            expected, _ = propose_token(rule, torch.stack(rows[j]), FIRST_STEP, alone[j])
            assert torch.equal(values[j], expected), (step, j, values[j].tolist(), expected.tolist())
    drawn = {int(v) for v in values[:, 0]}
    assert len(drawn) > 1  # the requests drew apart: no generator shared by mistake


@pytest.mark.parametrize("knobs", KNOBS)
def test_the_identity_rule_picks_a_batch_of_requests_as_each_alone(knobs):
    # flat scores (most of the mass outside any cut), so that a knob left out of the batch moves some draw
    generator = torch.Generator().manual_seed(2)
    rows = [[0.3 * torch.randn(50, generator=generator)] for _ in range(32)]
    fused = SingleStream.fuse_batch([single_stream] * 32, rows, [FIRST_STEP] * 32)
    assert fused.evidence is None and single_stream.batch_key() == (SingleStream,)
    together, alone = samplers(knobs, 32, 40), samplers(knobs, 32, 40)
    values = batch_proposals(fused, together)
    for j in range(32):
        expected, _ = propose_token(single_stream, torch.stack(rows[j]), FIRST_STEP, alone[j])
        assert torch.equal(values[j], expected)
        assert values[j, 1] == -1  # no attribution
    greedy = batch_proposals(fused, [TokenSampler()] * 32)
    for j in range(32):
        assert torch.equal(greedy[j], propose_token(single_stream, torch.stack(rows[j]), FIRST_STEP,
                                                    TokenSampler())[0])


def test_requests_sharing_one_generator_draw_in_the_jobs_order():
    # MapReduce's side decodes share their request's generator: together they must draw in the order they draw
    # one by one (the jobs' order), so the seeded answer does not depend on the batching.
    shared = TokenSampler(0.8, seed=7)
    side = shared.unconstrained()
    generator = torch.Generator().manual_seed(3)
    rows = [[torch.randn(30, generator=generator)] for _ in range(2)]
    fused = SingleStream.fuse_batch([single_stream] * 2, rows, [FIRST_STEP] * 2)
    values = batch_proposals(fused, [shared, side])
    reference = TokenSampler(0.8, seed=7)
    for j in range(2):
        expected, _ = propose_token(single_stream, torch.stack(rows[j]), FIRST_STEP, reference)
        assert torch.equal(values[j], expected)


def test_a_batch_that_raises_leaves_every_generator_as_it_was():
    one, two = TokenSampler(1.0, seed=1), TokenSampler(1.0, seed=2)
    before = [one.generator.get_state(), two.generator.get_state()]
    with pytest.raises(RuntimeError, match="broke"), generators_kept([one, two, one]):
        torch.rand(5, generator=one.generator), torch.rand(3, generator=two.generator)
        raise RuntimeError("broke")
    assert torch.equal(one.generator.get_state(), before[0]) and torch.equal(two.generator.get_state(), before[1])
    with generators_kept([one]):  # a batch that returns keeps its draws
        torch.rand(5, generator=one.generator)
    assert not torch.equal(one.generator.get_state(), before[0])


class _Unread:
    """A generator stand-in that fails when its state is copied or restored."""

    def get_state(self):
        raise AssertionError("a generator that draws nothing was copied")

    set_state = get_state


def test_a_batch_keeps_only_the_generators_it_draws_from():
    # A greedy sampler draws nothing, even with a seed, and an unseeded one has no generator (its noise is the
    # device's draw), so the batch copies no state for them (a get_state per request per step otherwise), and a
    # failure restores none.
    greedy, unseeded, seeded = TokenSampler(seed=5), TokenSampler(1.0), TokenSampler(1.0, seed=3)
    greedy.generator = _Unread()
    before = seeded.generator.get_state()
    with pytest.raises(RuntimeError, match="broke"), generators_kept([greedy, unseeded, seeded]):
        torch.rand(4, generator=seeded.generator)
        raise RuntimeError("broke")
    assert torch.equal(seeded.generator.get_state(), before)


def test_seeded_rows_draw_from_their_generators_and_unseeded_ones_in_one_draw_on_the_device():
    # A batch mixing seeded and unseeded samplers: each seeded row is its own generator's draw (what it draws alone),
    # the unseeded rows one draw from the device's default generator (here the CPU's: torch.manual_seed fixes it),
    # and no unseeded sampler has a generator of its own.
    mixed = [TokenSampler(1.0, seed=4), TokenSampler(1.0), TokenSampler(1.0, seed=9), TokenSampler(1.0)]
    assert [sampler.seeded for sampler in mixed] == [True, False, True, False]
    assert mixed[0].unconstrained().seeded and not mixed[1].unconstrained().seeded  # a side decode keeps its kind
    assert mixed[1].generator is None and mixed[3].generator is None  # nothing to draw from by mistake
    torch.manual_seed(0)
    race = race_noises(mixed, 30, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    unseeded = torch.empty(4, 30).exponential_()
    for j, seed in ((0, 4), (2, 9)):
        assert torch.equal(race[j], torch.empty(30).exponential_(generator=torch.Generator().manual_seed(seed)))
    assert torch.equal(race[1], unseeded[1]) and torch.equal(race[3], unseeded[3])
    seeded_only = race_noises([TokenSampler(1.0, seed=4)], 30, torch.float32, torch.device("cpu"))
    assert torch.equal(seeded_only[0], race[0])


def test_only_plain_samplers_batch_and_only_with_equal_knobs():
    assert TokenSampler().batch_knobs == TokenSampler(top_p=0.5).batch_knobs == ("greedy",)
    assert TokenSampler(0.7, seed=1).batch_knobs == TokenSampler(0.7, seed=2).batch_knobs
    assert TokenSampler(0.7).batch_knobs != TokenSampler(0.8).batch_knobs
    assert TokenSampler(0.7).batch_knobs != TokenSampler(0.7, top_p=0.9).batch_knobs
    assert TokenSampler(0.7).batch_knobs != TokenSampler(0.7, top_k=3).batch_knobs
    assert TokenSampler(0.7).batch_knobs != TokenSampler(0.7, min_p=0.1).batch_knobs
    assert TokenSampler(0.7, logprobs=2).batch_knobs is None
    assert TokenSampler(0.7, constraint=object()).batch_knobs is None


# -- in the engine -------------------------------------------------------------------------------------------------

REQUESTS = [
    dict(query="Who is the mayor?", documents=DOCS[:2], scores=[0.9, 0.3], max_new_tokens=12, seed=1, mode="pced"),
    dict(query="What is the secret code?", documents=DOCS, max_new_tokens=14, seed=2, mode="pced"),
    dict(query="Where is Quillby?", documents=DOCS[3:4], max_new_tokens=10, seed=3, mode="concat"),
    dict(query="When is the fair?", documents=DOCS[1:4], max_new_tokens=12, seed=4, mode="concat"),
    dict(query="What river?", documents=DOCS[:3], max_new_tokens=10, seed=5, mode="soft_nbce"),
    dict(query="Who is it?", documents=DOCS[:3], max_new_tokens=10, seed=6, mode="soft_nbce"),
    dict(query="Tell me about the city.", documents=DOCS[:3], max_new_tokens=11, seed=7, mode="ape"),
    dict(query="Who grew up there?", documents=DOCS[:2], max_new_tokens=9, seed=8, mode="ape"),
    dict(query="Who founded it?", documents=DOCS[:2], max_new_tokens=9, seed=9, temperature=0.5,  # other knobs
         mode="pced"),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3, position_sensitive=True), batch_invariant=True)


def _answer(answer) -> tuple:
    return answer.token_ids, [(s.token_id, s.document, s.score) for s in answer.trace]


def test_concurrent_sampled_requests_of_every_fused_mode_answer_as_alone(engine, monkeypatch):
    requests = [{"temperature": 1.0, "top_p": 0.9, **r} for r in REQUESTS]
    alone = [_answer(engine.generate(**r)) for r in requests]
    assert len({tuple(a[0]) for a in alone}) == len(alone)
    monkeypatch.setattr(FusedJob, "batch_on_cpu", True)
    batches: list[tuple[tuple, int]] = []
    propose_batch = FusedJob.propose_batch.__func__

    def spied(cls, jobs, logits):
        values = propose_batch(cls, jobs, logits)
        batches.append((jobs[0].batch_key(), len(jobs)))
        return values

    monkeypatch.setattr(FusedJob, "propose_batch", classmethod(spied))

    async def run():
        return await asyncio.gather(*(engine.agenerate(**r) for r in requests))

    assert [_answer(a) for a in asyncio.run(run())] == alone
    sizes: dict[tuple, int] = {}
    for key, size in batches:
        sizes[key] = max(sizes.get(key, 0), size)
    sampled = ("sampled", 1.0, 0.9, 0, 0.0)
    assert sizes[((SingleStream,), sampled)] >= 4  # concat and APE together
    pced = PCEDFusion([0.5]).batch_key()
    assert sizes[(pced, sampled)] >= 2
    assert sizes[(pced, ("sampled", 0.5, 0.9, 0, 0.0))] == 1  # the request at another temperature chose on its own


@pytest.mark.parametrize("seeded", [True, False])
def test_a_sampled_steps_operations_do_not_grow_with_its_requests(engine, monkeypatch, seeded):
    """The step's choice for 1 and 8 sampled concat requests. Unseeded: the same operations for 8 as for 1 (their noise
    is one draw on the device). Seeded: beside what does not depend on the request count, each request adds only its
    noise, drawn on the CPU by its own generator into its row of the batch's noise (1 operation, no copy). One by one
    each adds a whole pick."""
    monkeypatch.setattr(FusedJob, "batch_on_cpu", True)
    one, eight, one_by_one, eight_one_by_one = operations_per_step(engine, monkeypatch, mode="concat", temperature=0.8,
                                                                   top_p=0.9, seed_each=seeded)
    assert eight - one == (7 if seeded else 0)
    assert eight_one_by_one - 1 == 8 * (one_by_one - 1)
