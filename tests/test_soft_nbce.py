"""Soft-NBCE, hard NBCE and PCW: the fusion rule against a hand-written reference, its two limits,
the handling of top-p-filtered tokens, and the one-chunk invariant against plain greedy decoding."""

from __future__ import annotations

import math

import pytest
import torch

from ctx_integrations.engine.core.decoding import TokenSampler
from ctx_integrations.engine.core.registry import mode_options
from ctx_integrations.engine.modes.soft_nbce import (
    FILTERED_LOGPROB,
    RULES,
    NBCEFusion,
    PCWFusion,
    SoftNBCEFusion,
    chunk_sum,
    contrast_chunks,
    nucleus_entropy,
    nucleus_logprobs,
    nucleus_mask,
    paper_fusion,
    split_documents,
    truncated_entropy,
)
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import greedy_reference

WORDS = "river town market water city house school road field light tree hill stone wind rain".split()


def random_logits(seed: int, streams: int = 5, vocab: int = 64, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(streams, vocab, generator=generator) * scale


def reference_nuclei(rows: list[list[float]], rho: float) -> list[set[int]]:
    nuclei = []
    for row in rows:
        kept, mass = set(), 0.0
        for v in sorted(range(len(row)), key=lambda i: -row[i]):
            if mass >= rho and rho < 1:
                break
            kept.add(v)
            mass += math.exp(row[v])
        nuclei.append(kept)
    return nuclei


def reference_paper(logits: torch.Tensor, tau: float, beta: float, rho: float, hard: bool = False) -> list[float]:
    """Algorithm 1 of the Soft-NBCE paper, written out token by token with Python floats (float64) from its text:
    top-p mask L_k (-inf outside), P_k = softmax(L_k), H_k = -sum P_k log P_k, w = softmax(-H / tau),
    fused = sum_k w_k ((1 + beta) L_k - beta L_prior) with the prior unfiltered. Raw logits are used
    (as in the paper), so the result equals the rule's log-prob based scores up to one constant."""
    rows = [[float(x) for x in row.double()] for row in logits]
    probs_rows = [[math.exp(x - max(row)) / sum(math.exp(y - max(row)) for y in row) for x in row] for row in rows]
    nuclei = reference_nuclei([[math.log(p) if p > 0 else -math.inf for p in row] for row in probs_rows], rho)
    prior, chunks = rows[0], rows[1:]
    entropies = []
    for k, row in enumerate(chunks):
        kept = nuclei[k + 1]
        top = max(row[v] for v in kept)
        z = sum(math.exp(row[v] - top) for v in kept)
        p = {v: math.exp(row[v] - top) / z for v in kept}
        entropies.append(-sum(q * math.log(q) for q in p.values() if q > 0))
    if hard:
        best = min(range(len(chunks)), key=lambda k: entropies[k])
        weights = [1.0 if k == best else 0.0 for k in range(len(chunks))]
    else:
        exps = [math.exp(-(h - min(entropies)) / tau) for h in entropies]
        weights = [e / sum(exps) for e in exps]
    fused = []
    for v in range(len(prior)):
        if any(w > 0 and v not in nuclei[k + 1] for k, w in enumerate(weights)):
            fused.append(-math.inf)
            continue
        fused.append(sum(w * ((1 + beta) * chunks[k][v] - beta * prior[v]) for k, w in enumerate(weights) if w > 0))
    return fused


def reference_nbce_code(logits: torch.Tensor, tau: float, beta: float, rho: float) -> list[float]:
    """The ``nbce_code`` variant written out token by token with Python floats, from its documented definition."""
    rows = [[float(x) for x in torch.log_softmax(row.double(), -1)] for row in logits]
    nuclei = reference_nuclei(rows, rho)
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


def assert_same_up_to_constant(fused: torch.Tensor, expected: list[float]) -> None:
    """Equal support and equal scores up to one additive constant (softmax is blind to it)."""
    expected = torch.tensor(expected, dtype=torch.float64)
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(fused), finite)
    assert finite.any()
    shift = (fused.double()[finite] - expected[finite]).mean()
    torch.testing.assert_close(fused.double()[finite] - shift, expected[finite], rtol=1e-5, atol=1e-4)


