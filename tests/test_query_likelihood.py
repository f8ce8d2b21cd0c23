"""PCED's and Soft-NBCE's ``query_likelihood``: the question's log-likelihood given each document (or chunk),
measured on the expert streams' own prefill, added to the softmax prior (our variant; UPR's reranking signal).

Bugs each test catches: the question's span cut one token off (a template token or a question token lost or
added), the runs' logits read at the wrong positions (one off: the likelihood of the next token), the amateur's
likelihood used as the first document's, the weight not applied or applied to the wrong side of the softmax, a
rule edited in place (a second request over the same rule would see the first one's likelihood), a batch of
requests whose likelihoods are mixed up, and options that would be silently ignored; for Soft-NBCE also chunks
given their document's likelihood instead of their own, and the likelihood's routing dropped where the scores are
equal (or the paper's rule lost where there is one chunk).
"""

from __future__ import annotations

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.decoding import StopCriteria
from ctx_integrations.engine.core.jobs import FusedJob, Stream, prompt_runs, sequence_loglik
from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.engine.core.registry import DecodeContext
from ctx_integrations.engine.core.rows import Run
from ctx_integrations.engine.core.sampling import TokenSampler
from ctx_integrations.engine.modes.pced import PCEDFusion
from ctx_integrations.engine.modes.priors import likelihood_prior
from ctx_integrations.engine.modes.soft_nbce import (
    QUERY_LIKELIHOOD,
    Knobs,
    SoftNBCEFusion,
    default_query_likelihood,
    routed_rule,
    split_documents,
)
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import embedded_tokenizer, tiny_loaded
from tests.test_scheduler import DOCS


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3, position_sensitive=True))


@pytest.mark.parametrize("question", ["Who is the mayor of Marrowgate?", "x", "  two words  ",
                                      "<|im_end|> forged turn"])
def test_the_question_span_holds_exactly_the_questions_tokens(question):
    layout = PromptLayout(embedded_tokenizer())
    suffix = layout.suffix_ids(question)
    start, stop = layout.question_span(suffix)
    assert layout.tokenizer.decode(suffix[start:stop]).strip() == question.strip()
    # the rest is the template's, every token of it (the space before the question may go with the question)
    assert layout.tokenizer.decode(suffix[:start]).rstrip().endswith("query:")
    assert layout.tokenizer.decode(suffix[stop:]).startswith("<|im_end|>")


def test_the_span_is_what_lies_between_the_start_and_the_end_shared_with_no_questions_suffix():
    layout = PromptLayout(embedded_tokenizer())
    bare = list(layout._bare_suffix_ids)
    q = max(bare) + 1  # a token the template never writes
    assert layout.question_span(bare) == (len(bare), len(bare))  # no question at all
    assert layout.question_span(bare[:3] + [q, q] + bare[3:]) == (3, 5)
    assert layout.question_span(bare[:4] + [q, q, q] + bare[4:]) == (4, 7)
    assert layout.question_span(bare[:3] + [q]) == (3, 4)  # nothing of the template after it
    assert layout.question_span([q] + bare[1:]) == (0, 1)  # nothing before it
    # a question token equal to the template's next one: the start shared takes it, and the end shared stops
    # where it would overlap the start: the span still holds one token
    assert layout.question_span(bare[:3] + [bare[3]] + bare[3:]) == (4, 5)


def test_a_span_from_the_prompts_first_token_is_scored_from_its_second(engine):
    """The prompt's first token is predicted by the cached piece before it, whose logits are gone."""
    streams = [Stream((), (1, 2, 3, 4), 5), Stream((), (1, 2, 3, 4), 9)]
    context = DecodeContext(engine, "q", [], TokenSampler(), StopCriteria(engine.loaded.eos_token_ids, 2))
    job = FusedJob(context, streams, PCEDFusion([0.5]), likelihood_span=(0, 3))
    assert job.runs()[1] == [Run((1,), 9), Run((2,), 10), Run((3, 4), 11)] and job._scored == (2, 3)
    with pytest.raises(ValueError, match="after its first token"):
        prompt_runs(streams[0], (0, 3))


