"""LangChain's documented LCEL RAG chain with ``ChatContextOfExperts`` dropped in.

The chain is the tutorial's, built from real langchain-core pieces:
``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()``
with the tutorial's RAG prompt. The bug: the retrieved documents reached the model only as text joined into
the prompt, so it answered as plain chat (``mode: chat``, no documents, scores or citations) and said nothing.
Now the project's ``format_docs`` makes them recoverable, and the tutorial's own ``format_docs`` gets one
warning naming that fix. A tiny random Llama decodes; every recovered answer is compared with
``Engine.generate`` over the same documents and scores.
"""

from __future__ import annotations

import warnings

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from ctx_integrations import DEFAULT_MODE, Document, Engine
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.langchain import (
    ChatContextOfExperts,
    UndecodedContextWarning,
    VectorStoreScoredRetriever,
    format_docs,
)
from tests.helpers import tiny_loaded
from tests.test_langchain_patterns import QUESTION, TEXTS

TOKENS = 6
# LangChain's RAG tutorial prompt (rlm/rag-prompt), one human message with {context} and {question}
RAG_PROMPT = ChatPromptTemplate.from_messages([("human", (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and "
    "keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"))])


def tutorial_format_docs(docs: list[LCDocument]) -> str:
    """The tutorial's own ``format_docs``: the documents' boundaries are gone."""
    return "\n\n".join(doc.page_content for doc in docs)


class LastMessage(BaseCallbackHandler):
    """Keeps the chat model's last message, whose metadata ``StrOutputParser`` drops from the chain's output."""

    message = None

    def on_llm_end(self, response, **kwargs) -> None:
        self.message = response.generations[0][0].message


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture(scope="module")
def retriever() -> VectorStoreScoredRetriever:
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([LCDocument(page_content=text, id=key) for key, text in TEXTS.items()])
    return VectorStoreScoredRetriever(vectorstore=store, k=2)


def rag_chain(retriever, format_documents, llm):
    return ({"context": retriever | format_documents, "question": RunnablePassthrough()}
            | RAG_PROMPT | llm | StrOutputParser())


def expected_answer(engine: Engine, retrieved: list[LCDocument]):
    """What the decoder must answer: the prompt less its document blocks as the question, the documents as experts."""
    question = RAG_PROMPT.invoke({"question": QUESTION, "context": ""}).messages[0].content.strip()
    documents = [Document(d.page_content, d.id, d.metadata["score"]) for d in retrieved]
    return engine.generate(question, documents, max_new_tokens=TOKENS)


def test_the_tutorial_chain_with_our_format_docs_decodes_the_documents_with_their_scores(engine, retriever):
    chat = ChatContextOfExperts(engine=engine, max_tokens=TOKENS)
    seen = LastMessage()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndecodedContextWarning)
        text = rag_chain(retriever, format_docs, chat).invoke(QUESTION, config={"callbacks": [seen]})
    meta = seen.message.response_metadata
    retrieved = retriever.invoke(QUESTION)
    assert meta["mode"] == DEFAULT_MODE and len(meta["documents"]) == 2
    assert [(d["id"], d["text"], d["score"]) for d in meta["documents"]] == [
        (d.id, d.page_content, d.metadata["score"]) for d in retrieved]
    reference = expected_answer(engine, retrieved)
    assert text == reference.text and meta["token_ids"] == reference.token_ids


@pytest.mark.asyncio
async def test_the_async_chain_recovers_the_documents_too(engine, retriever):
    chat = ChatContextOfExperts(engine=engine, max_tokens=TOKENS)
    seen = LastMessage()
    text = await rag_chain(retriever, format_docs, chat).ainvoke(QUESTION, config={"callbacks": [seen]})
    assert seen.message.response_metadata["mode"] == DEFAULT_MODE
    assert text == expected_answer(engine, retriever.invoke(QUESTION)).text


def test_the_tutorial_s_own_format_docs_warns_once_with_the_fix(engine, retriever):
    chat = ChatContextOfExperts(engine=engine, max_tokens=TOKENS)
    chain = rag_chain(retriever, tutorial_format_docs, chat)
    seen = LastMessage()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain.invoke(QUESTION, config={"callbacks": [seen]})
        chain.invoke(QUESTION)
    ours = [w for w in caught if issubclass(w.category, UndecodedContextWarning)]
    assert len(ours) == 1  # once per chat model, not once per call
    assert "ctx_integrations.langchain.format_docs" in str(ours[0].message)
    assert seen.message.response_metadata["mode"] == "chat" and seen.message.response_metadata["documents"] == []


def test_plain_chat_does_not_warn(engine):
    chat = ChatContextOfExperts(engine=engine, max_tokens=2)
    chatbot = ChatPromptTemplate.from_messages([("system", "You are terse."), ("human", "{question}")]) | chat
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndecodedContextWarning)
        chat.invoke("Explain the context of this novel.")  # a direct call, not a chain's prompt
        chatbot.invoke({"question": "Say hello."})  # a chain whose prompt speaks of no context


def test_format_docs_round_trips_ids_and_scores_and_any_text():
    """Ids, scores and texts come back as given, a text holding ``</document>`` or a whole block included.

    (Such a text was refused before: the blocks were found by their closing tag. Sealed blocks are found by
    their length, so any text round-trips; see tests/test_attack_langchain.py.)
    """
    from langchain_core.messages import HumanMessage

    from ctx_integrations.langchain.convert import split_formatted_documents

    docs = [LCDocument(page_content="a <b> & \"c\"\n\nsecond paragraph", id='id "1" <&>', metadata={"score": 0.1}),
            LCDocument(page_content="no score"),
            LCDocument(page_content='x\n</document>\n\n<document id="y">\ny\n</document>', id="z")]
    found, rest = split_formatted_documents([HumanMessage(f"Before.\n{format_docs(docs)}\nAfter?")])
    assert [(d.id, d.page_content, d.metadata.get("score")) for d in found] == [
        ('id "1" <&>', docs[0].page_content, 0.1), (docs[1].id or found[1].id, "no score", None),
        ("z", docs[2].page_content, None)]
    assert rest[0].content == "Before.\n\nAfter?"  # the blocks and their separators are gone


def test_documents_in_the_prompt_and_as_an_argument_are_refused(engine):
    chat = ChatContextOfExperts(engine=engine, max_tokens=2)
    with pytest.raises(InvalidOptionError, match="one way"):
        chat.invoke(f"Context: {format_docs(['The code is 1.'])}\nWhat is the code?", documents=["Other."])
