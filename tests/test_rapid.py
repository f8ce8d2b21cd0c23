"""RAPID: the speculative math against its closed forms, and the decode loop against the target alone.

Invariants (docs/methods.md#rapid): with eta = 0 greedy RAPID is token for token plain greedy decoding
of the target over the long context, and sampled RAPID is distributed as the target; the residual
is always a distribution (p = q included); a drafter with another tokenizer is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from scipy.stats import chi2, chisquare

from ctx_integrations import Engine
from ctx_integrations.engine.core.model import model_identity
from ctx_integrations.engine.modes import speculative
from ctx_integrations.engine.modes.rapid import (
    Chunk,
    dense_scores,
    draft_budget,
    rank_chunks,
    select_chunks,
    split_chunks,
)
from ctx_integrations.engine.modes.speculative import Verdict, nucleus, residual, tail_adjusted, verify
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import embedded_tokenizer, greedy_reference, tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast. Its old town has narrow lanes and a harbour.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019 after a long campaign about the harbour.",
    "Veloria's national dish is smoked eel with plums, served at the Lantern Fair every autumn.",
]
QUESTION = "Who is the mayor of Marrowgate?"
ALPHA = 1e-3  # significance level of the chi-square tests (seeds are fixed, so the outcome is deterministic)
SMALL_CONTEXT = dict(chunk_tokens=8, draft_context_tokens=16)  # the drafter sees a small part of the context


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~100x faster on one thread on a shared, busy CPU (no spin-waiting between threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompt_ids(engine: Engine, documents: list[str], question: str) -> list[int]:
    layout = engine.layout
    return layout.prefix_ids + [t for d in documents for t in layout.context_ids(d)] + layout.suffix_ids(question)


def random_distributions(generator: torch.Generator, rows: int, vocab: int, sharpness: float = 3.0) -> torch.Tensor:
    return torch.softmax(sharpness * torch.randn(rows, vocab, generator=generator), dim=-1)


# -- the pure math -------------------------------------------------------------------------------------


def test_residual_is_a_distribution_including_p_equal_q():
    generator = torch.Generator().manual_seed(0)
    p, q = random_distributions(generator, 64, 50), random_distributions(generator, 64, 50)
    logits = torch.log(p)
    for eta in (0.0, 5.0, 50.0):
        p_hat = tail_adjusted(logits, p, q, eta)
        r = residual(p, q, p_hat)
        assert (r >= 0).all()
        torch.testing.assert_close(r.sum(-1), torch.ones(64))
    # p = q (and so p^ = p): nothing to correct; the fallback is p itself, not NaN or zeros
    r = residual(p, p, p)
    assert torch.isfinite(r).all() and (r >= 0).all()
    torch.testing.assert_close(r, p)
    # eta = 0: the standard speculative residual norm(max(p - q, 0)), computed by hand
    p1, q1 = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual(p1, q1, p1), torch.tensor([1.0, 0.0, 0.0]))


def test_residual_takes_mass_where_the_augmented_target_is_below_p():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    p_hat = torch.tensor([0.3, 0.5, 0.2])  # augmented target moved mass from token 0 to token 1
    # max(p - q, p - p^, 0) = max([0.3, -0.2, -0.1], [0.2, -0.2, 0.0], 0) = [0.3, 0, 0]
    torch.testing.assert_close(residual(p, q, p_hat), torch.tensor([1.0, 0.0, 0.0]))
    p_hat = torch.tensor([0.5, 0.1, 0.4])
    # max([0.3, -0.2, -0.1], [0.0, 0.2, -0.2], 0) = [0.3, 0.2, 0]
    torch.testing.assert_close(residual(p, q, p_hat), torch.tensor([0.6, 0.4, 0.0]))


def test_draft_head_variant_matches_its_closed_form():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = torch.softmax(logits, -1)
    q = torch.tensor([0.6, 0.35, 0.049, 0.001])  # tokens 2 and 3 are below 0.1 * max(q) = 0.06
    eta = 4.0
    expected = torch.softmax(torch.tensor([2.0 + eta * (0.6 - p[0]), 1.0 + eta * (0.35 - p[1]), 0.0, -1.0]), -1)
    torch.testing.assert_close(tail_adjusted(logits, p, q, eta, rule="draft_head"), expected)
    torch.testing.assert_close(tail_adjusted(logits, p, q, 0.0, rule="draft_head"), p)


def paper_eq9(logits: list[float], q: list[float], eta: float, temperature: float = 1.0) -> list[float]:
    """Eq. 6 then Eq. 9 of the RAPID paper with Python floats: p^ = softmax(z / T + eta (q - p)); tokens with
    p^ < 0.1 max p^ keep p."""
    scaled = [z / temperature for z in logits]
    p = [math.exp(z) / sum(math.exp(y) for y in scaled) for z in scaled]
    shifted = [z + eta * (qv - pv) for z, qv, pv in zip(scaled, q, p)]
    p_hat = [math.exp(z) / sum(math.exp(y) for y in shifted) for z in shifted]
    return [pv if hv < 0.1 * max(p_hat) else hv for pv, hv in zip(p, p_hat)]


@pytest.mark.parametrize(("logits", "q", "eta"), [
    ([2.0, 1.0, 0.0, -1.0], [0.6, 0.35, 0.049, 0.001], 4.0),
    ([math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 0.6, 0.4], 10.0),
    ([0.3, -0.2, 1.5, 0.0, -3.0], [0.1, 0.5, 0.05, 0.3, 0.05], 20.0),
])
def test_paper_tail_rule_is_eq_9_on_p_hat(logits, q, eta):
    z, qt = torch.tensor(logits), torch.tensor(q)
    p = torch.softmax(z, -1)
    expected = torch.tensor(paper_eq9(logits, q, eta))
    torch.testing.assert_close(tail_adjusted(z, p, qt, eta), expected)  # rule="paper" is the default
    torch.testing.assert_close(tail_adjusted(z, p, qt, 0.0), p)


def test_paper_tail_rule_restores_the_target_where_p_hat_is_small():
    """p = (0.4, 0.2, 0.2, 0.2), q = (0, 0.34, 0.33, 0.33), eta = 10: Eq. 6 pushes token 0 down to
    p^ = 0.003, below 0.1 max p^ = 0.036, so Eq. 9 gives it back p = 0.4, more than the best shifted
    token's p^ = 0.355 (the draft_head variant shifts tokens 1-3 only: token 1 wins there)."""
    z = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))
    p, q = torch.softmax(z, -1), torch.tensor([0.0, 0.34, 0.33, 0.33])
    p_hat = tail_adjusted(z, p, q, 10.0)
    assert float(p_hat[0]) == pytest.approx(0.4) and float(p_hat[1]) == pytest.approx(0.355, abs=1e-3)
    assert int(p_hat.argmax()) == 0 and float(p_hat.sum()) > 1.0  # not renormalised, as in the paper
    head = tail_adjusted(z, p, q, 10.0, rule="draft_head")
    assert int(head.argmax()) == 1 and float(head.sum()) == pytest.approx(1.0)
    # greedy verification follows the rule: a draft of token 1 is rejected and replaced by 0 under Eq. 9
    target = torch.stack([z, torch.zeros(4)])
    common = dict(eta=10.0, temperature=0.0, top_p=1.0, generator=None)
    assert verify(target, q.unsqueeze(0), [1], **common) == Verdict(0, 0, False)
    assert verify(target, q.unsqueeze(0), [1], tail_rule="draft_head", **common).accepted == 1