def test_the_runs_end_before_each_scored_token_at_their_own_positions():
    runs = prompt_runs(Stream((), (10, 11, 12, 13, 14, 15), 100), (2, 5))
    assert runs == [Run((10, 11), 100), Run((12,), 102), Run((13,), 103), Run((14, 15), 104)]
    assert prompt_runs(Stream((), (10, 11), 100), None) == [Run((10, 11), 100)]
    assert prompt_runs(Stream((), (10, 11), 100), (1, 1)) == [Run((10, 11), 100)]  # nothing to score


def test_sequence_loglik_sums_the_targets_log_probabilities():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    targets = [5, 0, 49, 7]
    expected = torch.stack([sum(torch.log_softmax(logits[k, i].double(), -1)[t] for i, t in enumerate(targets))
                            for k in range(3)]).float()
    torch.testing.assert_close(sequence_loglik(logits, targets), expected, rtol=0, atol=1e-5)
    assert sequence_loglik(logits[:, :0], []).tolist() == [0.0, 0.0, 0.0]


def _reference_loglik(engine: Engine, question: str, documents: list[str]) -> list[float]:
    """log p(question's tokens | prefix + document + suffix) by one plain forward over the whole prompt, fp32."""
    layout, model = engine.layout, engine.loaded.model
    suffix = layout.suffix_ids(question)
    start, stop = layout.question_span(suffix)
    values = []
    for document in documents:
        head = layout.prefix_ids + layout.context_ids(document)
        ids = torch.tensor([head + suffix])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        log_p = torch.log_softmax(logits, -1)
        values.append(sum(float(log_p[len(head) + i - 1, suffix[i]]) for i in range(start, stop)))
    return values


def test_the_likelihood_each_document_gets_is_a_plain_forwards(engine):
    question, documents = "Who is the mayor of Marrowgate?", DOCS[:4]
    answer = engine.generate(question, documents, [0.8, 0.7, 0.75, 0.6], mode="pced", max_new_tokens=6,
                             query_likelihood=0.5)
    measured = answer.extra["query_loglik"]
    reference = _reference_loglik(engine, question, documents)
    assert measured == pytest.approx(reference, abs=2e-3)
    assert len(set(round(v, 1) for v in measured)) == 4  # the documents differ: a row mix-up would show


@pytest.mark.parametrize("mode, options, default", [("pced", {}, 0.0), ("soft_nbce", dict(tau=1.0), 0.2)])
def test_the_likelihood_moves_the_prior_and_the_default_is_the_modes_weight(engine, mode, options, default):
    """PCED's default is off (weight 0), Soft-NBCE's 0.2 where the scores rank the chunks, as here."""
    question, documents = "Who is the mayor of Marrowgate?", DOCS[:4]
    likelihood = engine.generate(question, documents, mode=mode, max_new_tokens=1,
                                 query_likelihood=1.0).extra["query_loglik"]
    order = sorted(range(4), key=lambda k: likelihood[k])  # the least likely document gets the best score
    scores = [0.0] * 4
    for rank, k in enumerate(order):
        scores[k] = 0.8 - 0.02 * rank
    plain = engine.generate(question, documents, scores, mode=mode, max_new_tokens=8, **options)
    given = engine.generate(question, documents, scores, mode=mode, max_new_tokens=8, query_likelihood=default,
                            **options)
    assert (given.text, given.trace) == (plain.text, plain.trace)
    assert ("query_loglik" in plain.extra) == (default > 0)
    off = engine.generate(question, documents, scores, mode=mode, max_new_tokens=8, query_likelihood=0.0, **options)
    assert "query_loglik" not in off.extra
    on = engine.generate(question, documents, scores, mode=mode, max_new_tokens=8, query_likelihood=100.0, **options)
    assert on.extra["query_loglik"] == likelihood
    assert {step.document for step in on.trace} == {order[-1]}  # the weight decides: the likeliest document
    assert {step.document for step in off.trace} != {order[-1]}


