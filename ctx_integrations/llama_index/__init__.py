"""LlamaIndex adapters: an LLM, a response synthesizer, query and chat engines, score keeping, an ingestion hook.

Install with ``pip install 'ctx-integrations[llama-index]'`` (llama-index-core 0.14 and the Chroma vector
store integration). Nothing in ``ctx_integrations.engine`` imports LlamaIndex; this package maps nodes,
scores, responses and callbacks onto :class:`ctx_integrations.Engine` and back.
"""

from ctx_integrations.errors import UndecodedContextWarning, missing_dependency

try:
    import llama_index.core  # noqa: F401
except ImportError as error:  # the optional extra is not installed
    raise missing_dependency("llama-index-core", extra="llama-index") from error

from ctx_integrations.llama_index.chat_engine import ContextOfExpertsChatEngine
from ctx_integrations.llama_index.convert import node_text, to_document
from ctx_integrations.llama_index.embedding import EmbedderEmbedding, default_embedding
from ctx_integrations.llama_index.ingestion import KVCacheWarmer
from ctx_integrations.llama_index.llm import ExpertDecoderLLM, resolve_llm
from ctx_integrations.llama_index.query_engine import ContextOfExpertsQueryEngine
from ctx_integrations.llama_index.score_keeping import RerankerScoreFusion, ScoreKeepingRetriever
from ctx_integrations.llama_index.scores import SCORE_KINDS, infer_score_kind
from ctx_integrations.llama_index.synthesizer import ContextOfExpertsSynthesizer, MissingScoreWarning

__all__ = [
    "SCORE_KINDS",
    "ContextOfExpertsChatEngine",
    "ContextOfExpertsQueryEngine",
    "ContextOfExpertsSynthesizer",
    "EmbedderEmbedding",
    "ExpertDecoderLLM",
    "KVCacheWarmer",
    "MissingScoreWarning",
    "RerankerScoreFusion",
    "ScoreKeepingRetriever",
    "UndecodedContextWarning",
    "default_embedding",
    "infer_score_kind",
    "node_text",
    "resolve_llm",
    "to_document",
]
