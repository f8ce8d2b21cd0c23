"""PCED's ``switch="word"`` variant: the expert that won a word's last piece is the only one that may
continue that word; between words any expert may win (the paper's rule, ``switch="token"``, otherwise)."""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.decoding import FusionState
from ctx_integrations.engine.core.word_pieces import WordPieces, word_pieces
from ctx_integrations.engine.modes.pced import PCEDFusion
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import embedded_tokenizer, last_logits, tiny_loaded
from tests.test_core_pced import DOCS, QUESTION

# a 6-token vocabulary: 0 " Sto" (starts a word, inside one), 1 "os" and 2 "ex" (continue a word),
# 3 "," (neither), 4 " and", 5 "end"
PIECES = WordPieces(continues=torch.tensor([False, True, True, False, False, True]),
                    inside=torch.tensor([True, True, True, False, True, True]))


def fuse(logits, state, **kwargs):
    return PCEDFusion([0.5, 0.5], beta=0.0, gamma=0.0, switch="word", word_pieces=PIECES, **kwargs)(logits, state)


def test_a_word_is_continued_only_by_the_expert_that_began_it():
    # expert 1 (row 1) began the word; expert 2 prefers the continuation "ex", expert 1 prefers "os"
    logits = torch.tensor([[0.0] * 6, [0.0, 3.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])
    word = fuse(logits, FusionState(last_token=0, last_winner=0))
    token = PCEDFusion([0.5, 0.5], beta=0.0, gamma=0.0)(logits)
    assert int(token.scores.argmax()) == 2 and int(token.evidence[:, 2].argmax()) == 1  # the paper's rule splices
    assert int(word.scores.argmax()) == 1 and int(word.evidence[:, 1].argmax()) == 0
    assert word.evidence[1, [1, 2, 5]].eq(-math.inf).all()
    torch.testing.assert_close(word.evidence[0], token.evidence[0])  # the word's own expert is untouched


def test_tokens_that_start_a_word_stay_open_to_every_expert():
    logits = torch.tensor([[0.0] * 6, [2.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 7.0, 0.0]])
    word = fuse(logits, FusionState(last_token=0, last_winner=0))
    assert int(word.scores.argmax()) == 4 and int(word.evidence[:, 4].argmax()) == 1
    torch.testing.assert_close(word.evidence[:, [0, 3, 4]], PCEDFusion([0.5, 0.5], beta=0.0, gamma=0.0)(
        logits).evidence[:, [0, 3, 4]])


@pytest.mark.parametrize("state", [FusionState(), FusionState(last_token=3, last_winner=1)],
                         ids=["first step", "after punctuation"])
def test_without_an_open_word_it_is_the_papers_rule(state):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 6, generator=generator) * 3
    paper = PCEDFusion([0.5, 0.5], beta=0.0, gamma=0.0)(logits)
    word = fuse(logits, state)
    torch.testing.assert_close(word.scores, paper.scores)
    torch.testing.assert_close(word.evidence, paper.evidence)