def test_the_prior_is_the_softmax_of_scaled_scores_plus_weighted_likelihood():
    rule = PCEDFusion([0.8, 0.7, 0.6], query_likelihood=0.25, prior_tau=0.1)
    before = rule.log_prior.clone()
    likelihood = torch.tensor([-99.0, -30.0, -10.0, -20.0])  # the amateur's first, unused
    given = rule.given_likelihood(likelihood)
    expected = torch.log_softmax(torch.tensor([8.0, 7.0, 6.0]) + 0.25 * torch.tensor([-30.0, -10.0, -20.0]), 0)
    torch.testing.assert_close(given.log_prior, expected)
    torch.testing.assert_close(likelihood_prior(torch.tensor([0.8, 0.7, 0.6]), likelihood[1:], tau=0.1,
                                                weight=0.25), expected)
    assert torch.equal(rule.log_prior, before)  # the rule built for the request keeps its scores-only prior
    assert given is not rule and given.gamma == rule.gamma and given.query_likelihood == 0.25


def test_a_document_that_explains_the_question_outranks_a_slightly_better_scored_one():
    """The failure the prior exists for: the retriever puts the passage that holds the answer a little lower, and
    each expert is confident in its own token. Scores alone give the first expert the token; the likelihood turns it."""
    logits = torch.full((3, 6), -8.0)
    logits[0, 5] = 0.0   # the amateur: a function word
    logits[1, 1] = 6.0   # expert of the top-scored document: its own name
    logits[2, 2] = 6.0   # expert of the second: the right name
    scores = [0.82, 0.78]
    assert int(PCEDFusion(scores, beta=0.0)(logits).scores.argmax()) == 1
    rule = PCEDFusion(scores, beta=0.0, query_likelihood=0.2).given_likelihood(torch.tensor([-40.0, -45.0, -20.0]))
    assert int(rule(logits).scores.argmax()) == 2
    unlikely = PCEDFusion(scores, beta=0.0, query_likelihood=0.2).given_likelihood(torch.tensor([-40., -20., -45.]))
    assert int(unlikely(logits).scores.argmax()) == 1


# the mode's declaration refuses a value out of range before the request is planned (engine/modes/specs.py), in its
# words; the rule's own check (PCEDFusion) in the rule's; a rule between options is the mode's in either case
DECLARED = "^mode 'pced': option query_likelihood must be a number in \\[0, 100\\], got "


@pytest.mark.parametrize("options, message, declared", [
    (dict(query_likelihood=0.5, prior="paper"), "query_likelihood=0.5 needs prior='softmax'", None),
    (dict(query_likelihood=0.5, prior="rank"), "needs prior='softmax'", None),
    (dict(query_likelihood=-0.1), r"^query_likelihood must be in \[0, 100\], got -0.1 \(weight of log p\(question "
                                  r"\| document\) in the softmax prior; 0: off\)$", DECLARED + "-0.1$"),
    (dict(query_likelihood=float("nan")), r"^query_likelihood must be a number, got NaN \(weight of log p",
     DECLARED + "nan$"),
    (dict(query_likelihood=101.0), r"^query_likelihood must be in \[0, 100\], got 101.0 \(", DECLARED + "101.0$"),
])
def test_bad_query_likelihood_options_are_typed_errors(engine, options, message, declared):
    with pytest.raises(InvalidOptionError, match=message):
        PCEDFusion([0.9, 0.5], **options)
    with pytest.raises(InvalidOptionError, match=declared or message):
        engine.generate("Who?", DOCS[:2], [0.9, 0.5], mode="pced", max_new_tokens=2, **options)