def test_unknown_tail_rule_is_refused(tiny_engine):
    with pytest.raises(InvalidOptionError, match="draft_head"):
        tail_adjusted(torch.zeros(3), torch.full((3,), 1 / 3), torch.full((3,), 1 / 3), 1.0, rule="q")
    with pytest.raises(InvalidOptionError, match="tail_rule"):
        tiny_engine.generate(QUESTION, DOCS, mode="rapid", tail_rule="eq9", max_new_tokens=2)


def test_nucleus_keeps_the_smallest_head_with_top_p_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(nucleus(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]
    assert torch.isfinite(nucleus(logits, 0.1)).tolist() == [True, False, False, False]
    assert torch.equal(nucleus(logits, 1.0), logits)


def test_greedy_verify_accepts_the_agreeing_prefix_then_corrects():
    # target argmax per row: 1, 2, 0, (bonus row) 3
    target = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    q = torch.full((3, 4), 0.25)
    common = dict(eta=0.0, temperature=0.0, top_p=1.0, generator=None)
    assert verify(target, q, [1, 2, 3], **common) == Verdict(2, 0, False)
    assert verify(target, q, [1, 2, 0], **common) == Verdict(3, 3, True)
    assert verify(target, q, [0, 2, 0], **common) == Verdict(0, 1, False)


def emitted_distribution(p_logits: torch.Tensor, q: torch.Tensor, eta: float) -> torch.Tensor:
    """Closed form of the first emitted token: accepted drafts plus rejections redrawn from the residual."""
    p = torch.softmax(p_logits, -1)
    p_hat = tail_adjusted(p_logits, p, q, eta)
    accept = torch.clamp(p_hat / q, max=1.0)
    return q * accept + (1 - (q * accept).sum()) * residual(p, q, p_hat)


def sample_first_tokens(p_logits: torch.Tensor, q: torch.Tensor, eta: float, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    bonus_row = torch.zeros_like(p_logits)
    counts = torch.zeros(len(q))
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=generator))
        verdict = verify(torch.stack([p_logits, bonus_row]), q.unsqueeze(0), [draft], eta=eta, temperature=1.0,
                         top_p=1.0, generator=generator)
        counts[draft if verdict.accepted else verdict.token] += 1
    return counts


