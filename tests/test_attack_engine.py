"""Issue 28: an attack suite against the engine's Python API, on tiny random models.

Families: extreme knob values of every mode (greedy and sampled), a model whose scores turn NaN, wrong
types, callbacks raising each kind of ``BaseException``, an overloaded ``generate_many``, timeouts behind
long work. Every case is classified the same way (:func:`attempt`): ``typed`` (a library error, or the
documented outcome), ``untyped`` (any other exception), ``silent`` (an answer where an error was due, an
empty answer, or work left running for nobody), ``hang`` (nothing within the case's budget) or ``answer``
(a good answer where one was due). Each test asserts its case's expected class and says ``outcome=...``
when it fails, so a regression names its family. The bugs they catch are in each family's comment.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ctx_integrations import Answer, Engine, SamplingParams, mode_spec
from ctx_integrations.engine.core.mode_spec import Option
from ctx_integrations.errors import (
    CallbackError,
    CtxIntegrationsError,
    EngineOverloadedError,
    InvalidOptionError,
    NonFiniteScoresError,
    RequestTimeoutError,
    UnknownModeError,
)
from tests.helpers import tiny_loaded
from tests.mode_cases import every_mode, small_options

DOCS = ["Marrowgate is the capital of Veloria and lies on the river Ast.",
        "The mayor of Marrowgate is Ilsa Brenn, elected in 2019."]
QUESTION = "Who is the mayor?"
SCORES = [0.5, 0.4]  # below 1, so gamma * log r is not 0
SAMPLED = dict(temperature=0.7, seed=1)
BUDGET_S = 30.0  # a case with no outcome after this long hangs


@dataclass
class Outcome:
    kind: str  # typed | untyped | silent | hang | answer
    value: Any = None

    def message(self) -> str:
        return f"outcome={self.kind}: {self.value!r}"[:400]


def _empty(value: Any) -> bool:
    answers = value if isinstance(value, list) else [value]
    return any(isinstance(a, Answer) and (not a.text.strip() or set(a.token_ids) <= {0}) for a in answers)


def attempt(call: Callable[[], Any], *, expect: str, budget_s: float = BUDGET_S) -> Outcome:
    """Run ``call`` on a thread and classify what it did (``expect``: ``typed`` or ``answer``)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - classifying every outcome is the point
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(budget_s)
    if thread.is_alive():
        return Outcome("hang")
    if "error" in box:
        return Outcome("typed" if isinstance(box["error"], CtxIntegrationsError) else "untyped", box["error"])
    if expect == "typed" or _empty(box["value"]):
        return Outcome("silent", box["value"])
    return Outcome("answer", box["value"])


def check(outcome: Outcome, expected: str) -> None:
    assert outcome.kind == expected, outcome.message()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama", seed=3))


# -- knobs: values that overflow float32 (the bugs: greedy emitted token id 0 again and again with empty text,
#    sampling failed inside torch.multinomial with a RuntimeError, beta=1e300 with "value cannot be converted")
KNOBS = [
    ("pced", {"gamma": 3.5e38}), ("pced", {"gamma": 1e30}), ("pced", {"gamma": 1e8}),
    ("pced", {"beta": 1e38}), ("pced", {"beta": 1e300}), ("pced", {"beta": 1e8}),
    ("pced", {"gamma": 1e30, "aggregation": "mixture"}),
    ("ape", {"attention_temperature": 1e-46}), ("ape", {"attention_temperature": 1e-300}),
    ("ape", {"attention_temperature": 5e-324}),
    ("soft_nbce", {"beta": 1e300}), ("soft_nbce", {"beta": 1e38}), ("soft_nbce", {"tau": 1e-300}),
    ("soft_nbce", {"tau": 1e-45}), ("nbce", {"beta": 1e300}), ("pcw", {"beta": 1e300}),
    ("rapid", {"eta": 1e300}), ("rapid", {"eta": 1e39}),
]


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize(("mode", "options"), KNOBS, ids=[f"{m}-{o}" for m, o in KNOBS])
def test_extreme_knob_values_are_refused_with_the_option_named(engine, mode, options, sampling):
    settings = SAMPLED if sampling == "sampled" else {}
    outcome = attempt(lambda: engine.generate(QUESTION, DOCS, scores=SCORES, mode=mode, max_new_tokens=4,
                                              **settings, **options), expect="typed")
    check(outcome, "typed")
    assert isinstance(outcome.value, InvalidOptionError) and next(iter(options)) in str(outcome.value)