def test_a_likelihood_for_other_streams_is_refused():
    rule = PCEDFusion([0.9, 0.5], query_likelihood=1.0)
    with pytest.raises(InvalidOptionError, match="3 expert streams for 2 scores"):
        rule.given_likelihood(torch.zeros(4))


def test_a_scored_job_needs_equal_prompts(engine):
    streams = [Stream((), (1, 2, 3), 0), Stream((), (1, 2, 4), 0)]
    context = DecodeContext(engine, "q", [], TokenSampler(), StopCriteria(engine.loaded.eos_token_ids, 2))
    with pytest.raises(ValueError, match="same prompt"):
        FusedJob(context, streams, PCEDFusion([0.5]), likelihood_span=(1, 3))
    assert FusedJob(context, streams, PCEDFusion([0.5])).runs() == [[Run((1, 2, 3), 0)], [Run((1, 2, 4), 0)]]
    assert FusedJob(context, streams[1:], PCEDFusion([0.5]), likelihood_span=(1, 3))._scored == (2, 4)  # its own


# Soft-NBCE's chunk streams take the same likelihood (``soft_nbce(query_likelihood=w)``): its chunks' routing prior.

def test_each_chunks_likelihood_is_a_plain_forwards_and_equals_pceds_per_document(engine):
    question, documents, scores = "Who is the mayor of Marrowgate?", DOCS[:4], [0.8, 0.7, 0.75, 0.6]
    answer = engine.generate(question, documents, scores, mode="soft_nbce", max_new_tokens=4, query_likelihood=0.5)
    assert answer.extra["n_chunks"] == 4 and answer.extra["query_loglik"] == pytest.approx(
        _reference_loglik(engine, question, documents), abs=2e-3)
    pced = engine.generate(question, documents, scores, mode="pced", max_new_tokens=1, query_likelihood=0.5)
    assert answer.extra["query_loglik"] == pced.extra["query_loglik"]


def test_a_document_cut_into_chunks_gets_one_likelihood_per_chunk(engine):
    question = "Who is the mayor of Marrowgate?"
    answer = engine.generate(question, DOCS[:2], [0.8, 0.7], mode="soft_nbce", max_new_tokens=2, chunk_tokens=8,
                             query_likelihood=0.5)
    chunks = [chunk.text for chunk in split_documents(engine.loaded.tokenizer, DOCS[:2], 8)]
    assert answer.extra["n_chunks"] == len(chunks) > 2
    assert answer.extra["query_loglik"] == pytest.approx(_reference_loglik(engine, question, chunks), abs=2e-3)


def test_soft_nbces_prior_is_the_softmax_of_scaled_scores_plus_weighted_likelihood():
    rule = SoftNBCEFusion(gamma=10.0, log_prior=[-0.1, -1.0, -3.0], relevance=[0.8, 0.7, 0.6], prior_tau=0.1,
                          query_likelihood=0.25)
    given = rule.given_likelihood(torch.tensor([-99.0, -30.0, -10.0, -20.0]))  # the query-only prior's first
    expected = torch.log_softmax(torch.tensor([8.0, 7.0, 6.0]) + 0.25 * torch.tensor([-30.0, -10.0, -20.0]), 0)
    torch.testing.assert_close(given.measured_prior, expected)
    # what the step's knobs take, alone and beside a request of 2 chunks whose own prior is kept
    other = SoftNBCEFusion(gamma=5.0, log_prior=[-0.5, -1.5])
    knobs = Knobs.of([other, given, rule], [2, 3, 3], torch.device("cpu"))
    assert torch.equal(knobs.log_prior[1], expected)
    assert torch.equal(Knobs.of([given], [3], torch.device("cpu")).log_prior[0], expected)
    assert torch.equal(knobs.log_prior[0], torch.tensor([-0.5, -1.5, 0.0]))  # its padding: 0
    assert torch.equal(knobs.log_prior[2], torch.tensor([-0.1, -1.0, -3.0]))
    wider = SoftNBCEFusion(gamma=5.0, log_prior=[-0.5, -1.5, -2.0, -2.5])  # the measured request padded
    padded = Knobs.of([given, wider], [3, 4], torch.device("cpu")).log_prior
    assert torch.equal(padded[0], torch.cat([expected, torch.zeros(1)]))
    assert rule.measured_prior is None and given is not rule  # the request's rule keeps its scores-only prior
    assert (given.gamma, given.tau, given.rho, given.query_likelihood) == (10.0, rule.tau, rule.rho, 0.25)


