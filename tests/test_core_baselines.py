"""Baselines: concat and single equal plain greedy decoding of their prompts; map_reduce runs end to end."""

from __future__ import annotations

from tests.helpers import greedy_reference
from tests.test_core_pced import DOCS, QUESTION, prompt_ids


def test_concat_is_greedy_decoding_of_the_concatenated_prompt(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="concat", max_new_tokens=20)
    assert answer.token_ids == greedy_reference(tiny_engine.loaded, prompt_ids(tiny_engine, DOCS, QUESTION), 20)
    assert all(step.document is None for step in answer.trace)
    assert answer.cache_hits == answer.cache_misses == 0


def test_single_decodes_the_top_scored_document_from_cache(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, scores=[0.2, 0.4, 0.9], mode="single", max_new_tokens=20)
    assert answer.token_ids == greedy_reference(tiny_engine.loaded, prompt_ids(tiny_engine, DOCS[2:], QUESTION), 20)
    assert all(step.document == 2 for step in answer.trace) and answer.cache_misses == 1


def test_map_reduce_summarises_each_document_then_answers(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="map_reduce", summary_tokens=5, max_new_tokens=6)
    assert len(answer.extra["summaries"]) == 3
    assert len(answer.token_ids) == 6 and answer.timings["map_s"] <= answer.timings["total_s"]
