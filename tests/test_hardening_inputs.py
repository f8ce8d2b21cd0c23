"""Issue 18, items 1-3: every bad input is a typed error naming the argument, refused before any work.

Each table row is one input an attacker (or a careless caller) tried. The bug each row catches: the value
got through a comparison that NaN, a string or a bool slips past (``nan < 0`` is false; ``True`` is an
int; ``1.5 >= 1``), and then decoded forever, gave garbage or crashed inside torch/tokenizers.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from ctx_integrations import Document, Engine
from ctx_integrations.engine.core import model as model_module
from ctx_integrations.engine.core.validation import real_number, torch_device, whole_number
from ctx_integrations.errors import (
    CtxIntegrationsError,
    DocumentTooLongError,
    EmptyDocumentsError,
    InvalidDocumentError,
    InvalidOptionError,
    InvalidScoresError,
    RequestTooLargeError,
)
from tests.helpers import tiny_loaded
from tests.mode_cases import every_mode

DOCS = ["The river Ost runs through Velden.", "Velden was founded in 1204."]
NAN, INF = float("nan"), float("inf")


def _typed(error: BaseException) -> None:
    """A typed library error that is also a ValueError (what a Python user catches for a bad argument)."""
    assert isinstance(error, CtxIntegrationsError) and isinstance(error, ValueError), repr(error)


DECODING = [
    ("max_new_tokens", NAN), ("max_new_tokens", 1.5), ("max_new_tokens", True), ("max_new_tokens", "3"),
    ("max_new_tokens", 0), ("max_new_tokens", -1), ("max_new_tokens", INF), ("max_new_tokens", None),
    ("temperature", NAN), ("temperature", INF), ("temperature", -1.0), ("temperature", "0.5"),
    ("temperature", 1e-300), ("temperature", None), ("temperature", [0.5]),
    ("top_p", NAN), ("top_p", 0.0), ("top_p", 1.5), ("top_p", INF), ("top_p", "1"), ("top_p", -INF),
    ("seed", NAN), ("seed", 1.5), ("seed", "1"), ("seed", -1), ("seed", True), ("seed", 2**64), ("seed", INF),
    ("stop", [1]), ("stop", 5), ("stop", [None]),
]


@pytest.mark.parametrize(("name", "value"), DECODING, ids=[f"{n}={v!r}" for n, v in DECODING])
def test_bad_decoding_settings_are_typed_errors_naming_the_argument(tiny_engine, name, value):
    with pytest.raises(InvalidOptionError, match=name if name != "stop" else "stop") as caught:
        tiny_engine.generate("Where is Velden?", DOCS, mode="concat", **{"max_new_tokens": 2, name: value})
    _typed(caught.value)


def test_integer_valued_float_max_new_tokens_is_that_many_tokens(tiny_engine):
    """2.0 (e.g. from JSON) is 2; the bug: ``len(trace) >= 1.5`` stopped after 2 tokens for 1.5."""
    answer = tiny_engine.generate("Where is Velden?", DOCS, mode="concat", max_new_tokens=2.0)
    assert len(answer.token_ids) <= 2


MODE_OPTIONS = [
    ("pced", "gamma", NAN), ("pced", "gamma", INF), ("pced", "gamma", "2.5"), ("pced", "gamma", -1.0),
    ("pced", "beta", NAN), ("pced", "beta", INF), ("pced", "beta", "0.5"), ("pced", "beta", True),
    ("pced", "score_space", ["logits"]), ("pced", "aggregation", None),
    ("pced", "query_likelihood", NAN), ("pced", "query_likelihood", INF), ("pced", "query_likelihood", "0.2"),
    ("pced", "query_likelihood", True), ("pced", "query_likelihood", -0.5),
    ("soft_nbce", "query_likelihood", NAN), ("soft_nbce", "query_likelihood", "0.2"),
    ("soft_nbce", "query_likelihood", True), ("soft_nbce", "query_likelihood", 101.0),
    ("rapid", "eta", NAN), ("rapid", "eta", INF), ("rapid", "eta", "10"), ("rapid", "eta", -1.0),
    ("rapid", "gamma", NAN), ("rapid", "gamma", 2.5), ("rapid", "gamma", True), ("rapid", "gamma", 0),
    ("rapid", "chunk_tokens", NAN), ("rapid", "chunk_tokens", 1.5), ("rapid", "chunk_tokens", "64"),
    ("rapid", "draft_context_tokens", NAN), ("rapid", "min_similarity", NAN), ("rapid", "min_similarity", 2.0),
    ("rapid", "ranking", 3),
    ("soft_nbce", "tau", NAN), ("soft_nbce", "tau", "0.1"), ("soft_nbce", "tau", 0.0), ("soft_nbce", "tau", -INF),
    ("soft_nbce", "beta", NAN), ("soft_nbce", "beta", INF), ("soft_nbce", "rho", NAN), ("soft_nbce", "rho", 0.0),
    ("soft_nbce", "rho", "0.9"), ("soft_nbce", "chunk_tokens", NAN), ("soft_nbce", "chunk_tokens", 1.5),
    ("nbce", "beta", NAN), ("nbce", "rho", INF), ("pcw", "beta", "x"), ("pcw", "rho", NAN),
    ("ape", "attention_temperature", NAN), ("ape", "attention_temperature", INF), ("ape", "scale", NAN),
    ("ape", "scale", "0.9"), ("ape", "scale", 0.0),
    ("map_reduce", "summary_tokens", NAN), ("map_reduce", "summary_tokens", 1.5), ("map_reduce", "summary_tokens", 0),
    ("ippd", "max_stack_tokens", NAN), ("ippd", "max_stack_tokens", 1.5), ("ippd", "max_stack_tokens", "512"),
]


@pytest.mark.parametrize(("mode", "name", "value"), MODE_OPTIONS, ids=[f"{m}-{n}={v!r}" for m, n, v in MODE_OPTIONS])
def test_bad_mode_options_are_typed_errors_naming_the_option(tiny_engine, mode, name, value):
    with pytest.raises(InvalidOptionError, match=name) as caught:
        tiny_engine.generate("Where is Velden?", DOCS, mode=mode, max_new_tokens=2, **{name: value})
    _typed(caught.value)


DEVICES = ["gpu", "cuda:99", "cuda", "meta", "cpu:x", "", 3, 1.5, object()]


@pytest.mark.parametrize("device", DEVICES, ids=[type(d).__name__ if type(d) is object else repr(d) for d in DEVICES])
def test_bad_device_is_a_typed_error_before_loading(tmp_path, device):
    """The bug: ``torch.device("gpu")`` raised a RuntimeError from inside torch, after nothing was checked."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidOptionError, match="device") as caught:
        model_module.load_model(tmp_path / "no-such-model", device=device)
    _typed(caught.value)