def _past_bounds(option: Option) -> list[float]:
    """Values just outside ``option``'s declared range and far outside it (a float32 overflow), on each bounded side."""
    values = []
    if option.maximum is not None:
        values += [option.maximum * 2 + 1, 1e300]
    if option.minimum is not None:
        values += [option.minimum - 1, -1e300] + ([option.minimum] if not option.min_inclusive else [])
        values += [5e-324] if option.minimum > 0 else []
    return values


# A value of the wrong type for each kind of option: what a form or a JSON body sends by mistake.
WRONG_TYPE = {bool: "yes", int: "abc", float: "abc", str: 3, object: "text"}


@every_mode()
def test_every_declared_bound_wrong_type_and_unknown_option_are_refused_by_the_engine(engine, mode):
    """Every mode's own declaration, through ``generate``: a value past any bound, a value of the wrong type, and an
    unknown option are typed errors naming the option before anything is planned; a misspelt option's error names
    the option meant (the hand-picked KNOBS above are the past bugs)."""
    options = mode_spec(mode).options
    cases = [({option.name: value}, option.name) for option in options
             if option.kind in (int, float) for value in _past_bounds(option)]
    cases += [({option.name: WRONG_TYPE[option.kind]}, option.name) for option in options]
    cases.append(({"no_such_option": 1}, "no_such_option"))
    cases += [({option.name[:-1]: option.default}, f"did you mean {option.name}?") for option in options
              if option.name[:-1] not in {o.name for o in options}]
    for given, name in cases:
        outcome = attempt(lambda given=given: engine.generate(QUESTION, DOCS, scores=SCORES, mode=mode,
                                                              max_new_tokens=2, **given), expect="typed")
        check(outcome, "typed")
        assert isinstance(outcome.value, InvalidOptionError) and name in str(outcome.value), outcome.message()


# -- top_p tiny keeps the top token (as transformers' TopPLogitsWarper does with min_tokens_to_keep=1), so a
#    sampled answer is the greedy one (the bug: "invalid multinomial distribution")
@pytest.fixture(scope="module")
def greedy_tokens(engine) -> Callable[[str], list[int]]:
    """Each mode's greedy answer on ``engine``, decoded once for the module (the three top_p cases share it)."""
    return functools.cache(lambda mode: engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4,
                                                        **small_options(mode)).token_ids)


@pytest.mark.parametrize("top_p", [1e-9, 1e-300, 5e-324])
@every_mode()
def test_a_tiny_top_p_samples_the_top_token(engine, greedy_tokens, mode, top_p):
    options = small_options(mode)
    outcome = attempt(lambda: engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4, top_p=top_p, **SAMPLED,
                                              **options), expect="answer")
    check(outcome, "answer")
    if mode_spec(mode).picks_each_token:  # RAPID's sampled acceptance rule differs from its greedy one
        assert outcome.value.token_ids == greedy_tokens(mode)


# -- scores that turn NaN at runtime (a NaN model): the bug was token id 0 repeated with empty text (greedy) and
#    a RuntimeError from torch.multinomial (sampled); now every mode fails the request with a typed error
@pytest.fixture(scope="module")
def nan_engine() -> Engine:
    loaded = tiny_loaded("llama", seed=5)
    with torch.no_grad():
        loaded.model.lm_head.weight.fill_(float("nan"))
    return Engine(loaded)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@every_mode(extra=("chat",))