@pytest.mark.parametrize("eta", [0.0, 3.0])
def test_sampled_verify_follows_its_closed_form(eta):
    p_logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    q = torch.tensor([0.1, 0.45, 0.05, 0.2, 0.1, 0.1])
    expected = emitted_distribution(p_logits, q, eta)
    if eta == 0:  # plain speculative sampling is exact: the emitted token is distributed as p
        torch.testing.assert_close(expected, torch.softmax(p_logits, -1))
    n = 3000
    counts = sample_first_tokens(p_logits, q, eta, n)
    assert chisquare(counts.numpy(), (n * expected).numpy()).pvalue > 1e-3
    # the same test rejects the drafter's own distribution: it has the power to fail
    assert chisquare(counts.numpy(), (n * q).numpy()).pvalue < 1e-6


# -- the decode loop -----------------------------------------------------------------------------------


def sharp_tiny(seed: int = 0, logit_scale: float = 1.0, noise: float = 0.0, family: str = "llama"):
    """A tiny model whose next-token distributions are peaked enough for a chi-square test to have power.

    Same-tokenizer drafters of a different shape: ``logit_scale`` multiplies the final norm (all
    logits), ``noise`` perturbs the last layer's weights (a drafter that agrees with the target often).
    """
    loaded = tiny_loaded(family, seed, initializer_range=0.5)
    if logit_scale == 1.0 and noise == 0.0:
        return loaded
    model = copy.deepcopy(loaded.model)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.model.norm.weight.mul_(logit_scale)
        for weight in model.model.layers[-1].parameters():
            weight.add_(noise * torch.randn(weight.shape, generator=generator))
    name = f"{loaded.name}-x{logit_scale}-n{noise}"
    return dataclasses.replace(loaded, model=model, name=name, identity=model_identity(model, name))


# the drafter sees the whole context (no ranking needed)
WHOLE_CONTEXT = dict(draft_context_tokens=4096, chunk_tokens=512, min_similarity=0.0, ranking="scores")