def test_validators_accept_good_values():
    assert whole_number("n", 3.0) == 3 and isinstance(whole_number("n", 3.0), int)
    assert real_number("x", 2) == 2.0
    assert real_number("tau", math.inf, minimum=0, min_inclusive=False, allow_inf=True) == math.inf
    assert torch_device("cpu").type == "cpu"


class _WithText:
    def __init__(self, text):
        self.text = text


BAD_DOCUMENTS = [
    ([{"text": None}], InvalidDocumentError), ([{"text": 5}], InvalidDocumentError),
    ([{"text": b"bytes"}], InvalidDocumentError), ([{"body": "no text key"}], InvalidDocumentError),
    ({"text": "a dict as the whole argument"}, InvalidDocumentError),
    (Document("one Document, not a list"), InvalidDocumentError),
    ([Document(None)], InvalidDocumentError), ([Document(12)], InvalidDocumentError),
    ([5], InvalidDocumentError), ([None], InvalidDocumentError), ([b"bytes"], InvalidDocumentError),
    (["lone \ud800 surrogate"], InvalidDocumentError), ([{"text": "x\udfffy"}], InvalidDocumentError),
    ([_WithText(None)], InvalidDocumentError), ([_WithText(3.5)], InvalidDocumentError),
    ([{"text": "ok", "metadata": "not a mapping"}], InvalidDocumentError),
    (5, InvalidDocumentError), (None, EmptyDocumentsError), (b"bytes", EmptyDocumentsError),
    ([], EmptyDocumentsError), (["  \n "], EmptyDocumentsError),
]


@pytest.mark.parametrize(("documents", "error"), BAD_DOCUMENTS, ids=[repr(d)[:40] for d, _ in BAD_DOCUMENTS])
def test_bad_documents_are_typed_errors(tiny_engine, documents, error):
    """The bugs: ``{"text": None}`` became the document "None", a dict became the document "text"."""
    with pytest.raises(error) as caught:
        tiny_engine.generate("Where is Velden?", documents, mode="concat", max_new_tokens=2)
    _typed(caught.value)


BAD_SCORES = [[True, 0.5], ["0.5", 0.5], [INF, 0.5], [-INF, 0.5], [NAN, NAN], "05", {"a": 1.0}, 7, [1e400, 0.5]]


@pytest.mark.parametrize("scores", BAD_SCORES, ids=[repr(s) for s in BAD_SCORES])
def test_bad_scores_are_typed_errors(tiny_engine, scores):
    with pytest.raises(InvalidScoresError) as caught:
        tiny_engine.generate("Where is Velden?", DOCS, scores=scores, mode="pced", max_new_tokens=2)
    _typed(caught.value)


