"""Baselines: concat and single equal plain greedy decoding of their prompts; map_reduce runs end to end."""

from __future__ import annotations

import pytest

from ctx_integrations import Engine
from ctx_integrations.documents import prepare_documents
from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from ctx_integrations.engine.modes.baselines import map_inputs, reduce_texts
from ctx_integrations.errors import DocumentTooLongError, InvalidOptionError
from tests.helpers import greedy_reference, tiny_loaded
from tests.test_core_pced import DOCS, QUESTION, prompt_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_concat_is_greedy_decoding_of_the_concatenated_prompt(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="concat", max_new_tokens=20)
    assert answer.token_ids == greedy_reference(tiny_engine.loaded, prompt_ids(tiny_engine, DOCS, QUESTION), 20)
    assert all(step.document is None for step in answer.trace)
    assert answer.cache_hits == answer.cache_misses == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_single_decodes_the_top_scored_document_from_cache(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, scores=[0.2, 0.4, 0.9], mode="single", max_new_tokens=20)
    assert answer.token_ids == greedy_reference(tiny_engine.loaded, prompt_ids(tiny_engine, DOCS[2:], QUESTION), 20)
    assert all(step.document == 2 for step in answer.trace) and answer.cache_misses == 1


def test_map_reduce_summarises_each_document_then_answers(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="map_reduce", summary_tokens=5, max_new_tokens=6)
    assert len(answer.extra["summaries"]) == 3
    assert len(answer.token_ids) == 6 and answer.timings["map_s"] <= answer.timings["total_s"]


LONG_WORDS = "river town market water city house school road field light tree hill stone wind rain".split()


def small_window(family: str) -> Engine:
    """A tiny model with a 256-position window (RoPE models run past it silently, so sizes are checked)."""
    return Engine(tiny_loaded(family, max_position_embeddings=256))


@pytest.fixture(scope="module")
def small_window_engine():
    return small_window("llama")


def test_map_reduce_cuts_a_document_longer_than_the_window_into_pieces(small_window_engine):
    engine = small_window_engine
    long_doc = " ".join(LONG_WORDS[i % len(LONG_WORDS)] for i in range(700))  # far beyond 256 positions
    answer = engine.generate("What is the code?", ["The code is 4821.", long_doc], mode="map_reduce",
                             summary_tokens=8, max_new_tokens=4)
    sources = answer.extra["summary_documents"]
    assert sources[0] == 0 and set(sources[1:]) == {1} and len(sources) >= 4
    summary = PromptLayout(engine.loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    fixed = len(summary.prefix_ids) + len(summary.suffix_ids("")) + 8
    assert all(fixed + n <= 256 for n in answer.extra["map_input_tokens"])  # every map prompt fits
    assert max(answer.extra["map_input_tokens"]) == 256 - fixed  # pieces as large as fit
    # the pieces are the document's tokens, in order, nothing lost
    pieces = map_inputs(summary, [summary.context_ids("The code is 4821."), summary.context_ids(long_doc)], 8, 256)
    assert [t for i, ids in pieces if i == 1 for t in ids] == summary.context_ids(long_doc)
    assert len(answer.token_ids) == 4


def test_map_reduce_refuses_what_cannot_fit_with_a_typed_error(small_window_engine):
    docs = [" ".join(LONG_WORDS * 3)] * 3
    with pytest.raises(DocumentTooLongError, match="summary_tokens"):  # the summary prompt alone is too long
        small_window_engine.generate("What is the code?", docs, mode="map_reduce", summary_tokens=250,
                                     max_new_tokens=2)
    # three summaries of ~100 tokens do not fit one 256-position reduce prompt
    with pytest.raises(DocumentTooLongError, match="reduce step \\(the summaries of 3 documents: lower summary_tokens"):
        small_window_engine.generate("What is the code?", docs, mode="map_reduce", summary_tokens=100,
                                     max_new_tokens=2)


def test_reduce_joins_each_documents_piece_summaries_in_order():
    docs = prepare_documents(["first", "second", "third"], None)
    assert reduce_texts(docs, [0, 1, 1, 2], ["a ", "b1", " b2", ""]) == ["a", "b1 b2", "third"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_truncated_keeps_the_last_tokens_that_fit(family):
    engine = small_window(family)
    long_doc = " ".join(LONG_WORDS[i % len(LONG_WORDS)] for i in range(400))
    docs, question = [long_doc, "The code is 4821."], "What is the code?"
    answer = engine.generate(question, docs, mode="truncated", max_new_tokens=6)
    layout = engine.layout
    context = [t for d in docs for t in layout.context_ids(d)]
    fixed = len(layout.prefix_ids) + len(layout.suffix_ids(question))
    keep = 256 - fixed - 6
    assert answer.extra["context_tokens"] == keep and answer.extra["dropped_tokens"] == len(context) - keep > 0
    prompt = layout.prefix_ids + context[-keep:] + layout.suffix_ids(question)
    assert answer.token_ids == greedy_reference(engine.loaded, prompt, 6)
    short = engine.generate(question, docs, mode="truncated", context_tokens=20, max_new_tokens=6)
    assert short.token_ids == greedy_reference(engine.loaded, layout.prefix_ids + context[-20:]
                                               + layout.suffix_ids(question), 6)
    with pytest.raises(InvalidOptionError):
        engine.generate(question, docs, mode="truncated", context_tokens=0, max_new_tokens=2)


def test_truncated_is_concat_when_everything_fits(tiny_engine):
    truncated = tiny_engine.generate(QUESTION, DOCS, mode="truncated", max_new_tokens=10)
    concat = tiny_engine.generate(QUESTION, DOCS, mode="concat", max_new_tokens=10)
    assert truncated.token_ids == concat.token_ids and truncated.extra["dropped_tokens"] == 0
