"""The sampling knobs users know from vLLM and OpenAI: top_k, min_p, repetition / frequency / presence penalties.

The rules are pinned on the sampler with hand-made scores (which token each knob lets through, by how much a
penalty moves a score); the wiring through every mode, by negative penalties on a tiny random model: they
reward repeating, so an answer that takes the knob repeats its first token, and one that drops it does not.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ctx_integrations import Engine, SamplingParams
from ctx_integrations.engine.core.decoding import Penalties, TokenSampler
from ctx_integrations.errors import InvalidOptionError, UnsupportedSamplingError
from tests.helpers import tiny_loaded
from tests.test_core_pced import DOCS, QUESTION


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3))


@pytest.mark.parametrize("bad, message", [
    (dict(top_k=-2), "^top_k"),
    (dict(top_k=1.5), "^top_k"),
    (dict(min_p=1.5), "^min_p"),
    (dict(repetition_penalty=0.0), "^repetition_penalty"),
    (dict(frequency_penalty=2.5), "^frequency_penalty"),
    (dict(presence_penalty=-3.0), "^presence_penalty"),
    (dict(presence_penalty=float("nan")), "^presence_penalty"),
    (dict(logprobs=21), "^logprobs"),
    (dict(logprobs=True), "^logprobs"),
    (dict(structured={"type": "json_object"}), "^structured must be a StructuredOutput"),
])
def test_bad_knobs_fail_where_they_are_written(bad, message):
    with pytest.raises(InvalidOptionError, match=message):
        SamplingParams(**bad)


def test_top_k_minus_one_is_vllms_off():
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=-1) == SamplingParams()


def test_penalties_follow_openai_and_transformers():
    scores = torch.tensor([2.0, -1.0, 3.0, 0.5])
    counts = torch.tensor([2.0, 1.0, 0.0, 0.0])
    repeated = Penalties(repetition=2.0).apply(scores, counts)
    assert repeated.tolist() == [1.0, -2.0, 3.0, 0.5]  # positive divided, negative multiplied, unseen untouched
    frequency = Penalties(frequency=0.5).apply(scores, counts)
    assert frequency.tolist() == [1.0, -1.5, 3.0, 0.5]  # minus 0.5 per occurrence
    presence = Penalties(presence=0.25).apply(scores, counts)
    assert presence.tolist() == [1.75, -1.25, 3.0, 0.5]  # minus 0.25 once, however often
    both = Penalties(repetition=2.0, frequency=0.5, presence=0.25).apply(scores, counts)
    assert both.tolist() == [1.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 3.0, 0.5]  # repetition first, as in vLLM


def _greedy(sampler: TokenSampler, scores: list[float], steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        token = sampler(torch.tensor(scores))
        sampler.accept(token)
        chosen.append(token)
    return chosen


def test_penalties_act_on_the_answers_own_tokens_under_greedy():
    scores = [2.0, 1.5, 0.0]
    assert _greedy(TokenSampler(), scores, 3) == [0, 0, 0]
    assert _greedy(TokenSampler(penalties=Penalties(repetition=2.0)), scores, 3) == [0, 1, 0]  # 2/2 < 1.5; 1.5/2 < 1
    assert _greedy(TokenSampler(penalties=Penalties(frequency=0.3)), scores, 4) == [0, 0, 1, 0]  # 1.7, 1.4 < 1.5; 1.2
    assert _greedy(TokenSampler(penalties=Penalties(presence=0.6)), scores, 3) == [0, 1, 0]  # 1.4 < 1.5; 0.9 < 1.4


def _draws(sampler: TokenSampler, scores: torch.Tensor, n: int = 400) -> Counter[int]:
    return Counter(sampler(scores) for _ in range(n))


def test_top_k_keeps_the_k_best_tokens():
    scores = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
    assert set(_draws(TokenSampler(1.0, seed=0), scores)) == {0, 1, 2, 3, 4}
    assert set(_draws(TokenSampler(1.0, seed=0, top_k=2), scores)) == {0, 1}
    assert set(_draws(TokenSampler(1.0, seed=0, top_k=1), scores)) == {0}


def test_min_p_drops_tokens_below_a_share_of_the_top_ones():
    scores = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(_draws(TokenSampler(1.0, seed=1), scores)) == {0, 1, 2, 3}
    assert set(_draws(TokenSampler(1.0, seed=1, min_p=0.5), scores)) == {0, 1}  # 0.3 >= 0.25 > 0.15
    # after top_p (transformers' order): top_p=0.7 keeps {0, 1}; min_p=0.7 then drops 1 (0.3 < 0.35)
    assert set(_draws(TokenSampler(1.0, seed=1, top_p=0.7, min_p=0.7), scores)) == {0}


def test_the_filters_are_seeded_like_the_rest():
    scores = torch.linspace(0, 4, 50)
    first, second = (TokenSampler(1.0, seed=7, top_k=10, min_p=0.1) for _ in range(2))
    draws = [first(scores) for _ in range(30)]
    assert draws == [second(scores) for _ in range(30)]
    assert min(draws) >= 40 and len(set(draws)) > 1  # top_k=10 of 50 increasing scores


REPEAT = [dict(frequency_penalty=-2.0), dict(presence_penalty=-2.0), dict(repetition_penalty=0.01)]


@pytest.mark.parametrize("mode", ["concat", "pced", "single", "soft_nbce", "ape", "map_reduce"])
def test_every_mode_takes_the_penalties(engine, mode):
    """A negative penalty rewards repeating: the answer is its first token again and again."""
    plain = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=5).token_ids
    assert len(set(plain)) > 1
    for knob in REPEAT:
        repeated = engine.generate(QUESTION, DOCS, mode=mode, sampling=SamplingParams(max_tokens=5, **knob)).token_ids
        assert len(repeated) == 5 and len(set(repeated)) == 1, (knob, repeated)


def test_chat_ippd_and_exclusive_ape_take_the_penalties(engine):
    knob = SamplingParams(max_tokens=5, frequency_penalty=-2.0)
    assert len(set(engine.chat([{"role": "user", "content": "hi"}], sampling=knob).token_ids)) == 1
    answers = engine.generate_many([QUESTION, "Where is Marrowgate?"], DOCS, sampling=knob)
    # each question counts its own tokens: IPPD equals concat answer by answer
    assert [a.token_ids for a in answers] == [engine.generate(q, DOCS, mode="concat", sampling=knob).token_ids
                                              for q in (QUESTION, "Where is Marrowgate?")]
    assert all(len(set(a.token_ids)) == 1 for a in answers)
    flex = Engine(engine.loaded)  # APE on FlexAttention's merge runs as an exclusive job
    assert len(set(flex.generate(QUESTION, DOCS, mode="ape", attention_kernel="flex", sampling=knob).token_ids)) == 1
    assert flex.stats()["exclusive_s"] > 0


def test_rapid_refuses_what_its_acceptance_cannot_honour(engine):
    for knob in (dict(top_k=5), dict(min_p=0.1), dict(presence_penalty=0.5), dict(logprobs=0)):
        with pytest.raises(UnsupportedSamplingError, match="mode 'rapid' cannot honour") as refused:
            engine.generate(QUESTION, DOCS, mode="rapid", sampling=SamplingParams(max_tokens=4, **knob))
        assert refused.value.field == next(iter(knob))
    assert engine.generate(QUESTION, DOCS, mode="rapid", sampling=SamplingParams(max_tokens=4)).token_ids


def _multinomial_draw(scores: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float,
                      generator: torch.Generator) -> int:
    """The sampler's draw as it was written before it stayed on the device: the knobs in transformers' order, a
    boolean-indexed nucleus, then ``torch.multinomial`` on the CPU with the answer's generator."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper

    logits = scores.float().cpu() / temperature
    if top_k:
        logits = TopKLogitsWarper(top_k)(None, logits.unsqueeze(0))[0]
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, -1) - sorted_probs < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    if min_p:
        probs = torch.softmax(MinPLogitsWarper(min_p)(None, probs.log().unsqueeze(0))[0], dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)[0])