def test_word_pieces_are_ignored_under_the_papers_rule():
    logits = torch.tensor([[0.0] * 6, [0.0, 3.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])
    paper = PCEDFusion([0.5, 0.5], beta=0.0, gamma=0.0, switch="token", word_pieces=PIECES)
    torch.testing.assert_close(paper(logits, FusionState(last_token=0, last_winner=0)).evidence,
                               PCEDFusion([0.5, 0.5], beta=0.0, gamma=0.0)(logits).evidence)


def test_inputs_are_not_modified():
    logits = torch.tensor([[0.0] * 6, [0.0, 3.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])
    copy = logits.clone()
    fuse(logits, FusionState(last_token=0, last_winner=0))
    assert torch.equal(logits, copy)


@pytest.mark.parametrize("kwargs, message", [
    (dict(switch="word", word_pieces=PIECES, aggregation="mixture"), "aggregation='max'"),
    (dict(switch="word"), r"^switch='word' needs the vocabulary's word pieces \(LoadedModel.word_pieces\)$"),
    (dict(switch="sentence"), "^switch "),
])
def test_bad_switch_options_are_refused(kwargs, message):
    with pytest.raises(InvalidOptionError, match=message):
        PCEDFusion([0.5, 0.5], **kwargs)


def test_word_pieces_of_mismatched_vocabulary_are_refused():
    logits = torch.zeros(3, 7)
    with pytest.raises(InvalidOptionError, match="word pieces cover 6"):
        fuse(logits, FusionState(last_token=0, last_winner=0))


def test_word_pieces_of_a_real_tokenizer():
    tokenizer = embedded_tokenizer()
    pieces = word_pieces(tokenizer, len(tokenizer) + 5)
    assert pieces.continues.dtype == pieces.inside.dtype == torch.bool  # masks, 1 byte per vocabulary id
    ids = tokenizer.encode(" Stosbraend founded it, in 2019.")
    text = [tokenizer.decode([i]) for i in ids]
    assert [bool(pieces.continues[i]) for i in ids] == [bool(t) and t[0].isalnum() for t in text]
    assert [bool(pieces.inside[i]) for i in ids] == [bool(t) and t[-1].isalnum() for t in text]
    assert [bool(pieces.continues[i]) for i in ids[:4]] == [False, True, True, True]  # " St" "os" "bra" "end"
    assert not pieces.continues[-5:].any() and not pieces.inside[-5:].any()  # the head's padding ids


def test_answer_equals_a_reference_over_separate_prompts():
    """The job threads the last token and its winner into the rule: the engine's answer equals a greedy
    reference that applies the word rule by hand, step by step, on a position-sensitive tiny model, and
    differs from the paper's rule there (so the variant is exercised, not a no-op)."""
    loaded = tiny_loaded("llama", seed=6, position_sensitive=True)
    engine = Engine(loaded)
    scores, beta, gamma, steps = [0.9, 0.4, 0.7], 0.5, 1.0, 16
    answer = engine.generate(QUESTION, DOCS, mode="pced", scores=scores, beta=beta, gamma=gamma, max_new_tokens=steps,
                             switch="word", prior="paper")
    paper = engine.generate(QUESTION, DOCS, mode="pced", scores=scores, beta=beta, gamma=gamma, max_new_tokens=steps,
                            prior="paper")
    tokenizer = loaded.tokenizer
    layout = engine.layout
    suffix = layout.suffix_ids(QUESTION)
    prompts = [layout.prefix_ids + suffix] + [layout.prefix_ids + layout.context_ids(d) + suffix for d in DOCS]
    log_r = torch.log(torch.tensor(scores)).unsqueeze(1)
    continuing = torch.tensor([v for v in range(len(tokenizer)) if tokenizer.decode([v])[:1].isalnum()])
    tokens, cited = [], []
    for _ in range(steps):
        logprobs = torch.log_softmax(last_logits(loaded, [p + tokens for p in prompts]), -1)
        adjusted = (1 + beta) * logprobs[1:] - beta * logprobs[0] + gamma * log_r
        if tokens and tokenizer.decode([tokens[-1]])[-1:].isalnum():
            others = [k for k in range(len(DOCS)) if k != cited[-1]]
            adjusted[others] = adjusted[others].index_fill(1, continuing, -math.inf)
        tokens.append(int(adjusted.max(0).values.argmax()))
        cited.append(int(adjusted[:, tokens[-1]].argmax()))
        if tokens[-1] in loaded.eos_token_ids:
            tokens.pop()
            break
    assert answer.token_ids == tokens and [s.document for s in answer.trace] == cited[:len(tokens)]
    assert answer.token_ids != paper.token_ids


def test_one_document_is_the_papers_rule(tiny_engine):
    word = tiny_engine.generate(QUESTION, DOCS[:1], mode="pced", switch="word", max_new_tokens=12)
    assert word.token_ids == tiny_engine.generate(QUESTION, DOCS[:1], mode="pced", max_new_tokens=12).token_ids
