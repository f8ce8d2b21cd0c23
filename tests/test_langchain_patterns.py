"""LangChain's stock patterns with the decoder: the retrieval-chain helper, documents carried by a chat
prompt, standard chat-model events and token callbacks, and consistent option names. Real
langchain-core classes (``InMemoryVectorStore``, ``ChatPromptTemplate``, ``astream_events`` v2, callback
handlers); a tiny random Llama decodes and every answer is compared with ``Engine.generate`` over the
same documents and priors.
"""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from ctx_integrations import DEFAULT_MODE, Document, Engine
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.langchain import (
    ChatContextOfExperts,
    ContextOfExpertsRunnable,
    EmbedderEmbeddings,
    VectorStoreScoredRetriever,
    create_context_of_experts_chain,
    documents_as_messages,
)
from ctx_integrations.retrieval.scores import normalize_dense
from tests.helpers import concatenated_prompt_tokens as prompt_tokens
from tests.helpers import tiny_loaded

TEXTS = {"vault": "The secret code of the vault is 4721.", "paris": "Paris is the capital of France.",
         "fuji": "Mount Fuji is the highest mountain in Japan."}
QUESTION = "What is the secret code of the vault?"
TOKENS = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_loaded("llama"))


@pytest.fixture(scope="module")
def store() -> InMemoryVectorStore:
    store = InMemoryVectorStore(EmbedderEmbeddings())
    store.add_documents([LCDocument(page_content=text, id=key, metadata={"source": f"{key}.txt"})
                         for key, text in TEXTS.items()])
    return store


@pytest.fixture(scope="module")
def retriever(store) -> VectorStoreScoredRetriever:
    return VectorStoreScoredRetriever(vectorstore=store, k=2)  # default search works on InMemoryVectorStore


def expected(engine: Engine, documents: list[LCDocument], mode: str = DEFAULT_MODE):
    docs = [Document(d.page_content, d.id, d.metadata["score"]) for d in documents]
    return engine.generate(QUESTION, docs, mode=mode, max_new_tokens=TOKENS)


class TokenCollector(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


# -- 7. the chain helper and documents in a chat prompt --------------------------------------------------------
def test_the_chain_answers_with_context_scores_and_citations(engine, retriever, store):
    chain = create_context_of_experts_chain(retriever, engine=engine, max_tokens=TOKENS)
    out = chain.invoke({"input": QUESTION})
    assert set(out) >= {"input", "context", "answer", "citations", "usage_metadata"} and out["input"] == QUESTION
    cosines = dict((d.id, s) for d, s in store.similarity_search_with_score(QUESTION, k=2))
    assert [d.id for d in out["context"]][0] == "vault"
    for document in out["context"]:  # the score is kept in metadata: r = (cos + 1) / 2
        assert document.metadata["score"] == pytest.approx(normalize_dense(cosines[document.id]))
    answer = expected(engine, out["context"])
    assert out["answer"] == answer.text
    counts = answer.citation_counts()
    assert [(c["id"], c["tokens_won"]) for c in out["citations"]] == [
        (out["context"][i].id, n) for i, n in counts.most_common()]
    assert sum(c["tokens_won"] for c in out["citations"]) == TOKENS
    assert out["citations"][0]["score"] == out["context"][out["citations"][0]["index"]].metadata["score"]
    assert out["usage_metadata"]["output_tokens"] == TOKENS

    chunks = list(chain.stream({"input": QUESTION}))
    pieces = [chunk["answer"] for chunk in chunks if "answer" in chunk]
    assert len(pieces) > 1 and "".join(pieces) == answer.text  # streamed token by token, like create_retrieval_chain

    async def astreamed() -> str:
        return "".join([chunk["answer"] async for chunk in chain.astream({"input": QUESTION}) if "answer" in chunk])

    assert asyncio.run(astreamed()) == answer.text
    # the same citations; the scores to float precision: ainvoke embeds the question on an executor thread, whose
    # torch thread count may differ from this one's, and a matmul split differently moves the cosine's last bits
    async_citations = asyncio.run(chain.ainvoke({"input": QUESTION}))["citations"]
    assert [{**c, "score": None} for c in async_citations] == [{**c, "score": None} for c in out["citations"]]
    assert [c["score"] for c in async_citations] == pytest.approx([c["score"] for c in out["citations"]], rel=1e-6)


def test_a_chat_prompt_carries_documents_to_the_chat_model(engine, retriever):
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the documents."),
                                               ("placeholder", "{documents}"), ("human", "{question}")])
    chain = ({"documents": retriever | documents_as_messages, "question": RunnablePassthrough()} | prompt
             | ChatContextOfExperts(engine=engine, max_tokens=TOKENS))
    message = chain.invoke(QUESTION)
    retrieved = retriever.invoke(QUESTION)
    assert message.content == expected(engine, retrieved).text  # answered from the documents, not the flat prompt
    meta = message.response_metadata["documents"]
    assert [(d["id"], d["score"]) for d in meta] == [(d.id, d.metadata["score"]) for d in retrieved]

    messages = prompt.invoke({"question": QUESTION, "documents": documents_as_messages(retrieved)}).to_messages()
    assert [type(m) for m in messages[1:3]] == [SystemMessage, SystemMessage]  # any chat model reads them as context
    assert messages[1].content == retrieved[0].page_content
    with pytest.raises(InvalidOptionError, match="documents came both in the prompt"):
        ChatContextOfExperts(engine=engine).invoke(messages, documents=retrieved)


