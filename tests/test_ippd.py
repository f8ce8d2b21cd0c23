"""IPPD parity (docs/methods.md#ippd): every stacked answer equals independent greedy decoding of its own prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.cache import CachedKV
from ctx_integrations.engine.modes.ippd import PAD_ID, PAD_POSITION, _check_devices, visibility
from ctx_integrations.errors import DocumentTooLongError, EmptyDocumentsError, InvalidOptionError
from tests.helpers import greedy_reference, tiny_loaded

DOCS = [
    "Marrowgate is the capital of Veloria and lies on the river Ast.",
    "The mayor of Marrowgate is Ilsa Brenn, elected in 2019.",
]
OTHER_DOCS = ["The Lantern Fair is held every October in Marrowgate; smoked eel with plums is served there."]
QUESTIONS = [
    "Who is the mayor?",
    "On which river does the capital of Veloria lie, and what else do the documents above say about the city?",
    "When was the mayor elected?",
    "What is the capital?",
]


def independent(engine: Engine, documents: list[str], question: str, max_new_tokens: int) -> list[int]:
    """The reference: transformers' greedy generate over (prefix, documents, question) alone."""
    layout = engine.layout
    ids = layout.prefix_ids + [t for d in documents for t in layout.context_ids(d)] + layout.suffix_ids(question)
    return greedy_reference(engine.loaded, ids, max_new_tokens)


