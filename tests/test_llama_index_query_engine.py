"""ContextOfExpertsQueryEngine on real llama-index-core classes, checked against the engine itself.

Mechanics run on a tiny random Llama (same tokenizer as the embedded model): the query engine must give
exactly what ``Engine.generate`` gives for the same nodes and priors, so equality tests are meaningful
even with random weights. The end-to-end tests run the embedded SmolLM2 over the default in-memory
store and over an on-disk Chroma collection (marked slow).
"""

from __future__ import annotations

import asyncio
import importlib
import math
import sys
import time

import pytest
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.postprocessor import SimilarityPostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ctx_integrations import DEFAULT_MODE, Document, Engine
from ctx_integrations.errors import EmptyDocumentsError, InvalidOptionError, MissingDependencyError, UnknownModeError
from ctx_integrations.llama_index import ContextOfExpertsQueryEngine, ExpertDecoderLLM, node_text
from ctx_integrations.llama_index.convert import node_source
from tests.helpers import loop_ticks, tiny_loaded
from tests.llama_index_support import (
    QUESTION,
    TEXTS,
    KeywordReranker,
    chroma_index,
    keyword_logit,
    make_nodes,
    memory_index,
)

TOKENS = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture(scope="module")
def index():
    return memory_index()


def engine_answer(engine: Engine, sources: list[NodeWithScore], mode: str = DEFAULT_MODE, **settings):
    """The engine's own answer over the nodes the query engine reported, with their priors."""
    docs = [Document(node_text(item.node), item.node.node_id, item.score) for item in sources]
    return engine.generate(QUESTION, docs, mode=mode, **{"max_new_tokens": TOKENS, **settings})


def test_query_matches_engine_and_carries_scores_trace_citations_timings(engine, index):
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2,
                                                          max_new_tokens=TOKENS)
    response = query_engine.query(QUESTION)
    assert isinstance(response, Response)
    sources = response.source_nodes
    assert [item.node.node_id for item in sources][0] == "vault" and len(sources) == 2
    for item in sources:
        scores = item.node.metadata["scores"]
        assert item.score == item.node.metadata["score"] == scores["fused"] == scores["dense_norm"]
        assert item.score == pytest.approx((scores["dense"] + 1) / 2)
    answer = engine_answer(engine, sources)
    assert response.response == answer.text
    meta = response.metadata
    assert meta["mode"] == DEFAULT_MODE and meta["model_name"] == engine.loaded.name
    assert [step["token_id"] for step in meta["trace"]] == answer.token_ids
    ids = [item.node.node_id for item in sources]
    assert [step["node_id"] for step in meta["trace"]] == [ids[step.document] for step in answer.trace]
    assert sum(meta["tokens_won"].values()) == len(answer.token_ids)
    assert meta["cited_nodes"] == sorted(meta["tokens_won"], key=lambda i: -meta["tokens_won"][i])
    assert [c["id"] for c in meta["citations"]] == meta["cited_nodes"]
    for cited in meta["citations"]:
        item = sources[cited["index"]]
        assert (cited["id"], cited["tokens_won"], cited["score"]) == (
            item.node.node_id, meta["tokens_won"][item.node.node_id], item.score)
        assert cited["source"] == f"{item.node.node_id}.txt"  # make_nodes' source
    assert {"ttft_s", "total_s", "tokens_per_s"} <= set(meta["timings"])
    assert meta["cache"]["hits"] + meta["cache"]["misses"] == 2
    assert query_engine.query(QUESTION).metadata["cache"] == {"hits": 2, "misses": 0}  # caches reused


def test_priors_reach_the_decoder(engine, index):
    """The fused r of each node is the decoder's prior: the same nodes with flipped scores answer differently."""
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2,
                                                          max_new_tokens=TOKENS)
    nodes = query_engine.retrieve(QUESTION)
    flipped = [NodeWithScore(node=item.node.model_copy(update={"metadata": {**item.node.metadata, "score": r}}),
                             score=r) for item, r in zip(nodes, (0.01, 0.99))]
    response = query_engine.synthesize(QueryBundle(QUESTION), flipped)
    assert [item.score for item in response.source_nodes] == [0.01, 0.99]
    assert response.response == engine_answer(engine, flipped).text
    original = query_engine.synthesize(QueryBundle(QUESTION), nodes).metadata["trace"]
    assert [step["score"] for step in response.metadata["trace"]] != [step["score"] for step in original]