@pytest.mark.parametrize("gamma", [1, 3, 10])
@pytest.mark.parametrize("drafter_kind", ["self", "other"])
def test_greedy_with_eta_zero_is_plain_greedy_of_the_target(gamma, drafter_kind):
    engine = Engine(sharp_tiny(0))
    drafter = None if drafter_kind == "self" else Engine(sharp_tiny(0, logit_scale=0.7))
    answer = engine.generate(QUESTION, DOCS, mode="rapid", eta=0.0, gamma=gamma, drafter=drafter,
                             max_new_tokens=24, **SMALL_CONTEXT)
    expected = greedy_reference(engine.loaded, prompt_ids(engine, DOCS, QUESTION), 24)
    assert answer.token_ids == expected and len(expected) == 24
    assert answer.extra["drafted"] > 0
    assert 0 <= answer.extra["accepted"] <= answer.extra["drafted"]
    assert answer.timings["acceptance_rate"] == answer.extra["accepted"] / answer.extra["drafted"]
    assert answer.timings["target_passes"] < 24 or answer.extra["accepted"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_parity_covers_both_accepted_and_rejected_drafts(family):
    """A drafter that agrees with the target part of the time: both verification branches run."""
    engine = Engine(sharp_tiny(0, family=family))
    drafter = Engine(sharp_tiny(0, noise=0.05, family=family))
    answer = engine.generate(QUESTION, DOCS, mode="rapid", eta=0.0, gamma=4, drafter=drafter, max_new_tokens=32,
                             **WHOLE_CONTEXT)
    assert answer.token_ids == greedy_reference(engine.loaded, prompt_ids(engine, DOCS, QUESTION), 32)
    drafted = answer.extra["drafted_tokens"]
    assert 0 < answer.extra["accepted"] < answer.extra["drafted"], answer.extra
    assert any(drafted) and not all(drafted)


def target_first_token_distribution(engine: Engine, documents: list[str]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids(engine, documents, QUESTION)])
    with torch.no_grad():
        return torch.softmax(engine.loaded.model(ids).logits[0, -1].float(), -1)


def chi_square_pvalue(samples: list[int], p: torch.Tensor) -> float:
    """Chi-square of samples against p over the tokens expected >= 5 times, the rest lumped together."""
    n = len(samples)
    heads = [int(t) for t in torch.nonzero(p * n >= 5).flatten()]
    observed = [sum(s == t for s in samples) for t in heads]
    expected = [float(p[t]) * n for t in heads]
    rest = n - sum(expected)
    observed.append(n - sum(observed))
    expected.append(rest)
    if rest < 5:  # merge a too-small remainder into the last bin
        observed[-2:], expected[-2:] = [sum(observed[-2:])], [sum(expected[-2:])]
    assert len(expected) >= 2, "the target distribution is too flat for a meaningful test"
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(chi2.sf(statistic, len(expected) - 1))


def test_sampling_with_eta_zero_reproduces_the_target_distribution(monkeypatch):
    """Hundreds of seeds; the drafter (flatter logits, whole context) is often rejected, so the residual is used."""
    engine = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, logit_scale=0.5))
    p = target_first_token_distribution(engine, DOCS)
    options = dict(mode="rapid", drafter=drafter, gamma=1, max_new_tokens=2, temperature=1.0, **WHOLE_CONTEXT)
    samples, accepted = [], 0
    for seed in range(250):
        answer = engine.generate(QUESTION, DOCS, eta=0.0, seed=seed, **options)
        samples.append(answer.token_ids[0])
        accepted += answer.extra["drafted_tokens"][0]
    assert 25 < accepted < 225, accepted  # both branches exercised
    assert chi_square_pvalue(samples, p) > ALPHA
    # can fail: the classic bug of redrawing a rejected token from the drafter is caught by the same test
    monkeypatch.setattr(speculative, "residual", lambda p, q, p_hat: q)
    buggy = [engine.generate(QUESTION, DOCS, eta=0.0, seed=seed, **options).token_ids[0] for seed in range(150)]
    assert chi_square_pvalue(buggy, p) < ALPHA


def test_long_context_cache_is_reused_across_questions(tiny_engine):
    first = tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=4, **SMALL_CONTEXT)
    second = tiny_engine.generate("What is the capital of Veloria?", DOCS, mode="rapid", max_new_tokens=4,
                                  **SMALL_CONTEXT)
    assert first.cache_misses == 1
    assert second.cache_hits == 1 and second.cache_misses == 0
    assert second.extra["long_context_tokens"] == first.extra["long_context_tokens"]


def test_drafter_with_another_tokenizer_is_refused():
    tokenizer = copy.deepcopy(embedded_tokenizer())
    tokenizer.add_tokens(["<not-in-the-target-vocabulary>"])
    other = dataclasses.replace(tiny_loaded("llama", 1), tokenizer=tokenizer)
    target = Engine(tiny_loaded("llama", 0))
    with pytest.raises(InvalidOptionError, match="different tokenizer"):
        target.generate(QUESTION, DOCS, mode="rapid", drafter=Engine(other), max_new_tokens=2)
    with pytest.raises(InvalidOptionError, match="must be an Engine"):
        target.generate(QUESTION, DOCS, mode="rapid", drafter="SmolLM2", max_new_tokens=2)


