"""Retrieval priors: a document's relevance score r_k turned into the log-prior a fusion rule adds to its expert.

The PCED paper adds ``gamma * log r_k`` with r mapped to [0, 1] (appendix B); that is ``prior="paper"``.
A dense retriever's cosines land in a narrow band, though: mapped by (s + 1) / 2 the eight passages
retrieved for a question typically span r = 0.65 to 0.85, so ``gamma * log r`` separates the first
and the eighth by a fraction of a nat, while a contextual expert's confident wrong name beats the
right expert's token by several. The paper's cross-encoder scores span more; a MiniLM cosine does not.
The other priors are ours (named variants, docs/methods.md#pced), calibrated per query over the
retrieved set, so that the ranking, not the absolute cosine, is what the rule sees:

- ``"softmax"``: log softmax_k(r_k / tau). For the max rule only differences between experts matter, so
  this is gamma / tau times r_k: a temperature on the score gaps (gaps of 0.1 in r become 0.1 / tau nats
  before gamma). A retriever that is unsure (equal scores) gives equal priors.
- ``"rank"``: -log(rank_k), rank 1 for the best score (ties share the better rank): a Zipf prior that
  ignores the gap sizes, so the k-th document is always gamma log k behind the first.
- ``"minmax"``: log(floor + (1 - floor) (r_k - min r) / (max r - min r)): the best document 0, the
  worst ``log floor``; all equal when all scores are.

Every prior depends only on the scores, not on the documents' order, and a larger score never gets a
smaller prior (the tests in tests/test_priors.py hold each rule to both).

:func:`likelihood_prior` adds what the model itself says of each document: the question's log-likelihood given
the document, log p(q | d_k), as UPR (Sachan et al., 2022, "Improving Passage Retrieval with Zero-Shot Question
Generation") reranks passages with it. PCED's expert streams compute it anyway while they prefill the question
after each cached document (``query_likelihood`` in :mod:`~ctx_integrations.engine.modes.pced`), and so do
Soft-NBCE's chunk streams (:mod:`~ctx_integrations.engine.modes.soft_nbce`); ours, not the papers'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ctx_integrations.engine.core.validation import choice, real_number
from ctx_integrations.engine.modes.specs import DEFAULT_FLOOR as DEFAULT_FLOOR
from ctx_integrations.engine.modes.specs import DEFAULT_PRIOR as DEFAULT_PRIOR
from ctx_integrations.engine.modes.specs import DEFAULT_TAU as DEFAULT_TAU
from ctx_integrations.engine.modes.specs import MAX_PRIOR_TAU, MAX_QUERY_LIKELIHOOD, MIN_PRIOR_TAU, PRIORS
from ctx_integrations.errors import InvalidOptionError

TINY = torch.finfo(torch.float32).tiny


def check_prior(prior: str, tau: float = DEFAULT_TAU, floor: float = DEFAULT_FLOOR) -> None:
    choice("prior", prior, PRIORS)
    real_number("prior_tau", tau, minimum=MIN_PRIOR_TAU, maximum=MAX_PRIOR_TAU,
                hint=" (softmax prior's temperature, in units of r)")
    real_number("prior_floor", floor, minimum=0.0, maximum=1.0, min_inclusive=False,
                hint=" (minmax prior's value for the lowest-scored document)")


def log_prior(relevance: Sequence[float] | torch.Tensor, prior: str = "paper", *, tau: float = DEFAULT_TAU,
              floor: float = DEFAULT_FLOOR) -> torch.Tensor:
    """The log-prior of each document ([K] float32, every entry <= 0) from its relevance r_k in [0, 1]."""
    check_prior(prior, tau, floor)
    r = torch.as_tensor(relevance, dtype=torch.float32).reshape(-1)
    if r.numel() == 0:
        raise InvalidOptionError("a retrieval prior needs at least one document score")
    if not bool(torch.isfinite(r).all()):
        raise InvalidOptionError(f"document scores must be finite numbers, got {r.tolist()}")
    if prior == "paper":
        return torch.log(r.clamp_min(TINY))
    if prior == "softmax":
        return torch.log_softmax(r / tau, 0)
    if prior == "rank":
        better = (r.unsqueeze(0) > r.unsqueeze(1)).sum(1)  # how many documents score strictly higher
        return -torch.log1p(better.float())
    spread = r.max() - r.min()
    if spread <= 0:
        return torch.zeros_like(r)
    return torch.log(floor + (1 - floor) * (r - r.min()) / spread)


def check_query_likelihood(weight: float, prior: str = "softmax") -> None:
    """The weight of the question's log-likelihood in a prior (0: off); it is added to the softmax prior's scaled
    scores, so any other ``prior`` is refused rather than silently given a softmax."""
    real_number("query_likelihood", weight, minimum=0.0, maximum=MAX_QUERY_LIKELIHOOD,
                hint=" (weight of log p(question | document) in the softmax prior; 0: off)")
    if weight > 0 and prior != "softmax":
        raise InvalidOptionError(f"query_likelihood={weight} needs prior='softmax' (it is added to the softmax "
                                 f"prior's scaled scores), got prior={prior!r}")


def likelihood_prior(relevance: torch.Tensor, likelihood: torch.Tensor, *, tau: float = DEFAULT_TAU,
                     weight: float) -> torch.Tensor:
    """log softmax_k(r_k / tau + weight * log p(q | d_k)): the softmax prior with the question's log-likelihood given
    each document (nats, summed over the question's tokens) added to the scaled score, on ``likelihood``'s device.

    One nat of likelihood counts as ``weight * tau`` of r: with tau = 0.05 and weight = 0.2, a document the model
    finds the question 10 nats likelier after gains what 0.1 in r gives. ``weight = 0`` is the softmax prior.
    """
    r = relevance.to(device=likelihood.device, dtype=torch.float32)
    return torch.log_softmax(r / tau + weight * likelihood.float(), 0)
