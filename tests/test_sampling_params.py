"""``SamplingParams``: one object for max_tokens / temperature / top_p / seed / stop, accepted by every engine
entry point as ``sampling=`` and equal in effect to the separate keyword arguments."""

from __future__ import annotations

import asyncio

import pytest

from ctx_integrations import Engine, SamplingParams
from ctx_integrations.errors import InvalidOptionError
from tests.test_core_pced import DOCS, QUESTION

MESSAGES = [{"role": "user", "content": "Name a river in Veloria."}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    from tests.helpers import tiny_loaded

    return Engine(tiny_loaded("llama", seed=3))


@pytest.mark.parametrize("bad, message", [
    (dict(max_tokens=0), r"^max_tokens \(max_new_tokens\) must be"),
    (dict(temperature=-0.5), "^temperature"),
    (dict(top_p=0.0), "^top_p"),
    (dict(seed=-1), "^seed"),
    (dict(stop=[3]), "^stop"),
    (dict(stop=("",)), "^stop strings must not be empty"),  # it would never match (issue 58)
    (dict(stop=""), "^stop strings must not be empty"),
    (dict(stop=["a", ""]), "^stop strings must not be empty"),
])
def test_bad_settings_fail_where_they_are_written(bad, message):
    with pytest.raises(InvalidOptionError, match=message):
        SamplingParams(**bad)


def test_stop_is_normalised_to_a_tuple_and_the_object_is_immutable():
    params = SamplingParams(stop="\n\n")
    assert params.stop == ("\n\n",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]


def test_sampling_equals_the_separate_arguments(engine):
    """Sampled (not greedy) answers, so a dropped seed, temperature or top_p changes the tokens."""
    separate = engine.generate(QUESTION, DOCS, max_new_tokens=7, temperature=1.3, top_p=0.9, seed=11, mode="concat")
    params = SamplingParams(max_tokens=7, temperature=1.3, top_p=0.9, seed=11)
    together = engine.generate(QUESTION, DOCS, sampling=params, mode="concat")
    assert together.token_ids == separate.token_ids and len(together.token_ids) == 7
    other_seed = engine.generate(QUESTION, DOCS, sampling=SamplingParams(7, 1.3, 0.9, seed=12), mode="concat")
    assert other_seed.token_ids != together.token_ids  # the seed reaches the sampler


def test_every_entry_point_takes_sampling(engine):
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5)
    assert len(engine.generate(QUESTION, DOCS[:1], sampling=params).token_ids) == 3
    assert len(asyncio.run(engine.agenerate(QUESTION, DOCS[:1], sampling=params)).token_ids) == 3
    assert len(engine.chat(MESSAGES, sampling=params).token_ids) == 3
    assert len(asyncio.run(engine.achat(MESSAGES, sampling=params)).token_ids) == 3
    many = engine.generate_many([QUESTION, "Where is Marrowgate?"], DOCS[:2], sampling=params)
    separate = engine.generate_many([QUESTION, "Where is Marrowgate?"], DOCS[:2], max_new_tokens=3,
                                    temperature=1.0, seed=5)
    assert [a.token_ids for a in many] == [a.token_ids for a in separate]  # question i samples with seed + i
    assert len(asyncio.run(engine.agenerate_many([QUESTION], DOCS[:1], sampling=params))[0].token_ids) == 3

    async def pieces(stream):
        return "".join([piece async for piece in stream])

    stream = engine.astream(QUESTION, DOCS[:1], sampling=params)
    assert asyncio.run(pieces(stream)) == stream.answer.text and len(stream.answer.token_ids) == 3
    chat_stream = engine.astream_chat(MESSAGES, sampling=params)
    asyncio.run(pieces(chat_stream))
    assert len(chat_stream.answer.token_ids) == 3


def test_both_spellings_at_once_are_refused(engine):
    with pytest.raises(InvalidOptionError, match="either as sampling=SamplingParams"):
        engine.generate(QUESTION, DOCS, sampling=SamplingParams(max_tokens=4), max_new_tokens=9)
    with pytest.raises(InvalidOptionError, match="sampling must be a SamplingParams, got dict"):
        engine.chat(MESSAGES, sampling={"max_tokens": 4})


def test_stop_strings_reach_the_answer(engine):
    full = engine.generate(QUESTION, DOCS[:1], max_new_tokens=16, mode="concat").text
    stop = full.strip()[len(full.strip()) // 2:][:3]
    assert stop and stop in full
    stopped = engine.generate(QUESTION, DOCS[:1], sampling=SamplingParams(max_tokens=16, stop=stop), mode="concat")
    assert stopped.text == full[:full.index(stop)]


def test_an_empty_stop_string_is_refused_by_the_adapters_too():
    """Issue 58: ``stop=("",)`` was accepted and never matched; every adapter builds its SamplingParams."""
    pytest.importorskip("llama_index.core")
    pytest.importorskip("langchain_core")
    from ctx_integrations.langchain import ContextOfExpertsRunnable
    from ctx_integrations.llama_index import ExpertDecoderLLM

    with pytest.raises(InvalidOptionError, match="^stop strings must not be empty"):
        ExpertDecoderLLM(stop=[""])
    with pytest.raises(InvalidOptionError, match="^stop strings must not be empty"):
        ExpertDecoderLLM().sampling_params({"stop": ["a", ""]})
    with pytest.raises(InvalidOptionError, match="^stop strings must not be empty"):
        ContextOfExpertsRunnable(stop=[""])._settings(None)
