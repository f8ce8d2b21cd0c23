"""Keep every retrieval and reranker score on LlamaIndex nodes, on copies, hidden from the LLM and the embedder.

LlamaIndex keeps one number per node (``NodeWithScore.score``) and a reranker overwrites it, so the
retrieval score is lost exactly when PCED needs both (docs/methods.md#scores: r = harmonic mean of the
normalised retrieval and reranker scores). Here every part is written into the node's metadata:

- ``metadata["score"]``: the current fused relevance r in [0, 1] (what the decoder uses as its prior);
- ``metadata["scores"]``: every raw and normalised part, in the project's naming (``<kind>``,
  ``<kind>_norm``, ``retrieval`` = r_ret, ``reranker`` / ``reranker_norm``, ``fused`` = r).

Both keys are added to ``excluded_llm_metadata_keys`` and ``excluded_embed_metadata_keys``: a score in
the LLM text would change the document's tokens on every query (so its KV cache would never hit) and
would leak into rerankers and embeddings. Nodes are copied, never mutated: the retriever's nodes are
often the docstore's own objects.

``ScoreKeepingRetriever`` wraps any retriever; ``RerankerScoreFusion`` goes right after a reranker in a
stock query engine's ``node_postprocessors``. ``ContextOfExpertsQueryEngine`` uses both for you.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import Field
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.llama_index.scores import as_float, check_score_kind, infer_score_kind, score_parts
from ctx_integrations.retrieval.scores import fuse_scores

SCORE_KEY = "score"
SCORES_KEY = "scores"
HIDDEN_KEYS = (SCORE_KEY, SCORES_KEY)


def _hidden(keys: Sequence[str]) -> list[str]:
    return list(keys) + [k for k in HIDDEN_KEYS if k not in keys]


def node_scores(item: NodeWithScore) -> tuple[float | None, dict[str, float]]:
    """The kept fused r and score parts of a node (``None`` / ``{}`` when none were kept)."""
    metadata = item.node.metadata
    return metadata.get(SCORE_KEY), dict(metadata.get(SCORES_KEY) or {})


def with_scores(item: NodeWithScore, r: float | None, parts: dict[str, float],
                score: float | None) -> NodeWithScore:
    """A copy of ``item`` whose node carries ``r`` and ``parts`` (hidden keys) and whose score is ``score``."""
    node = item.node
    copy = node.model_copy(update={
        "metadata": {**node.metadata, SCORE_KEY: r, SCORES_KEY: dict(parts)},
        "excluded_llm_metadata_keys": _hidden(node.excluded_llm_metadata_keys),
        "excluded_embed_metadata_keys": _hidden(node.excluded_embed_metadata_keys),
    })
    return NodeWithScore(node=copy, score=score)


def keep_retrieval_score(item: NodeWithScore, kind: str) -> NodeWithScore:
    """Record ``item.score`` as a retrieval score of ``kind``; ``node.score`` stays the raw (float) value.

    Keeping the raw value means later postprocessors (e.g. ``SimilarityPostprocessor(similarity_cutoff=...)``)
    still compare against the number they were written for. A node without a score keeps no prior.
    """
    if item.score is None:
        return with_scores(item, None, {}, None)
    parts, r = score_parts(kind, item.score)
    return with_scores(item, r, {**parts, "retrieval": r, "fused": r}, as_float(item.score))


def keep_reranker_score(item: NodeWithScore, kind: str) -> NodeWithScore:
    """Record ``item.score`` (written by a reranker) as a reranker score of ``kind`` and fuse it with r_ret.

    r = 2 r_ret r_rer / (r_ret + r_rer + eps); a node with no retrieval score gets r = r_rer.
    ``node.score`` stays the reranker's raw value (as a float).
    """
    _, parts = node_scores(item)
    reranker, r_rer = score_parts(kind, item.score)
    parts.update(reranker=reranker[kind], reranker_norm=r_rer)
    retrieval = parts.get("retrieval")
    parts["fused"] = r = fuse_scores(retrieval, r_rer) if retrieval is not None else r_rer
    return with_scores(item, r, parts, as_float(item.score))


def finalize(item: NodeWithScore) -> NodeWithScore:
    """The node as the decoder and the response see it: ``node.score`` = the fused r.

    A node that never got a score (e.g. added by ``PrevNextNodePostprocessor``) gets r = 1, the
    project's "no prior" (``ctx_integrations.documents.prepare_documents``), stated in its metadata.
    """
    r, parts = node_scores(item)
    r = 1.0 if r is None else float(r)
    return with_scores(item, r, parts, r)


class ScoreKeepingRetriever(BaseRetriever):
    """Any LlamaIndex retriever, returning copies of its nodes with the retrieval score kept in metadata.

    ``score_kind="auto"`` reads it from the wrapped retriever (a ``VectorStoreIndex`` retriever over the
    default in-memory store or Chroma); for any other retriever say what its ``node.score`` is (see
    :mod:`ctx_integrations.llama_index.scores`), e.g. ``"dense"`` for a cosine similarity.
    """

    def __init__(self, retriever: BaseRetriever, score_kind: str = "auto",
                 callback_manager: CallbackManager | None = None):
        if not isinstance(retriever, BaseRetriever):
            raise InvalidOptionError(f"retriever must be a LlamaIndex BaseRetriever (e.g. index.as_retriever()), "
                                     f"got {type(retriever).__name__}")
        check_score_kind(score_kind, allow_auto=True)
        self.retriever = retriever
        self.score_kind = infer_score_kind(retriever) if score_kind == "auto" else score_kind
        super().__init__(callback_manager=callback_manager or retriever.callback_manager)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [keep_retrieval_score(item, self.score_kind) for item in self.retriever.retrieve(query_bundle)]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        found = await self.retriever.aretrieve(query_bundle)
        return [keep_retrieval_score(item, self.score_kind) for item in found]


class RerankerScoreFusion(BaseNodePostprocessor):
    """Put right after a reranker: keep the reranker's score and fuse it with the kept retrieval score.

    ``score_kind``: what the reranker writes into ``node.score`` (``"reranker"``: a logit, normalised with
    a sigmoid; ``"relevance"``: already in [0, 1]). Afterwards ``node.score`` is the fused r.
    """

    score_kind: str = Field(default="reranker", description="kind of the reranker's node.score")

    def __init__(self, **data: Any):
        super().__init__(**data)
        check_score_kind(self.score_kind)

    @classmethod
    def class_name(cls) -> str:
        return "RerankerScoreFusion"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return [finalize(keep_reranker_score(item, self.score_kind) if item.score is not None else item)
                for item in nodes]