def test_visibility_is_the_conjunction_rule():
    # keys: prefix (0), context 1, context 2, question 1 of ctx 1, question 2 of ctx 2, padding
    k_pos = torch.tensor([[0, 1, 1, 2, 2, PAD_POSITION]])
    k_ctx = torch.tensor([[0, 1, 2, 1, 2, PAD_ID]])
    k_qid = torch.tensor([[0, 0, 0, 1, 2, PAD_ID]])
    q = (torch.tensor([[3, 3]]), torch.tensor([[1, 2]]), torch.tensor([[1, 2]]))  # next token of each answer
    mask = visibility(*q, k_pos, k_ctx, k_qid)[0, 0]
    assert mask.tolist() == [[True, True, False, True, False, False], [True, False, True, False, True, False]]
    earlier = visibility(torch.tensor([[1]]), torch.tensor([[1]]), torch.tensor([[0]]), k_pos, k_ctx, k_qid)[0, 0]
    assert earlier.tolist() == [[True, True, False, False, False, False]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_answers_equal_independent_greedy_decoding(family):
    engine = Engine(tiny_loaded(family, seed=2))
    answers = engine.generate_many(QUESTIONS, DOCS, max_new_tokens=16)
    assert [a.extra["stacked_questions"] for a in answers] == [4] * 4
    for question, answer in zip(QUESTIONS, answers):
        expected = independent(engine, DOCS, question, 16)
        assert len(set(expected)) > 3 and answer.token_ids == expected
    assert len({tuple(a.token_ids) for a in answers}) > 1  # the questions really got their own answers


def test_answers_finishing_at_different_steps():
    loaded = tiny_loaded("llama", seed=2)
    engine = Engine(loaded)
    early = independent(engine, DOCS, QUESTIONS[0], 16)[3]  # make question 0's 4th token an end of turn
    loaded.model.generation_config.eos_token_id = [loaded.tokenizer.eos_token_id, early]
    answers = engine.generate_many(QUESTIONS, DOCS, max_new_tokens=16)
    lengths = [len(a.token_ids) for a in answers]
    assert lengths[0] == 3 and answers[0].finish_reason == "eos" and max(lengths) == 16
    for question, answer in zip(QUESTIONS, answers):
        assert answer.token_ids == independent(engine, DOCS, question, 16)


def test_two_contexts_in_one_stack_and_a_batch_of_two_stacks():
    engine = Engine(tiny_loaded("llama", seed=3))
    documents = [DOCS, OTHER_DOCS, DOCS, OTHER_DOCS]
    one_stack = engine.generate_many(QUESTIONS, documents, max_new_tokens=12)
    assert {a.extra["stack"] for a in one_stack} == {0} and one_stack[0].timings["stacks"] == 1
    two_stacks = engine.generate_many(QUESTIONS, documents, max_new_tokens=12, max_stack_tokens=220)
    assert two_stacks[0].timings["stacks"] >= 2
    for question, docs, a, b in zip(QUESTIONS, documents, one_stack, two_stacks):
        expected = independent(engine, docs, question, 12)
        assert a.token_ids == expected and b.token_ids == expected


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_position_sensitive_answers_equal_independent_greedy_decoding(family):
    """On a model whose answer moves when a token moves by one position: two contexts of different
    lengths and questions of different lengths share one stack, so every virtual position (context
    after the prefix, question after its own context, answer after its own question) must be exact."""
    engine = Engine(tiny_loaded(family, seed=4, position_sensitive=True))
    documents = [DOCS, OTHER_DOCS, DOCS, OTHER_DOCS]
    answers = engine.generate_many(QUESTIONS, documents, max_new_tokens=10)
    assert {a.extra["stack"] for a in answers} == {0}
    for question, docs, answer in zip(QUESTIONS, documents, answers):
        expected = independent(engine, docs, question, 10)
        assert len(set(expected)) > 3 and answer.token_ids == expected


def test_concat_mode_is_the_independent_baseline_and_ippd_answers_one_question_too(tiny_engine):
    baseline = tiny_engine.generate_many(QUESTIONS[:2], DOCS, mode="concat", max_new_tokens=10)
    stacked = tiny_engine.generate_many(QUESTIONS[:2], DOCS, max_new_tokens=10)
    assert [a.token_ids for a in baseline] == [a.token_ids for a in stacked]
    assert [a.mode for a in baseline] == ["concat"] * 2 and [a.mode for a in stacked] == ["ippd"] * 2
    pieces: list[str] = []
    single = tiny_engine.generate(QUESTIONS[0], DOCS, mode="ippd", max_new_tokens=10, on_token=pieces.append)
    assert single.token_ids == baseline[0].token_ids and "".join(pieces) == single.text and len(pieces) > 1


def test_the_context_cache_is_reused_across_calls(tiny_engine):
    first = tiny_engine.generate_many(QUESTIONS[:2], DOCS, max_new_tokens=4)
    second = tiny_engine.generate_many(QUESTIONS[2:], DOCS, max_new_tokens=4)
    assert (first[0].cache_misses, second[0].cache_misses, second[0].cache_hits) == (1, 0, 1)


def test_one_document_context_is_the_ingested_document_cache(tiny_engine):
    tiny_engine.warm(DOCS[:1])
    answers = tiny_engine.generate_many(QUESTIONS[:2], DOCS[:1], max_new_tokens=4)
    assert (answers[0].cache_hits, answers[0].cache_misses) == (1, 0)


def test_sampling_is_reproducible_per_question(tiny_engine):
    kwargs = dict(max_new_tokens=8, temperature=1.0, seed=7)
    a = tiny_engine.generate_many(QUESTIONS[:2], DOCS, **kwargs)
    b = tiny_engine.generate_many(QUESTIONS[:2], DOCS, **kwargs)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    alone = tiny_engine.generate(QUESTIONS[1], DOCS, mode="concat", max_new_tokens=8, temperature=1.0, seed=8)
    assert a[1].token_ids == alone.token_ids  # question i samples with seed + i


@pytest.mark.parametrize("questions", [[], "one question as a string"])
def test_questions_must_be_a_non_empty_list(tiny_engine, questions):
    with pytest.raises(InvalidOptionError, match="non-empty list"):
        tiny_engine.generate_many(questions, DOCS)


def test_document_lists_must_match_the_questions(tiny_engine):
    with pytest.raises(EmptyDocumentsError, match="2 document lists for 3 questions"):
        tiny_engine.generate_many(QUESTIONS[:3], [DOCS, DOCS])


def test_a_stack_too_small_for_one_question_says_none_fits(tiny_engine):
    with pytest.raises(DocumentTooLongError, match="not even one of its 2 questions fits"):
        tiny_engine.generate_many(QUESTIONS[:2], DOCS, max_new_tokens=8, max_stack_tokens=60)
    with pytest.raises(InvalidOptionError, match="max_stack_tokens"):
        tiny_engine.generate_many(QUESTIONS[:2], DOCS, max_stack_tokens=0)


def test_a_question_beyond_the_window_is_refused():
    engine = Engine(tiny_loaded("llama", max_position_embeddings=160))
    with pytest.raises(DocumentTooLongError, match="question 1 with its documents"):
        engine.generate_many(["short?", "word " * 60], DOCS, max_new_tokens=8)


def test_caches_on_another_device_are_refused():
    here = CachedKV("a", (1,), torch.zeros(1, 2, 1, 1, 1))
    elsewhere = CachedKV("b", (1,), torch.zeros(1, 2, 1, 1, 1, device="meta"))
    _check_devices(torch.device("cpu"), [here])
    with pytest.raises(InvalidOptionError, match=r"IPPD got cached contexts on \['cpu', 'meta'\] for a model on cpu: "
                       r"compute the caches with this engine \(its store moves them to the model's device\) instead "
                       r"of mixing engines or devices"):
        _check_devices(torch.device("cpu"), [here, elsewhere])
    # mixed caches are refused whichever device the model is on, the one a set would name first included
    with pytest.raises(InvalidOptionError, match=r"IPPD got cached contexts on \['cpu', 'meta'\] for a model on meta"):
        _check_devices(torch.device("meta"), [here, elsewhere])


@pytest.mark.slow
def test_embedded_model_parity(embedded_engine):
    questions = ["Who is the mayor of Marrowgate?", "On which river is Marrowgate?", "When was Ilsa Brenn elected?"]
    answers = embedded_engine.generate_many(questions, DOCS, max_new_tokens=20)
    for question, answer in zip(questions, answers):
        assert answer.token_ids == independent(embedded_engine, DOCS, question, 20)
    assert "Ilsa Brenn" in answers[0].text


def test_caches_on_cuda_0_match_a_model_on_cuda():
    # torch says cuda:0 != cuda; a model loaded on "cuda" holds its caches on cuda:0, and IPPD refused them all.
    # Without a GPU no tensor can live on cuda:0: the check reads only .device, so a stand-in carries it.
    entry = CachedKV("a", (1,), SimpleNamespace(device=torch.device("cuda:0")))
    _check_devices(torch.device("cuda"), [entry])


def _entry(key: str, length: int) -> CachedKV:
    return CachedKV(key, tuple(range(length)), torch.zeros(1, 2, 1, length, 1))


def _question(index: int, suffix: int):
    from ctx_integrations.engine.modes.ippd import _Question

    return _Question(index, None, 0, 0, 0, list(range(suffix)), None, 0)


def test_stacks_are_filled_in_order_with_each_context_once_up_to_the_exact_budget():
    # prefix 10; context a (30 tokens) with questions of 5 and 3 tokens, context b (20) with one of 4; 8 new tokens
    # each. Stack 0: 10 + 30 + (5 + 8) + (3 + 8) = 64, exactly the budget (a question that fits exactly joins);
    # context b then opens stack 1: 10 + 20 + (4 + 8) = 42. A context counted twice, a question counted without
    # its context, or ">=" instead of ">" at the budget changes the stacks or their token counts.
    from ctx_integrations.engine.modes.ippd import _pack

    a, b = _entry("a", 30), _entry("b", 20)
    questions = [_question(0, 5), _question(1, 3), _question(2, 4)]
    stacks = _pack([(a, questions[:2]), (b, questions[2:])], prefix_len=10, budget=64, max_new_tokens=8)
    assert [s.tokens for s in stacks] == [64, 42]
    assert [[e.key for e in s.contexts] for s in stacks] == [["a"], ["b"]]
    assert [s.context_keys for s in stacks] == [["a"], ["b"]]
    assert [(q.stack, q.context, q.qid) for q in questions] == [(0, 1, 1), (0, 1, 2), (1, 1, 1)]
    # one token less of budget: the second question of context a opens stack 1 and brings its context along
    questions = [_question(0, 5), _question(1, 3), _question(2, 4)]
    stacks = _pack([(a, questions[:2]), (b, questions[2:])], prefix_len=10, budget=63, max_new_tokens=8)
    assert [s.tokens for s in stacks] == [53, 10 + 30 + 11, 10 + 20 + 12]  # b beside a in stack 1: 83 > 63
    assert [(q.stack, q.context, q.qid) for q in questions] == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]


