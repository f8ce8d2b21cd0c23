"""LlamaIndex's stock patterns with the decoder: one engine (llm= / Settings.llm), caches that outlive the
engine, ContextOfExpertsSynthesizer in stock query engines, the chat engine, legacy callbacks, and the
warning for unscored nodes. Real llama-index-core classes throughout; a tiny random Llama decodes (the
answers are compared with ``Engine.generate`` over the same nodes and priors, so equality is meaningful).
"""

from __future__ import annotations

import asyncio
import warnings

import pytest
from llama_index.core import Settings, StorageContext, load_index_from_storage
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.callbacks import (
    CallbackManager,
    CBEventType,
    EventPayload,
    LlamaDebugHandler,
    TokenCountingHandler,
)
from llama_index.core.chat_engine.condense_question import DEFAULT_PROMPT
from llama_index.core.llms import MockLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from ctx_integrations import DEFAULT_MODE, Document, Engine, adapters
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.llama_index import (
    ContextOfExpertsChatEngine,
    ContextOfExpertsQueryEngine,
    ContextOfExpertsSynthesizer,
    ExpertDecoderLLM,
    KVCacheWarmer,
    MissingScoreWarning,
    UndecodedContextWarning,
    default_embedding,
    node_text,
)
from tests.helpers import concatenated_prompt_tokens as prompt_tokens
from tests.helpers import tiny_loaded
from tests.llama_index_support import QUESTION, memory_index

TOKENS = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture(scope="module")
def llm(engine) -> ExpertDecoderLLM:
    return ExpertDecoderLLM(engine=engine, max_new_tokens=TOKENS)


@pytest.fixture(scope="module")
def index():
    return memory_index()


@pytest.fixture
def settings_llm(monkeypatch, llm):
    """``Settings.llm = llm`` for one test (the private attribute: the property would resolve a default LLM)."""
    monkeypatch.setattr(Settings, "_llm", llm)
    return llm


@pytest.fixture
def shared_tiny(monkeypatch, tmp_path):
    """The shared default engines over a tiny model, with ``CTX_CACHE_DIR`` in a per-test folder."""
    monkeypatch.setenv("CTX_CACHE_DIR", str(tmp_path / "user-cache"))
    loaded = tiny_loaded("llama")
    monkeypatch.setattr(adapters, "default_loaded", lambda: loaded)
    monkeypatch.setattr(adapters, "_engines", {})
    monkeypatch.setattr(Settings, "_llm", None)
    return loaded


def expected(engine: Engine, sources: list[NodeWithScore], question: str = QUESTION):
    docs = [Document(node_text(item.node), item.node.node_id, item.score) for item in sources]
    return engine.generate(question, docs, max_new_tokens=TOKENS)


# -- 1. one engine ---------------------------------------------------------------------------------------------
def test_llm_argument_and_settings_llm_pick_one_engine(index, engine, llm, settings_llm):
    given = ContextOfExpertsQueryEngine.from_index(index, llm=ExpertDecoderLLM(engine=engine))
    assert given.engine is engine
    from_settings = [ContextOfExpertsQueryEngine.from_index(index), ContextOfExpertsSynthesizer(),
                     ContextOfExpertsChatEngine.from_index(index)._query_engine]
    assert all(item.llm is llm and item.engine is engine for item in from_settings)
    assert KVCacheWarmer().engine is engine
    assert from_settings[0].sampling.max_tokens == TOKENS  # the LLM's settings, unless overridden


def test_another_settings_llm_is_not_used_silently(index, shared_tiny, monkeypatch):
    monkeypatch.setattr(Settings, "_llm", MockLLM())
    with pytest.warns(UserWarning, match="Settings.llm is a MockLLM.*embedded model instead"):
        query_engine = ContextOfExpertsQueryEngine.from_index(index)
    assert query_engine.llm.engine is None and query_engine.engine.loaded is shared_tiny


def test_wrong_llm_arguments_are_typed_errors(index, engine, llm):
    with pytest.raises(InvalidOptionError, match="llm must be an ExpertDecoderLLM"):
        ContextOfExpertsQueryEngine.from_index(index, llm=MockLLM())
    with pytest.raises(InvalidOptionError, match="not llm and engine"):
        ContextOfExpertsSynthesizer(llm, engine=engine)
    with pytest.raises(InvalidOptionError, match="not engine and cache_dir"):
        ContextOfExpertsQueryEngine.from_index(index, engine=engine, cache_dir=None)
    with pytest.raises(InvalidOptionError, match="max_new_tokens or its alias max_tokens"):
        ExpertDecoderLLM(engine=engine, max_tokens=4, max_new_tokens=4)
    assert ExpertDecoderLLM(engine=engine, max_tokens=5).max_new_tokens == 5


