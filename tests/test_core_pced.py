"""PCED decoding invariants (docs/methods.md) and the streaming / stopping mechanics of the engine."""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Answer, Document, Engine
from tests.helpers import greedy_reference, last_logits, tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019.",
    "Veloria's national dish is smoked eel with plums, served at the Lantern Fair.",
]
QUESTION = "Who is the mayor of Marrowgate?"


def prompt_ids(engine: Engine, documents: list[str], question: str) -> list[int]:
    layout = engine.layout
    return layout.prefix_ids + [t for d in documents for t in layout.context_ids(d)] + layout.suffix_ids(question)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("score_space", ["logprobs", "logits"])
def test_one_document_without_contrast_or_prior_is_plain_greedy(family, score_space):
    engine = Engine(tiny_loaded(family, seed=5))
    answer = engine.generate(QUESTION, DOCS[1:2], mode="pced", beta=0.0, gamma=0.0, score_space=score_space,
                             max_new_tokens=24)
    expected = greedy_reference(engine.loaded, prompt_ids(engine, DOCS[1:2], QUESTION), 24)
    assert answer.token_ids == expected
    assert len(answer.token_ids) > 0
    assert all(step.document == 0 for step in answer.trace)


def test_document_order_does_not_change_the_answer(tiny_engine):
    scores = [0.6, 0.9, 0.3]
    forward = tiny_engine.generate(QUESTION, DOCS, mode="pced", scores=scores, max_new_tokens=20)
    order = [2, 0, 1]
    backward = tiny_engine.generate(QUESTION, [DOCS[i] for i in order], mode="pced", scores=[scores[i] for i in order],
                                    max_new_tokens=20)
    assert forward.token_ids == backward.token_ids
    assert [order[s.document] for s in backward.trace] == [s.document for s in forward.trace]


def test_document_with_near_zero_relevance_never_wins(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="pced", scores=[0.7, 1e-30, 0.5], max_new_tokens=20)
    assert answer.trace and all(step.document != 1 for step in answer.trace)
    # control: with a real score the same document does win tokens, so the check above can fail
    control = tiny_engine.generate(QUESTION, DOCS, mode="pced", scores=[1e-30, 1.0, 1e-30], max_new_tokens=20)
    assert all(step.document == 1 for step in control.trace)


def test_answer_carries_documents_scores_timings_and_cache_counts(tiny_engine):
    docs = [Document(d, id=f"d{i}", score=0.5 + i / 10, scores={"dense": 0.1 * i}) for i, d in enumerate(DOCS)]
    first = tiny_engine.generate(QUESTION, docs, mode="pced", max_new_tokens=8)
    second = tiny_engine.generate(QUESTION, docs, mode="pced", max_new_tokens=8)
    assert isinstance(first, Answer)
    assert (first.cache_misses, first.cache_hits) == (3, 0)
    assert (second.cache_misses, second.cache_hits) == (0, 3)
    assert [d.id for d in first.documents] == ["d0", "d1", "d2"]
    assert first.documents[2].scores == {"dense": 0.2} and first.documents[2].score == pytest.approx(0.7)
    for key in ("ttft_s", "total_s", "tokens_per_s"):
        assert first.timings[key] >= 0
    assert first.timings["ttft_s"] <= first.timings["total_s"]
    assert len(first.trace) == len(first.token_ids)
    assert first.to_dict()["documents"][0]["id"] == "d0"
    assert first.extra["beta"] is not None and len(first.extra["beta"]) == 3


def test_streaming_pieces_join_to_the_answer(tiny_engine):
    pieces: list[str] = []
    answer = tiny_engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=16, on_token=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == answer.text
    stream = tiny_engine.stream(QUESTION, DOCS, mode="pced", max_new_tokens=16)
    streamed = list(stream)
    assert "".join(streamed) == answer.text