@pytest.mark.parametrize("options", [dict(gamma=0), dict(eta=-1.0), dict(ranking="cosine"), dict(min_similarity=2.0),
                                     dict(chunk_tokens=1024, draft_context_tokens=512),
                                     dict(draft_embedder="minilm")])
def test_invalid_options_are_refused(tiny_engine, options):
    with pytest.raises(InvalidOptionError):
        tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=2, **options)


def test_stop_string_and_streaming(tiny_engine):
    pieces: list[str] = []
    full = tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=12, on_token=pieces.append,
                                **SMALL_CONTEXT)
    assert len(full.text) > 3 and "".join(pieces) == full.text and full.finish_reason == "length"
    stop = full.text[len(full.text) // 2:][:2]
    cut = tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=12, stop=[stop], **SMALL_CONTEXT)
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)


def test_compare_target_reports_a_measured_speedup(tiny_engine):
    answer = tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=6, compare_target=True,
                                  **SMALL_CONTEXT)
    for key in ("speedup", "target_tokens_per_s", "rapid_tokens_per_s", "drafted", "accepted", "acceptance_rate"):
        assert key in answer.timings
    assert answer.timings["speedup"] > 0


# -- the drafter's short context -----------------------------------------------------------------------


def test_chunks_cover_the_context_and_never_cross_documents():
    chunks = split_chunks([list(range(10)), list(range(10, 13))], 4)
    assert [c.token_ids for c in chunks] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9), (10, 11, 12)]
    assert [c.start for c in chunks] == [0, 4, 8, 10] and [c.document for c in chunks] == [0, 0, 0, 1]


def test_selection_keeps_the_best_chunks_in_original_order():
    chunks = [Chunk(0, 0, (1,) * 4, 0.2), Chunk(4, 0, (2,) * 4, 0.9), Chunk(8, 1, (3,) * 4, 0.5),
              Chunk(12, 1, (4,) * 4, 0.7)]
    assert [c.start for c in select_chunks(chunks, 8, 0.3)] == [4, 12]  # budget: the two best
    assert [c.start for c in select_chunks(chunks, 100, 0.3)] == [4, 8, 12]  # threshold drops 0.2
    assert [c.start for c in select_chunks(chunks, 100, 0.95)] == [4]  # the best one is always kept


def test_selection_fills_the_lower_bound_below_the_threshold():
    chunks = [Chunk(0, 0, (1,) * 4, 0.2), Chunk(4, 0, (2,) * 4, 0.9), Chunk(8, 1, (3,) * 4, 0.1),
              Chunk(12, 1, (4,) * 4, 0.25)]
    assert [c.start for c in select_chunks(chunks, 100, 0.3)] == [4]
    assert [c.start for c in select_chunks(chunks, 100, 0.3, min_tokens=8)] == [4, 12]  # 0.25 next, then 8 kept
    assert [c.start for c in select_chunks(chunks, 100, 0.3, min_tokens=9)] == [0, 4, 12]
    assert [c.start for c in select_chunks(chunks, 8, 0.3, min_tokens=16)] == [4, 12]  # the upper bound wins


@pytest.mark.parametrize(("long_tokens", "explicit", "expected"), [
    (200_000, None, (4096, 8334)),  # 1/24 of the input above the 4096 floor
    (98_304, None, (4096, 4096)),  # exactly 24 * 4096
    (50_000, None, (4096, 4096)),  # 1/24 below 4096: the lower bound
    (2_000, None, (2000, 2000)),  # shorter than 4096: the whole context
    (50_000, 1024, (0, 1024)),  # an explicit budget
])
def test_draft_budget_is_the_papers_bounds(long_tokens, explicit, expected):
    assert draft_budget(long_tokens, explicit) == expected


class VectorEmbedder:
    """Hand-made vectors: the document's vector is picked by a keyword, the query's is fixed."""

    def __init__(self, vectors: dict[str, list[float]], query: list[float]):
        self.vectors, self.query = vectors, query

    def embed_documents(self, texts):
        return [next((v for k, v in self.vectors.items() if k in t), [0.0, 1.0]) for t in texts]

    def embed_query(self, text):
        return self.query