# -- 2. caches persist by default ------------------------------------------------------------------------------
def test_default_engines_keep_caches_under_the_user_cache_dir(shared_tiny, tmp_path):
    default = ExpertDecoderLLM().resolved_engine
    assert default.store.directory == tmp_path / "user-cache" / "kv"  # the KV root ingest and serve use too
    assert ExpertDecoderLLM(cache_dir=None).resolved_engine.store.directory is None
    custom = ExpertDecoderLLM(cache_dir=tmp_path / "mine").resolved_engine
    assert custom.store.directory == tmp_path / "mine"
    assert default.loaded is custom.loaded is shared_tiny  # one model in memory, whatever the cache folders
    assert ExpertDecoderLLM().resolved_engine is default


def test_an_index_reloaded_from_storage_hits_the_caches_of_an_earlier_engine(shared_tiny, tmp_path):
    index = memory_index()
    index.storage_context.persist(persist_dir=str(tmp_path / "index"))
    first = ContextOfExpertsQueryEngine.from_index(index, similarity_top_k=2, max_new_tokens=4).query(QUESTION)
    assert first.metadata["cache"] == {"hits": 0, "misses": 2}

    adapters._engines.clear()  # what a new process starts with: no engine, nothing in memory
    reloaded = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(tmp_path / "index")),
                                       embed_model=default_embedding())
    query_engine = ContextOfExpertsQueryEngine.from_index(reloaded, similarity_top_k=2, max_new_tokens=4)
    assert query_engine.engine is not first  # a fresh engine ...
    again = query_engine.query(QUESTION)
    assert again.metadata["cache"] == {"hits": 2, "misses": 0}  # ... that found both caches on disk
    assert again.response == first.response


def test_cache_dir_none_keeps_caches_in_memory_only(shared_tiny, tmp_path):
    index = memory_index()
    ContextOfExpertsQueryEngine.from_index(index, cache_dir=None, max_new_tokens=2).query(QUESTION)
    assert not (tmp_path / "user-cache" / "kv").exists()


# -- 3. the synthesizer in stock query engines -----------------------------------------------------------------
def test_stock_query_engines_answer_with_the_synthesizer(index, engine, settings_llm):
    synthesizer = ContextOfExpertsSynthesizer()
    stock = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=2), response_synthesizer=synthesizer)
    response = stock.query(QUESTION)
    assert isinstance(response, Response)
    sources = response.source_nodes
    assert [item.node.node_id for item in sources][0] == "vault" and len(sources) == 2
    for item in sources:  # the cosine kept and turned into r = (cos + 1) / 2
        scores = item.node.metadata["scores"]
        assert item.score == scores["fused"] == pytest.approx((scores["dense"] + 1) / 2)
    answer = expected(engine, sources)
    assert response.response == answer.text and response.metadata["mode"] == DEFAULT_MODE
    assert [step["token_id"] for step in response.metadata["trace"]] == answer.token_ids
    assert sum(response.metadata["tokens_won"].values()) == TOKENS and response.metadata["cited_nodes"]

    via_index = index.as_query_engine(similarity_top_k=2, response_synthesizer=synthesizer).query(QUESTION)
    assert via_index.response == answer.text and via_index.metadata["cache"] == {"hits": 2, "misses": 0}

    concat = ContextOfExpertsSynthesizer(mode="concat")
    other = index.as_query_engine(similarity_top_k=2, response_synthesizer=concat).query(QUESTION)
    docs = [Document(node_text(item.node), item.node.node_id, item.score) for item in sources]
    assert other.response == engine.generate(QUESTION, docs, mode="concat", max_new_tokens=TOKENS).text


def test_the_synthesizer_streams_in_a_stock_query_engine(index, engine, settings_llm):
    plain = index.as_query_engine(similarity_top_k=2, response_synthesizer=ContextOfExpertsSynthesizer()).query(
        QUESTION)
    streaming = index.as_query_engine(similarity_top_k=2,
                                      response_synthesizer=ContextOfExpertsSynthesizer(streaming=True))
    response = streaming.query(QUESTION)
    assert isinstance(response, StreamingResponse) and response.metadata == {}
    assert "".join(response.response_gen) == plain.response
    assert response.metadata["trace"] == plain.metadata["trace"]  # filled once the stream is complete

    async def astreamed() -> str:
        streamed = await streaming.aquery(QUESTION)
        return "".join([piece async for piece in streamed.async_response_gen()])

    assert asyncio.run(astreamed()) == plain.response