def agreeing_logits(seed: int, streams: int = 4, vocab: int = 24) -> torch.Tensor:
    """Random logits whose chunks all put token 0 first, so every nucleus holds it (the paper's support,
    the intersection of the nuclei, is not empty) and most also hold token 1 and more."""
    logits = random_logits(seed, streams=streams, vocab=vocab, scale=1.5)
    top = logits[1:, 2:].max(1).values
    logits[1:, 1] = top + 1.0 + logits[1:, 1].abs() / 2
    logits[1:, 0] = logits[1:, 1] + 1.0
    return logits


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("tau", "beta", "rho"), [(0.1, 0.25, 0.9), (1.0, 0.5, 0.6), (5.0, 0.0, 1.0),
                                                  (0.3, 0.25, 0.98)])
def test_paper_rule_equals_algorithm_1(seed, tau, beta, rho):
    logits = agreeing_logits(seed)
    fused = SoftNBCEFusion(tau=tau, beta=beta, rho=rho)(logits).scores  # rule="paper" is the default
    assert_same_up_to_constant(fused, reference_paper(logits, tau, beta, rho))


def test_paper_entropy_is_renormalised_and_picks_another_chunk_than_nbce_code():
    """Chunk A: one token at p = 0.5 (nucleus {0} at rho 0.09: renormalised H = 0, truncated 0.35).
    Chunk B: two tokens at p = 0.05 (nucleus {1, 2}: renormalised H = log 2, truncated 0.30).
    The paper's entropy prefers A, NBCE's truncated one prefers B."""
    vocab = 64
    a = torch.full((vocab,), 0.5 / (vocab - 1))
    a[0] = 0.5
    b = torch.full((vocab,), 0.9 / (vocab - 3))
    b[1:3] = 0.05
    logits = torch.stack([torch.zeros(vocab), a.log(), b.log()])
    logprobs = torch.log_softmax(logits, -1)
    keep = nucleus_mask(logprobs, 0.09)
    assert keep[1].sum() == 1 and keep[2].sum() == 2
    entropy = nucleus_entropy(nucleus_logprobs(logprobs[1:], keep[1:]))
    torch.testing.assert_close(entropy, torch.tensor([0.0, math.log(2)]))
    assert int(NBCEFusion(rho=0.09)(logits).scores.argmax()) == 0
    assert int(NBCEFusion(rho=0.09, rule="nbce_code")(logits).scores.argmax()) in (1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_paper_rule_hard_and_uniform_limits_equal_algorithm_1(seed):
    logits = agreeing_logits(seed, streams=5)
    assert_same_up_to_constant(NBCEFusion(beta=0.25, rho=0.9)(logits).scores,
                               reference_paper(logits, 1.0, 0.25, 0.9, hard=True))
    assert_same_up_to_constant(PCWFusion(rho=0.9)(logits).scores, reference_paper(logits, math.inf, 0.0, 0.9))


def test_paper_rule_prior_is_unfiltered():
    """The prior's contrast applies on every token, also outside the prior's own nucleus (the variant drops it)."""
    logits = torch.zeros(3, 6)
    logits[1:, :3] = torch.tensor([[5.0, 4.9, 4.8], [5.0, 4.8, 4.9]])
    logits[0, 5] = 20.0  # the prior's nucleus is token 5 alone, outside both chunks' nuclei
    logits[0, 1] = -3.0
    beta = 0.5
    fused = SoftNBCEFusion(beta=beta, rho=0.9)(logits).scores
    assert_same_up_to_constant(fused, reference_paper(logits, 0.1, beta, 0.9))
    without_prior = SoftNBCEFusion(beta=0.0, rho=0.9)(logits).scores
    # token 1, the one the prior dislikes most, gains beta * 3 nats more than token 0 from the contrast
    gain = (fused[1] - fused[0]) - (1 + beta) * (without_prior[1] - without_prior[0])
    assert float(gain) == pytest.approx(beta * 3.0, abs=1e-4)


def test_paper_rule_when_the_nuclei_share_no_token():
    """The open case: the paper's support is empty. Documented rule: chunks by increasing entropy, a chunk
    whose nucleus shares nothing with the support so far is left out; the most confident is always taken."""
    logits = torch.full((4, 8), -5.0)
    logits[0] = 0.0
    logits[1, 0] = 10.0  # chunk 1: certain of token 0 (the lowest entropy, the heaviest)
    logits[2, 1] = 6.0
    logits[2, 0] = 6.0  # chunk 2: tokens 0 and 1, shares token 0 with chunk 1
    logits[3, 5] = 8.0  # chunk 3: token 5 only, shares nothing
    rule = SoftNBCEFusion(tau=1.0, beta=0.25, rho=0.9)
    step = rule(logits)
    assert not torch.isnan(step.scores).any() and not torch.isnan(step.evidence).any()
    assert torch.isfinite(step.scores).tolist() == [True] + [False] * 7
    # chunk 3 dropped: the result is Algorithm 1 over the prior and chunks 1 and 2 alone, with their weights
    # renormalised, which the reference gives when fed those rows with the same entropies
    assert_same_up_to_constant(step.scores, reference_paper(logits[[0, 1, 2]], 1.0, 0.25, 0.9))
    # every chunk disjoint from the heaviest: the heaviest chunk alone (hard NBCE's choice)
    logits[2, 0] = -5.0
    alone = rule(logits)
    assert torch.isfinite(alone.scores).tolist() == [True] + [False] * 7
    assert int(alone.scores.argmax()) == 0


def test_paper_rule_zero_weight_chunk_neither_contributes_nor_restricts():
    logits = torch.full((3, 8), -5.0)
    logits[0] = 0.0
    logits[1, 0] = 30.0  # entropy ~0
    logits[2, 1:5] = 3.0  # entropy ~log 4, weight exp(-1.4 / 1e-3) = 0 exactly
    step = SoftNBCEFusion(tau=1e-3, beta=0.25, rho=0.9)(logits)
    assert not torch.isnan(step.scores).any()
    assert torch.isfinite(step.scores).tolist() == [True] + [False] * 7


def test_prior_minus_infinity_never_gives_nan_or_plus_infinity():
    logits = random_logits(2, streams=3, vocab=12)
    logits[0, 4:] = -math.inf  # a model masking part of its vocabulary, prior included
    logits[1:, 4:] = -math.inf
    for rule in RULES:
        step = SoftNBCEFusion(rule=rule)(logits)
        assert not torch.isnan(step.scores).any() and not (step.scores == math.inf).any()
        assert not torch.isfinite(step.scores[4:]).any()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("tau", "beta", "rho"), [(0.1, 0.25, 0.9), (1.0, 0.5, 0.6), (5.0, 0.0, 1.0)])