def test_every_engine_mode_runs_through_the_same_class(engine, index):
    short = {"map_reduce": {"summary_tokens": 4}}  # keep the summaries short: mechanics, not quality
    for mode in engine.modes:
        query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, mode=mode, similarity_top_k=2,
                                                              max_new_tokens=4, mode_options=short)
        response = query_engine.query(QUESTION)
        assert response.metadata["mode"] == mode
        expected = engine_answer(engine, response.source_nodes, mode=mode, max_new_tokens=4, **short.get(mode, {}))
        assert response.response == expected.text


def test_mode_options_go_to_their_mode_only(engine, index):
    options = {"pced": {"gamma": 0.5}, "soft_nbce": {"tau": 1.0}}
    pced = ContextOfExpertsQueryEngine.from_index(index, engine=engine, mode="pced", similarity_top_k=2,
                                                  max_new_tokens=TOKENS, mode_options=options).query(QUESTION)
    assert pced.metadata["options"] == {"gamma": 0.5}
    assert pced.response == engine_answer(engine, pced.source_nodes, "pced", gamma=0.5).text
    default = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2, max_new_tokens=TOKENS,
                                                     mode_options=options).query(QUESTION)
    assert default.metadata["options"] == options[DEFAULT_MODE]
    concat = ContextOfExpertsQueryEngine.from_index(index, engine=engine, mode="concat", similarity_top_k=2,
                                                    max_new_tokens=TOKENS, mode_options=options).query(QUESTION)
    assert concat.metadata["options"] == {}


def test_streaming_yields_deltas_that_join_to_the_answer(engine, index):
    plain = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2, max_new_tokens=TOKENS)
    streaming = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2,
                                                       max_new_tokens=TOKENS, streaming=True)
    expected = plain.query(QUESTION)
    response = streaming.query(QUESTION)
    assert isinstance(response, StreamingResponse)
    assert [item.node.node_id for item in response.source_nodes] == [i.node.node_id for i in expected.source_nodes]
    assert response.metadata == {}  # filled once the answer is complete
    deltas = list(response.response_gen)
    assert len(deltas) > 1 and "".join(deltas) == expected.response
    assert response.metadata["trace"] == expected.metadata["trace"]


def test_async_streaming(engine, index):
    streaming = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2,
                                                       max_new_tokens=TOKENS, streaming=True)

    async def main():
        response = await streaming.aquery(QUESTION)
        assert isinstance(response, AsyncStreamingResponse)
        return [delta async for delta in response.async_response_gen()], response

    deltas, response = asyncio.run(main())
    expected = engine_answer(engine, response.source_nodes)
    assert len(deltas) > 1 and "".join(deltas) == expected.text
    assert [step["token_id"] for step in response.metadata["trace"]] == expected.token_ids


def test_aquery_does_not_block_the_event_loop(engine, index):
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2, max_new_tokens=48)
    expected = query_engine.query(QUESTION)  # the reference answer (and a warm start, so the timing is the decode's)

    async def main():
        async with loop_ticks() as ticks:
            response = await query_engine.aquery(QUESTION)
            finished = time.perf_counter()
        return response, finished, ticks

    response, finished, ticks = asyncio.run(main())
    assert response.response == expected.response and len(response.metadata["trace"]) > 8
    decode_s = response.metadata["timings"]["total_s"]
    # ticks inside the middle of the decode: a loop blocked by decoding would have none there
    during = [t for t in ticks if finished - 0.9 * decode_s < t < finished - 0.1 * decode_s]
    assert len(during) >= 3, f"the loop ticked {len(during)} times during a {decode_s:.3f} s decode"


def test_scores_survive_a_reranker(engine, index):
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=3,
                                                          max_new_tokens=TOKENS,
                                                          node_postprocessors=[KeywordReranker()])
    retrieval = {item.node.node_id: item.node.metadata["scores"]["retrieval"]
                 for item in ContextOfExpertsQueryEngine.from_index(index, engine=engine,
                                                                    similarity_top_k=3).retrieve(QUESTION)}
    response = query_engine.query(QUESTION)
    for item in response.source_nodes:
        node_id, scores = item.node.node_id, item.node.metadata["scores"]
        r_rer = 1 / (1 + math.exp(-keyword_logit(QUESTION, TEXTS[node_id])))
        fused = 2 * retrieval[node_id] * r_rer / (retrieval[node_id] + r_rer + 1e-8)
        assert scores["retrieval"] == retrieval[node_id] and "dense" in scores
        assert scores["reranker"] == keyword_logit(QUESTION, TEXTS[node_id]) and type(scores["reranker"]) is float
        assert item.score == pytest.approx(fused) and scores["fused"] == item.score
    assert response.response == engine_answer(engine, response.source_nodes).text
    relevance = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=3,
                                                       node_postprocessors=[KeywordReranker()],
                                                       reranker_score_kind="relevance").retrieve(QUESTION)
    vault = next(item for item in relevance if item.node.node_id == "vault")
    assert vault.node.metadata["scores"]["reranker_norm"] == pytest.approx(1 - 1e-8)  # logit 3 clipped as a relevance
    assert "score" not in index.docstore.get_node("vault").metadata  # the index's nodes were never touched
    again = asyncio.run(query_engine.aretrieve(QUESTION))  # the async path keeps the same scores
    assert [(i.node.node_id, i.score) for i in again] == [(i.node.node_id, i.score) for i in response.source_nodes]