def test_non_finite_scores_fail_the_request_instead_of_emitting_token_zero(nan_engine, mode, sampling):
    settings = dict(max_new_tokens=3, **(SAMPLED if sampling == "sampled" else {}))
    if mode == "chat":
        call = lambda: nan_engine.chat([{"role": "user", "content": QUESTION}], **settings)  # noqa: E731
    else:
        call = lambda: nan_engine.generate(QUESTION, DOCS, mode=mode, **settings, **small_options(mode))  # noqa: E731
    outcome = attempt(call, expect="typed")
    check(outcome, "typed")
    assert isinstance(outcome.value, NonFiniteScoresError), outcome.message()


# -- wrong types, refused in the caller's thread with the argument named (the bugs: TypeError unhashable for a
#    list mode, a TypeError inside the scheduler for a non-callable on_token, a dict's keys taken as questions,
#    an Engine whose prompts silently lacked the question)
def _generate(**kwargs: Any) -> Callable[[Engine], Any]:
    return lambda engine: engine.generate(QUESTION, DOCS, **{"max_new_tokens": 2, **kwargs})


def _many(questions: Any, **kwargs: Any) -> Callable[[Engine], Any]:
    return lambda engine: engine.generate_many(questions, DOCS, **{"max_new_tokens": 2, **kwargs})


def _built(**kwargs: Any) -> Callable[[Engine], Any]:
    return lambda engine: Engine(engine.loaded, **kwargs)


TYPES = [
    ("mode-list", _generate(mode=["pced"]), "mode"), ("mode-dict", _generate(mode={"pced": 1}), "mode"),
    ("mode-None", _generate(mode=None), "mode"), ("mode-int", _generate(mode=3), "mode"),
    ("many-mode-list", _many([QUESTION], mode=["single"]), "mode"),
    ("on_token-int", _generate(on_token=5), "on_token"), ("on_token-str", _generate(on_token="print"), "on_token"),
    ("chat-on_token", lambda e: e.chat([{"role": "user", "content": "hi"}], on_token=[], max_new_tokens=2),
     "on_token"),
    ("many-on_token", _many([QUESTION], mode="single", on_token=print), "on_token"),
    ("many-dict", _many({QUESTION: 1, "Where?": 2}, mode="single"), "questions"),
    ("many-dict-ippd", _many({QUESTION: 1}), "questions"),
    ("many-set", _many({QUESTION, "Where?"}, mode="single"), "questions"),
    ("many-generator", _many(q for q in [QUESTION]), "questions"),
    ("many-bytes", _many(b"Who?"), "questions"), ("many-str", _many(QUESTION), "questions"),
    ("many-None", _many(None), "questions"), ("many-int-item", _many([QUESTION, 5], mode="single"), "query"),
    ("template-missing", _built(question_template="Answer briefly."), "question_template"),
    ("template-other-field", _built(question_template="{q}"), "question_template"),
    ("template-extra-field", _built(question_template="{question} {context}"), "question_template"),
    ("template-brace", _built(question_template="{question} {"), "question_template"),
    ("template-int", _built(question_template=5), "question_template"),
]


@pytest.mark.parametrize(("call", "name"), [(c, n) for _, c, n in TYPES], ids=[i for i, _, _ in TYPES])
def test_wrong_types_are_typed_errors_naming_the_argument(engine, call, name):
    outcome = attempt(lambda: call(engine), expect="typed")
    check(outcome, "typed")
    assert isinstance(outcome.value, (InvalidOptionError, UnknownModeError)) and name in str(outcome.value), \
        outcome.message()


def test_a_template_with_literal_braces_is_accepted(engine):
    templated = Engine(engine.loaded, question_template="Answer in JSON like {{\"a\": 1}}: {question}")
    assert "{\"a\": 1}" in templated.layout.suffix_text("Q?")


# -- callbacks raising each kind of BaseException (the bug: SystemExit / KeyboardInterrupt / GeneratorExit from
#    on_token ended the scheduler's thread, so the request and its neighbours waited forever)
RAISED = [SystemExit, KeyboardInterrupt, GeneratorExit, RuntimeError]


