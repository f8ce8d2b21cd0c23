"""ContextOfExpertsRunnable: an LCEL Runnable over the engine, checked against the engine itself.

Mechanics run on a tiny random Llama (same tokenizer as the embedded model): the runnable must give
exactly what ``Engine.generate`` gives for the same inputs, so equality tests are meaningful even with
random weights. One end-to-end chain runs on the embedded SmolLM2 (marked slow).
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from ctx_integrations import DEFAULT_MODE, Document, Engine
from ctx_integrations.errors import (
    EmptyDocumentsError,
    InvalidOptionError,
    InvalidScoresError,
    MissingDependencyError,
    UnknownModeError,
)
from ctx_integrations.langchain import ContextOfExpertsRunnable
from tests.helpers import loop_ticks, tiny_loaded

DOCS = [
    LCDocument(page_content="The secret code of the vault is 4721.", id="vault",
               metadata={"score": 0.9, "scores": {"dense": 0.6, "dense_norm": 0.8}, "source": "a.txt"}),
    LCDocument(page_content="Paris is the capital of France.", id="paris", metadata={"score": 0.4}),
]
QUESTION = "What is the secret code?"
TOKENS = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture
def runnable(engine) -> ContextOfExpertsRunnable:
    return ContextOfExpertsRunnable(engine=engine, max_new_tokens=TOKENS)


_EXPECTED: dict = {}


def expected(engine: Engine, mode: str = DEFAULT_MODE, max_new_tokens: int = TOKENS, **options):
    """The engine's own answer to QUESTION over DOCS (memoised: greedy decoding is deterministic)."""
    key = (mode, max_new_tokens, tuple(sorted(options.items())))
    if key not in _EXPECTED:
        docs = [Document(d.page_content, d.id, d.metadata["score"]) for d in DOCS]
        _EXPECTED[key] = engine.generate(QUESTION, docs, mode=mode, max_new_tokens=max_new_tokens, **options)
    return _EXPECTED[key]


class Recorder(BaseCallbackHandler):
    def __init__(self):
        self.events: list[tuple[str, str | None]] = []

    def on_chain_start(self, serialized, inputs, *, name=None, **kwargs):
        self.events.append(("chain_start", name))

    def on_chain_end(self, outputs, **kwargs):
        self.events.append(("chain_end", type(outputs).__name__))

    def on_chain_error(self, error, **kwargs):
        self.events.append(("chain_error", type(error).__name__))

    def on_retriever_start(self, serialized, query, **kwargs):
        self.events.append(("retriever_start", query))


def test_invoke_matches_engine_and_carries_trace_citations_timings(runnable, engine):
    message = runnable.invoke({"question": QUESTION, "documents": DOCS})
    answer = expected(engine)
    assert isinstance(message, AIMessage) and message.content == answer.text
    meta = message.response_metadata
    assert meta["mode"] == DEFAULT_MODE and meta["model_name"] == engine.loaded.name
    assert [step["token_id"] for step in meta["trace"]] == answer.token_ids
    assert {"ttft_s", "total_s", "tokens_per_s"} <= set(meta["timings"])
    assert [d["id"] for d in meta["documents"]] == ["vault", "paris"]
    assert meta["documents"][0]["scores"] == {"dense": 0.6, "dense_norm": 0.8}  # every part travels through
    assert meta["documents"][0]["metadata"] == {"source": "a.txt"}
    won = [d["tokens_won"] for d in meta["documents"]]
    assert sum(won) == len(answer.token_ids)
    assert meta["cited_documents"] == sorted((i for i in range(2) if won[i]), key=lambda i: -won[i])
    layout = engine.layout
    prompt = len(layout.prefix_ids) + sum(len(layout.context_ids(d.page_content)) for d in DOCS)
    prompt += len(layout.suffix_ids(QUESTION))
    assert message.usage_metadata == {"input_tokens": prompt, "output_tokens": len(answer.token_ids),
                                      "total_tokens": prompt + len(answer.token_ids)}


def test_scores_are_read_from_metadata(runnable, engine):
    """The relevance prior is metadata['score']: changing it changes the PCED answer the same way as in the engine."""
    flipped = [DOCS[0].model_copy(update={"metadata": {"score": 0.01}}),
               DOCS[1].model_copy(update={"metadata": {"score": 0.99}})]
    message = runnable.invoke({"question": QUESTION, "documents": flipped})
    docs = [Document(d.page_content, d.id, d.metadata["score"]) for d in flipped]
    assert message.content == engine.generate(QUESTION, docs, max_new_tokens=TOKENS).text
    assert [d["score"] for d in message.response_metadata["documents"]] == [0.01, 0.99]


def test_text_output_and_plain_documents(engine):
    runnable = ContextOfExpertsRunnable(engine=engine, max_new_tokens=TOKENS, output="text")
    texts = [d.page_content for d in DOCS]
    out = runnable.invoke({"question": QUESTION, "documents": texts})
    assert out == engine.generate(QUESTION, texts, max_new_tokens=TOKENS).text
    pieces = list(runnable.stream({"question": QUESTION, "documents": texts}))
    assert len(pieces) > 2 and all(isinstance(p, str) for p in pieces) and "".join(pieces) == out