def test_filtering_postprocessors_keep_their_meaning(engine, index):
    """A similarity cutoff still compares raw cosines (node.score stays raw until the end), and is no reranker."""
    nodes = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=3,
                                                   node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=0.5)]
                                                   ).retrieve(QUESTION)
    assert [item.node.node_id for item in nodes] == ["vault"]  # cosine 0.85; the others are below 0.2
    assert "reranker" not in nodes[0].node.metadata["scores"]


def test_explicit_nodes_and_an_llm_as_engine(engine):
    llm = ExpertDecoderLLM(engine=engine)
    query_engine = ContextOfExpertsQueryEngine(memory_index().as_retriever(), engine=llm, max_new_tokens=TOKENS)
    nodes = [NodeWithScore(node=node, score=0.2) for node in make_nodes()]
    response = query_engine.synthesize(QueryBundle(QUESTION), nodes)  # scores of the retriever's kind: cosines
    assert [item.score for item in response.source_nodes] == pytest.approx([0.6] * 3)
    assert response.response == engine_answer(engine, response.source_nodes).text


QUESTIONS = [QUESTION, "Which city is the capital of France?"]


def test_query_many_over_given_nodes_is_one_ippd_call(engine, index):
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2,
                                                          max_new_tokens=TOKENS)
    nodes = query_engine.retrieve(QUESTION)
    responses = query_engine.query_many(QUESTIONS, nodes=nodes)
    docs = [Document(node_text(i.node), i.node.node_id, i.score) for i in nodes]
    answers = engine.generate_many(QUESTIONS, docs, mode="ippd", max_new_tokens=TOKENS)
    assert [r.response for r in responses] == [a.text for a in answers]
    assert all(r.metadata["mode"] == "ippd" and r.source_nodes == nodes for r in responses)
    assert [len(r.metadata["trace"]) for r in responses] == [len(a.token_ids) for a in answers]


def test_query_many_shares_a_context_between_questions_with_the_same_nodes():
    engine = Engine(tiny_loaded("llama"))  # fresh caches: the misses count the stacked contexts
    query_engine = ContextOfExpertsQueryEngine.from_index(memory_index(), engine=engine, similarity_top_k=3,
                                                          max_new_tokens=TOKENS)
    own = [query_engine.retrieve(q) for q in QUESTIONS]
    assert [i.node.node_id for i in own[0]] != [i.node.node_id for i in own[1]]  # same set, another order
    responses = query_engine.query_many(QUESTIONS)
    assert responses[0].metadata["cache"]["misses"] == 1  # one context for both questions
    order = [i.node.node_id for i in own[0]]
    for response, nodes, question in zip(responses, own, QUESTIONS):
        assert [i.node.node_id for i in response.source_nodes] == order
        assert {i.node.node_id: i.score for i in response.source_nodes} == {i.node.node_id: i.score for i in nodes}
        texts = [node_text(i.node) for i in response.source_nodes]
        assert response.response == engine.generate(question, texts, mode="concat", max_new_tokens=TOKENS).text
    again = asyncio.run(query_engine.aquery_many(QUESTIONS))
    assert [r.response for r in again] == [r.response for r in responses]


def test_query_many_without_batch_mode_answers_each_like_query(engine, index):
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=engine, similarity_top_k=2,
                                                          max_new_tokens=TOKENS, batch_mode=None)
    responses = query_engine.query_many(QUESTIONS)
    singles = [query_engine.query(q) for q in QUESTIONS]
    assert [r.response for r in responses] == [r.response for r in singles]
    assert [r.metadata["mode"] for r in responses] == [DEFAULT_MODE, DEFAULT_MODE]
    assert [[i.node.node_id for i in r.source_nodes] for r in responses] == \
        [[i.node.node_id for i in r.source_nodes] for r in singles]
    with pytest.raises(InvalidOptionError, match="list of questions"):
        query_engine.query_many(QUESTION)