def _callback_outcome(kind: type[BaseException], error: BaseException | None) -> str:
    """The documented outcome: sync callers get SystemExit / KeyboardInterrupt as such (chained from the typed
    CallbackError), GeneratorExit as a CallbackError, an Exception as itself."""
    if error is None:
        return "silent"
    if kind in (SystemExit, KeyboardInterrupt):
        ok = type(error) is kind and isinstance(error.__cause__, CallbackError)
    elif kind is GeneratorExit:
        ok = isinstance(error, CallbackError) and isinstance(error.original, GeneratorExit)
    else:
        ok = type(error) is kind
    return "typed" if ok else "untyped"


@pytest.mark.parametrize("mode", ["pced", "ape"])  # a pooled job and an exclusive one
@pytest.mark.parametrize("kind", RAISED, ids=[k.__name__ for k in RAISED])
def test_a_raising_callback_fails_its_own_request_promptly_and_nobody_else(kind, mode):
    engine = Engine(tiny_loaded("llama", seed=6))  # its own scheduler: a dead one cannot leak into other cases
    neighbour_alone = engine.generate("Where is Marrowgate?", DOCS, mode=mode, max_new_tokens=16).token_ids
    pieces: list[str] = []

    def explode(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            raise kind("the caller's callback")

    results: dict[str, Outcome] = {}

    def neighbour() -> None:
        results["neighbour"] = attempt(lambda: engine.generate("Where is Marrowgate?", DOCS, mode=mode,
                                                               max_new_tokens=16), expect="answer", budget_s=20)

    thread = threading.Thread(target=neighbour)
    thread.start()
    started = time.perf_counter()
    bad = attempt(lambda: engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=40, on_token=explode, timeout=5),
                  expect="typed", budget_s=20)
    took = time.perf_counter() - started
    thread.join(25)
    got = "hang" if bad.kind == "hang" else _callback_outcome(kind, bad.value)
    assert got == "typed" and took < 5, f"outcome={got} after {took:.1f} s: {bad.value!r}"
    check(results["neighbour"], "answer")
    assert results["neighbour"].value.token_ids == neighbour_alone
    assert engine.scheduler._thread is not None and engine.scheduler._thread.is_alive()  # the thread survived
    assert len(engine.generate(QUESTION, DOCS[:1], mode=mode, max_new_tokens=3).token_ids) == 3
    assert engine.stats()["active_requests"] == 0 and engine.stats()["queue_depth"] == 0


def test_an_async_caller_gets_the_typed_callback_error():
    """Re-raising SystemExit inside an asyncio task would stop the whole event loop: async callers get CallbackError."""
    engine = Engine(tiny_loaded("llama", seed=6))

    def explode(piece: str) -> None:
        raise SystemExit(3)

    async def run() -> BaseException:
        handle = engine.submit(QUESTION, DOCS, on_token=explode, sampling=SamplingParams(8))
        try:
            await handle.wait()
        except BaseException as error:  # noqa: BLE001
            return error
        raise AssertionError("the request did not fail")

    outcome = attempt(lambda: asyncio.run(run()), expect="answer", budget_s=20)
    kind = outcome.kind if outcome.kind == "hang" else (
        "typed" if isinstance(outcome.value, CallbackError) and isinstance(outcome.value.original, SystemExit)
        else "untyped")
    assert kind == "typed", f"outcome={kind}: {outcome.value!r}"


# -- overload: a refused generate_many leaves nothing behind (the bug: the questions queued before the refusal
#    stayed queued and were answered for nobody)
def _held_engine(monkeypatch, max_queued: int) -> tuple[Engine, threading.Event]:
    engine = Engine(tiny_loaded("llama", seed=3), max_queued_requests=max_queued)
    release = threading.Event()
    monkeypatch.setattr(engine.store, "prefetch", lambda prepared: release.wait(10))  # hold the queue
    return engine, release