def test_chain_arguments_are_checked(engine, retriever):
    with pytest.raises(InvalidOptionError, match="llm= or model options"):
        create_context_of_experts_chain(retriever, ChatContextOfExperts(engine=engine), mode="concat")
    with pytest.raises(InvalidOptionError, match="retriever must be a LangChain Runnable"):
        create_context_of_experts_chain(["not", "a", "retriever"], engine=engine)
    with pytest.raises(InvalidOptionError, match="takes {'input': question}"):
        create_context_of_experts_chain(retriever, engine=engine).invoke(QUESTION)


# -- 8. standard events ----------------------------------------------------------------------------------------
DOCS = [LCDocument(page_content=TEXTS["vault"], id="vault", metadata={"score": 0.9}),
        LCDocument(page_content=TEXTS["paris"], id="paris", metadata={"score": 0.4})]


def test_the_runnable_emits_chat_model_events_with_tokens(engine):
    runnable = ContextOfExpertsRunnable(engine=engine, max_tokens=TOKENS)
    answer = expected(engine, DOCS)

    async def events() -> list[dict]:
        return [event async for event in runnable.astream_events({"question": QUESTION, "documents": DOCS},
                                                                 version="v2", include_types=["chat_model"])]

    seen = asyncio.run(events())
    names = [event["event"] for event in seen]
    assert names[0] == "on_chat_model_start" and names[-1] == "on_chat_model_end"
    assert set(names[1:-1]) == {"on_chat_model_stream"}
    assert "".join(event["data"]["chunk"].content for event in seen[1:-1]) == answer.text
    final = seen[-1]["data"]["output"]
    assert final.usage_metadata["output_tokens"] == TOKENS
    assert final.response_metadata["trace"] and final.response_metadata["mode"] == DEFAULT_MODE


def test_token_callbacks_and_usage_metadata(engine):
    runnable = ContextOfExpertsRunnable(engine=engine, max_tokens=TOKENS)
    answer = expected(engine, DOCS)
    collector = TokenCollector()
    streamed = list(runnable.stream({"question": QUESTION, "documents": DOCS}, {"callbacks": [collector]}))
    assert "".join(collector.tokens) == answer.text and len([t for t in collector.tokens if t]) > 1
    assert "".join(str(chunk.content) for chunk in streamed) == answer.text

    message = runnable.invoke({"question": QUESTION, "documents": DOCS})
    used = prompt_tokens(engine, QUESTION, [d.page_content for d in DOCS])
    assert message.usage_metadata == {"input_tokens": used, "output_tokens": TOKENS, "total_tokens": used + TOKENS}

    chat = ChatContextOfExperts(engine=engine, max_tokens=TOKENS)
    collector = TokenCollector()
    pieces = [chunk.content for chunk in chat.stream(QUESTION, {"callbacks": [collector]}, documents=DOCS)]
    assert "".join(collector.tokens) == "".join(pieces) == answer.text


# -- 9. option names, the default search, the input error ------------------------------------------------------
def test_max_tokens_everywhere_with_max_new_tokens_as_alias(engine):
    assert ChatContextOfExperts(engine=engine, max_new_tokens=5).max_tokens == 5
    chat = ChatContextOfExperts(engine=engine, max_tokens=TOKENS)
    assert len(chat.invoke(QUESTION, documents=DOCS, max_new_tokens=3).response_metadata["token_ids"]) == 3
    with pytest.raises(InvalidOptionError, match="not both"):
        chat.invoke(QUESTION, documents=DOCS, max_tokens=3, max_new_tokens=3)

    runnable = ContextOfExpertsRunnable(engine=engine, max_new_tokens=5)
    assert runnable.max_tokens == runnable.max_new_tokens == 5
    with pytest.raises(InvalidOptionError, match="not both"):
        ContextOfExpertsRunnable(engine=engine, max_tokens=5, max_new_tokens=5)
    for key in ("max_tokens", "max_new_tokens"):
        message = runnable.invoke({"question": QUESTION, "documents": DOCS}, {"configurable": {key: 2}})
        assert len(message.response_metadata["token_ids"]) == 2


def test_default_search_and_its_refusal(store):
    from langchain_core.vectorstores import VectorStore

    assert VectorStoreScoredRetriever(vectorstore=store).search == "similarity"  # InMemoryVectorStore: a cosine

    class UnknownStore(VectorStore):  # a store whose raw score we cannot interpret
        add_texts = similarity_search = from_texts = None

    with pytest.raises(InvalidOptionError, match="pass search='similarity' with a normalize="):
        VectorStoreScoredRetriever(vectorstore=UnknownStore())


def test_the_input_error_has_no_stray_braces(engine):
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    with pytest.raises(InvalidOptionError) as raised:
        (prompt | ContextOfExpertsRunnable(engine=engine)).invoke({"question": QUESTION})
    message = str(raised.value)
    assert "ChatPromptValue" in message and "}}" not in message and "{'question': str, 'documents': [...]}" in message