BAD_QUERIES = [None, 5, b"bytes", "  ", "lone \ud800 surrogate", ["a list"]]


@pytest.mark.parametrize("query", BAD_QUERIES, ids=[repr(q) for q in BAD_QUERIES])
@pytest.mark.parametrize("mode", ["pced", "concat", "ape"])
def test_bad_queries_are_typed_errors(tiny_engine, query, mode):
    """The bug: a lone surrogate reached the tokenizer, which raised a TypeError."""
    with pytest.raises(CtxIntegrationsError) as caught:
        tiny_engine.generate(query, DOCS, mode=mode, max_new_tokens=2)
    _typed(caught.value)


@every_mode()
def test_request_over_the_memory_budget_is_refused_before_any_cache_is_computed(tmp_path, mode):
    """Item 3: the bug was 2000 tiny documents allocating 6.4 GB; now the KV bytes are checked first."""
    engine = Engine(tiny_loaded("llama"), cache_dir=tmp_path / "kv")
    engine.max_request_bytes = 4096  # 8 tokens of the tiny model's KV

    def forbidden(*args, **kwargs):
        raise AssertionError("a cache was computed before the budget was checked")

    engine.store.documents_tokens = forbidden
    engine.store.document_tokens = forbidden
    with pytest.raises(RequestTooLargeError, match="max_request_bytes") as caught:
        engine.generate("Where is Velden?", DOCS, mode=mode, max_new_tokens=4)
    _typed(caught.value)


def test_many_documents_under_the_default_budget_are_refused(tmp_path):
    """2000 documents x ~40 tokens of a SmolLM2-sized KV (30 layers, 3 KV heads, dim 64, fp32) > 2 GiB."""
    from ctx_integrations.engine.core.registry import DEFAULT_CPU_REQUEST_BYTES, kv_bytes_per_token

    loaded = tiny_loaded("llama", num_hidden_layers=30, hidden_size=192, num_attention_heads=3,
                         num_key_value_heads=3, intermediate_size=16)
    assert kv_bytes_per_token(loaded) == 30 * 2 * 3 * 64 * 4
    engine = Engine(loaded)
    documents = [f"Document number {i} says that the river Ost is {i} metres wide at the bridge." for i in range(2000)]
    with pytest.raises(RequestTooLargeError) as caught:
        engine.generate("How wide is the Ost?", documents, mode="pced", max_new_tokens=4)
    assert f"budget of {DEFAULT_CPU_REQUEST_BYTES / 2**20:.1f} MiB" in str(caught.value)
    assert engine.store.stats.misses == 0  # nothing was computed


def test_map_reduce_past_the_window_is_refused(tmp_path):
    """The bug: the map step ran each document past the model's positions and answered anyway."""
    engine = Engine(tiny_loaded("llama", max_position_embeddings=160))
    document = "word " * 60  # fits prefix + document + question + 4 new tokens, not + 96 summary tokens
    with pytest.raises(DocumentTooLongError, match="summary_tokens"):
        engine.generate("What word?", [document], mode="map_reduce", max_new_tokens=4)


def test_a_retrieval_query_with_a_lone_surrogate_is_a_typed_error(tmp_path):
    """The embedder's tokenizer raised a bare TypeError on it from the Python API (the CLI refused it first)."""
    from ctx_integrations.retrieval import DocumentStore, ScoredRetriever

    store = DocumentStore(tmp_path / "store")
    store.add(["Marrowgate is the capital of Veloria."], warm=False)
    with pytest.raises(InvalidDocumentError, match="lone surrogate"):
        ScoredRetriever(store).retrieve("Who rules \ud800?", top_k=1)


# -- reliability issue, item 6: every budget is validated, and binds every kind of request ---------------------------
BUDGETS = ["memory_bytes", "host_bytes", "disk_bytes", "max_request_bytes", "max_batch_bytes", "max_queued_requests"]
BAD_BUDGETS = [1.5, -1, True, "1", NAN, INF, [1]]


@pytest.mark.parametrize("with_folder", [False, True], ids=["no-cache-dir", "cache-dir"])
@pytest.mark.parametrize("value", BAD_BUDGETS, ids=[repr(v) for v in BAD_BUDGETS])
@pytest.mark.parametrize("name", BUDGETS)
def test_a_bad_budget_is_a_typed_error_naming_it(loaded, tmp_path, name, value, with_folder):
    """The bug: ``Engine(disk_bytes=1.5)`` (or ``-1``, ``"1"``) was accepted whenever there was no cache folder."""
    folder = tmp_path / "kv" if with_folder else None
    with pytest.raises(InvalidOptionError, match=name) as caught:
        Engine(loaded, cache_dir=folder, **{name: value})
    _typed(caught.value)