@pytest.mark.parametrize("knobs", [dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
                                   dict(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0),
                                   dict(temperature=1.3, top_p=0.95, top_k=50, min_p=0.02)])
def test_the_sampled_draw_is_multinomials_own_bit_for_bit_with_the_same_seed(knobs):
    # The draw is written out as torch.multinomial's exponential race (argmax p / q, q ~ Exp(1) from the answer's
    # CPU generator) so nothing is read back: every seed must give multinomial's token, draw after draw (a
    # different race, a q drawn in another dtype or shape, or a nucleus that dropped or kept other tokens differ).
    scores = torch.randn(4096, generator=torch.Generator().manual_seed(5)) * 3
    for seed in range(40):
        sampler = TokenSampler(seed=seed, **knobs)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(3):
            token, best = sampler.pick(scores)
            assert int(token) == _multinomial_draw(scores, generator=generator, **knobs)
            assert float(best) == float(scores.max())


def test_a_top_p_below_float32s_smallest_number_keeps_the_top_token_alone():
    # cumsum - p < top_p is 0 < 1e-50 in float32: False for every token, the top one included; it must stay, or the
    # draw would run over zeros and return token 0 without a word.
    scores = torch.randn(512, generator=torch.Generator().manual_seed(2))
    for seed in range(20):
        token, _ = TokenSampler(temperature=1.0, top_p=1e-50, seed=seed).pick(scores)
        assert int(token) == int(scores.argmax()) != 0