def test_two_contexts_share_a_stack_while_they_fit():
    from ctx_integrations.engine.modes.ippd import _pack

    a, b = _entry("a", 12), _entry("b", 7)
    questions = [_question(0, 2), _question(1, 3), _question(2, 1)]
    stacks = _pack([(a, questions[:1]), (b, questions[1:])], prefix_len=4, budget=1000, max_new_tokens=5)
    assert len(stacks) == 1 and stacks[0].context_keys == ["a", "b"]
    assert stacks[0].tokens == 4 + 12 + (2 + 5) + 7 + (3 + 5) + (1 + 5)
    assert [(q.context, q.qid) for q in questions] == [(1, 1), (2, 2), (2, 3)]


def test_ippd_answers_report_their_prefill_time_once(tiny_engine):
    answers = tiny_engine.generate_many(QUESTIONS[:3], DOCS, max_new_tokens=12)
    for answer in answers:
        prefill, ttft, total = (answer.timings[k] for k in ("prefill_s", "ttft_s", "total_s"))
        assert isinstance(prefill, float) and 0 < prefill <= ttft < total  # set at the first step, not later ones
    assert len({a.timings["prefill_s"] for a in answers}) == 1  # one stacked prefill serves every question


def test_ippd_traces_carry_each_tokens_log_probability_and_context_attribution(tiny_engine):
    # The trace's score is the chosen token's log-probability given its own prompt (checked against one plain forward
    # over prompt + answer); the attribution tells citations.py that each answer saw only its own context.
    layout, model = tiny_engine.layout, tiny_engine.loaded.model
    answers = tiny_engine.generate_many(QUESTIONS[:2], DOCS, max_new_tokens=6)
    for question, answer in zip(QUESTIONS[:2], answers):
        prompt = layout.prefix_ids + [t for d in DOCS for t in layout.context_ids(d)] + layout.suffix_ids(question)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + answer.token_ids])).logits[0].float()
        steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        expected = steps.gather(1, torch.tensor(answer.token_ids).unsqueeze(1)).squeeze(1)
        assert all(isinstance(step.score, float) for step in answer.trace)
        torch.testing.assert_close(torch.tensor([s.score for s in answer.trace]), expected, atol=1e-4, rtol=1e-4)
        assert answer.extra["attribution"] == "context" and answer.extra["stacked_questions"] == 2


