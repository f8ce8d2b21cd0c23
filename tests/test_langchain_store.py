"""ScoredRetriever: the project's Chroma store and retriever as a LangChain retriever, scores and ids intact."""

from __future__ import annotations

import tempfile
from functools import cache

import pytest
from langchain_tests.integration_tests import RetrieversIntegrationTests

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.langchain import ScoredRetriever
from ctx_integrations.retrieval.retriever import ScoredRetriever as ProjectRetriever
from ctx_integrations.retrieval.store import DocumentStore

# langchain-tests' async standard tests carry no asyncio mark; the project runs pytest-asyncio in strict mode.
pytestmark = [pytest.mark.asyncio, pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning")]

TEXTS = {
    "eiffel": "The Eiffel Tower is in Paris, the capital of France.",
    "fuji": "Mount Fuji is the highest mountain in Japan.",
    "nile": "The Nile flows north through Egypt into the Mediterranean Sea.",
    "vault": "The secret code of the vault is 4721.",
}
_FOLDER = tempfile.TemporaryDirectory(prefix="ctx-lc-store-")


@cache
def project_retriever() -> ProjectRetriever:
    store = DocumentStore(_FOLDER.name)
    store.add([{"id": key, "text": text, "metadata": {"topic": key}} for key, text in TEXTS.items()])
    return ProjectRetriever(store)


def test_scores_and_ids_are_those_of_the_project_retriever():
    retriever = ScoredRetriever(retriever=project_retriever(), k=2)
    docs = retriever.invoke("What is the code of the vault?")
    expected = project_retriever().retrieve("What is the code of the vault?", 2)
    assert [d.id for d in docs] == [d.id for d in expected] and docs[0].id == "vault"
    for doc, ref in zip(docs, expected):
        assert doc.page_content == ref.text
        assert doc.metadata["score"] == ref.score and doc.metadata["scores"] == ref.scores
        assert {"dense", "dense_norm", "retrieval", "fused"} <= set(doc.metadata["scores"])
        assert doc.metadata["topic"] == doc.id  # the stored metadata is kept beside the scores
    assert len(retriever.invoke("mountain", k=3)) == 3


def test_a_retriever_without_retrieve_is_refused():
    with pytest.raises(InvalidOptionError, match="retrieve"):
        ScoredRetriever(retriever=object())


class TestScoredRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[ScoredRetriever]:
        return ScoredRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"retriever": project_retriever()}

    @property
    def retriever_query_example(self) -> str:
        return "Where is the Eiffel Tower?"