def test_nbce_code_variant_equals_hand_written_reference(seed, tau, beta, rho):
    logits = random_logits(seed, streams=4, vocab=24)
    expected = torch.tensor(reference_nbce_code(logits, tau, beta, rho), dtype=torch.float32)
    fused = SoftNBCEFusion(tau=tau, beta=beta, rho=rho, rule="nbce_code")(logits).scores
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(fused), finite)
    torch.testing.assert_close(fused[finite], expected[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", range(6))
def test_tau_to_zero_is_hard_nbce(seed, rule):
    logits = random_logits(seed, streams=6, vocab=500)
    hard = NBCEFusion(beta=0.25, rho=0.9, rule=rule)(logits)
    soft = SoftNBCEFusion(tau=1e-7, beta=0.25, rho=0.9, rule=rule)(logits)
    torch.testing.assert_close(soft.scores, hard.scores)
    torch.testing.assert_close(soft.evidence, hard.evidence)
    # and hard NBCE really follows the lowest-entropy chunk: on its nucleus, its scores are that chunk's alone
    logprobs = torch.log_softmax(logits, -1)
    keep = nucleus_mask(logprobs, 0.9)
    if rule == "paper":
        entropy = nucleus_entropy(nucleus_logprobs(logprobs[1:], keep[1:]))
    else:
        entropy = truncated_entropy(logprobs[1:], keep[1:])
    best = 1 + int(entropy.argmin())
    alone = SoftNBCEFusion(beta=0.25, rho=0.9, rule=rule)(logits[[0, best]])
    torch.testing.assert_close(hard.scores[keep[best]], alone.scores[keep[best]])
    if rule == "paper":  # and nothing outside it
        assert torch.equal(torch.isfinite(hard.scores), keep[best])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [1e7, math.inf])
def test_tau_to_infinity_is_pcw(seed, tau, rule):
    logits = random_logits(seed, streams=6, vocab=500)
    uniform = PCWFusion(beta=0.25, rho=0.9, rule=rule)(logits)
    soft = SoftNBCEFusion(tau=tau, beta=0.25, rho=0.9, rule=rule)(logits)
    torch.testing.assert_close(soft.scores, uniform.scores)
    torch.testing.assert_close(soft.evidence, uniform.evidence)


@pytest.mark.parametrize("rule", RULES)
def test_limits_are_not_the_same_rule(rule):
    """Guards the two limit tests against a rule that ignores tau."""
    logits = random_logits(0, streams=6, vocab=500)
    hard, uniform = NBCEFusion(rule=rule)(logits).scores, PCWFusion(beta=0.25, rule=rule)(logits).scores
    assert not torch.equal(torch.isfinite(hard), torch.isfinite(uniform)) or not torch.allclose(hard, uniform)


def test_pcw_defaults_to_beta_zero():
    assert PCWFusion().beta == 0.0
    assert mode_options("pcw")["beta"] == 0.0


@pytest.mark.parametrize("rule", [SoftNBCEFusion(rule="nbce_code"), NBCEFusion(rule="nbce_code"),
                                  PCWFusion(rule="nbce_code")], ids=["soft", "nbce", "pcw"])
def test_nbce_code_filtered_tokens_never_poison_the_sum(rule):
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


@pytest.mark.parametrize("rule", [SoftNBCEFusion(), NBCEFusion(), PCWFusion()], ids=["soft", "nbce", "pcw"])
def test_paper_filtered_tokens_never_poison_the_sum(rule):
    """The same hostile step under the paper's rule: no NaN, a non-empty support inside the heaviest
    chunk's nucleus, and sampled and argmax tokens inside it."""
    logits = random_logits(3, streams=4, vocab=50, scale=1.0)
    logits[1, :] = -1e4
    logits[1, 7] = 30.0
    logits[2, 10:] = -math.inf
    logits[0, :] = 0.0
    logits[0, 3] = 50.0
    step = rule(logits)
    assert not torch.isnan(step.scores).any() and not torch.isnan(step.evidence).any()
    support = torch.isfinite(step.scores)
    assert support.any()
    keep = nucleus_mask(torch.log_softmax(logits, -1)[1:], rule.rho)
    assert not (support & ~keep.any(0)).any()  # never a token outside every chunk's nucleus
    token = TokenSampler(temperature=1.0, seed=0)(step.scores)
    assert bool(support[token]) and bool(support[int(step.scores.argmax())])


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
    with pytest.raises(InvalidOptionError, match="nbce_code"):
        SoftNBCEFusion(rule="nbce")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
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


def test_the_nucleus_stops_where_the_mass_before_a_token_reaches_rho_exactly():
    # Probabilities exact in binary: the mass before the third-ranked token is exactly 0.75, so at rho = 0.75
    # the nucleus is {1, 3} (the smallest head whose mass reaches rho).
    logprobs = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25]))  # sorted: 1, 3, then 0 and 2
    assert nucleus_mask(logprobs, 0.75).tolist() == [False, True, False, True]
    assert nucleus_mask(logprobs, 0.5).tolist() == [False, True, False, False]
    assert nucleus_mask(logprobs, 1.0).all()