@pytest.mark.parametrize("max_stack_tokens", [None, 170])
def test_a_finished_question_stops_costing_tokens_and_a_finished_stack_its_row(monkeypatch, max_stack_tokens):
    """Question 0 ends at its 3rd token while question 1 decodes 16: from then on each forward takes no token
    of question 0 (one stack) or no row at all for its stack (one stack per question), and both answers stay
    exact. Catches a job that keeps feeding a finished answer, or a stack row left in the pool until the end."""
    from ctx_integrations.engine.core import rows

    loaded = tiny_loaded("llama", seed=2)
    engine = Engine(loaded)
    early = independent(engine, DOCS, QUESTIONS[0], 16)[3]
    loaded.model.generation_config.eos_token_id = [loaded.tokenizer.eos_token_id, early]
    forwards: list[tuple[int, int]] = []  # (pool rows, tokens taken) per forward
    forward = rows.RowPool.forward

    def spy(pool, model, runs, *args, **kwargs):
        forwards.append((pool.rows, sum(len(run.ids) for row in runs for run in row)))
        return forward(pool, model, runs, *args, **kwargs)

    monkeypatch.setattr(rows.RowPool, "forward", spy)
    answers = engine.generate_many(QUESTIONS[:2], DOCS, max_new_tokens=16, max_stack_tokens=max_stack_tokens)
    assert [len(a.token_ids) for a in answers] == [3, 16]
    for question, answer in zip(QUESTIONS, answers):
        assert answer.token_ids == independent(engine, DOCS, question, 16)
    stacks = int(answers[0].timings["stacks"])
    assert stacks == (1 if max_stack_tokens is None else 2)
    # the prefill (a forward per prompt length: the two stacks' prompts differ, and no row's tokens are padded to
    # another's, tests/test_batch_invariance.py), then one forward per token of the longer answer
    prefills = 1 if max_stack_tokens is None else 2
    assert [taken for _, taken in forwards[:prefills]] == ([82] if prefills == 1 else [32, 50])
    assert len(forwards) == prefills + 15
    assert forwards[prefills:prefills + 3] == [(stacks, 2)] * 3  # both answers decode
    assert forwards[prefills + 3:] == [(1, 1)] * 12  # question 0 is done: one token per step, and one row left