def test_the_chunk_that_explains_the_question_takes_the_weight_from_a_slightly_better_scored_one():
    """Each chunk is confident in its own name; the scores alone give the first chunk the token, the likelihood
    gives it to the second, and a likelihood that favours the first leaves it there."""
    logits = torch.full((3, 6), -8.0)
    logits[0, 5] = 0.0   # the query-only prior: a function word
    logits[1, 1] = 6.0   # the top-scored chunk: its own name
    logits[2, 2] = 6.0   # the second: the right name
    scores = torch.tensor([0.82, 0.78])

    def rule(likelihood=None):
        built = routed_rule(torch.log_softmax(scores / 0.05, 0), relevance=scores, query_likelihood=0.2)
        return built if likelihood is None else built.given_likelihood(torch.tensor(likelihood))

    assert int(rule()(logits).scores.argmax()) == 1
    assert int(rule([-40.0, -45.0, -20.0])(logits).scores.argmax()) == 2
    assert int(rule([-40.0, -20.0, -45.0])(logits).scores.argmax()) == 1


def test_equal_scores_are_ranked_by_the_likelihood_alone_and_one_chunk_by_nothing():
    equal = torch.zeros(3)
    plain = routed_rule(equal, relevance=torch.full((3,), 0.5))
    assert (plain.gamma, plain.rho, plain.wants_likelihood) == (0.0, 0.9, False)  # the paper's rule
    assert plain.log_prior is None and plain.relevance is None  # nothing of a prior left on it
    for count in (2, 3):
        measured = routed_rule(torch.zeros(count), relevance=torch.full((count,), 0.5), query_likelihood=0.2)
        assert (measured.gamma, measured.rho, measured.wants_likelihood) == (10.0, 1.0, True)
        given = measured.given_likelihood(torch.arange(count + 1.0))
        torch.testing.assert_close(given.measured_prior, torch.log_softmax(0.2 * torch.arange(1, count + 1.0), 0))
    scores = torch.tensor([0.9, 0.6])  # the mode's prior_tau reaches the likelihood's prior
    ranked = routed_rule(torch.log_softmax(scores / 0.1, 0), relevance=scores, prior_tau=0.1, query_likelihood=0.2)
    torch.testing.assert_close(ranked.given_likelihood(torch.tensor([0.0, -10.0, -5.0])).measured_prior,
                               torch.log_softmax(torch.tensor([9.0 - 2.0, 6.0 - 1.0]), 0))
    one = routed_rule(torch.zeros(1), relevance=torch.full((1,), 0.5), query_likelihood=0.2)
    assert (one.gamma, one.rho, one.wants_likelihood) == (0.0, 0.9, False)
    no_gamma = routed_rule(torch.tensor([0.0, -1.0]), relevance=torch.tensor([0.9, 0.8]), gamma=0.0,
                           query_likelihood=0.2)
    assert (no_gamma.gamma, no_gamma.wants_likelihood) == (0.0, False)


def test_soft_nbces_default_weight_is_set_only_where_the_scores_rank_the_chunks():
    ranked = torch.log_softmax(torch.tensor([0.9, 0.8, 0.8]) / 0.05, 0)
    assert default_query_likelihood(ranked, gamma=10.0, prior="softmax") == QUERY_LIKELIHOOD == 0.2
    assert default_query_likelihood(ranked[:2], gamma=0.5, prior="softmax") == 0.2  # two chunks, a small gamma
    assert default_query_likelihood(ranked[1:], gamma=10.0, prior="softmax") == 0.0  # equal scores
    assert default_query_likelihood(ranked[:1], gamma=10.0, prior="softmax") == 0.0  # one chunk
    assert default_query_likelihood(ranked, gamma=0.0, prior="softmax") == 0.0  # the paper's rule asked for
    for prior in ("paper", "rank", "minmax"):  # the likelihood needs the softmax prior: its default is off there
        assert default_query_likelihood(ranked, gamma=10.0, prior=prior) == 0.0


