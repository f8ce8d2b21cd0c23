"""LangChain adapters: a chat model, a retrieval-chain helper, an LCEL Runnable, and retrievers that keep every score.

Install with ``pip install 'ctx-integrations[langchain]'``. Nothing in ``ctx_integrations.engine``
imports LangChain; this package is a thin layer that maps LangChain documents, messages, configs and
callbacks onto :class:`ctx_integrations.Engine` and back.
"""

from ctx_integrations.errors import missing_dependency

try:
    import langchain_core  # noqa: F401
except ImportError as error:  # the optional extra is not installed
    raise missing_dependency("langchain-core", extra="langchain") from error

from ctx_integrations.langchain.chains import create_context_of_experts_chain
from ctx_integrations.langchain.chat_model import ChatContextOfExperts, UndecodedContextWarning
from ctx_integrations.langchain.convert import (
    documents_as_messages,
    format_docs,
    from_langchain_document,
    to_langchain_document,
)
from ctx_integrations.langchain.embeddings import EmbedderEmbeddings
from ctx_integrations.langchain.retriever import ScoredRetriever, VectorStoreScoredRetriever
from ctx_integrations.langchain.runnable import ContextOfExpertsRunnable

__all__ = [
    "ChatContextOfExperts",
    "ContextOfExpertsRunnable",
    "EmbedderEmbeddings",
    "ScoredRetriever",
    "UndecodedContextWarning",
    "VectorStoreScoredRetriever",
    "create_context_of_experts_chain",
    "documents_as_messages",
    "format_docs",
    "from_langchain_document",
    "to_langchain_document",
]