def test_the_rules_work_along_the_last_axis_of_any_batch_shape():
    # Distillation passes [batch, positions, V] tensors; each [V] row must get what it gets alone.
    logprobs = torch.log_softmax(torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)) * 2, -1)
    keep = nucleus_mask(logprobs, 0.8)
    rows, row_keeps = logprobs.reshape(6, 7), keep.reshape(6, 7)
    assert torch.equal(row_keeps, torch.stack([nucleus_mask(r, 0.8) for r in rows]))
    assert not row_keeps.all() and row_keeps.any(-1).all()  # the nuclei really cut something
    masked = nucleus_logprobs(logprobs, keep)
    torch.testing.assert_close(masked.reshape(6, 7), torch.stack([nucleus_logprobs(r, k) for r, k in
                                                                   zip(rows, row_keeps)]))
    entropy = nucleus_entropy(masked)
    assert entropy.shape == (2, 3)
    torch.testing.assert_close(entropy.reshape(6), torch.stack([nucleus_entropy(r) for r in masked.reshape(6, 7)]))
    truncated = truncated_entropy(logprobs, keep)
    assert truncated.shape == (2, 3)
    torch.testing.assert_close(truncated.reshape(6), torch.stack([truncated_entropy(r, k) for r, k in
                                                                  zip(rows, row_keeps)]))