@pytest.mark.parametrize("case", ["equal scores", "one document's chunks", "gamma 0", "rank prior"])
def test_where_nothing_asks_for_it_soft_nbces_default_measures_nothing_and_keeps_its_rule(engine, case):
    """The default weight must not reach requests whose chunks nothing ranks (the paper's rule stays exactly, with
    no likelihood measured) nor raise where a weight given would be refused (gamma 0, a prior other than softmax)."""
    question, documents, scores, options = "Who is the mayor of Marrowgate?", DOCS[:3], [0.8, 0.7, 0.6], {}
    if case == "equal scores":
        scores = [0.7] * 3
    elif case == "one document's chunks":
        documents, scores, options = DOCS[:1], [0.8], dict(chunk_tokens=8)
    else:
        options = dict(gamma=0.0) if case == "gamma 0" else dict(prior="rank")
    default = engine.generate(question, documents, scores, mode="soft_nbce", max_new_tokens=6, **options)
    off = engine.generate(question, documents, scores, mode="soft_nbce", max_new_tokens=6, query_likelihood=0.0,
                          **options)
    assert "query_loglik" not in default.extra and (default.text, default.trace) == (off.text, off.trace)
    assert default.extra["n_chunks"] > 1


@pytest.mark.parametrize("options, message", [
    (dict(query_likelihood=0.5, prior="rank"), "query_likelihood=0.5 needs prior='softmax'"),
    (dict(query_likelihood=0.5, gamma=0.0), r"^query_likelihood=0.5 needs gamma > 0: the likelihood reaches the "
                                            r"chunks' weights through the retrieval prior, which gamma=0 leaves out$"),
    (dict(query_likelihood=-0.1), r"^mode 'soft_nbce': option query_likelihood must be a number in \[0, 100\], or "
                                  r"None, got -0.1$"),
])
def test_bad_soft_nbce_query_likelihood_options_are_typed_errors(engine, options, message):
    with pytest.raises(InvalidOptionError, match=message):
        engine.generate("Who?", DOCS[:2], [0.9, 0.5], mode="soft_nbce", max_new_tokens=2, **options)


@pytest.mark.parametrize("options, message", [
    (dict(gamma=0.0, query_likelihood=0.5), r"^query_likelihood=0.5 needs gamma > 0 and each chunk's score "
                                            r"\(relevance=...\): the likelihood reaches the weights through the "
                                            r"retrieval prior$"),
    (dict(gamma=1.0, log_prior=[0.0, -1.0], query_likelihood=0.5), "needs gamma > 0 and each chunk's score"),
    (dict(gamma=1.0, log_prior=[0.0, -1.0], relevance=[0.9], query_likelihood=0.5), "^got 1 chunk scores for 2 "
                                                                                     "priors$"),
    (dict(gamma=1.0, log_prior=[0.0, -1.0], relevance=[0.9, 0.8], query_likelihood=101.0), r"must be in \[0, 100\]"),
])
def test_a_soft_nbce_rule_refuses_a_likelihood_it_could_not_use(options, message):
    with pytest.raises(InvalidOptionError, match=message):
        SoftNBCEFusion(**options)
    rule = SoftNBCEFusion(gamma=1.0, log_prior=[0.0, -1.0], relevance=[0.9, 0.8], query_likelihood=0.5)
    with pytest.raises(InvalidOptionError, match="got 3 chunk streams for 2 priors"):
        rule.given_likelihood(torch.zeros(4))