def _settled(engine: Engine, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        stats = engine.stats()
        if stats["queue_depth"] == 0 and stats["active_requests"] == 0:
            break
        time.sleep(0.02)
    time.sleep(0.2)  # anything still on its way would show now
    return engine.stats()


@pytest.mark.parametrize(("waiting", "questions"), [(0, 5), (2, 2)])
def test_a_refused_generate_many_leaves_nothing_behind(monkeypatch, waiting, questions):
    engine, release = _held_engine(monkeypatch, max_queued=3)
    before = [engine.submit(QUESTION, DOCS, mode="single", max_new_tokens=2)
              for _ in range(waiting)]
    answered = engine.scheduler.stats.answered
    outcome = attempt(lambda: engine.generate_many([f"Question {i}?" for i in range(questions)], DOCS,
                                                   mode="single", max_new_tokens=2), expect="typed", budget_s=10)
    release.set()
    for handle in before:
        handle.result()
    stats = _settled(engine)
    leaked = stats["answered"] - answered - waiting
    kind = outcome.kind if leaked == 0 else "silent"
    assert kind == "typed" and isinstance(outcome.value, EngineOverloadedError), \
        f"outcome={kind}: {leaked} orphan answers, {outcome.value!r}"
    assert (stats["queue_depth"], stats["active_requests"], stats["active_rows"]) == (0, 0, 0)


def test_generate_many_that_fits_is_answered(monkeypatch):
    engine, release = _held_engine(monkeypatch, max_queued=3)
    release.set()
    answers = engine.generate_many(["A?", "B?", "C?"], DOCS, mode="single", max_new_tokens=2)
    assert len(answers) == 3 and all(len(a.token_ids) == 2 for a in answers)


# -- timeouts behind long work (the bug: a request with timeout=0.5 queued behind a large warm() got its error
#    after the whole warm, 154.6 s)
MARGIN_S = 0.6  # the deadline watcher answers within milliseconds; this is slack for a loaded CI machine


def _slow_computation(monkeypatch, engine: Engine, seconds: float) -> None:
    """Every batch of cold document caches takes ``seconds`` longer (a big corpus on a slow machine)."""
    compute = engine.store._compute_batch

    def slow(token_lists, prefix):
        time.sleep(seconds)
        return compute(token_lists, prefix)

    monkeypatch.setattr(engine.store, "_compute_batch", slow)


def _time_to_error(call: Callable[[], Any]) -> tuple[Outcome, float]:
    started = time.perf_counter()
    outcome = attempt(call, expect="typed", budget_s=20)
    return outcome, time.perf_counter() - started


def _timed_out_on_time(outcome: Outcome, took: float, timeout: float) -> None:
    late = outcome.kind == "typed" and took > timeout + MARGIN_S
    kind = "hang" if late else outcome.kind
    assert kind == "typed" and isinstance(outcome.value, RequestTimeoutError), \
        f"outcome={kind}: after {took:.2f} s (timeout {timeout} s): {outcome.value!r}"


def test_a_timeout_holds_behind_a_long_warm(monkeypatch):
    engine = Engine(tiny_loaded("llama", seed=7))
    engine.store.batch_tokens = 64  # a few documents per batch
    _slow_computation(monkeypatch, engine, 0.3)  # 7 batches: about 2 s of warm()
    corpus = [f"Document {i} says the river Ast is {i} metres wide near the old bridge." for i in range(20)]
    warm = threading.Thread(target=engine.warm, args=(corpus,))
    warm.start()
    time.sleep(0.2)
    outcome, took = _time_to_error(lambda: engine.generate(QUESTION, DOCS[:1], max_new_tokens=2, timeout=0.5))
    _timed_out_on_time(outcome, took, 0.5)
    assert warm.is_alive()  # the warm really was still running when the error came
    # and warm() yields between batches: a request without a timeout is answered before the corpus is done
    answer = engine.generate("Where?", ["The river Ast."], max_new_tokens=2)
    assert len(answer.token_ids) == 2 and warm.is_alive()
    warm.join(60)
    assert engine.store.stats.misses >= 20


@pytest.mark.parametrize("caller", ["generate", "agenerate", "astream", "generate_many", "stream"])
def test_a_timeout_holds_while_one_step_computes_caches(monkeypatch, caller):
    """One long step (a request's cold caches computed in its plan) cannot be cut short: the deadline watcher
    fails the requests queued behind it, and the long request itself, on time."""
    engine = Engine(tiny_loaded("llama", seed=8))
    _slow_computation(monkeypatch, engine, 2.5)
    started = time.perf_counter()
    long_outcome = {}

    def long_request() -> None:
        long_outcome["value"] = _time_to_error(lambda: engine.generate(
            "Slow?", ["A cold document nobody has seen.", "Another."], max_new_tokens=2, timeout=1.0))

    long = threading.Thread(target=long_request)
    long.start()
    time.sleep(0.2)
    calls: dict[str, Callable[[], Any]] = {
        "generate": lambda: engine.generate(QUESTION, ["Other."], max_new_tokens=2, timeout=0.5),
        "agenerate": lambda: asyncio.run(engine.agenerate(QUESTION, ["Other."], max_new_tokens=2, timeout=0.5)),
        "astream": lambda: asyncio.run(_drain(engine.astream(QUESTION, ["Other."], max_new_tokens=2, timeout=0.5))),
        "generate_many": lambda: engine.generate_many([QUESTION, "Where?"], ["Other."], mode="single",
                                                      max_new_tokens=2, timeout=0.5),
        "stream": lambda: list(engine.stream(QUESTION, ["Other."], max_new_tokens=2, timeout=0.5)),
    }
    outcome, took = _time_to_error(calls[caller])
    _timed_out_on_time(outcome, took, 0.5)
    long.join(20)
    long_result, long_took = long_outcome["value"]
    _timed_out_on_time(long_result, long_took, 1.0)
    assert time.perf_counter() - started < 20
    stats = _settled(engine)
    assert (stats["queue_depth"], stats["active_requests"]) == (0, 0) and stats["timed_out"] >= 2


async def _drain(stream: Any) -> list[str]:
    return [piece async for piece in stream]


def test_the_deadline_watcher_exits_when_no_request_has_a_deadline():
    engine = Engine(tiny_loaded("llama", seed=3))
    with pytest.raises(RequestTimeoutError):
        engine.generate(QUESTION, DOCS, max_new_tokens=400, timeout=0.05)
    deadline = time.perf_counter() + 5
    while engine.scheduler._watcher is not None and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert engine.scheduler._watcher is None


# -- on_token of the wrong arity (the bug: accepted, then a TypeError from inside decoding.py on the scheduler's
#    thread, mid-answer); refused at submission, in the caller's thread, naming on_token
def _keyword_only(*, piece: str) -> None:
    return None


ARITY = [("no-argument", lambda: None), ("two-arguments", lambda piece, more: None),
         ("keyword-only", _keyword_only)]


@pytest.mark.parametrize("request_kind", ["generate", "chat"])
@pytest.mark.parametrize("callback", [c for _, c in ARITY], ids=[i for i, _ in ARITY])
def test_an_on_token_of_the_wrong_arity_is_refused_naming_it(engine, callback, request_kind):
    def call() -> Any:
        if request_kind == "chat":
            return engine.chat([{"role": "user", "content": "hi"}], on_token=callback, max_new_tokens=2)
        return engine.generate(QUESTION, DOCS, on_token=callback, max_new_tokens=2)

    outcome = attempt(call, expect="typed")
    check(outcome, "typed")
    assert isinstance(outcome.value, InvalidOptionError) and "on_token" in str(outcome.value), outcome.message()


class _Collector:
    def __init__(self) -> None:
        self.pieces: list[str] = []

    def __call__(self, piece: str) -> None:
        self.pieces.append(piece)


GOOD_CALLBACKS = [("lambda", lambda piece: None), ("varargs", lambda *pieces: None),
                  ("with-default", lambda piece, end="": None), ("callable-object", _Collector()),
                  ("bound-method", _Collector().pieces.append), ("builtin", print),
                  ("partial", functools.partial(lambda prefix, piece: None, "x"))]


@pytest.mark.parametrize("callback", [c for _, c in GOOD_CALLBACKS], ids=[i for i, _ in GOOD_CALLBACKS])
def test_an_on_token_taking_one_piece_is_accepted(engine, callback, capsys):
    check(attempt(lambda: engine.generate(QUESTION, DOCS, on_token=callback, max_new_tokens=2), expect="answer"),
          "answer")
