"""A document store on ChromaDB whose KV caches live beside it.

One folder holds a corpus: ``<folder>/chroma`` (the Chroma PersistentClient) and ``<folder>/kv``
(the engine's per-document KV caches, computed at ingestion). Given an ``http(s)://`` URL instead,
the store talks to a Chroma server through ``HttpClient`` and keeps its caches under the user
cache directory.

Why these choices:
- Embeddings always come from our :class:`~ctx_integrations.retrieval.embedders.Embedder`; the
  collection is created with ``embedding_function=None`` because Chroma's default would download a
  model. The collection records the embedder's identity, and opening it with another embedder is
  an error (vectors from two models are not comparable), raised before anything is touched.
- Cosine space is set explicitly, so ``1 - distance`` is the cosine similarity the dense score uses.
- Writes are upserts in batches within the client's maximum batch size; unchanged documents are not
  re-embedded, and a changed or deleted document's KV cache is dropped (``engine.store.forget``).
- Chroma refuses ``None`` metadata values; they are dropped, and non-scalar values become JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np

from ctx_integrations.documents import Document, as_document
from ctx_integrations.errors import CtxIntegrationsError, EmptyDocumentsError, InvalidOptionError, StoreConnectionError
from ctx_integrations.paths import cache_root
from ctx_integrations.retrieval.embedders import Embedder

if TYPE_CHECKING:
    from ctx_integrations.engine.core.engine import Engine

STORE_FORMAT = "ctx-store-1"
DEFAULT_COLLECTION = "ctx_documents"
_COLLECTION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,510}[A-Za-z0-9]$")


class StoreMismatchError(CtxIntegrationsError, ValueError):
    """A store opened with an embedder other than the one that built it."""


@dataclass
class AddReport:
    """What an :meth:`DocumentStore.add` call did: counts of documents and of KV caches computed."""

    added: int = 0
    updated: int = 0
    unchanged: int = 0
    cache_misses: int = 0
    cache_hits: int = 0


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def clean_metadata(metadata: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """Chroma-safe metadata: ``None`` dropped, scalars kept, anything else stored as JSON text."""
    clean: dict[str, str | int | float | bool] = {}
    for key, value in metadata.items():
        if value is None:
            continue
        if isinstance(value, (str, int, float, bool)):
            clean[str(key)] = value
        else:
            clean[str(key)] = json.dumps(value, sort_keys=True, default=str)
    return clean


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def is_url(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and location.startswith(("http://", "https://"))


class DocumentStore:
    """Documents, their embeddings and their KV caches, persisted together.

    ``location``: a folder (default ``$CTX_CACHE_DIR/store``) or a Chroma server URL.
    ``embedder``: how texts become vectors; ``None`` uses the embedder the store was built with
    (the embedded MiniLM for a new store). ``engine``: when given, KV caches are computed at
    ingestion and invalidated on change; build one that writes beside the store with
    :meth:`open_engine`.
    """

    def __init__(self, location: str | os.PathLike | None = None, *, embedder: Embedder | None = None,
                 collection: str = DEFAULT_COLLECTION, engine: Engine | None = None,
                 kv_dir: str | os.PathLike | None = None, client: Any = None):
        if not _COLLECTION_NAME.match(collection):
            raise InvalidOptionError(f"collection name {collection!r} is not valid for Chroma: use 3-512 letters, "
                                     "digits, '.', '_' or '-', starting and ending with a letter or digit")
        self.location = str(location) if is_url(location or "") else Path(location or cache_root() / "store")
        self.collection_name = collection
        try:
            self._client = client if client is not None else self._connect()
            # embedding_function=None also when reopening: get_collection's default would attach Chroma's own
            exists = self._exists()
        except (ValueError, ConnectionError, OSError) as error:
            if not isinstance(self.location, str) or isinstance(error, CtxIntegrationsError):
                raise
            raise StoreConnectionError(f"cannot reach the Chroma server at {self.location} ({error}): start it "
                                       "(`chroma run --path DIR`), check the URL, or give a folder instead") from None
        self._collection = self._client.get_collection(collection, embedding_function=None) if exists else None
        self.embedder = self._check_embedder(embedder)
        self.kv_dir = Path(kv_dir) if kv_dir is not None else self._default_kv_dir()
        self.engine = engine
        self._lexical: Any = None

    # -- opening -----------------------------------------------------------------------------------
    def _connect(self) -> Any:
        import chromadb

        settings = chromadb.Settings(anonymized_telemetry=False)
        if isinstance(self.location, str):
            url = urlparse(self.location)
            ssl = url.scheme == "https"
            return chromadb.HttpClient(host=url.hostname or "localhost", port=url.port or (443 if ssl else 8000),
                                       ssl=ssl, settings=settings)
        if self.location.exists() and not self.location.is_dir():
            raise InvalidOptionError(f"store location {self.location} is a file: give a folder")
        self.location.mkdir(parents=True, exist_ok=True)
        return chromadb.PersistentClient(path=str(self.location / "chroma"), settings=settings)

    def _exists(self) -> bool:
        return self.collection_name in {getattr(c, "name", c) for c in self._client.list_collections()}

    def _default_kv_dir(self) -> Path:
        if isinstance(self.location, Path):
            return self.location / "kv"
        url = urlparse(self.location)
        return cache_root() / "kv" / f"{url.hostname}_{url.port or 0}_{self.collection_name}"

    def _check_embedder(self, embedder: Embedder | None) -> Embedder:
        from ctx_integrations.retrieval.specs import embedder_from_spec

        recorded = dict(self._collection.metadata or {}) if self._collection is not None else {}
        if embedder is None:
            embedder = embedder_from_spec(str(recorded.get("embedder_spec", "minilm")))
        identity = recorded.get("embedder")
        if identity is not None and identity != embedder.identity:
            raise StoreMismatchError(
                f"store {self.location} (collection {self.collection_name!r}) was built with embedder {identity!r}, "
                f"not {embedder.identity!r}; its vectors are not comparable. Open it with the same embedder "
                f"(spec {recorded.get('embedder_spec')!r}), or use another --store / collection.")
        return embedder

    def _collection_for_writing(self) -> Any:
        if self._collection is None:
            from ctx_integrations.retrieval.specs import embedder_spec

            metadata = {"format": STORE_FORMAT, "embedder": self.embedder.identity,
                        "embedder_spec": embedder_spec(self.embedder), "dimension": int(self.embedder.dimension)}
            self._collection = self._client.get_or_create_collection(
                self.collection_name, embedding_function=None, configuration={"hnsw": {"space": "cosine"}},
                metadata=metadata)
        return self._collection

    def open_engine(self, model: str | os.PathLike | None = None, **options: Any) -> Engine:
        """Load a model (the embedded default without ``model``) whose caches live in this store's ``kv_dir``."""
        from ctx_integrations.engine.core.engine import Engine

        self.engine = Engine.from_pretrained(model, cache_dir=self.kv_dir, **options)
        return self.engine

    # -- size and reading ----------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return int(self._client.get_max_batch_size())

    def count(self) -> int:
        return 0 if self._collection is None else int(self._collection.count())

    __len__ = count

    def ids(self) -> list[str]:
        return [doc.id for doc in self._iterate(include=[])]  # type: ignore[misc]

    def all_documents(self) -> list[Document]:
        return list(self._iterate(include=["documents", "metadatas"]))

    def get(self, ids: Sequence[str]) -> list[Document]:
        """The stored documents with these ids, in the order asked; unknown ids are skipped."""
        found: dict[str, Document] = {}
        if self._collection is not None:
            for batch in _batches(list(ids), self.max_batch_size):
                result = self._collection.get(ids=list(batch), include=["documents", "metadatas"])
                for doc in self._rows(result):
                    found[doc.id] = doc  # type: ignore[index]
        return [found[i] for i in ids if i in found]

    def embeddings(self, ids: Sequence[str]) -> np.ndarray:
        """Stored vectors ``[len(ids), D]`` in the order asked (every id must exist)."""
        vectors: dict[str, np.ndarray] = {}
        if self._collection is not None:
            for batch in _batches(list(ids), self.max_batch_size):
                result = self._collection.get(ids=list(batch), include=["embeddings"])
                for i, vector in zip(result["ids"], result["embeddings"]):
                    vectors[i] = np.asarray(vector, dtype=np.float32)
        missing = [i for i in ids if i not in vectors]
        if missing:
            raise InvalidOptionError(f"documents {missing[:5]} are not in the store")
        return np.stack([vectors[i] for i in ids]) if ids else np.zeros((0, self.embedder.dimension), np.float32)

    def where(self, metadata: dict[str, Any]) -> list[Document]:
        """Documents whose metadata has every given key/value (e.g. ``{"source": path}``)."""
        if self._collection is None:
            return []
        clause = metadata if len(metadata) == 1 else {"$and": [{k: v} for k, v in metadata.items()]}
        return self._rows(self._collection.get(where=clause, include=["documents", "metadatas"]))

    def _iterate(self, include: list[str]) -> Iterator[Document]:
        if self._collection is None:
            return
        size, offset = self.max_batch_size, 0
        while True:
            result = self._collection.get(include=include, limit=size, offset=offset)
            rows = self._rows(result)
            yield from rows
            if len(rows) < size:
                return
            offset += size

    @staticmethod
    def _rows(result: dict[str, Any]) -> list[Document]:
        texts = result.get("documents") or [""] * len(result["ids"])
        metas = result.get("metadatas") or [{}] * len(result["ids"])
        return [Document(text=t or "", id=i, metadata=dict(m or {})) for i, t, m in zip(result["ids"], texts, metas)]

    def query(self, vector: np.ndarray, n: int) -> list[tuple[str, float]]:
        """The ``n`` nearest ids to a unit ``vector`` with their cosine similarity (1 - cosine distance)."""
        n = min(n, self.count())
        if n <= 0:
            return []
        result = self._collection.query(query_embeddings=[np.asarray(vector, np.float32).tolist()], n_results=n,
                                        include=["distances"])
        return [(i, 1.0 - float(d)) for i, d in zip(result["ids"][0], result["distances"][0])]

    # -- writing ---------------------------------------------------------------------------------------
    def add(self, documents: Iterable[Any], *, warm: bool = True, progress: Any = None) -> AddReport:
        """Upsert documents (``Document``, str, or mappings with ``text``); ids default to the content hash.

        Unchanged documents (same text and metadata) are not re-embedded. A changed document's old KV
        cache is dropped; with an engine attached and ``warm``, caches of new and changed documents
        (and of unchanged ones whose cache is missing) are computed now. ``progress(n)`` is called
        as batches are written.
        """
        docs = self._prepare(documents)
        report = AddReport()
        existing = {d.id: d for d in self.get([d.id for d in docs])}  # type: ignore[misc]
        changed, replaced = [], []
        for doc in docs:
            old = existing.get(doc.id)
            if old is not None and old.text == doc.text and old.metadata == doc.metadata:
                report.unchanged += 1
                continue
            if old is not None:
                report.updated += 1
                if old.text != doc.text:
                    replaced.append(old.text)
            else:
                report.added += 1
            changed.append(doc)
        collection = self._collection_for_writing()
        for batch in _batches(changed, self.max_batch_size):
            vectors = self.embedder.embed_documents([d.text for d in batch])
            collection.upsert(ids=[d.id for d in batch], documents=[d.text for d in batch],
                              embeddings=np.asarray(vectors, np.float32), metadatas=[d.metadata for d in batch])
            if progress is not None:
                progress(len(batch))
        if changed:
            self._lexical = None
        self._forget_unreferenced(replaced)
        if warm and self.engine is not None:
            self._warm(docs, report)
        return report

    def _prepare(self, documents: Iterable[Any]) -> list[Document]:
        if isinstance(documents, (str, bytes)):
            raise EmptyDocumentsError("add() takes a list of documents, not a single string")
        docs, seen = [], set()
        for item in documents:
            doc = as_document(item)
            if not doc.text.strip():
                raise EmptyDocumentsError(f"document {doc.id!r} has empty text: nothing was stored; drop it and retry")
            doc.id = str(doc.id) if doc.id is not None else content_hash(doc.text)[:32]
            if doc.id in seen:
                raise InvalidOptionError(f"document id {doc.id!r} appears twice in one add(): ids must be unique")
            seen.add(doc.id)
            doc.metadata = clean_metadata({**doc.metadata, "content_hash": content_hash(doc.text)})
            docs.append(doc)
        return docs

    def _warm(self, docs: Sequence[Document], report: AddReport) -> None:
        engine = self.engine
        todo = [d.text for d in docs if not engine.store.contains(engine.layout, d.text)]
        if todo:
            counts = engine.warm(todo)
            report.cache_misses += counts["misses"]
            report.cache_hits += counts["hits"]

    def warm(self, engine: Engine | None = None) -> AddReport:
        """Compute every missing KV cache of the stored documents (e.g. after ingesting without an engine)."""
        if engine is not None:
            self.engine = engine
        if self.engine is None:
            raise InvalidOptionError("warm() needs an engine: pass one, or call open_engine() first")
        report = AddReport(unchanged=self.count())
        self._warm(self.all_documents(), report)
        return report

    def delete(self, ids: Sequence[str]) -> int:
        """Remove documents and their KV caches; returns how many existed.

        Deleting the last document also empties ``kv_dir``: every entry there derives from documents of this
        store (or from the prompt prefix, recomputed in milliseconds), including stale entries of documents
        deleted earlier without an engine attached, so nothing computed from deleted text stays on disk.
        """
        if isinstance(ids, str):
            raise InvalidOptionError("delete() takes a list of ids, not a single string: delete([id])")
        docs = self.get(list(ids))
        if docs:
            for batch in _batches([d.id for d in docs], self.max_batch_size):
                self._collection.delete(ids=list(batch))
            self._forget_unreferenced([d.text for d in docs])
            self._lexical = None
            if self.count() == 0:
                self._clear_kv_dir()
        return len(docs)

    def _clear_kv_dir(self) -> None:
        """Delete every KV entry and temp file under ``kv_dir`` (and the engine's in-memory copies)."""
        if self.engine is not None:
            self.engine.store.clear_memory()
        if not self.kv_dir.is_dir():
            return
        for path in [*self.kv_dir.glob("*/*.safetensors"), *self.kv_dir.glob("*/.tmp-*")]:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # read-only or racing another process: the entries are unreachable by key anyway
        for folder in self.kv_dir.iterdir():
            if folder.is_dir():
                try:
                    folder.rmdir()  # only empty shard folders
                except OSError:
                    pass

    def _forget_unreferenced(self, texts: Iterable[str]) -> None:
        """Drop the KV caches of texts that no stored document has any more.

        Caches are keyed by content, so two documents with the same text share one: it stays while
        either exists. Without an engine nothing can be dropped (the key needs the model); stale
        entries then stay on disk, unused, since a changed text has another key.
        """
        if self.engine is None:
            return
        for text in set(texts):
            if not self.where({"content_hash": content_hash(text)}):
                self.engine.store.forget(self.engine.layout, text)

    # -- lexical index ---------------------------------------------------------------------------------
    def lexical_scores(self, query: str) -> dict[str, float]:
        """BM25 score of ``query`` against every stored document (bm25s, built on first use after a write)."""
        if self._lexical is None:
            self._lexical = _Bm25Index.build(self.all_documents())
        return self._lexical.scores(query)


@dataclass
class _Bm25Index:
    ids: list[str]
    index: Any

    @classmethod
    def build(cls, documents: list[Document]) -> _Bm25Index:
        import bm25s

        index = bm25s.BM25()
        if documents:
            index.index(bm25s.tokenize([d.text for d in documents], stopwords="en", show_progress=False),
                        show_progress=False)
        return cls([d.id for d in documents], index)  # type: ignore[misc]

    def scores(self, query: str) -> dict[str, float]:
        import bm25s

        if not self.ids:
            return {}
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
        values = self.index.get_scores(tokens) if tokens else np.zeros(len(self.ids))
        return {i: float(v) for i, v in zip(self.ids, values)}
