"""Soft-NBCE's streams and citations, independent of which fusion rule is the default.

The streams are checked by recomputing each step from separate plain forward passes (the prior is
(prefix, question) with no chunk, chunk k is (prefix, chunk k, question)) and fusing them with the
mode's own rule class, so these tests hold for the paper's Algorithm 1 and for the NBCE-code variant.
The citation evidence log w_k + S_k(v) is checked at rho = 1, where both rules coincide (every token
is in every nucleus, so truncated and renormalised entropies are the full entropy).
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.modes.soft_nbce import NBCEFusion, PCWFusion, SoftNBCEFusion
from tests.helpers import last_logits, tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019.",
    "Veloria's national dish is smoked eel with plums, served at the Lantern Fair.",
]
QUESTION = "Who is the mayor of Marrowgate?"


# Qwen2 runs the Soft-NBCE case only: hard NBCE shares its streams (and is checked on Qwen2 in test_soft_nbce.py)
@pytest.mark.parametrize(("mode", "rule", "family"), [
    ("soft_nbce", SoftNBCEFusion(tau=0.5, beta=0.5, rho=0.9), "llama"),
    ("soft_nbce", SoftNBCEFusion(tau=0.5, beta=0.5, rho=0.9), "qwen2"),
    ("nbce", NBCEFusion(beta=0.5, rho=0.9), "llama")])
def test_answer_and_citations_equal_the_rule_over_separate_prompts(mode, rule, family):
    """Fails if the prior is built from a chunk's cache (or any stream is shifted or padded wrongly):
    on a position-sensitive model every stream must match its own prompt decoded alone."""
    loaded = tiny_loaded(family, seed=6, position_sensitive=True)
    engine = Engine(loaded)
    options = dict(beta=0.5, rho=0.9) | (dict(tau=0.5) if mode == "soft_nbce" else {})
    steps = 10
    answer = engine.generate(QUESTION, DOCS, mode=mode, chunk_tokens=None, max_new_tokens=steps, **options)
    layout = engine.layout
    suffix = layout.suffix_ids(QUESTION)
    prompts = [layout.prefix_ids + suffix] + [layout.prefix_ids + layout.context_ids(d) + suffix for d in DOCS]
    tokens, cited = [], []
    for _ in range(steps):
        fused = rule(last_logits(loaded, [p + tokens for p in prompts]))
        tokens.append(int(fused.scores.argmax()))
        cited.append(int(fused.evidence[:, tokens[-1]].argmax()))
        if tokens[-1] in loaded.eos_token_ids:
            tokens.pop()
            break
    assert answer.token_ids == tokens and len(set(tokens)) > 3
    assert [step.document for step in answer.trace] == cited[:len(tokens)]


def full_rule_reference(logits: torch.Tensor, tau: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log w_k and S_k(v) at rho = 1 in float64: w = softmax_k(-H_k / tau), S_k = (1 + beta) L_k - beta L_prior."""
    logprobs = torch.log_softmax(logits.double(), -1)
    entropy = -(logprobs[1:].exp() * logprobs[1:]).sum(-1)
    return torch.log_softmax(-entropy / tau, 0), (1 + beta) * logprobs[1:] - beta * logprobs[0]


@pytest.mark.parametrize("seed", range(3))
def test_citation_evidence_is_log_weight_plus_contrasted_score(seed):
    """The evidence that names a token's source chunk is log w_k + S_k(v), not S_k(v) alone: a confident
    chunk (large w) wins the citation over a vaguer one that gives the token a slightly higher score."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 40, generator=generator) * torch.tensor([[3.0], [1.0], [4.0], [2.0], [6.0]])
    tau, beta = 0.3, 0.4
    step = SoftNBCEFusion(tau=tau, beta=beta, rho=1.0)(logits)
    log_w, scores = full_rule_reference(logits, tau, beta)
    expected = log_w.unsqueeze(1) + scores
    torch.testing.assert_close(step.evidence.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(step.scores.double(), (log_w.exp().unsqueeze(1) * scores).sum(0), rtol=1e-5,
                               atol=1e-4)
    # the weights move citations: without log w another chunk would be cited for some tokens
    assert (expected.argmax(0) != scores.argmax(0)).any()


def test_a_confident_chunk_is_cited_over_a_vague_one_with_a_higher_score():
    """Hand case: chunk A puts 0.90 on token 0 with a sharp tail (entropy 0.33), chunk B 0.91 with a flat
    tail (entropy 0.37). B scores token 0 higher (log 0.91 > log 0.90) but A's weight is e^(0.04 / tau)
    times B's; the citation of token 0 must be A (row 0 of the evidence)."""
    probs = torch.tensor([[0.5, 0.3, 0.2],  # prior (beta = 0: unused)
                          [0.90, 0.0999, 0.0001],  # chunk A
                          [0.91, 0.045, 0.045]])  # chunk B
    step = SoftNBCEFusion(tau=0.1, beta=0.0, rho=1.0)(torch.log(probs))
    assert int(step.scores.argmax()) == 0
    assert int(step.evidence[:, 0].argmax()) == 0


def test_pcw_and_nbce_pass_their_top_p_on():
    """rho reaches the parent rule (a mutant found by ``make mutate`` dropped PCW's)."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3)) * 3
    for rule in (PCWFusion, NBCEFusion):
        assert rule(rho=0.5).rho == 0.5
        assert not torch.equal(rule(rho=0.5)(logits).scores, rule(rho=0.99)(logits).scores)