def test_stream_returns_the_answer_and_reraises_errors(tiny_engine):
    generator = tiny_engine.stream(QUESTION, DOCS, mode="pced", max_new_tokens=4)
    with pytest.raises(StopIteration) as stop:
        while True:
            next(generator)
    assert isinstance(stop.value.value, Answer)
    with pytest.raises(Exception, match="unknown mode"):
        list(tiny_engine.stream(QUESTION, DOCS, mode="nope"))


def test_stop_strings_and_max_new_tokens(tiny_engine):
    full = tiny_engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=30)
    assert len(full.token_ids) == 30 and full.finish_reason == "length"
    marker = full.text[len(full.text) // 2:][:3]
    assert marker, "the random model produced too little text to pick a stop string"
    cut = tiny_engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=30, stop=[marker])
    assert cut.finish_reason == "stop" and marker not in cut.text and full.text.startswith(cut.text)


def test_sampling_is_reproducible_with_a_seed(tiny_engine):
    kwargs = dict(max_new_tokens=12, temperature=1.0, top_p=0.9)
    a = tiny_engine.generate(QUESTION, DOCS, mode="pced", seed=1, **kwargs)
    b = tiny_engine.generate(QUESTION, DOCS, mode="pced", seed=1, **kwargs)
    c = tiny_engine.generate(QUESTION, DOCS, mode="pced", seed=2, **kwargs)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


@pytest.mark.parametrize("aggregation", ["mixture", "product"])
def test_aggregation_variants_decode(tiny_engine, aggregation):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="pced", aggregation=aggregation, max_new_tokens=6)
    assert len(answer.token_ids) == 6 and all(s.document in (0, 1, 2) for s in answer.trace)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_answer_and_citations_equal_a_reference_over_separate_prompts(family):
    """Fused greedy decoding, recomputed from one plain forward pass per prompt and step: the amateur
    is (prefix, question) with no document, expert k is (prefix, document k, question), then
    max_k (1 + beta) log p_k - beta log p_0 + gamma log r_k. On a position-sensitive model with documents
    of different lengths. Fails if the amateur stream is built from a document's cache, if a stream's
    positions or padding are off, or if relevance scores are matched to the wrong expert."""
    loaded = tiny_loaded(family, seed=6, position_sensitive=True)
    engine = Engine(loaded)
    scores, beta, gamma, steps = [0.9, 0.4, 0.7], 0.5, 1.0, 10
    answer = engine.generate(QUESTION, DOCS, mode="pced", scores=scores, beta=beta, gamma=gamma, max_new_tokens=steps,
                             prior="paper")
    layout = engine.layout
    suffix = layout.suffix_ids(QUESTION)
    prompts = [layout.prefix_ids + suffix] + [layout.prefix_ids + layout.context_ids(d) + suffix for d in DOCS]
    log_r = torch.log(torch.tensor(scores)).unsqueeze(1)
    tokens, cited = [], []
    for _ in range(steps):
        logprobs = torch.log_softmax(last_logits(loaded, [p + tokens for p in prompts]), -1)
        adjusted = (1 + beta) * logprobs[1:] - beta * logprobs[0] + gamma * log_r
        tokens.append(int(adjusted.max(0).values.argmax()))
        cited.append(int(adjusted[:, tokens[-1]].argmax()))
        if tokens[-1] in loaded.eos_token_ids:
            tokens.pop()
            break
    assert answer.token_ids == tokens and len(set(tokens)) > 3
    assert [step.document for step in answer.trace] == cited[:len(tokens)]
    assert len(set(cited)) > 1  # more than one expert wins tokens, so citations are checked too


@pytest.mark.slow
def test_embedded_model_single_document_parity_and_warm_cache(embedded_engine):
    answer = embedded_engine.generate(QUESTION, DOCS[1:2], mode="pced", beta=0.0, gamma=0.0, max_new_tokens=12)
    expected = greedy_reference(embedded_engine.loaded, prompt_ids(embedded_engine, DOCS[1:2], QUESTION), 12)
    assert answer.token_ids == expected
    assert "Ilsa Brenn" in embedded_engine.generate(QUESTION, DOCS, mode="pced", max_new_tokens=24).text