def test_greedy_questions_chosen_at_once_give_the_values_of_one_at_a_time():
    # token, its log-probability and its score per question, as the per-question loop (the sampler's pick) gives
    # them, bit for bit (and the log-probability within float32's rounding of log_softmax's): a gather from the wrong
    # question, a reduction over the wrong dim or values out of question order would differ. A tie in the first
    # question: argmax takes the first maximum in both.
    from ctx_integrations.engine.core.decoding import TokenSampler
    from ctx_integrations.engine.modes.ippd import greedy_question_values

    scores = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 4
    scores[0, 17] = scores[0, 900] = scores[0].max() + 1
    expected = []
    for row in scores:
        token, checked = TokenSampler().pick(row)
        expected += [float(token), float(row[token] - torch.logsumexp(row, -1)), float(checked)]
    assert greedy_question_values(scores).tolist() == expected and expected[0] == 17
    logprobs = greedy_question_values(scores).view(-1, 3)[:, 1]
    torch.testing.assert_close(logprobs, torch.log_softmax(scores.double(), -1).gather(1, logprobs.new_tensor(
        expected[::3]).long().unsqueeze(1)).squeeze(1), atol=1e-5, rtol=0)


def test_a_steps_greedy_choice_costs_the_same_operations_for_2_or_16_questions_and_batches_across_requests(
        monkeypatch):
    import asyncio

    from benchmarks.host_reads import Operations as CountOps
    from ctx_integrations.engine.core import runner as runner_module
    from ctx_integrations.engine.modes.ippd import StackedJob

    engine = Engine(tiny_loaded("llama", seed=5))
    questions = [f"Question number {i}?" for i in range(16)]
    counts: list[int] = []
    choose = runner_module.choose

    def counted(taking):
        with CountOps() as ops:
            choice = choose(taking)
        counts.append(ops.count)
        return choice

    monkeypatch.setattr(runner_module, "choose", counted)

    def fewest(asked: list[str]) -> int:
        counts.clear()
        engine.generate_many(asked, DOCS, max_new_tokens=4)
        return min(counts)

    batches: list[int] = []  # per batch evaluation, its jobs; one by one: the questions each propose chose
    alone_calls: list[int] = []
    propose_batch, propose = StackedJob.propose_batch.__func__, StackedJob.propose

    def spied_batch(cls, jobs, logits):
        values = propose_batch(cls, jobs, logits)
        batches.append(len(values))
        return values

    def spied(self, logits):
        alone_calls.append(1)
        return propose(self, logits)

    monkeypatch.setattr(StackedJob, "propose_batch", classmethod(spied_batch))
    monkeypatch.setattr(StackedJob, "propose", spied)
    assert fewest(questions[:2]) == fewest(questions) <= 12  # one question's launches, not one set per question
    alone = [[a.token_ids for a in engine.generate_many(q, DOCS, max_new_tokens=5)]
             for q in (questions[:3], questions[3:8])]
    assert batches == [] and alone_calls  # the CPU chooses request by request (batch_on_cpu)
    monkeypatch.setattr(StackedJob, "batch_on_cpu", True)
    alone_calls.clear()

    async def together():
        return await asyncio.gather(*(engine.agenerate_many(q, DOCS, max_new_tokens=5)
                                      for q in (questions[:3], questions[3:8])))

    assert [[a.token_ids for a in answers] for answers in asyncio.run(together())] == alone
    assert 2 in batches and alone_calls == []  # both requests chose in one evaluation, never one by one


@pytest.mark.parametrize("knobs", [dict(temperature=0.8), dict(temperature=1.2, top_p=0.9, top_k=40, min_p=0.01)])
def test_sampled_questions_chosen_at_once_draw_what_each_draws_alone(knobs):
    # Each question's token, log-probability and score to check, as its own sampler's pick gives them, draw for
    # draw: one question's noise drawn from another's generator, the nucleus cut over all the questions, the score
    # to check taken at the token (greedy's) or values out of question order would differ.
    from ctx_integrations.engine.core.decoding import TokenSampler
    from ctx_integrations.engine.modes.ippd import sampled_question_values

    # flat scores (most of the mass outside any cut), so that a knob left out moves some draw
    scores = torch.randn(7, 300, generator=torch.Generator().manual_seed(4)) * 0.3
    together = [TokenSampler(seed=10 + q, **knobs) for q in range(7)]
    alone = [TokenSampler(seed=10 + q, **knobs) for q in range(7)]
    for _ in range(3):
        expected = []
        for row, sampler in zip(scores, alone):
            token, checked = sampler.pick(row)
            expected += [float(token), float(row[token] - torch.logsumexp(row, -1)), float(checked)]
        assert sampled_question_values(scores, together).tolist() == expected
    assert len(set(expected[::3])) > 1
    token, checked = alone[3].pick(scores[3])  # a stack with one question left
    assert sampled_question_values(scores[3:4], together[3:4]).tolist() == [
        float(token), float(scores[3, token] - torch.logsumexp(scores[3], -1)), float(checked)]


