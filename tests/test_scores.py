"""Score normalisation and fusion against hand-computed values (docs/methods.md#scores)."""

from __future__ import annotations

import math

import pytest

from ctx_integrations import Document
from ctx_integrations.documents import prepare_documents
from ctx_integrations.errors import InvalidOptionError, InvalidScoresError
from ctx_integrations.retrieval.scores import (
    EPS,
    UPPER,
    fuse_scores,
    normalize,
    normalize_colbert,
    normalize_dense,
    normalize_reranker,
    normalize_sparse,
)


@pytest.mark.parametrize(("similarity", "expected"), [
    (0.5, 0.75), (0.0, 0.5), (-0.2, 0.4), (-1.0, 0.0), (-3.0, 0.0), (1.0, UPPER), (1.7, UPPER)])
def test_dense_is_affine_and_clipped(similarity, expected):
    assert normalize_dense(similarity) == pytest.approx(expected, abs=1e-15)
    assert normalize_colbert(similarity) == normalize_dense(similarity)


def test_upper_bound_keeps_log_finite():
    assert UPPER == 1.0 - 1e-8 and EPS == 1e-8
    assert normalize_dense(1.0) < 1.0 and math.isfinite(math.log(normalize_dense(-0.999)))


@pytest.mark.parametrize(("score", "expected"), [
    (0.0, 0.0), (-2.0, 0.0), (1.0, 0.5), (math.sqrt(3.0), 2.0 / 3.0), (1.0 / math.sqrt(3.0), 1.0 / 3.0),
    (1e12, UPPER), (math.inf, UPPER)])
def test_sparse_is_arctan_of_positive_part(score, expected):
    assert normalize_sparse(score) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("logit", "expected"), [
    (0.0, 0.5), (math.log(3.0), 0.75), (-math.log(3.0), 0.25), (1000.0, UPPER), (-1000.0, 0.0), (-math.inf, 0.0)])
def test_reranker_is_a_stable_sigmoid(logit, expected):
    assert normalize_reranker(logit) == pytest.approx(expected, abs=1e-12)


def test_fusion_hand_computed():
    assert fuse_scores(0.5) == 0.5
    assert fuse_scores(0.5, None) == 0.5
    assert fuse_scores(1.0) == UPPER
    assert fuse_scores(0.5, 0.5) == pytest.approx(0.5 / (1.0 + EPS), abs=1e-15)
    assert fuse_scores(0.75, 0.25) == pytest.approx(2 * 0.75 * 0.25 / (1.0 + EPS), abs=1e-15)  # 0.375
    assert fuse_scores(0.0, 0.9) == 0.0
    assert fuse_scores(0.0, 0.0) == 0.0  # eps keeps 0/0 away


@pytest.mark.parametrize(("a", "b"), [(0.1, 0.9), (0.3, 0.31), (0.99, 0.02), (0.6, 0.6)])
def test_fusion_is_a_symmetric_harmonic_mean(a, b):
    fused = fuse_scores(a, b)
    assert fused == pytest.approx(fuse_scores(b, a), abs=1e-15)
    assert min(a, b) - 1e-7 <= fused <= max(a, b)
    assert fused == pytest.approx(2.0 / (1.0 / a + 1.0 / b), rel=1e-6)


def test_dispatch_by_kind_and_unknown_kind():
    assert normalize("dense", 0.5) == 0.75
    assert normalize("colbert", -0.2) == pytest.approx(0.4)
    assert normalize("sparse", 1.0) == pytest.approx(0.5)
    assert normalize("reranker", 0.0) == 0.5
    with pytest.raises(InvalidOptionError, match="'bm42': use one of dense, colbert, sparse, reranker$"):
        normalize("bm42", 1.0)


@pytest.mark.parametrize(("rule", "kind"), [(normalize_dense, "dense"), (normalize_sparse, "sparse"),
                                          (normalize_reranker, "reranker"), (fuse_scores, "retrieval")])
def test_nan_is_refused_naming_the_score(rule, kind):
    with pytest.raises(InvalidScoresError, match=f"^{kind} score is NaN"):
        rule(float("nan"))


def test_nan_reranker_score_in_a_fusion_is_named():
    with pytest.raises(InvalidScoresError, match="^reranker score is NaN"):
        fuse_scores(0.5, float("nan"))


def test_normalised_scores_are_accepted_by_the_decoder_validation():
    raw = [-1.0, -0.3, 0.0, 0.4, 1.0, 5.0]
    docs = [Document(f"doc {i}", score=fuse_scores(normalize_dense(s), normalize_reranker(s)))
            for i, s in enumerate(raw)]
    docs.append(Document("sparse", score=normalize_sparse(1e9)))
    prepared = prepare_documents(docs)
    assert [d.score for d in prepared] == [d.score for d in docs]
    assert all(0.0 <= d.score < 1.0 for d in prepared)
