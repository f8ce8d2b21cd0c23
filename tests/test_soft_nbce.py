"""Soft-NBCE, hard NBCE and PCW: the fusion rule against a hand-written reference, its two limits,
the handling of top-p-filtered tokens, and the one-chunk invariant against plain greedy decoding."""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations.engine.core.streams import TokenSampler
from ctx_integrations.engine.modes.soft_nbce import (
    FILTERED_LOGPROB,
    NBCEFusion,
    PCWFusion,
    SoftNBCEFusion,
    nucleus_mask,
    split_documents,
    truncated_entropy,
)
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import greedy_reference

WORDS = "river town market water city house school road field light tree hill stone wind rain".split()


def random_logits(seed: int, streams: int = 5, vocab: int = 64, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(streams, vocab, generator=generator) * scale


def reference_fusion(logits: torch.Tensor, tau: float, beta: float, rho: float) -> list[float]:
    """Soft-NBCE written out token by token with Python floats, from the rule's documented definition."""
    rows = [[float(x) for x in torch.log_softmax(row.double(), -1)] for row in logits]
    nuclei = []
    for row in rows:
        kept, mass = set(), 0.0
        for v in sorted(range(len(row)), key=lambda i: -row[i]):
            if mass >= rho and rho < 1:
                break
            kept.add(v)
            mass += math.exp(row[v])
        nuclei.append(kept)
    prior, chunks = rows[0], rows[1:]
    entropies = [-sum(math.exp(row[v]) * row[v] for v in nuclei[k + 1]) for k, row in enumerate(chunks)]
    exps = [math.exp(-h / tau) for h in entropies]
    weights = [e / sum(exps) for e in exps]
    fused = []
    for v in range(len(prior)):
        if not any(v in nuclei[k + 1] for k in range(len(chunks))):
            fused.append(-math.inf)
            continue
        total = 0.0
        for k, row in enumerate(chunks):
            own = row[v] if v in nuclei[k + 1] else FILTERED_LOGPROB
            total += weights[k] * ((1 + beta) * own - beta * prior[v] if v in nuclei[0] else own)
        fused.append(total)
    return fused


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("tau", "beta", "rho"), [(0.1, 0.25, 0.9), (1.0, 0.5, 0.6), (5.0, 0.0, 1.0)])
def test_fused_scores_equal_hand_written_reference(seed, tau, beta, rho):
    logits = random_logits(seed, streams=4, vocab=24)
    expected = torch.tensor(reference_fusion(logits, tau, beta, rho), dtype=torch.float32)
    fused = SoftNBCEFusion(tau=tau, beta=beta, rho=rho)(logits).scores
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(fused), finite)
    torch.testing.assert_close(fused[finite], expected[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_tau_to_zero_is_hard_nbce(seed):
    logits = random_logits(seed, streams=6, vocab=500)
    hard = NBCEFusion(beta=0.25, rho=0.9)(logits)
    soft = SoftNBCEFusion(tau=1e-7, beta=0.25, rho=0.9)(logits)
    torch.testing.assert_close(soft.scores, hard.scores)
    torch.testing.assert_close(soft.evidence, hard.evidence)
    # and hard NBCE really follows the lowest-entropy chunk: on its nucleus, its scores are that chunk's alone
    logprobs = torch.log_softmax(logits, -1)
    keep = nucleus_mask(logprobs, 0.9)
    best = 1 + int(truncated_entropy(logprobs[1:], keep[1:]).argmin())
    alone = SoftNBCEFusion(beta=0.25, rho=0.9)(logits[[0, best]])
    torch.testing.assert_close(hard.scores[keep[best]], alone.scores[keep[best]])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [1e7, math.inf])
def test_tau_to_infinity_is_pcw(seed, tau):
    logits = random_logits(seed, streams=6, vocab=500)
    uniform = PCWFusion(beta=0.25, rho=0.9)(logits)
    soft = SoftNBCEFusion(tau=tau, beta=0.25, rho=0.9)(logits)
    torch.testing.assert_close(soft.scores, uniform.scores)
    torch.testing.assert_close(soft.evidence, uniform.evidence)


def test_limits_are_not_the_same_rule():
    """Guards the two limit tests against a rule that ignores tau."""
    logits = random_logits(0, streams=6, vocab=500)
    assert not torch.allclose(NBCEFusion()(logits).scores, PCWFusion()(logits).scores)


@pytest.mark.parametrize("rule", [SoftNBCEFusion(), NBCEFusion(), PCWFusion()], ids=["soft", "nbce", "pcw"])
def test_filtered_tokens_never_poison_the_sum(rule):
    vocab = 50
    logits = random_logits(3, streams=4, vocab=vocab, scale=1.0)
    logits[1, :] = -1e4
    logits[1, 7] = 30.0  # a chunk certain of one token: every other token is filtered there
    logits[2, 10:] = -math.inf  # a model that masks part of its vocabulary
    logits[0, :] = 0.0
    logits[0, 3] = 50.0  # a prior whose nucleus is one token
    step = rule(logits)
    assert not torch.isnan(step.scores).any() and not torch.isnan(step.evidence).any()
    logprobs = torch.log_softmax(logits, -1)
    union = nucleus_mask(logprobs[1:], rule.rho).any(0)
    assert torch.equal(torch.isfinite(step.scores), union)  # support = union of the chunks' nuclei, never empty
    assert union.any()
    token = TokenSampler(temperature=1.0, seed=0)(step.scores)
    assert bool(union[token])
    assert bool(union[int(step.scores.argmax())])


def test_nucleus_keeps_top_token_and_reaches_mass():
    logprobs = torch.log_softmax(random_logits(1, streams=3, vocab=100), -1)
    for rho in (1e-6, 0.5, 0.9, 1.0):
        keep = nucleus_mask(logprobs, rho)
        assert keep.gather(1, logprobs.argmax(1, keepdim=True)).all()
        assert (logprobs.exp() * keep).sum(1).ge(min(rho, 1.0) - 1e-5).all()
    assert nucleus_mask(logprobs, 1e-6).sum(1).eq(1).all()


@pytest.mark.parametrize("bad", [dict(tau=0.0), dict(tau=-1.0), dict(tau=math.nan), dict(beta=-0.1),
                                 dict(beta=math.inf), dict(rho=0.0), dict(rho=1.5)])
def test_invalid_rule_options(bad):
    with pytest.raises(InvalidOptionError):
        SoftNBCEFusion(**bad)


@pytest.mark.parametrize("mode", ["soft_nbce", "nbce", "pcw"])
def test_one_chunk_with_beta_zero_is_greedy_decoding(tiny_engine, mode):
    document = "The river town market sells water. The secret code is 48213. " * 3
    question = "What is the secret code?"
    answer = tiny_engine.generate(question, [document], mode=mode, beta=0.0, max_new_tokens=12)
    layout = tiny_engine.layout
    prompt = layout.prefix_ids + layout.context_ids(document) + layout.suffix_ids(question)
    assert answer.token_ids == greedy_reference(tiny_engine.loaded, prompt, 12)
    assert all(step.document == 0 for step in answer.trace)
    assert answer.extra["n_chunks"] == 1


def test_long_document_is_chunked_and_trace_names_source_documents(tiny_engine):
    long_doc = " ".join(WORDS[i % len(WORDS)] for i in range(300))
    short_doc = "The secret code is 48213."
    answer = tiny_engine.generate("What is the secret code?", [short_doc, long_doc], mode="soft_nbce",
                                  chunk_tokens=64, max_new_tokens=6)
    sources = answer.extra["chunk_documents"]
    assert sources[0] == 0 and set(sources[1:]) == {1} and len(sources) >= 5
    assert len(answer.extra["trace_chunks"]) == len(answer.trace)
    for step, chunk in zip(answer.trace, answer.extra["trace_chunks"]):
        assert step.document == sources[chunk]
    assert answer.cache_misses == len(sources)
    again = tiny_engine.generate("What is the secret code?", [short_doc, long_doc], mode="soft_nbce",
                                 chunk_tokens=64, max_new_tokens=6)
    assert again.cache_hits == len(sources) and again.token_ids == answer.token_ids


def test_chunk_size_is_clamped_to_the_window():
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded

    engine = Engine(tiny_loaded("llama", max_position_embeddings=256))
    long_doc = " ".join(WORDS[i % len(WORDS)] for i in range(1000))  # far beyond the 256-position window
    answer = engine.generate("What is the code?", [long_doc], mode="nbce", max_new_tokens=4)
    assert answer.extra["chunk_tokens"] < 256 and answer.extra["n_chunks"] >= 4


def test_document_order_does_not_change_soft_nbce(tiny_engine):
    docs = ["The secret code is 48213.", "The market opens at nine.", "Rain fell on the stone bridge."]
    first = tiny_engine.generate("What is the secret code?", docs, mode="soft_nbce", max_new_tokens=8)
    second = tiny_engine.generate("What is the secret code?", docs[::-1], mode="soft_nbce", max_new_tokens=8)
    assert first.token_ids == second.token_ids


def test_split_documents(tiny_engine):
    tokenizer = tiny_engine.loaded.tokenizer
    text = " ".join(WORDS * 4)
    chunks = split_documents(tokenizer, ["short one", text], 10)
    assert chunks[0].text == "short one" and chunks[0].document == 0
    assert all(c.document == 1 for c in chunks[1:])
    assert all(len(tokenizer(c.text, add_special_tokens=False)["input_ids"]) <= 11 for c in chunks[1:])
    assert "".join(c.text for c in chunks[1:]) == text
    with pytest.raises(InvalidOptionError):
        split_documents(tokenizer, [text], 0)
    with pytest.raises(InvalidOptionError):
        tiny_engine.generate("q?", [text], mode="pcw", chunk_tokens=-5, max_new_tokens=2)
