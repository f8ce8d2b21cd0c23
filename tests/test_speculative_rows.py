"""RAPID as rows of the shared batch: the row bookkeeping, the on-device greedy verdict, and RAPID beside others.

Invariants: a row fed a new sequence keeps exactly the common prefix it holds and rewinds the rest;
``greedy_verdict`` is ``verify``'s greedy branch (same accepted count and token); RAPID requests, with
the drafter in their own job or on another model's scheduler, answer token for token as alone while
other requests share both batches; a cancelled RAPID request frees its drafter's row on the other
scheduler; a failed drafter fails its RAPID request with the drafter's error. Sampled rounds: the drafter
records the tempered nucleus it drew each draft from (so a drafter that sees the target's own context has
every draft accepted), and the trace scores every emitted token, corrections included, by the target's
log-probability at its own position.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.decoding import TokenSampler
from ctx_integrations.engine.core.rows import Run
from ctx_integrations.engine.modes.speculative import (
    TAIL_RULES,
    greedy_verdict,
    nucleus,
    sampled_verdict,
    tail_adjusted,
    verdict_noise,
    verdict_noises,
    verify,
)
from ctx_integrations.engine.modes.speculative_rows import DraftJob, DraftRow, RapidJob, SequenceRow, verdict_values
from ctx_integrations.errors import RequestTooLargeError
from tests.helpers import tiny_loaded
from tests.test_rapid import (  # noqa: F401 - one_thread: autouse
    DOCS,
    QUESTION,
    SMALL_CONTEXT,
    WHOLE_CONTEXT,
    one_thread,
    prompt_ids,
    sharp_tiny,
)

WAIT_S = 60


# -- the row's bookkeeping -----------------------------------------------------------------------------

def test_a_row_keeps_the_common_prefix_and_rewinds_the_rest():
    fresh = SequenceRow(first_position=7)
    assert fresh.runs == [] and fresh.rewind is None  # a row nobody fed takes nothing
    fresh.ran()
    assert fresh.held == []
    row = SequenceRow(first_position=100)
    row.feed([1, 2, 3], keep=0)  # the question's prefill: one run, nothing to rewind
    assert row.runs == [Run((1, 2, 3), 100)] and row.rewind is None
    row.ran()
    assert row.held == [1, 2, 3] and row.runs == []
    row.feed([1, 2, 3, 4, 5, 6], keep=4)  # verification: the last token and 3 drafts, one run each
    assert row.runs == [Run((3,), 102), Run((4,), 103), Run((5,), 104), Run((6,), 105)]
    assert row.rewind == 102  # the last held token goes through again: its column is dropped first
    row.ran()
    row.feed([1, 2, 3, 4, 9, 7], keep=2)  # draft 5 rejected, corrected to 9; the next round's last token and draft
    assert row.rewind == 104 and row.runs == [Run((9,), 104), Run((7,), 105)]
    row.ran()
    row.feed([1, 2, 3, 4, 9, 7, 8], keep=1)  # everything held is kept
    assert row.rewind is None and row.runs == [Run((8,), 106)]
    row.ran()
    row.append(11)
    assert row.runs == [Run((11,), 107)] and row.held[-1] == 8
    row.ran()
    assert row.held == [1, 2, 3, 4, 9, 7, 8, 11] and row.runs == [] and row.rewind is None


def test_a_row_that_held_a_longer_sequence_rewinds_to_the_new_ones_end():
    row = SequenceRow(first_position=0)
    row.feed([5, 6, 7, 8, 9], keep=1)
    row.ran()
    row.feed([5, 6, 7], keep=1)  # shorter: 7 goes through again, 8 and 9 leave with it
    assert row.rewind == 2 and row.runs == [Run((7,), 2)]


def test_a_row_that_diverges_early_keeps_only_what_agrees_and_sends_a_one_token_head_as_a_run():
    # Catches a prefix walk that stops feeding at the first disagreement, and a head of exactly one token (the
    # tokens before the ``keep`` last ones) dropped instead of sent as a run of its own.
    row = SequenceRow(first_position=0)
    row.feed([1, 2, 3, 4, 5, 6], keep=0)
    row.ran()
    row.feed([1, 2, 9, 4], keep=1)
    assert row.rewind == 2 and row.runs == [Run((9,), 2), Run((4,), 3)]
    row.ran()
    assert row.held == [1, 2, 9, 4]


def test_a_sequence_fed_again_before_its_runs_ran_still_brings_them():
    # The RAPID request whose drafts arrive before its question's prefill ran: the verification must carry the
    # prefill too (a row that counted its pending runs as held would skip the question: a wrong cache).
    row = SequenceRow(first_position=10)
    row.feed([1, 2, 3], keep=0)
    row.feed([1, 2, 3, 4, 5, 6], keep=3)
    assert row.rewind is None and row.runs == [Run((1, 2, 3), 10), Run((4,), 13), Run((5,), 14), Run((6,), 15)]


# -- the verdict ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("eta", [0.0, 2.0, 20.0])
@pytest.mark.parametrize("tail_rule", TAIL_RULES)
def test_the_greedy_verdict_on_the_device_is_verifys_greedy_branch(eta, tail_rule):
    # Random logits whose p^ argmax agrees with the drafts on a random prefix: every accepted count 0..g
    # appears, including all accepted (the bonus token). A verdict that counted agreements after the first
    # rejection, took the bonus from p^ or the correction from p would differ from verify's.
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for case in range(60):
        g, vocab = 4, 12
        logits = 3 * torch.randn(g + 1, vocab, generator=generator)
        q = torch.softmax(2 * torch.randn(g, vocab, generator=generator), dim=-1)
        agree = case % (g + 1)
        p_hat = tail_adjusted(logits[:g], torch.softmax(logits[:g], -1), q, eta, rule=tail_rule)
        drafts = [int(p_hat[i].argmax()) if i < agree else int(torch.randint(vocab, (), generator=generator))
                  for i in range(g)]
        expected = verify(logits, q, drafts, eta=eta, temperature=0.0, top_p=1.0, generator=None,
                          tail_rule=tail_rule)
        accepted, token = greedy_verdict(logits, q, torch.tensor(drafts), eta=eta, tail_rule=tail_rule)
        assert (int(accepted), int(token)) == (expected.accepted, expected.token), case
        seen.add(expected.accepted)
    assert seen == set(range(g + 1))


@pytest.mark.parametrize("tail_rule", TAIL_RULES)
def test_verdicts_chosen_together_are_each_requests_own(tail_rule):
    # J requests' verdicts over [J, g + 1, V] against each alone, bit for bit, every accepted count present: a batch
    # that took one request's bonus row, drafts or accepted count for another's would differ.
    generator = torch.Generator().manual_seed(4)
    g, vocab, requests = 3, 12, 24
    logits = 3 * torch.randn(requests, g + 1, vocab, generator=generator)
    q = torch.softmax(2 * torch.randn(requests, g, vocab, generator=generator), dim=-1)
    p_hat = tail_adjusted(logits[:, :g], torch.softmax(logits[:, :g], -1), q, 2.0, rule=tail_rule)
    drafts = torch.stack([torch.where(torch.arange(g) < j % (g + 1), p_hat[j].argmax(-1),
                                      torch.randint(vocab, (g,), generator=generator)) for j in range(requests)])
    accepted, token = greedy_verdict(logits, q, drafts, eta=2.0, tail_rule=tail_rule)
    together = verdict_values(logits, drafts, accepted, token, logits.amax(dim=(-2, -1)), 0.0)
    for j in range(requests):
        alone = greedy_verdict(logits[j], q[j], drafts[j], eta=2.0, tail_rule=tail_rule)
        assert (int(accepted[j]), int(token[j])) == tuple(int(x) for x in alone)
        assert together[j].tolist() == verdict_values(logits[j], drafts[j], *alone, logits[j].max(), 0.0).tolist()
    assert set(accepted.tolist()) == set(range(g + 1))


@pytest.mark.parametrize(("eta", "tail_rule", "top_p", "temperature"),
                         [(0.0, "paper", 1.0, 1.0), (0.5, "paper", 0.9, 0.8), (2.0, "draft_head", 0.95, 1.2)])
def test_the_sampled_verdict_on_the_device_is_verifys_sampling_branch_draw_for_draw(eta, tail_rule, top_p,
                                                                                   temperature):
    # The same generator seed must give verify's accepted count and token: the same g uniforms, then the same draw
    # over the vocabulary, from the residual after the first rejected draft or from p at the bonus position. A
    # verdict that read the residual of another row, drew the bonus from p^, or spent the generator otherwise
    # (another order, another count of uniforms) would part from verify's over these seeds.
    generator = torch.Generator().manual_seed(1)
    seen = set()
    for seed in range(150):
        g, vocab = 1 + seed % 4, 40
        logits = 2 * torch.randn(g + 1, vocab, generator=generator)
        q = torch.softmax(2 * torch.randn(g, vocab, generator=generator) + logits[:g] / 2, dim=-1)
        drafts = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(g)]
        expected = verify(logits, q, drafts, eta=eta, temperature=temperature, top_p=top_p,
                          generator=torch.Generator().manual_seed(seed), tail_rule=tail_rule)
        accepted, token = sampled_verdict(logits, q, torch.tensor(drafts), eta=eta, temperature=temperature,
                                          top_p=top_p, noise=verdict_noise(torch.Generator().manual_seed(seed), g,
                                                                           vocab), tail_rule=tail_rule)
        assert (int(accepted), int(token)) == (expected.accepted, expected.token), seed
        seen.add((expected.accepted == g, expected.accepted == 0))
    assert seen == {(True, False), (False, True), (False, False)}  # every draft accepted, the first rejected, between


@pytest.mark.parametrize("tail_rule", TAIL_RULES)
def test_sampled_verdicts_chosen_together_are_each_requests_own_draw_for_draw(tail_rule):
    # J requests' sampled verdicts over [J, g + 1, V], each with its own generator's noise, against each alone, bit
    # for bit, with every accepted count present: a batch that drew one request's residual, uniforms or race for
    # another, or picked the draw's row by another request's accepted count, would differ.
    generator = torch.Generator().manual_seed(5)
    g, vocab, requests = 3, 40, 48
    logits = 2 * torch.randn(requests, g + 1, vocab, generator=generator)
    q = torch.softmax(2 * torch.randn(requests, g, vocab, generator=generator) + logits[:, :g] / 2, dim=-1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(requests, g)
    options = dict(eta=0.5, temperature=0.8, top_p=0.9, tail_rule=tail_rule)
    noise = [verdict_noise(torch.Generator().manual_seed(j), g, vocab) for j in range(requests)]
    accepted, token = sampled_verdict(logits, q, drafts, noise=(torch.stack([u for u, _ in noise]),
                                                                torch.stack([r for _, r in noise])), **options)
    for j in range(requests):
        alone = sampled_verdict(logits[j], q[j], drafts[j], noise=noise[j], **options)
        assert (int(accepted[j]), int(token[j])) == tuple(int(x) for x in alone), j
    assert set(accepted.tolist()) == set(range(g + 1))


def test_verdict_noise_is_a_seeded_requests_own_and_one_device_draw_for_the_unseeded():
    # A seeded request's uniforms and race are what verify draws from its generator (alone, batched, any device); the
    # unseeded requests' come from the device's default generator in one draw (here the CPU's: torch.manual_seed
    # fixes it): an unseeded request has no generator of its own (no V-wide host draw per unseeded request per round).
    g, vocab = 3, 40
    mixed = [TokenSampler(0.8, seed=4), TokenSampler(0.8), TokenSampler(0.8, seed=9), TokenSampler(0.8)]
    torch.manual_seed(0)
    uniforms, race = verdict_noises(mixed, g, vocab, torch.device("cpu"))
    torch.manual_seed(0)
    device_uniforms, device_race = torch.rand(4, g), torch.empty(4, vocab).exponential_()
    for j, seed in ((0, 4), (2, 9)):
        own_uniforms, own_race = verdict_noise(torch.Generator().manual_seed(seed), g, vocab)
        assert torch.equal(uniforms[j], own_uniforms) and torch.equal(race[j], own_race)
    for j in (1, 3):
        assert torch.equal(uniforms[j], device_uniforms[j]) and torch.equal(race[j], device_race[j])
        assert mixed[j].generator is None
    alone = verdict_noises([TokenSampler(0.8, seed=9)], g, vocab, torch.device("cpu"))
    assert torch.equal(alone[0][0], uniforms[2]) and torch.equal(alone[1][0], race[2])
    torch.manual_seed(0)
    unseeded = verdict_noises([mixed[1], mixed[3]], g, vocab, torch.device("cpu"))  # no request seeded
    torch.manual_seed(0)
    assert torch.equal(unseeded[0], torch.rand(2, g)) and torch.equal(unseeded[1], torch.empty(2, vocab).exponential_())


# -- the drafter's distributions and the sampled verdict -------------------------------------------------

# the drafter's logits after its last token: one row over a vocabulary of 6, and 2 columns past the shared width
# (a drafter with a larger vocabulary) that would win every draw if they were not cut off
DRAFTER_LOGITS = torch.tensor([[2.0, 1.5, 0.5, 0.0, -1.0, -3.0, 9.0, 9.0]])
WIDTH = 6


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.5, 1.0), (2.0, 0.8)])
def test_the_drafter_records_the_tempered_nucleus_it_drew_each_draft_from(temperature, top_p):
    # Exact: the distribution verification divides by must be the one each draft was drawn from, softmax of the
    # nucleus of z / T over the shared width (greedy: softmax z, and the argmax), drawn with the request's own
    # generator. A drafter that kept z untempered, skipped the nucleus or read past the width would record (and
    # draw from) another q, and the acceptance test p^(x) / q(x) would no longer make the output follow the target.
    scores = DRAFTER_LOGITS[-1, :WIDTH]
    if temperature == 0:
        expected_q = torch.softmax(scores, -1)
        expected = [int(scores.argmax())] * 3
    else:
        expected_q = torch.softmax(nucleus(scores / temperature, top_p), -1)
        assert not torch.allclose(expected_q, torch.softmax(scores, -1), atol=1e-3)  # the case separates the rules
        generator = torch.Generator().manual_seed(3)
        expected = [int(torch.multinomial(expected_q, 1, generator=generator)) for _ in range(3)]
    draft = DraftRow(SequenceRow(first_position=4), [1, 2, 3], TokenSampler(temperature, top_p, seed=3),
                     eos=frozenset(), width=WIDTH)
    assert not draft.drafting and draft.drafts == draft.dists == [] and draft.passes == 0  # nobody asked yet
    assert draft.first_draft_at is None
    draft.start([7], goal=3)
    assert draft.row.runs == [Run((1, 2, 3), 4), Run((7,), 7)] and draft.drafting  # the prompt, then its last token
    before = time.perf_counter()
    for i, token in enumerate(expected):
        values = draft.propose(DRAFTER_LOGITS).tolist()
        assert values == [token, 2.0]  # the token, and the largest score within the width (checked finite)
        draft.accept(values)
        if i == 0:
            first_draft_at = draft.first_draft_at
            assert before <= first_draft_at <= time.perf_counter()
        torch.testing.assert_close(draft.dists[i], expected_q, rtol=0, atol=0)
        assert draft.passes == i + 1 and draft.drafts == expected[:i + 1]
        # the draft goes in at the next step, until the goal is reached
        assert draft.row.runs == ([Run((token,), 8 + i)] if i < 2 else []) and draft.drafting == (i < 2)
    assert draft.first_draft_at == first_draft_at  # the first draft's time, kept


def test_the_drafter_stops_at_an_end_of_sequence_token_before_its_goal():
    draft = DraftRow(SequenceRow(first_position=0), [1], TokenSampler(), eos=frozenset({0}), width=WIDTH)
    draft.start([], goal=3)
    draft.accept(draft.propose(DRAFTER_LOGITS).tolist())  # greedy: token 0, an end of sequence
    assert draft.drafts == [0] and not draft.drafting and draft.row.runs == []


def test_a_seeded_sampled_answer_does_not_depend_on_torchs_global_generator():
    # The verdict's uniforms and corrections are drawn with the request's own generator: the same seed gives the
    # same answer whatever the global generator's state (a draw from the global one would differ between the two).
    engine = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, logit_scale=0.5))
    answers = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        answers.append(engine.generate(QUESTION, DOCS, mode="rapid", drafter=drafter, gamma=4, eta=0.0,
                                       max_new_tokens=24, temperature=1.0, seed=0, **WHOLE_CONTEXT))
    assert 0 < answers[0].extra["accepted"] < answers[0].extra["drafted"]  # the uniforms decided something
    assert answers[0].token_ids == answers[1].token_ids


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (1.5, 0.9)])
@pytest.mark.parametrize("eta", [0.0, 5.0])
def test_a_drafter_that_sees_the_targets_context_has_every_draft_accepted(temperature, top_p, eta):
    # Self-speculation over the whole context: the drafter's q is the target's p (the same model, tokens, temperature
    # and nucleus, up to float rounding), so p^ = p and every ratio p^(x) / q(x) is 1: nothing is ever rejected, at
    # any eta. Catches a drafter whose distribution is not tempered (or not cut to the nucleus) like the target's
    # before the acceptance test: then q != p, and a draft with q(x) > p(x) is rejected with probability
    # 1 - p(x) / q(x). At T = 1 it also catches sampling verified by the greedy rule (a draft that is not
    # argmax p^ rejected).
    engine = Engine(sharp_tiny(0))
    answer = engine.generate(QUESTION, DOCS, mode="rapid", gamma=4, eta=eta, max_new_tokens=24,
                             temperature=temperature, top_p=top_p, seed=1, **WHOLE_CONTEXT)
    assert answer.extra["draft_context_tokens"] == answer.extra["long_context_tokens"]  # what the target sees
    assert len(answer.token_ids) == 24 and answer.extra["drafted"] >= 18
    assert answer.extra["accepted"] == answer.extra["drafted"], answer.extra["drafted_tokens"]


@pytest.mark.parametrize(("temperature", "drafter_options"), [(0.0, dict(noise=0.05)), (0.7, dict(logit_scale=0.5))])
def test_the_trace_scores_every_token_by_the_targets_log_probability_corrections_included(temperature,
                                                                                          drafter_options):
    # docs/rapid.md: the trace's score is the target's log-probability of each token (at the temperature), against
    # one plain forward over the prompt and the answer. After a rejection the correction sits at the rejected
    # draft's position: a verdict that scored the rejected draft there, or read another position's row, would put
    # another token's probability in the trace. A drafter that often disagrees runs both branches.
    engine = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, **drafter_options))
    answer = engine.generate(QUESTION, DOCS, mode="rapid", drafter=drafter, gamma=4, eta=0.0, max_new_tokens=24,
                             temperature=temperature, seed=0, **WHOLE_CONTEXT)
    assert 0 < answer.extra["accepted"] < answer.extra["drafted"], answer.extra
    prompt = prompt_ids(engine, DOCS, QUESTION)
    with torch.no_grad():
        logits = engine.loaded.model(torch.tensor([prompt + answer.token_ids])).logits[0, len(prompt) - 1:-1]
    log_p = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    expected = log_p.gather(-1, torch.tensor(answer.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([step.score for step in answer.trace]), expected, atol=1e-4, rtol=1e-4)


# -- RAPID in the shared batch -------------------------------------------------------------------------

def test_rapid_runs_in_the_shared_batch_beside_other_requests():
    engine = Engine(tiny_loaded("llama", seed=3, position_sensitive=True))
    alone = engine.generate(QUESTION, DOCS, mode="rapid", gamma=3, max_new_tokens=10, **SMALL_CONTEXT)
    pced_alone = engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=10)

    async def together():
        return await asyncio.gather(
            engine.agenerate(QUESTION, DOCS, mode="rapid", gamma=3, max_new_tokens=10, **SMALL_CONTEXT),
            engine.agenerate(QUESTION, DOCS, mode="pced", max_new_tokens=10))

    rapid, pced = asyncio.run(together())
    assert rapid.token_ids == alone.token_ids and pced.token_ids == pced_alone.token_ids
    stats = engine.stats()
    assert stats["exclusive_s"] == 0  # no mode ran a forward of its own
    assert engine.scheduler.stats.peak_rows >= 2 + len(DOCS) + 1  # RAPID's two rows beside PCED's four


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95)])
def test_rapid_requests_draft_and_verify_together_and_answer_as_alone(monkeypatch, sampling):
    # On an accelerator (here: batch_on_cpu) RAPID requests with one sampler's knobs choose their verdicts of as many
    # drafts in one evaluation, and their drafters' next drafts in another; each answer, drafts and acceptances
    # included, must be what it is alone (sampled: each request seeded apart, its noise drawn from its own generator).
    engine = Engine(tiny_loaded("llama", seed=3, position_sensitive=True))
    questions = [QUESTION, "What is the capital of Veloria?", "Who founded it?"]
    options = [dict(mode="rapid", gamma=3, max_new_tokens=10, seed=4 + i, **SMALL_CONTEXT, **sampling)
               for i in range(len(questions))]
    alone = [engine.generate(q, DOCS, **o) for q, o in zip(questions, options, strict=True)]
    monkeypatch.setattr(RapidJob, "batch_on_cpu", True)
    batches: dict[str, list[int]] = {"verdict": [], "draft": []}
    alone_verdicts: list[int] = []  # verifications of drafts chosen one by one (the batch's fallback)
    alone_drafts: list[int] = []  # drafting steps chosen one by one
    propose_batch, propose_verdict = RapidJob.propose_batch.__func__, RapidJob._propose_verdict
    monkeypatch.setattr(DraftRow, "propose", lambda self, logits: alone_drafts.append(1))  # never called: batched

    def spied(cls, jobs, logits):
        kind = jobs[0].batch_key()[0]
        batches[kind].append(-len(jobs))  # a batch that raises (and falls back to one by one) stays negative
        values = propose_batch(cls, jobs, logits)
        width = {"verdict": [3 + len(job.drafts) + 1 for job in jobs], "draft": [2] * len(jobs)}[kind]
        assert [v.shape[0] for v in values] == width
        batches[kind][-1] = len(jobs)
        return values

    def spied_verdict(self, logits):
        alone_verdicts.append(self.dists is not None)
        return propose_verdict(self, logits)

    monkeypatch.setattr(RapidJob, "propose_batch", classmethod(spied))
    monkeypatch.setattr(RapidJob, "_propose_verdict", spied_verdict)

    async def together():
        return await asyncio.gather(*(engine.agenerate(q, DOCS, **o) for q, o in zip(questions, options, strict=True)))

    answers = asyncio.run(together())
    assert [a.token_ids for a in answers] == [a.token_ids for a in alone]
    assert [a.extra["accepted"] for a in answers] == [a.extra["accepted"] for a in alone]
    assert [a.extra["drafted_tokens"] for a in answers] == [a.extra["drafted_tokens"] for a in alone]
    for together_, alone_ in zip(answers, alone, strict=True):  # the forward's rounding with the batch apart
        assert [s.score for s in together_.trace] == pytest.approx([s.score for s in alone_.trace], abs=1e-4)
    assert alone_drafts == []
    for kind in batches:
        assert max(batches[kind]) >= 2 and min(batches[kind]) > 0, (kind, batches[kind])
    assert all(a.extra["drafted"] > 0 for a in alone)
    if sampling:
        assert any(0 < a.extra["accepted"] < a.extra["drafted"] for a in alone)  # the uniforms decided something
    assert not any(alone_verdicts)  # every verification of drafts was batched, none fell back to one by one


def test_a_drafter_of_its_own_drafts_on_its_models_scheduler_beside_that_models_requests():
    # Two RAPID requests share a drafter model, which also answers a request of its own meanwhile: every answer
    # equals its answer alone, and the drafter's rows ran on the drafter's scheduler (never the target's).
    target = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, noise=0.05))
    options = dict(mode="rapid", gamma=3, eta=0.0, drafter=drafter, max_new_tokens=12, **SMALL_CONTEXT)
    questions = [QUESTION, "What is the capital of Veloria?"]
    alone = [target.generate(q, DOCS, **options).token_ids for q in questions]
    own_alone = drafter.generate(QUESTION, DOCS[:2], mode="concat", max_new_tokens=12).token_ids
    drafter_steps = drafter.scheduler.stats.steps

    async def together():
        return await asyncio.gather(*(target.agenerate(q, DOCS, **options) for q in questions),
                                    drafter.agenerate(QUESTION, DOCS[:2], mode="concat", max_new_tokens=12))

    *rapid, own = asyncio.run(together())
    assert [a.token_ids for a in rapid] == alone and own.token_ids == own_alone
    assert all(a.extra["drafted"] > 0 for a in rapid)
    assert drafter.scheduler.stats.steps > drafter_steps
    assert target.scheduler.stats.exclusive_s == 0 and drafter.scheduler.stats.exclusive_s == 0
    wait_until(lambda: drafter.scheduler.active() == (0, 0), "the drafter rows to leave")


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=3)])
def test_drafters_of_their_own_model_draft_together_and_their_requests_answer_as_alone(monkeypatch, sampling):
    # On an accelerator (here: batch_on_cpu) the drafter rows of RAPID requests on the drafter model's own scheduler
    # take their drafting steps in one evaluation (DraftJob.propose_batch), and the targets' verdicts in another; every
    # answer, drafts, acceptances and trace scores included, is what it is alone. The CPU keeps one by one.
    target = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, noise=0.05))
    options = dict(mode="rapid", gamma=3, eta=0.0, drafter=drafter, max_new_tokens=12, **SMALL_CONTEXT, **sampling)
    questions = [QUESTION, "What is the capital of Veloria?", "Who founded it?"]
    batches: list[tuple[str, int]] = []
    for kind in (DraftJob, RapidJob):
        original = kind.propose_batch.__func__

        def spied(cls, jobs, logits, original=original):
            values = original(cls, jobs, logits)
            batches.append((cls.__name__, len(jobs)))  # a batch that raised (and went one by one) is not counted
            return values

        monkeypatch.setattr(kind, "propose_batch", classmethod(spied))

    def answers() -> list[tuple]:
        async def together():
            return await asyncio.gather(*(target.agenerate(q, DOCS, **options) for q in questions))
        return [(a.token_ids, a.extra["drafted_tokens"], [s.score for s in a.trace]) for a in asyncio.run(together())]

    alone = [(a.token_ids, a.extra["drafted_tokens"], [s.score for s in a.trace])
             for a in (target.generate(q, DOCS, **options) for q in questions)]
    assert batches == []  # the CPU chooses one by one
    monkeypatch.setattr(DraftJob, "batch_on_cpu", True)
    monkeypatch.setattr(RapidJob, "batch_on_cpu", True)
    for (tokens, drafted, scores), (tokens_, drafted_, scores_) in zip(answers(), alone, strict=True):
        assert (tokens, drafted) == (tokens_, drafted_)
        assert scores == pytest.approx(scores_, abs=1e-4)  # the forward's rounding with the batch apart
    assert max(size for name, size in batches if name == "DraftJob") >= 2
    assert max(size for name, size in batches if name == "RapidJob") >= 2


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_cancelled_rapid_request_frees_its_drafter_row_on_the_other_scheduler():
    target = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, noise=0.05))
    stream = target.stream(QUESTION, DOCS, mode="rapid", gamma=2, drafter=drafter, max_new_tokens=200,
                           **SMALL_CONTEXT)
    next(stream)  # the first piece of text: the request and its drafter row are running
    stream.close()
    wait_until(lambda: target.scheduler.active() == (0, 0), "the RAPID request to leave")
    wait_until(lambda: drafter.scheduler.active() == (0, 0), "the drafter's row to leave its scheduler")


def test_a_drafter_that_cannot_run_fails_its_rapid_request_with_the_drafters_error():
    target = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, noise=0.05), max_batch_bytes=1)  # no drafter row can ever be admitted
    with pytest.raises(RequestTooLargeError, match="max_batch_bytes"):
        target.generate(QUESTION, DOCS, mode="rapid", gamma=2, drafter=drafter, max_new_tokens=8, timeout=WAIT_S,
                        **SMALL_CONTEXT)
    wait_until(lambda: target.scheduler.active() == (0, 0), "the failed request to leave")