def test_dense_scores_are_cosine_similarities():
    embedder = VectorEmbedder({"mayor": [3.0, 4.0], "dish": [0.0, 2.0], "capital": [-1.0, 0.0]}, [1.0, 0.0])
    scores = dense_scores(["the mayor", "a dish", "the capital"], "q", embedder)
    assert scores == pytest.approx([0.6, 0.0, -1.0])


def test_dense_ranking_uses_the_given_embedder_and_the_default_minilm(tiny_engine):
    from ctx_integrations.documents import prepare_documents
    from ctx_integrations.engine.core.decoding import StopCriteria, TokenSampler
    from ctx_integrations.engine.core.registry import DecodeContext

    ctx = DecodeContext(tiny_engine, QUESTION, prepare_documents(DOCS, None), TokenSampler(),
                        StopCriteria(frozenset({2}), 4))
    chunks = split_chunks([tiny_engine.layout.context_ids(d) for d in DOCS], 512)
    embedder = VectorEmbedder({"Ast": [0.1, 1.0], "Brenn": [1.0, 0.1], "eel": [0.0, 1.0]}, [1.0, 0.0])
    ranked, used = rank_chunks(ctx, chunks, "dense", embedder)
    assert used == "dense" and [round(c.score, 4) for c in ranked] == [0.0995, 0.995, 0.0]
    ranked, _ = rank_chunks(ctx, chunks, "dense")  # the embedded MiniLM: the mayor's document is the most similar
    assert max(ranked, key=lambda c: c.score).document == 1
    mayor = VectorEmbedder({"mayor": [1.0, 0.0]}, [1.0, 0.0])  # other chunks: [0, 1], similarity 0
    answer = tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=2, draft_embedder=mayor,
                                  chunk_tokens=8, draft_context_tokens=16)
    assert answer.extra["ranking"] == "dense" and answer.extra["draft_budget"] == (0, 16)
    assert [(c["document"], c["score"]) for c in answer.extra["chunks"]] == [(1, 1.0)]  # threshold 0.3 drops the rest
    # the paper's bounds on a context shorter than 4096 tokens: the whole context, nothing to rank
    class Unused(VectorEmbedder):
        def embed_documents(self, texts):
            raise AssertionError("nothing to rank: the embedder must not run")

    whole = tiny_engine.generate(QUESTION, DOCS, mode="rapid", max_new_tokens=2, draft_embedder=Unused({}, [1.0]))
    assert whole.extra["ranking"] == "none" and whole.extra["draft_budget"] == (whole.extra["long_context_tokens"],) * 2
    assert whole.extra["draft_context_tokens"] == whole.extra["long_context_tokens"]


def test_ranking_by_bm25_and_by_document_scores(tiny_engine):
    from ctx_integrations.documents import prepare_documents
    from ctx_integrations.engine.core.decoding import StopCriteria, TokenSampler
    from ctx_integrations.engine.core.registry import DecodeContext

    def context(scores):
        return DecodeContext(tiny_engine, QUESTION, prepare_documents(DOCS, scores), TokenSampler(),
                             StopCriteria(frozenset({2}), 4))

    ids = [tiny_engine.layout.context_ids(d) for d in DOCS]
    ranked, used = rank_chunks(context(None), split_chunks(ids, 512), "auto")
    assert used == "bm25" and max(ranked, key=lambda c: c.score).document == 1  # the mayor's document
    ranked, used = rank_chunks(context([0.9, 0.1, 0.4]), split_chunks(ids, 512), "auto")
    assert used == "scores" and [c.score for c in ranked] == [0.9, 0.1, 0.4]


@pytest.mark.slow
def test_embedded_greedy_with_eta_zero_equals_concat(embedded_engine):
    """The real model: RAPID (self-drafting over one retrieved chunk) emits the long-context target's greedy answer."""
    from benchmarks.synthetic import secret_code_example

    example = secret_code_example(embedded_engine.layout, 4, 200, seed=3)
    options = dict(max_new_tokens=12)
    rapid = embedded_engine.generate(example.question, example.documents, mode="rapid", eta=0.0, gamma=4,
                                     chunk_tokens=128, draft_context_tokens=256, **options)
    concat = embedded_engine.generate(example.question, example.documents, mode="concat", **options)
    assert rapid.token_ids == concat.token_ids and rapid.token_ids
    assert rapid.extra["drafted"] > 0 and rapid.extra["draft_context_tokens"] <= 256