def test_construction_errors_are_typed(engine, index):
    retriever = index.as_retriever()
    with pytest.raises(UnknownModeError, match="unknown mode 'pcde'"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, mode="pcde")
    with pytest.raises(InvalidOptionError, match="does not accept gamma"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, mode_options={"concat": {"gamma": 1.0}})
    with pytest.raises(InvalidOptionError, match="unknown score kind 'cos'"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, retrieval_score_kind="cos")
    with pytest.raises(InvalidOptionError, match="unknown score kind"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, reranker_score_kind="probability")
    with pytest.raises(InvalidOptionError, match="engine must be"):
        ContextOfExpertsQueryEngine(retriever, engine="SmolLM2")
    with pytest.raises(InvalidOptionError, match="BaseNodePostprocessor"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, node_postprocessors=[lambda nodes: nodes])
    with pytest.raises(InvalidOptionError, match="BaseRetriever"):
        ContextOfExpertsQueryEngine(index, engine=engine)
    with pytest.raises(InvalidOptionError, match="max_new_tokens"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, max_new_tokens=0)
    with pytest.raises(UnknownModeError, match="unknown mode 'ipdp'"):
        ContextOfExpertsQueryEngine(retriever, engine=engine, batch_mode="ipdp")


def test_no_nodes_retrieved_is_a_typed_error(engine, index):
    query_engine = ContextOfExpertsQueryEngine.from_index(
        index, engine=engine, node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=0.99)])
    with pytest.raises(EmptyDocumentsError, match="found no nodes"):
        query_engine.query(QUESTION)
    with pytest.raises(EmptyDocumentsError, match="found no nodes"):
        asyncio.run(query_engine.aquery(QUESTION))
    with pytest.raises(EmptyDocumentsError, match="found no nodes"):
        query_engine.query_many([QUESTION, "Which city?"])
    with pytest.raises(EmptyDocumentsError, match="empty text"):
        query_engine.synthesize(QueryBundle(QUESTION), [NodeWithScore(node=TextNode(text="  "), score=0.5)])


def test_import_without_llama_index_raises_missing_dependency(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[:2] == ["ctx_integrations", "llama_index"]]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llama_index.core", None)
    with pytest.raises(MissingDependencyError, match=r"ctx-integrations\[llama-index\]"):
        importlib.import_module("ctx_integrations.llama_index")


@pytest.mark.slow
def test_in_memory_index_on_the_embedded_default(embedded_engine):
    """The docs' example: VectorStoreIndex in memory -> PCED on the embedded SmolLM2; streaming gives the same."""
    index = memory_index()
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=embedded_engine, similarity_top_k=2,
                                                          max_new_tokens=12)
    response = query_engine.query(QUESTION)
    assert "4721" in response.response
    assert response.source_nodes[0].node.node_id == "vault" and response.metadata["cited_nodes"][0] == "vault"
    assert 0.5 < response.source_nodes[0].score < 1 and "dense" in response.source_nodes[0].node.metadata["scores"]
    streaming = ContextOfExpertsQueryEngine.from_index(index, engine=embedded_engine, similarity_top_k=2,
                                                       max_new_tokens=12, streaming=True).query(QUESTION)
    deltas = list(streaming.response_gen)
    assert len(deltas) > 1 and "".join(deltas) == response.response


@pytest.mark.slow
def test_chroma_on_disk_on_the_embedded_default(embedded_engine, tmp_path):
    index = chroma_index(tmp_path / "chroma")
    query_engine = ContextOfExpertsQueryEngine.from_index(index, engine=embedded_engine, similarity_top_k=2,
                                                          max_new_tokens=12)
    response = query_engine.query(QUESTION)
    assert "4721" in response.response
    top = response.source_nodes[0]
    assert top.node.node_id == "vault" and "chroma_l2" in top.node.metadata["scores"]
    assert top.score == pytest.approx((top.node.metadata["scores"]["dense"] + 1) / 2)


def test_a_citation_names_the_file_as_the_reader_recorded_it():
    assert node_source(TextNode(text="x", metadata={"file_path": "/data/GFDL-1.3", "file_name": "GFDL-1.3"})) \
        == "/data/GFDL-1.3"  # SimpleDirectoryReader's
    assert node_source(TextNode(text="x", metadata={"source": "a.txt", "file_path": "/b"})) == "a.txt"
    assert node_source(TextNode(text="x", metadata={"file_name": "c.md"})) == "c.md"
    assert node_source(TextNode(text="x", metadata={"source": ""})) is None
