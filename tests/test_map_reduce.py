"""MapReduce's two steps against greedy references: the map prompt is the summary prompt, the reduce
step reads the summaries."""

from __future__ import annotations

import pytest

from ctx_integrations.engine.core.layout import SUMMARY_QUESTION_TEMPLATE, SUMMARY_SYSTEM_PROMPT, PromptLayout
from tests.helpers import greedy_reference
from tests.test_core_pced import DOCS, QUESTION


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_map_reduce_maps_with_the_summary_prompt_and_reduces_over_the_summaries(tiny_engine):
    """Each summary is greedy decoding of (summary system prompt, document, "Summarize the document
    above."), not of the QA prompt; the answer is greedy decoding of the QA prompt over the summaries,
    not over the raw documents."""
    loaded, layout = tiny_engine.loaded, tiny_engine.layout
    answer = tiny_engine.generate(QUESTION, DOCS, mode="map_reduce", summary_tokens=6, max_new_tokens=8)
    summary_layout = PromptLayout(loaded.tokenizer, SUMMARY_SYSTEM_PROMPT, SUMMARY_QUESTION_TEMPLATE)
    summaries = answer.extra["summaries"]
    for document, summary in zip(DOCS, summaries, strict=True):
        ids = summary_layout.prefix_ids + summary_layout.context_ids(document) + summary_layout.suffix_ids("")
        assert summary == loaded.tokenizer.decode(greedy_reference(loaded, ids, 6))
    assert all(s.strip() for s in summaries)  # no summary fell back to its raw document
    reduce_ids = layout.prefix_ids + [t for s in summaries for t in layout.context_ids(s.strip())]
    assert answer.token_ids == greedy_reference(loaded, reduce_ids + layout.suffix_ids(QUESTION), 8)


def test_map_reduce_has_no_compile_mode_of_its_own_the_engine_has_it(tiny_engine):
    """MapReduce's exclusive compiled path is gone: every request decodes in the pool, whose step the engine compiles
    (``Engine(compile_mode=...)``); a compile_mode given to the mode is refused, not ignored."""
    from ctx_integrations.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="does not accept compile_mode; its options are: summary_tokens"):
        tiny_engine.generate(QUESTION, DOCS, mode="map_reduce", compile_mode="reduce-overhead")
