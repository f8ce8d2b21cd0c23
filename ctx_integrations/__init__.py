"""ctx-integrations: a local decoder for RAG apps with per-document KV caches and five decoding methods."""

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.answer import Answer
from ctx_integrations.engine.core.engine import Engine

__all__ = ["Answer", "Document", "Engine"]
__version__ = "0.1.0"
