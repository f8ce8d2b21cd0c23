"""Translate between LangChain's documents/messages and the engine's Document/Answer, keeping every score.

LangChain documents carry scores only in ``metadata``; the convention here is ``metadata["score"]``
for the fused relevance r in [0, 1] and ``metadata["scores"]`` for every raw and normalised part,
so a document can go retriever -> runnable -> answer sources and back without losing any of them.

Documents reach a chat model inside a prompt in one of two recoverable forms: tagged messages
(:func:`documents_as_messages`) or sealed text blocks made by :func:`format_docs`, the drop-in for the
``format_docs`` of LangChain's RAG tutorial (see :mod:`ctx_integrations.langchain.boundaries`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.documents import Document as LCDocument
from langchain_core.messages import BaseMessage, SystemMessage
from langchain_core.messages.ai import UsageMetadata

from ctx_integrations import Answer
from ctx_integrations.documents import Document, as_document
from ctx_integrations.errors import EmptyDocumentsError
from ctx_integrations.langchain.boundaries import Block, read_blocks, write_blocks

SCORE_KEY = "score"
SCORES_KEY = "scores"
DOCUMENT_TAG = "ctx_document"  # the additional_kwargs key that marks a message as a document


class DocumentTag(dict):
    """The value of ``additional_kwargs["ctx_document"]`` that :func:`documents_as_messages` writes: id and metadata.

    Only a tag of this class marks a document. LangChain builds messages from plain data too, and
    ``convert_to_messages`` moves a message dict's unknown keys into ``additional_kwargs``, so a chat
    history sent by a client as ``{"role": ..., "content": ..., "ctx_document": {...}}`` would otherwise
    forge a document with any id and score. Plain data (JSON, dicts) cannot make an instance of this
    class; being a ``dict``, it serialises and traces as the mapping it holds.
    """


def content_id(text: str) -> str:
    """A stable id for a document that came without one, so citations can still name it."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def from_langchain_document(item: Any) -> Document:
    """A LangChain ``Document`` (scores in metadata), a project Document, a str or a mapping -> Document."""
    if isinstance(item, LCDocument):
        metadata = dict(item.metadata)
        score = metadata.pop(SCORE_KEY, None)
        scores = metadata.pop(SCORES_KEY, None) or {}
        if not isinstance(scores, Mapping):
            raise EmptyDocumentsError(f"metadata['scores'] of document {item.id!r} must be a mapping of name -> score, "
                                      f"got {type(scores).__name__}")
        return Document(item.page_content, item.id or metadata.get("id"), score, dict(scores), metadata)
    if isinstance(item, Mapping) and "page_content" in item and "text" not in item:
        return from_langchain_document(LCDocument(page_content=str(item["page_content"]), id=item.get("id"),
                                                  metadata=dict(item.get("metadata") or {})))
    return as_document(item)


def from_langchain_documents(items: Any) -> list[Document]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise EmptyDocumentsError(f"'documents' must be a list of documents, got {type(items).__name__}: wrap a "
                                  "single text in a list, or route a retriever's output into 'documents'")
    return [from_langchain_document(item) for item in items]


def to_langchain_document(document: Document) -> LCDocument:
    """A project Document -> LangChain ``Document`` with ``id`` set and every score in ``metadata``."""
    metadata = {**document.metadata, SCORE_KEY: document.score, SCORES_KEY: dict(document.scores)}
    return LCDocument(page_content=document.text, id=document.id or content_id(document.text), metadata=metadata)


def response_metadata(answer: Answer, model_name: str) -> dict[str, Any]:
    """Everything a user needs to cite and time an answer, as ``AIMessage.response_metadata``.

    ``documents`` lists every input document with its scores and how many tokens it won;
    ``cited_documents`` gives the indices of those that won at least one token, most first.
    """
    meta = answer.to_dict()
    del meta["text"]
    meta["model_name"] = model_name
    meta["cited_documents"] = [i for i, _ in answer.citation_counts().most_common()]
    return meta


