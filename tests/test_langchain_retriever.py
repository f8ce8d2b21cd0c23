"""LangChain retrievers that keep scores: the vector-store adapter, the MiniLM Embeddings wrapper, standard suites.

The vector stores are langchain-core's real ``InMemoryVectorStore`` over the embedded MiniLM (no fake
embeddings); scores are checked against what the store itself returns.
"""

from __future__ import annotations

import math

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import EmbeddingsIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.langchain import EmbedderEmbeddings, VectorStoreScoredRetriever
from ctx_integrations.langchain.convert import content_id, from_langchain_document
from ctx_integrations.retrieval.scores import normalize_dense

# langchain-tests' async standard tests carry no asyncio mark; the project runs pytest-asyncio in strict mode.
pytestmark = [pytest.mark.asyncio, pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning")]

TEXTS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Mount Fuji is the highest mountain in Japan.",
    "The Nile flows north through Egypt into the Mediterranean Sea.",
    "Photosynthesis turns light, water and carbon dioxide into sugar.",
    "The secret code of the vault is 4721.",
]


class HalfCosineStore(InMemoryVectorStore):
    """InMemoryVectorStore with a relevance function (langchain-core leaves it to each store): (cos + 1) / 2."""

    def _select_relevance_score_fn(self):
        return lambda similarity: (similarity + 1.0) / 2.0


@pytest.fixture(scope="module")
def embeddings() -> EmbedderEmbeddings:
    return EmbedderEmbeddings()


def make_store(embeddings: EmbedderEmbeddings, cls: type[InMemoryVectorStore] = HalfCosineStore):
    store = cls(embedding=embeddings)
    store.add_documents([LCDocument(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(TEXTS)],
                        ids=[f"doc{i}" for i in range(len(TEXTS))])
    return store


def test_relevance_scores_are_kept_with_ids(embeddings):
    store = make_store(embeddings)
    retriever = VectorStoreScoredRetriever(vectorstore=store, k=3)
    docs = retriever.invoke("Which city has the Eiffel Tower?")
    expected = store.similarity_search_with_relevance_scores("Which city has the Eiffel Tower?", k=3)
    assert [d.id for d in docs] == [d.id for d, _ in expected] and docs[0].id == "doc0"
    for doc, (_, relevance) in zip(docs, expected):
        assert doc.metadata["score"] == pytest.approx(relevance)
        scores = {"relevance": pytest.approx(relevance), "relevance_norm": doc.metadata["score"]}
        assert doc.metadata["scores"] == scores
        assert doc.metadata["source"] == doc.id  # the store's own metadata is kept
    assert docs[0].metadata["score"] > docs[-1].metadata["score"]


def test_similarity_search_normalises_cosine_like_the_paper(embeddings):
    """InMemoryVectorStore has no relevance function; search='similarity' maps its cosine with normalize_dense."""
    store = make_store(embeddings, InMemoryVectorStore)
    with pytest.raises(InvalidOptionError, match="search='similarity'"):
        VectorStoreScoredRetriever(vectorstore=store, search="relevance").invoke("vault code")
    docs = VectorStoreScoredRetriever(vectorstore=store, search="similarity", k=2).invoke("vault code")
    raw = dict((d.id, s) for d, s in store.similarity_search_with_score("vault code", k=2))
    assert docs[0].id == "doc4"
    for doc in docs:
        assert doc.metadata["scores"]["similarity"] == pytest.approx(raw[doc.id])
        assert doc.metadata["score"] == pytest.approx(normalize_dense(raw[doc.id]))


def test_document_without_id_gets_a_content_id_and_scores_reach_the_decoder_documents(embeddings):
    store = HalfCosineStore(embedding=embeddings)
    store.add_documents([LCDocument(page_content=TEXTS[4])])
    store.store[next(iter(store.store))]["id"] = None  # a store that keeps no ids
    (doc,) = VectorStoreScoredRetriever(vectorstore=store, k=1).invoke("vault")
    assert doc.id == content_id(TEXTS[4])
    project = from_langchain_document(doc)
    assert project.score == doc.metadata["score"] and project.scores == doc.metadata["scores"]
    assert "score" not in project.metadata and project.text == TEXTS[4]


async def test_async_path_matches_sync(embeddings):
    retriever = VectorStoreScoredRetriever(vectorstore=make_store(embeddings), k=2)
    sync, asynchronous = retriever.invoke("mountain in Japan"), await retriever.ainvoke("mountain in Japan")
    assert [(d.id, d.metadata["score"]) for d in sync] == [(d.id, d.metadata["score"]) for d in asynchronous]


def test_bad_k_is_refused(embeddings):
    with pytest.raises(InvalidOptionError, match="k must be"):
        VectorStoreScoredRetriever(vectorstore=make_store(embeddings), k=0)


def test_embeddings_wrap_the_project_embedder(embeddings):
    from ctx_integrations.retrieval.embedders import default_embedder

    vector = embeddings.embed_query("hello")
    assert vector == pytest.approx(default_embedder().embed_query("hello").tolist())
    assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-4)


class TestVectorStoreScoredRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[VectorStoreScoredRetriever]:
        return VectorStoreScoredRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"vectorstore": make_store(EmbedderEmbeddings())}

    @property
    def retriever_query_example(self) -> str:
        return "Where is the Eiffel Tower?"


class TestEmbedderEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[EmbedderEmbeddings]:
        return EmbedderEmbeddings


class TestEmbedderEmbeddingsStandard(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[EmbedderEmbeddings]:
        return EmbedderEmbeddings