def test_a_chunk_left_out_of_the_support_gives_its_weight_to_the_others():
    # Chunk 2's nucleus shares no token with chunks 0 and 1 (all finite on tokens 0-2): it is left out and the
    # weights 0.5 and 0.3 are renormalised to 0.625 and 0.375 over the shared support.
    inf = math.inf
    scores = torch.tensor([[-1.0, -2.0, -3.0, -inf], [-2.0, -1.0, -inf, -inf], [-inf, -inf, -inf, -0.5]])
    fused = paper_fusion(torch.tensor([0.5, 0.3, 0.2]), scores, entropy=torch.tensor([0.1, 0.2, 0.3]))
    expected = [0.625 * -1.0 + 0.375 * -2.0, 0.625 * -2.0 + 0.375 * -1.0, -inf, -inf]
    assert fused.tolist() == pytest.approx(expected)


def committed_paper_fusion(weights: torch.Tensor, scores: torch.Tensor, entropy: torch.Tensor,
                           pairwise: bool = True) -> torch.Tensor:
    """:func:`paper_fusion` as it was written first, a Python loop over the chunks that reads each step's order,
    weights and overlaps back to the host: the reference the on-device rule must equal bit for bit. Its two sums
    over the chunks are taken in :func:`chunk_sum`'s order (the rule's since it batches requests of several chunk
    counts); ``pairwise=False``: in torch's, as first written."""
    finite = torch.isfinite(scores)
    support = torch.ones_like(scores[0], dtype=torch.bool)
    used = torch.zeros_like(weights, dtype=torch.bool)
    for k in torch.argsort(entropy, stable=True).tolist():
        if weights[k] > 0 and bool((support & finite[k]).any()):
            support &= finite[k]
            used[k] = True
    total = (lambda x: chunk_sum(x, 0).squeeze(0)) if pairwise else (lambda x: x.sum(0))
    kept = torch.where(used, weights, torch.zeros_like(weights))
    kept = (kept / total(kept)).unsqueeze(1)
    terms = torch.where(used.unsqueeze(1) & support, kept * scores, torch.zeros_like(scores))
    return torch.where(support, total(terms), torch.full_like(scores[0], -math.inf))