@pytest.mark.parametrize("name", BUDGETS)
def test_a_budget_below_its_minimum_is_refused_and_the_minimum_accepted(loaded, name):
    minimum = 0 if name in ("memory_bytes", "host_bytes", "disk_bytes") else 1
    with pytest.raises(InvalidOptionError, match=name):
        Engine(loaded, **{name: minimum - 1})
    if name != "max_batch_bytes":  # the model's scheduler keeps the budget it was built with
        Engine(loaded, **{name: minimum})


CHAT = [{"role": "user", "content": "Where does the river Ost run?"}]


def _chat_bytes(engine: Engine, max_new_tokens: int) -> int:
    from ctx_integrations.engine.core.chat import conversation_ids
    from ctx_integrations.engine.core.registry import kv_bytes_per_token

    return kv_bytes_per_token(engine.loaded) * (len(conversation_ids(engine.layout, CHAT)) + max_new_tokens)


async def _astream_chat(engine: Engine) -> str:
    return "".join([piece async for piece in engine.astream_chat(CHAT, max_new_tokens=4)])


CHAT_CALLS = {
    "chat": lambda engine: engine.chat(CHAT, max_new_tokens=4),
    "achat": lambda engine: asyncio.run(engine.achat(CHAT, max_new_tokens=4)),
    "stream_chat": lambda engine: "".join(engine.stream_chat(CHAT, max_new_tokens=4)),
    "astream_chat": lambda engine: asyncio.run(_astream_chat(engine)),
}


@pytest.mark.parametrize("call", sorted(CHAT_CALLS))
def test_a_conversation_over_max_request_bytes_is_refused(loaded, call):
    """The bug: chat never checked the per-request budget (``max_request_bytes=1`` still answered a chat)."""
    engine = Engine(loaded, max_request_bytes=1)
    with pytest.raises(RequestTooLargeError, match="max_request_bytes") as caught:
        CHAT_CALLS[call](engine)
    _typed(caught.value)
    assert "the conversation" in str(caught.value) and "Drop earlier turns" in str(caught.value)


def test_a_conversation_exactly_at_max_request_bytes_is_answered_and_one_byte_less_refused(loaded):
    """The boundary: prompt + max_new_tokens tokens of KV fit a budget of exactly their bytes."""
    needed = _chat_bytes(Engine(loaded), 4)
    assert Engine(loaded, max_request_bytes=needed).chat(CHAT, max_new_tokens=4).token_ids
    with pytest.raises(RequestTooLargeError):
        Engine(loaded, max_request_bytes=needed - 1).chat(CHAT, max_new_tokens=4)


def test_a_conversation_over_max_batch_bytes_alone_is_refused():
    """The batch budget binds chat too (a fresh model: its scheduler keeps the first engine's budget)."""
    engine = Engine(tiny_loaded("llama", seed=5), max_batch_bytes=1)
    with pytest.raises(RequestTooLargeError, match="max_batch_bytes"):
        engine.chat(CHAT, max_new_tokens=4)


# -- reliability issue, item 7: the untyped API errors ----------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("metadata", 1), ("metadata", ["a"]), ("scores", [0.5]),
                                              ("scores", 1), ("scores", "0.5")])
def test_a_document_with_scores_or_metadata_that_are_not_a_mapping_is_refused_naming_them(field, value):
    """The bug: ``Document(metadata=1)`` was built, then failed inside ``as_document`` with ``TypeError: 'int'
    object is not iterable``, naming nothing."""
    with pytest.raises(InvalidDocumentError, match=rf"Document\({field}=") as caught:
        Document("Velden lies on the Ost.", **{field: value})
    _typed(caught.value)


@pytest.mark.parametrize(("field", "value"), [("metadata", 1), ("scores", [0.5]), ("scores", 1)])
def test_a_document_whose_scores_or_metadata_were_reassigned_is_refused_by_the_engine(tiny_engine, field, value):
    document = Document("Velden lies on the Ost.")
    setattr(document, field, value)
    with pytest.raises(InvalidDocumentError, match=rf"document 0: .*Document\({field}=") as caught:
        tiny_engine.generate("Where is Velden?", [document], mode="concat", max_new_tokens=2)
    _typed(caught.value)


def test_a_document_without_scores_or_metadata_gets_empty_ones():
    document = Document("Velden lies on the Ost.", scores=None, metadata=None)
    assert document.scores == {} and document.metadata == {}
    scores = {"dense": 0.5}
    assert Document("x", scores=scores).scores == scores