# -- 4. the chat engine ----------------------------------------------------------------------------------------
def test_chat_engine_condenses_with_the_decoder_and_answers_over_the_nodes(index, engine, llm):
    chat_engine = ContextOfExpertsChatEngine.from_index(index, llm=llm, similarity_top_k=2)
    first = chat_engine.chat(QUESTION)
    response = first.sources[0].raw_output
    assert first.response == response.response == expected(engine, response.source_nodes).text
    assert response.metadata["trace"] and response.source_nodes[0].node.metadata["scores"]

    follow_up = "And who keeps it?"
    condensed = llm.predict(DEFAULT_PROMPT, question=follow_up,
                            chat_history="\n".join(f"{m.role.value}: {m.content}" for m in chat_engine.chat_history))
    second = chat_engine.chat(follow_up)
    assert second.sources[0].raw_input["query"] == condensed  # the decoder's own LLM condensed it
    assert [m.role.value for m in chat_engine.chat_history] == ["user", "assistant"] * 2

    fresh = ContextOfExpertsChatEngine.from_index(index, llm=llm, similarity_top_k=2)
    streamed = fresh.stream_chat(QUESTION)
    assert "".join(streamed.response_gen) == first.response

    async def achat() -> str:
        chat = index.as_chat_engine(chat_mode="condense_question", llm=llm, similarity_top_k=2,
                                    response_synthesizer=ContextOfExpertsSynthesizer(llm))  # the stock factory
        streamed = await chat.astream_chat(QUESTION)
        return "".join([piece async for piece in streamed.async_response_gen()])

    assert asyncio.run(achat()) == first.response


# -- 5. legacy callbacks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True])
def test_token_counting_and_debug_handlers_see_the_llm_call(index, engine, llm, streaming):
    counter = TokenCountingHandler(tokenizer=engine.loaded.tokenizer.encode)
    debug = LlamaDebugHandler()
    query_engine = ContextOfExpertsQueryEngine.from_index(index, llm=llm, similarity_top_k=2, streaming=streaming,
                                                          callback_manager=CallbackManager([counter, debug]))
    response = query_engine.query(QUESTION)
    text = "".join(response.response_gen) if streaming else response.response
    texts = [node_text(item.node) for item in response.source_nodes]
    (event,) = counter.llm_token_counts
    assert event.prompt_token_count == prompt_tokens(engine, QUESTION, texts)
    assert event.completion_token_count == len(response.metadata["trace"]) == TOKENS
    assert counter.total_llm_token_count == prompt_tokens(engine, QUESTION, texts) + TOKENS
    ((start, end),) = debug.get_llm_inputs_outputs()
    assert start.event_type == end.event_type == CBEventType.LLM
    assert QUESTION in start.payload[EventPayload.PROMPT] and texts[0] in start.payload[EventPayload.PROMPT]
    assert end.payload[EventPayload.COMPLETION].text == text


# -- 6. nodes without scores -----------------------------------------------------------------------------------
def test_nodes_without_scores_warn_once_naming_the_fix(engine, llm):
    synthesizer = ContextOfExpertsSynthesizer(llm)
    nodes = [NodeWithScore(node=TextNode(id_="a", text="The vault code is 4721."), score=None),
             NodeWithScore(node=TextNode(id_="b", text="Paris is in France."), score=0.5)]
    with pytest.warns(MissingScoreWarning, match=r"1 node\(s\).*'a'.*r = 1.*index.as_retriever\(\)"):
        response = synthesizer.synthesize(QUESTION, nodes)
    assert [item.score for item in response.source_nodes] == [1.0, pytest.approx(0.75)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synthesizer.synthesize(QUESTION, nodes)  # once per synthesizer


# -- 7. Settings.llm under a stock engine without the synthesizer ---------------------------------------------------
async def _astream_query(index) -> str:
    response = await index.as_query_engine(similarity_top_k=2, streaming=True).aquery(QUESTION)
    return "".join([piece async for piece in response.async_response_gen()])


STOCK_ENGINES = {  # LlamaIndex's own engines, as its tutorials build them with Settings.llm = ExpertDecoderLLM()
    "as_query_engine": lambda index: index.as_query_engine(similarity_top_k=2).query(QUESTION),
    "streaming": lambda index: "".join(index.as_query_engine(similarity_top_k=2, streaming=True)
                                       .query(QUESTION).response_gen),
    "aquery": lambda index: asyncio.run(index.as_query_engine(similarity_top_k=2).aquery(QUESTION)),
    "astream": lambda index: asyncio.run(_astream_query(index)),
    "tree_summarize": lambda index: index.as_query_engine(similarity_top_k=2, response_mode="tree_summarize")
    .query(QUESTION),
    "refine": lambda index: index.as_query_engine(similarity_top_k=3, response_mode="refine").query(QUESTION),
    "as_chat_engine": lambda index: index.as_chat_engine(similarity_top_k=2).chat(QUESTION),  # condense + context
    "context_chat": lambda index: index.as_chat_engine(chat_mode="context", similarity_top_k=2).chat(QUESTION),
}


def _undecoded(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UndecodedContextWarning)]