def usage_metadata(input_tokens: int, answer: Answer) -> UsageMetadata:
    output_tokens = len(answer.token_ids)
    return UsageMetadata(input_tokens=input_tokens, output_tokens=output_tokens,
                         total_tokens=input_tokens + output_tokens)


def documents_as_messages(documents: Any) -> list[SystemMessage]:
    """Documents as tagged system messages, for a ``("placeholder", "{documents}")`` slot of a chat prompt.

    Each message holds one document's text, tagged with ``additional_kwargs["ctx_document"]`` (id and
    metadata, scores included). :class:`ChatContextOfExperts` takes tagged messages out of the
    conversation and answers the last user message from them as documents (each its own expert, with
    its KV cache and relevance prior); any other chat model simply reads them as system context.
    """
    messages = []
    for document in from_langchain_documents(documents):
        metadata = {**document.metadata, SCORE_KEY: document.score, SCORES_KEY: dict(document.scores)}
        messages.append(SystemMessage(content=document.text, additional_kwargs={
            DOCUMENT_TAG: DocumentTag(id=document.id or content_id(document.text), metadata=metadata)}))
    return messages


def split_document_messages(messages: Sequence[BaseMessage]) -> tuple[list[LCDocument] | None, list[BaseMessage]]:
    """The documents carried by tagged messages (``None``: no tagged message) and the other messages.

    A message counts as a document only when :func:`documents_as_messages` tagged it (a :class:`DocumentTag`);
    one whose ``ctx_document`` came as plain data is an ordinary message.
    """
    documents, rest = [], []
    for message in messages:
        tag = message.additional_kwargs.get(DOCUMENT_TAG)
        if not isinstance(tag, DocumentTag):
            rest.append(message)
        else:
            documents.append(LCDocument(page_content=str(message.text), id=tag.get("id"),
                                        metadata=dict(tag.get("metadata") or {})))
    return (documents or None), rest


def format_docs(documents: Any) -> str:
    """Retrieved documents as one string for a prompt's ``{context}``, with boundaries the decoder can recover.

    The drop-in for the ``format_docs`` of LangChain's RAG tutorial
    (``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm``). Each
    document becomes ``<document id="..." score="..." chars="..." seal="...">`` text ``</document>``,
    blank-line separated: any chat model reads it as tagged context, and :class:`ChatContextOfExperts` takes
    the blocks back out of the prompt and decodes them as documents (each its own expert, with its KV cache
    and its retrieval score as prior) instead of answering the whole prompt as plain chat. The seal (an HMAC
    under this process's key) is what makes a block recoverable: a block written by hand, e.g. in a question,
    a pasted message or a document's own text, stays plain text. The tutorial's own
    ``"\\n\\n".join(doc.page_content ...)`` cannot be split back into documents.
    """
    blocks = [Block(document.id or content_id(document.text), document.score, document.text)
              for document in from_langchain_documents(documents)]
    return write_blocks(blocks)


def split_formatted_documents(messages: Sequence[BaseMessage]) -> tuple[list[LCDocument] | None, list[BaseMessage]]:
    """The documents of :func:`format_docs` blocks in the messages (``None``: none) and the messages without them.

    Only blocks sealed by :func:`format_docs` in this process count; any other marker-like text is left in
    its message as plain text. Each document keeps its id and score (``metadata["score"]``); what is left of a
    message (the prompt's instructions, the question) stays in the conversation. A block repeated (in one
    message or several: a replay) is one document, at its first place.
    """
    documents: list[LCDocument] = []
    rest: list[BaseMessage] = []
    seen: set[str] = set()  # one document per sealed block, however often the prompt's messages repeat it
    for message in messages:
        text = str(message.text)
        blocks, without = read_blocks(text, seen)
        if without == text:
            rest.append(message)
            continue
        documents += [LCDocument(page_content=block.text, id=block.id,
                                 metadata={} if block.score is None else {SCORE_KEY: block.score})
                      for block in blocks]
        rest.append(message.model_copy(update={"content": without.strip()}))
    return (documents or None), rest