def test_stream_yields_token_chunks_that_join_to_the_answer(runnable, engine):
    chunks = list(runnable.stream({"question": QUESTION, "documents": DOCS}))
    answer = expected(engine)
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == answer.text
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.response_metadata["model_name"] == engine.loaded.name  # metadata once, not concatenated
    assert merged.usage_metadata["output_tokens"] == len(answer.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_astream_does_not_block_the_event_loop(engine):
    runnable = ContextOfExpertsRunnable(engine=engine, max_new_tokens=24)
    arrivals: list[float] = []

    async def main():
        chunks = []
        async with loop_ticks() as ticks:
            async for chunk in runnable.astream({"question": QUESTION, "documents": DOCS}):
                arrivals.append(time.perf_counter())
                chunks.append(chunk)
        return chunks, ticks

    chunks, ticks = asyncio.run(main())
    assert len(chunks) > 2
    assert "".join(c.content for c in chunks) == expected(engine, max_new_tokens=24).text
    during = [t for t in ticks if arrivals[0] < t < arrivals[-1]]
    assert len(during) >= 3, f"the loop ticked {len(during)} times while tokens were decoded"


def test_astream_events_report_each_token(runnable, engine):
    async def events():
        return [e async for e in runnable.astream_events({"question": QUESTION, "documents": DOCS}, version="v2")]

    streamed = [e for e in asyncio.run(events()) if e["event"] == "on_chain_stream"]
    assert len(streamed) > 2 and "".join(e["data"]["chunk"].content for e in streamed) == expected(engine).text


def test_ainvoke_matches_invoke(runnable, engine):
    message = asyncio.run(runnable.ainvoke({"question": QUESTION, "documents": DOCS}))
    assert message.content == expected(engine).text and message.response_metadata["trace"]


def test_the_config_specs_describe_the_modes_and_the_modes_options_from_their_declarations(engine):
    # Caught: a hand-kept list of modes (a plugin's mode or a new one missing), options described by hand
    from ctx_integrations import available_modes
    from ctx_integrations.engine.core.mode_catalog import mode_spec

    runnable = ContextOfExpertsRunnable(engine=engine, mode="soft_nbce")
    specs = {s.id: s for s in runnable.config_specs}
    listed = specs["mode"].description.removeprefix("one of ").split(", ")
    assert listed == available_modes()
    described = specs["mode_options"].description
    assert all(f"{o.name}: {o.expected()}, default {o.default!r}" in described for o in mode_spec("soft_nbce").options)
    concat = {s.id: s for s in ContextOfExpertsRunnable(engine=engine, mode="concat").config_specs}
    assert concat["mode_options"].description.endswith("concat's: none")


def test_mode_is_configurable_per_call(engine):
    runnable = ContextOfExpertsRunnable(engine=engine, max_new_tokens=TOKENS, mode_options={"pced": {"gamma": 0.5}})
    assert {"mode", "mode_options", "max_new_tokens", "temperature"} <= {s.id for s in runnable.config_specs}
    default = runnable.invoke({"question": QUESTION, "documents": DOCS})
    assert default.content == expected(engine, gamma=0.5).text
    concat = runnable.with_config(configurable={"mode": "concat"}).invoke({"question": QUESTION, "documents": DOCS})
    assert concat.response_metadata["mode"] == "concat"  # pced's gamma is not sent to concat
    assert concat.content == expected(engine, mode="concat").text
    single = runnable.invoke({"question": QUESTION, "documents": DOCS},
                             config={"configurable": {"mode": "single", "max_new_tokens": 4}})
    assert single.content == expected(engine, mode="single", max_new_tokens=4).text
    assert single.response_metadata["trace"][0]["document"] == 0  # the top-scored document


def test_runnable_with_retriever_takes_a_plain_question_and_callbacks_see_the_run(engine):
    retriever = RunnableLambda(lambda question: DOCS, name="docs_for_question")
    runnable = ContextOfExpertsRunnable(engine=engine, retriever=retriever, max_new_tokens=TOKENS)
    recorder = Recorder()
    message = runnable.invoke(QUESTION, config={"callbacks": [recorder]})
    assert message.content == expected(engine).text
    assert recorder.events[0] == ("chain_start", "ContextOfExpertsRunnable")
    assert ("chain_start", "docs_for_question") in recorder.events  # retrieval is a child run
    assert recorder.events[-1] == ("chain_end", "AIMessage")


def test_lcel_chain_streams_through_parallel_inputs(engine):
    chain = {"question": RunnablePassthrough(), "documents": RunnableLambda(lambda q: DOCS)} | \
        ContextOfExpertsRunnable(engine=engine, max_new_tokens=TOKENS)
    chunks = list(chain.stream(QUESTION))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == expected(engine).text


def test_batch_over_different_documents_answers_each(runnable, engine):
    inputs = [{"question": QUESTION, "documents": DOCS}, {"question": "Which city?", "documents": DOCS[1:]}]
    recorder = Recorder()
    outputs = runnable.batch(inputs, config={"callbacks": [recorder]})
    assert outputs[0].content == expected(engine).text
    second = Document(DOCS[1].page_content, DOCS[1].id, DOCS[1].metadata["score"])
    assert outputs[1].content == engine.generate("Which city?", [second], max_new_tokens=TOKENS).text
    assert sum(1 for kind, _ in recorder.events if kind == "chain_end") == 2
    again = asyncio.run(runnable.abatch(inputs))
    assert [m.content for m in again] == [m.content for m in outputs]


def test_batch_over_shared_documents(runnable, engine):
    """Questions over the same documents are answered in one IPPD decode."""
    questions = [QUESTION, "Which city is the capital?"]
    outputs = runnable.batch([{"question": q, "documents": DOCS} for q in questions])
    docs = [Document(d.page_content, d.id, d.metadata["score"]) for d in DOCS]
    answers = engine.generate_many(questions, docs, mode="ippd", max_new_tokens=TOKENS)
    assert [o.content for o in outputs] == [a.text for a in answers]
    assert [o.response_metadata["mode"] for o in outputs] == ["ippd", "ippd"]
    assert outputs[0].response_metadata["extra"]["stacked_questions"] == 2


def test_bad_inputs_raise_clear_errors(runnable, engine):
    with pytest.raises(InvalidOptionError, match="no 'question'"):
        runnable.invoke({"query": QUESTION, "documents": DOCS})
    with pytest.raises(EmptyDocumentsError, match="empty text"):
        runnable.invoke({"question": QUESTION, "documents": [LCDocument(page_content="  ")]})
    with pytest.raises(EmptyDocumentsError, match="no 'documents'"):
        runnable.invoke(QUESTION)
    with pytest.raises(EmptyDocumentsError, match="list of documents"):
        runnable.invoke({"question": QUESTION, "documents": "just one string"})
    with pytest.raises(UnknownModeError, match="unknown mode 'pcde'"):
        runnable.invoke({"question": QUESTION, "documents": DOCS}, config={"configurable": {"mode": "pcde"}})
    with pytest.raises(InvalidScoresError, match="outside"):
        runnable.invoke({"question": QUESTION, "documents": [LCDocument(page_content="x", metadata={"score": 3.0})]})
    with pytest.raises(InvalidOptionError, match="does not accept"):
        runnable.invoke({"question": QUESTION, "documents": DOCS}, config={"configurable": {"mode_options": {"x": 1}}})
    with pytest.raises(UnknownModeError):
        ContextOfExpertsRunnable(engine=engine, mode="nope")
    with pytest.raises(InvalidOptionError, match="does not accept"):
        ContextOfExpertsRunnable(engine=engine, mode_options={"concat": {"gamma": 1.0}})
    with pytest.raises(InvalidOptionError, match="engine must be"):
        ContextOfExpertsRunnable(engine="SmolLM2")


def test_error_reaches_callbacks_and_stream(runnable):
    recorder = Recorder()
    with pytest.raises(EmptyDocumentsError):
        list(runnable.stream({"question": QUESTION, "documents": []}, config={"callbacks": [recorder]}))
    assert recorder.events[-1] == ("chain_error", "EmptyDocumentsError")

    async def consume():
        return [c async for c in runnable.astream({"question": QUESTION, "documents": [LCDocument(page_content="")]})]

    with pytest.raises(EmptyDocumentsError):
        asyncio.run(consume())


def test_import_without_langchain_raises_missing_dependency(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[:2] == ["ctx_integrations", "langchain"]]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    with pytest.raises(MissingDependencyError, match=r"ctx-integrations\[langchain\]"):
        importlib.import_module("ctx_integrations.langchain")


@pytest.mark.slow
def test_lcel_chain_on_the_embedded_default(embedded_engine):
    """The README's chain: retriever over MiniLM -> PCED on the embedded SmolLM2, scores and citations kept."""
    from langchain_core.vectorstores import InMemoryVectorStore

    from ctx_integrations.langchain import EmbedderEmbeddings, VectorStoreScoredRetriever

    store = InMemoryVectorStore(embedding=EmbedderEmbeddings())
    store.add_texts(["The secret code of the vault is 4721.", "Paris is the capital of France.",
                     "Mount Fuji is the highest mountain in Japan."], ids=["vault", "paris", "fuji"])
    retriever = VectorStoreScoredRetriever(vectorstore=store, search="similarity", k=2)
    chain = {"question": RunnablePassthrough(), "documents": retriever} | \
        ContextOfExpertsRunnable(engine=embedded_engine, max_new_tokens=12)
    message = chain.invoke("What is the secret code of the vault?")
    assert "4721" in message.content
    meta = message.response_metadata
    assert meta["documents"][0]["id"] == "vault" and meta["cited_documents"][0] == 0
    assert 0.5 < meta["documents"][0]["score"] < 1 and "similarity" in meta["documents"][0]["scores"]
    chunks = list(chain.stream("What is the secret code of the vault?"))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == message.content