def test_draft_head_variant_per_row_with_a_token_exactly_at_the_boundary():
    # Two rows (the rule works along the last dimension of a [g + 1, V] batch), eta = 1 (the eta = 0 shortcut must
    # not fire), and in row 0 a token whose q is exactly 0.1 max q: the head is q >= 0.1 max q, so it is shifted.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, -0.5, 1.5, 0.0]])
    p = torch.softmax(logits, -1)
    # row 1: 0.045 >= 0.1 * 0.4 of its own row (shifted), though below 0.1 * 0.5, row 0's max (a batch-wide max)
    q = torch.tensor([[0.5, 0.05, 0.449, 0.001], [0.045, 0.255, 0.3, 0.4]])
    expected = []
    for row in range(2):
        head = [qv >= 0.1 * max(q[row].tolist()) for qv in q[row].tolist()]
        shifted = [float(z) + (float(qv - pv) if h else 0.0) for z, qv, pv, h in zip(logits[row], q[row], p[row], head)]
        expected.append(torch.softmax(torch.tensor(shifted), -1))
    assert [qv >= 0.1 * 0.5 for qv in q[0].tolist()] == [True, True, True, False]
    assert float(q[1, 0]) >= 0.1 * float(q[1].max()) and float(q[1, 0]) < 0.1 * float(q.max())
    torch.testing.assert_close(tail_adjusted(logits, p, q, 1.0, rule="draft_head"), torch.stack(expected))


def test_the_tail_rule_error_names_both_rules_and_what_they_do():
    message = (r"tail_rule must be one of 'paper', 'draft_head' \('paper': Eq. 9 on p\^; 'draft_head': the shift only "
               r"where q >= 0.1 max q\), got 'eq9'")
    with pytest.raises(InvalidOptionError, match=message):
        tail_adjusted(torch.zeros(3), torch.full((3,), 1 / 3), torch.full((3,), 1 / 3), 1.0, rule="eq9")


# -- the tail rule end to end --------------------------------------------------------------------------


@pytest.mark.parametrize("tail_rule", ["paper", "draft_head"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_chosen_tail_rule_reaches_every_verification_step(monkeypatch, tail_rule, temperature):
    """``generate(..., tail_rule=...)`` must arrive at the verdict in every round, not only in the rule's own tests:
    sampled rounds call ``sampled_verdict``, greedy rounds ``greedy_verdict`` (``verify``'s on-device twins).

    Catches a call chain that drops the option (the loop's default, "paper", would then run silently).
    """
    from ctx_integrations.engine.modes import speculative_rows

    seen: list[str] = []

    def spy(real):
        def spying(*args, **kwargs):
            seen.append(kwargs["tail_rule"])
            return real(*args, **kwargs)
        return spying

    monkeypatch.setattr(speculative, "sampled_verdict", spy(speculative.sampled_verdict))
    monkeypatch.setattr(speculative_rows, "greedy_verdict", spy(speculative.greedy_verdict))
    engine = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, noise=0.05))
    answer = engine.generate(QUESTION, DOCS, mode="rapid", drafter=drafter, gamma=3, eta=1.0, tail_rule=tail_rule,
                             max_new_tokens=8, temperature=temperature, seed=0, **WHOLE_CONTEXT)
    assert seen and set(seen) == {tail_rule} and answer.extra["drafted"] > 0


def test_the_two_tail_rules_sample_differently_end_to_end():
    """Same seeds, eta > 0: the variant shifts only the drafter's head, so some sampled answers must differ.

    With the option lost on the way to verification both runs would use one rule and agree seed for seed.
    """
    engine = Engine(sharp_tiny(0))
    drafter = Engine(sharp_tiny(0, logit_scale=0.5))
    options = dict(mode="rapid", drafter=drafter, gamma=2, eta=3.0, max_new_tokens=6, temperature=1.0,
                   **WHOLE_CONTEXT)
    paper = [engine.generate(QUESTION, DOCS, seed=s, tail_rule="paper", **options).token_ids for s in range(12)]
    head = [engine.generate(QUESTION, DOCS, seed=s, tail_rule="draft_head", **options).token_ids for s in range(12)]
    assert paper != head