@pytest.mark.parametrize("use", list(STOCK_ENGINES))
def test_a_stock_engine_stuffing_nodes_into_the_prompt_warns_once_per_llm(monkeypatch, engine, index, use):
    """The stock synthesizers join the nodes into the prompt text: the answer is plain chat, and the LLM says so
    once (per LLM), naming the one-line fix, instead of losing per-document decoding and citations silently."""
    first = ExpertDecoderLLM(engine=engine, max_new_tokens=2)
    monkeypatch.setattr(Settings, "_llm", first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warning: "once" is the LLM's doing, not Python's registry
        STOCK_ENGINES[use](index)
        STOCK_ENGINES[use](index)
        monkeypatch.setattr(Settings, "_llm", ExpertDecoderLLM(engine=engine, max_new_tokens=2))
        STOCK_ENGINES[use](index)  # another LLM warns again
    messages = _undecoded(caught)
    assert len(messages) == 2
    assert "plain chat" in messages[0] and "ContextOfExpertsQueryEngine.from_index(index)" in messages[0]
    assert "response_synthesizer=ContextOfExpertsSynthesizer(retrieval_score_kind=infer_score_kind(index))" in (
        messages[0])


def test_plain_chat_and_the_decoding_engines_never_warn(monkeypatch, engine, index):
    """No retrieved context in the prompt, or the nodes reach the decoder as documents: nothing to warn about,
    even when the text speaks of context or documents."""
    llm = ExpertDecoderLLM(engine=engine, max_new_tokens=2)
    monkeypatch.setattr(Settings, "_llm", llm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndecodedContextWarning)
        llm.complete("Summarise the context of the French revolution.")
        llm.chat([ChatMessage(role=MessageRole.USER, content="Which documents do I need for a passport?")])
        llm.predict(PromptTemplate("Name a {thing}."), thing="colour")
        list(llm.stream(PromptTemplate("Name a {thing}."), thing="colour"))
        asyncio.run(llm.apredict(PromptTemplate("Explain the {context_str} of this."), context_str=" "))  # empty
        ContextOfExpertsQueryEngine.from_index(index, similarity_top_k=2).query(QUESTION)
        index.as_query_engine(similarity_top_k=2, response_synthesizer=ContextOfExpertsSynthesizer()).query(QUESTION)
        chat = ContextOfExpertsChatEngine.from_index(index, similarity_top_k=2)
        chat.chat(QUESTION)
        chat.chat("And what is the capital of France?")  # condensed with the history by the same LLM
        index.as_chat_engine(chat_mode="condense_question", similarity_top_k=2,
                             response_synthesizer=ContextOfExpertsSynthesizer()).chat(QUESTION)


def test_the_warning_is_the_langchain_adapters_class():
    pytest.importorskip("langchain_core")
    from ctx_integrations.langchain import UndecodedContextWarning as LangChainWarning

    assert LangChainWarning is UndecodedContextWarning and issubclass(UndecodedContextWarning, UserWarning)


_PROCESS = """
import json, sys
from llama_index.core import Settings, StorageContext, VectorStoreIndex, load_index_from_storage
from ctx_integrations.llama_index import ContextOfExpertsQueryEngine, default_embedding
from tests.llama_index_support import QUESTION, make_nodes

folder, kv = sys.argv[1], sys.argv[2]
Settings.embed_model = default_embedding()
if sys.argv[3] == "build":
    index = VectorStoreIndex(make_nodes())
    index.storage_context.persist(persist_dir=folder)
else:
    index = load_index_from_storage(StorageContext.from_defaults(persist_dir=folder))
response = ContextOfExpertsQueryEngine.from_index(index, cache_dir=kv, similarity_top_k=2, max_new_tokens=4).query(
    QUESTION)
print(json.dumps({"cache": response.metadata["cache"], "text": response.response}))
"""


@pytest.mark.slow
def test_a_new_process_over_a_reloaded_index_hits_the_caches_on_the_embedded_model(tmp_path):
    """Two real processes on the embedded SmolLM2: the second, over ``load_index_from_storage``, computes nothing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    def run(step: str) -> dict:
        done = subprocess.run([sys.executable, "-c", _PROCESS, str(tmp_path / "index"), str(tmp_path / "kv"), step],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run("build"), run("reload")
    assert first["cache"] == {"hits": 0, "misses": 2}
    assert second["cache"] == {"hits": 2, "misses": 0} and second["text"] == first["text"]