def test_sampled_ippd_requests_choose_together_and_answer_as_one_by_one(monkeypatch):
    import asyncio

    from ctx_integrations.engine.modes.ippd import StackedJob

    engine = Engine(tiny_loaded("llama", seed=5))
    questions = [f"Question number {i}?" for i in range(8)]
    options = dict(max_new_tokens=5, temperature=0.9, top_p=0.95)
    calls: list[str] = []
    propose_batch, propose = StackedJob.propose_batch.__func__, StackedJob.propose

    def spied_batch(cls, jobs, logits):
        calls.append("batch")
        return propose_batch(cls, jobs, logits)

    def spied(self, logits):
        calls.append("alone")
        return propose(self, logits)

    monkeypatch.setattr(StackedJob, "propose_batch", classmethod(spied_batch))
    monkeypatch.setattr(StackedJob, "propose", spied)

    def answers(seed: int) -> list[list[list[int]]]:
        async def together():
            return await asyncio.gather(*(engine.agenerate_many(q, DOCS, seed=seed + i, **options)
                                          for i, q in enumerate((questions[:3], questions[3:]))))
        return [[a.token_ids for a in request] for request in asyncio.run(together())]

    monkeypatch.setattr(StackedJob, "_knobs", lambda self: None)  # every question picked by its own sampler
    one_by_one = answers(2)
    assert "batch" not in calls
    monkeypatch.undo()
    monkeypatch.setattr(StackedJob, "propose_batch", classmethod(spied_batch))
    monkeypatch.setattr(StackedJob, "propose", spied)
    monkeypatch.setattr(StackedJob, "batch_on_cpu", True)
    calls.clear()
    assert answers(2) == one_by_one
    assert "batch" in calls and "alone" not in calls
    assert len({tuple(a) for request in one_by_one for a in request}) > 1


def test_sampled_questions_report_their_own_log_probabilities_and_alternatives():
    # One question at a time (a sampled step): each trace step's log-probability and top alternatives are the
    # softmax of that question's own logits, checked against one plain forward over its prompt and answer.
    from ctx_integrations import SamplingParams

    engine = Engine(tiny_loaded("llama", seed=5))
    layout, model = engine.layout, engine.loaded.model
    sampling = SamplingParams(max_tokens=4, temperature=0.9, seed=3, logprobs=2)
    answers = engine.generate_many(QUESTIONS[:2], DOCS, sampling=sampling)
    for question, answer in zip(QUESTIONS[:2], answers):
        prompt = layout.prefix_ids + [t for d in DOCS for t in layout.context_ids(d)] + layout.suffix_ids(question)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + answer.token_ids])).logits[0].float()
        steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        for step, expected in zip(answer.trace, steps, strict=True):
            assert step.score == pytest.approx(float(expected[step.token_id]), abs=1e-4)
            assert step.logprob == pytest.approx(float(expected[step.token_id]), abs=1e-4)
            best = torch.topk(expected, 2)
            assert [t for t, _ in step.top_logprobs] == best.indices.tolist()
            assert [lp for _, lp in step.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_a_request_reserves_its_stacks_prompt_and_answer_budget():
    # prefix + each context once + every question's suffix and max_new_tokens, per stack: what admission reserves
    engine = Engine(tiny_loaded("llama", seed=5))
    layout = engine.layout
    engine.generate_many(QUESTIONS[:3], DOCS, max_new_tokens=7)
    context = sum(len(layout.context_ids(d)) for d in DOCS)
    tokens = len(layout.prefix_ids) + context + sum(len(layout.suffix_ids(q)) + 7 for q in QUESTIONS[:3])
    kv = engine.stats()["kv_bytes"]
    assert kv["peak"] == tokens * kv["bytes_per_token"]