def fusion_case(seed: int, chunks: int | None = None, vocab: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random weights, scores and order for :func:`paper_fusion`, with its edge cases drawn often: small nuclei in a
    small vocabulary (nuclei that share no token with the support so far), weights exactly 0 (the heaviest chunk's
    too), ties in the order (entropies from a few values), one chunk, every chunk disjoint."""
    generator = torch.Generator().manual_seed(seed)
    chunks = chunks or int(torch.randint(1, 7, (1,), generator=generator))
    vocab = vocab or int(torch.randint(2, 9, (1,), generator=generator))
    scores = torch.randn(chunks, vocab, generator=generator) * 2 - 3
    density = float(torch.rand(1, generator=generator)) * 0.8 + 0.1
    inside = torch.rand(chunks, vocab, generator=generator) < density
    inside[torch.arange(chunks), torch.randint(0, vocab, (chunks,), generator=generator)] = True  # no empty nucleus
    if seed % 7 == 0:  # every chunk on a token of its own
        inside = torch.zeros_like(inside)
        inside[torch.arange(chunks), torch.arange(chunks) % vocab] = True
    scores = torch.where(inside, scores, torch.full_like(scores, -math.inf))
    weights = torch.softmax(torch.randn(chunks, generator=generator) * 3, 0)
    weights = torch.where(torch.rand(chunks, generator=generator) < 0.3, torch.zeros_like(weights), weights)
    entropy = torch.randint(0, 3, (chunks,), generator=generator).float() / 2
    return weights, scores, entropy


@pytest.mark.parametrize("seed", range(300))
def test_paper_fusion_equals_its_committed_loop_bit_for_bit(seed):
    weights, scores, entropy = fusion_case(seed)
    fused = paper_fusion(weights, scores, entropy)
    assert torch.equal(fused, committed_paper_fusion(weights, scores, entropy))
    first = committed_paper_fusion(weights, scores, entropy, pairwise=False)  # other sums: the last bit may move
    assert torch.equal(torch.isfinite(fused), torch.isfinite(first))
    torch.testing.assert_close(fused, first, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 9, 17])
def test_chunk_sum_gives_a_request_the_same_bits_whatever_zeros_pad_it(size):
    values = torch.randn(3, size, 7, generator=torch.Generator().manual_seed(size)) * 10
    values[0, 0, 0] = -0.0  # a sum of -0.0 alone stays -0.0 (the padding is -0.0, the identity of +)
    values[0, 1:, 0] = -0.0
    alone = chunk_sum(values, 1)
    assert alone.shape == (3, 1, 7)
    torch.testing.assert_close(alone.squeeze(1), values.sum(1), rtol=1e-6, atol=1e-5)
    assert str(alone[0, 0, 0].item()) == "-0.0"
    for width in range(size, 40):
        padded = torch.cat([values, torch.full((3, width - size, 7), -0.0)], 1)
        assert torch.equal(chunk_sum(padded, 1).view(torch.int32), alone.view(torch.int32)), width
    assert torch.equal(chunk_sum(values.transpose(1, 2), -1), alone.transpose(1, 2))


def test_paper_fusion_cases_cover_the_documented_edge_cases():
    """The random cases above really hold what the docstring's rule is about: nuclei that share no token, weights
    exactly 0 (the first chunk in the order's too), ties in the order, a chunk left out of the support."""
    cases = [fusion_case(seed) for seed in range(300)]
    disjoint = zero = zero_first = tie = left_out = 0
    for weights, scores, entropy in cases:
        finite = torch.isfinite(scores)
        disjoint += not bool(finite[weights > 0].all(0).any())
        zero += bool((weights == 0).any())
        zero_first += bool(weights[torch.argsort(entropy, stable=True)[0]] == 0)
        tie += len(set(entropy.tolist())) < len(entropy)
        fused = paper_fusion(weights, scores, entropy)
        left_out += bool((torch.isfinite(fused) & ~finite[weights > 0].all(0)).any())
    assert min(disjoint, zero, zero_first, tie, left_out) >= 20, (disjoint, zero, zero_first, tie, left_out)


def test_paper_fusion_over_a_batch_is_each_row_alone():
    cases = [fusion_case(seed, chunks=4, vocab=6) for seed in range(40)]
    weights, scores, entropy = (torch.stack(parts) for parts in zip(*cases, strict=True))
    fused = paper_fusion(weights, scores, entropy)
    for row, case in zip(fused, cases, strict=True):
        assert torch.equal(row, committed_paper_fusion(*case))


def test_defaults_are_the_papers_settings():
    # Soft-NBCE: tau = 0.1, beta = 0.25, top-p 0.9, Algorithm 1; hard NBCE keeps NBCE's beta; PCW is the uniform
    # average without the prior's contrast (beta = 0).
    soft, hard, pcw = SoftNBCEFusion(), NBCEFusion(), PCWFusion()
    assert (soft.tau, soft.beta, soft.rho, soft.rule) == (0.1, 0.25, 0.9, "paper")
    assert (hard.beta, hard.rho, hard.rule) == (0.25, 0.9, "paper")
    assert (pcw.beta, pcw.rho, pcw.rule) == (0.0, 0.9, "paper")
    assert pcw.chunk_weights(torch.tensor([0.1, 2.0, 5.0])).tolist() == pytest.approx([1 / 3] * 3)


def test_chunk_weights_are_the_softmax_of_the_routing_logits():
    entropy = torch.tensor([0.3, 1.2, 0.05, 2.0])
    logs = [-0.2, -1.5, -3.0, 0.0]
    routed = SoftNBCEFusion(tau=0.7, gamma=0.5, log_prior=logs).chunk_weights(entropy)
    torch.testing.assert_close(routed, torch.softmax(-entropy / 0.7 + 0.5 * torch.tensor(logs), 0))
    torch.testing.assert_close(SoftNBCEFusion(tau=0.7).chunk_weights(entropy), torch.softmax(-entropy / 0.7, 0))
    assert NBCEFusion().chunk_weights(entropy).tolist() == [0, 0, 1, 0]
    assert PCWFusion().chunk_weights(entropy).tolist() == [0.25] * 4


def test_with_a_prior_the_support_is_built_in_the_order_of_the_weights():
    """Chunk 1 is sure of token 5 (entropy 0) but its document ranked low; chunk 2 spreads over tokens 10-13 (entropy
    log 4) from the top document: their nuclei share no token. By entropy chunk 1 comes first and chunk 2 is left
    out; with the prior (gamma 0.5, tau 1) chunk 2's routing logit is the larger (-1.39 against -5), so it comes
    first and chunk 1 is left out."""
    logits = torch.full((3, 16), -8.0)
    logits[0] = 0.0
    logits[1, 5] = 12.0
    logits[2, 10:14] = 4.0
    paper = SoftNBCEFusion(tau=1.0)(logits).scores
    routed = SoftNBCEFusion(tau=1.0, gamma=0.5, log_prior=[-10.0, 0.0])(logits).scores
    assert torch.isfinite(paper).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(routed).nonzero().flatten().tolist() == [10, 11, 12, 13]


@pytest.mark.parametrize("rule", RULES)
def test_one_chunk_at_rho_one_is_the_contrast_with_the_python_floats_bit_for_bit(rule):
    """One chunk has weight 1 and every token: the scores are (1 + beta) L_chunk - beta L_prior, with 1 + beta
    computed in Python as the formula reads (for beta = 0.18, 1 + float32(0.18) rounds to another float32)."""
    logits = random_logits(5, streams=2, vocab=30)
    logprobs = torch.log_softmax(logits, -1)
    if rule == "paper":  # the chunk renormalised over its nucleus (all of it), the prior as it is
        chunk, prior = nucleus_logprobs(logprobs[1], torch.ones(30, dtype=torch.bool)), logprobs[0]
    else:
        chunk, prior = logprobs[1], logprobs[0].clamp_min(FILTERED_LOGPROB)
    expected = (1 + 0.18) * chunk - 0.18 * prior
    step = SoftNBCEFusion(beta=0.18, rho=1.0, rule=rule)(logits)
    assert torch.equal(step.scores.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(step.evidence[0].view(torch.int32), expected.view(torch.int32))  # log 1 + S


def test_contrast_chunks_takes_a_float_beta_as_distillation_passes_it():
    logprobs = torch.log_softmax(random_logits(6, streams=3, vocab=20), -1)
    keep = nucleus_mask(logprobs, 0.7)
    assert not keep.all()
    kept = torch.where(keep[1:], logprobs[1:], torch.full_like(logprobs[1:], FILTERED_LOGPROB))
    expected = torch.where(keep[0], (1 + 0.18) * kept - 0.18 * logprobs[0].clamp_min(FILTERED_LOGPROB), kept)
    assert torch.equal(contrast_chunks(logprobs[0], logprobs[1:], keep[0], keep[1:], 0.18), expected)
    as_knobs = contrast_chunks(logprobs[0], logprobs[1:], keep[0], keep[1:], torch.tensor(0.18), torch.tensor(1 + 0.18))
    assert torch.equal(as_knobs, expected)


def test_knob_errors_name_the_knob_and_say_what_it_means():
    with pytest.raises(InvalidOptionError,
                       match=r"^tau must be in \[1e-09, inf\], got 0.0 \(math.inf = uniform average; mode='nbce' is "
                             r"the tau -> 0 limit\)$"):
        SoftNBCEFusion(tau=0)
    with pytest.raises(InvalidOptionError, match=r"^beta must be in \[0, 100\], got -1.0$"):
        SoftNBCEFusion(beta=-1)
    with pytest.raises(InvalidOptionError, match=r"^rho must be in \(0, 1\], got 0.0 \(each chunk's top-p\)$"):
        SoftNBCEFusion(rho=0)
    with pytest.raises(InvalidOptionError, match=r"^rule must be one of 'paper', 'nbce_code' \('paper': Algorithm 1 "
                                                 r"of the Soft-NBCE paper; 'nbce_code': NBCE's reference code\), "
                                                 r"got 'x'$"):
        SoftNBCEFusion(rule="x")
    with pytest.raises(InvalidOptionError, match=r"^Soft-NBCE needs the prior stream plus at least one chunk stream$"):
        SoftNBCEFusion()(torch.zeros(1, 5))
    for gamma in (-1, 101):
        with pytest.raises(InvalidOptionError, match=rf"^gamma must be in \[0, 100\], got {float(gamma)} \(weight of "
                                                     r"the retrieval prior; 0: none\)$"):
            SoftNBCEFusion(gamma=gamma, log_prior=[0.0])
    with pytest.raises(InvalidOptionError, match=r"^gamma > 0 needs each chunk's log-prior \(log_prior=\.\.\.\)$"):
        SoftNBCEFusion(gamma=0.5)
