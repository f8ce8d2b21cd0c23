"""A document store on ChromaDB whose KV caches live in the user's one KV store.

One folder holds a corpus (``<folder>/chroma``, the Chroma PersistentClient); given an ``http(s)://``
URL instead, the store talks to a Chroma server through ``HttpClient``. KV caches, computed at
ingestion, do not live beside the corpus: every store, whatever its folder, server or collection,
uses the KV root ``$CTX_CACHE_DIR/kv`` (``kv_dir``), one folder per model beneath it. Entries are
content-addressed, so the same passage in two stores is computed and stored once.

Why these choices:
- Embeddings always come from our :class:`~ctx_integrations.retrieval.embedders.Embedder`; the
  collection is created with ``embedding_function=None`` because Chroma's default would download a
  model. The collection records the embedder's identity, and opening it with another embedder is
  an error (vectors from two models are not comparable), raised before anything is touched.
- Cosine space is set explicitly, so ``1 - distance`` is the cosine similarity the dense score uses.
- Writes are upserts in batches within the client's maximum batch size; unchanged documents are not
  re-embedded, and a changed or deleted document's KV cache is dropped (``engine.store.forget``).
- Chroma refuses ``None`` metadata values; they are dropped, and non-scalar values become JSON.
- Which entry files a document's caches were written to is recorded in its Chroma metadata (hidden from
  readers), so deleting or changing a document removes its entries even when no engine (no model) is
  attached; an entry is removed only when no document of this store has the same text any more.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np

from ctx_integrations.documents import Document, as_document, user_text
from ctx_integrations.errors import CtxIntegrationsError, EmptyDocumentsError, InvalidOptionError, StoreConnectionError
from ctx_integrations.paths import cache_root, kv_root
from ctx_integrations.retrieval.embedders import Embedder

if TYPE_CHECKING:
    from ctx_integrations import Engine

STORE_FORMAT = "ctx-store-1"
DEFAULT_COLLECTION = "ctx_documents"
_COLLECTION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,510}[A-Za-z0-9]$")
ENTRIES_KEY = "ctx_kv_entries"  # metadata: JSON list of the KV entry files written for this document's text
_ENTRY_NAME = re.compile(r"^[0-9a-f]{64}\.safetensors$")


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
    ingestion and invalidated on change; build one over the store's ``kv_dir`` with :meth:`open_engine`.
    ``kv_dir``: the KV root (default ``$CTX_CACHE_DIR/kv``, the same for every store and collection).
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
        """The user's KV root, whatever the location or collection: one store of KV entries per model."""
        return kv_root()

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
        """Load a model (the embedded default without ``model``) whose caches live under this store's ``kv_dir``."""
        from ctx_integrations import Engine

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
        for key, value in metadata.items():
            if isinstance(value, str):
                user_text(value, f"where()'s value for {key!r}")  # Chroma's own error for it is untyped
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
        return [Document(text=t or "", id=i, metadata={k: v for k, v in (m or {}).items() if k != ENTRIES_KEY})
                for i, t, m in zip(result["ids"], texts, metas)]

    def _recorded_entries(self, ids: Sequence[str]) -> dict[str, set[str]]:
        """The entry files recorded for each of ``ids`` (see the module doc)."""
        recorded: dict[str, set[str]] = {}
        if self._collection is None:
            return recorded
        for batch in _batches(list(ids), self.max_batch_size):
            result = self._collection.get(ids=list(batch), include=["metadatas"])
            for i, meta in zip(result["ids"], result.get("metadatas") or []):
                try:
                    paths = json.loads(str((meta or {}).get(ENTRIES_KEY, "[]")))
                except ValueError:
                    paths = []
                recorded[i] = {str(path) for path in paths if isinstance(path, str)} if isinstance(paths, list) \
                    else set()
        return recorded

    def query(self, vector: np.ndarray, n: int) -> list[tuple[str, float]]:
        """The ``n`` nearest ids to a unit ``vector`` with their cosine similarity (1 - cosine distance)."""
        n = min(n, self.count())
        if n <= 0:
            return []
        result = self._collection.query(query_embeddings=[np.asarray(vector, np.float32).tolist()], n_results=n,
                                        include=["distances"])
        return [(i, 1.0 - float(d)) for i, d in zip(result["ids"][0], result["distances"][0])]

    # -- writing ---------------------------------------------------------------------------------------
    def add(self, documents: Iterable[Any], *, warm: bool = True, progress: Any = None,
            kv_progress: Callable[[int, int], None] | None = None) -> AddReport:
        """Upsert documents (``Document``, str, or mappings with ``text``); ids default to the content hash.

        Unchanged documents (same text and metadata) are not re-embedded. A changed document's old KV
        cache is dropped; with an engine attached and ``warm``, caches of new and changed documents
        (and of unchanged ones whose cache is missing) are computed now. ``progress(n)`` is called
        as batches are written; ``kv_progress(done, total)`` as caches are computed: once with ``done=0`` before
        the first, then from the engine's scheduler thread (see :meth:`Engine.warm`), so it must not block.
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
                    replaced.append(old)
            else:
                report.added += 1
            changed.append(doc)
        recorded = self._recorded_entries([old.id for old in replaced])  # type: ignore[misc]
        collection = self._collection_for_writing()
        for batch in _batches(changed, self.max_batch_size):
            vectors = self.embedder.embed_documents([d.text for d in batch])
            # Chroma merges metadata on upsert: reset the recorded entries, they belonged to the old text
            collection.upsert(ids=[d.id for d in batch], documents=[d.text for d in batch],
                              embeddings=np.asarray(vectors, np.float32),
                              metadatas=[{**d.metadata, ENTRIES_KEY: "[]"} for d in batch])
            if progress is not None:
                progress(len(batch))
        if changed:
            self._lexical = None
        self._forget_unreferenced([(old.text, recorded.get(old.id, set())) for old in replaced])  # type: ignore[arg-type]
        if warm and self.engine is not None:
            self._warm(docs, report, kv_progress)
        return report

    def _prepare(self, documents: Iterable[Any]) -> list[Document]:
        if isinstance(documents, (str, bytes)):
            raise EmptyDocumentsError("add() takes a list of documents, not a single string")
        docs, seen = [], set()
        for item in documents:
            doc = as_document(item)
            if not doc.text.strip():
                raise EmptyDocumentsError(f"document {doc.id!r} has empty text: nothing was stored; drop it and retry")
            doc.id = user_text(str(doc.id), "a document id") if doc.id is not None else content_hash(doc.text)[:32]
            if doc.id in seen:
                raise InvalidOptionError(f"document id {doc.id!r} appears twice in one add(): ids must be unique")
            seen.add(doc.id)
            doc.metadata = clean_metadata({**doc.metadata, "content_hash": content_hash(doc.text)})
            for key, value in doc.metadata.items():  # Chroma refuses these with an untyped error, mid-batch
                user_text(key, f"a metadata key of document {doc.id!r}")
                if isinstance(value, str):
                    user_text(value, f"metadata {key!r} of document {doc.id!r}")
            docs.append(doc)
        return docs

    def _warm(self, docs: Sequence[Document], report: AddReport,
              progress: Callable[[int, int], None] | None = None) -> None:
        engine = self.engine
        todo = [d.text for d in docs if not engine.store.contains(engine.layout, d.text)]
        if todo:
            if progress is not None:
                progress(0, len(todo))  # the step starts now (its first count comes after a batched forward)
            counts = engine.warm(todo, progress=progress)
            report.cache_misses += counts["misses"]
            report.cache_hits += counts["hits"]
        self._record_entries(docs)

    def _record_entries(self, docs: Sequence[Document]) -> None:
        """Record in each document's metadata the entry file its text's cache is in (for deleting it later)."""
        disk = self.engine.store.disk if self.engine is not None else None
        if disk is None or self._collection is None:
            return
        recorded = self._recorded_entries([d.id for d in docs])  # type: ignore[misc]
        updates: dict[str, str] = {}
        for doc in docs:
            path = str(disk.path(self.engine.store.entry_key(self.engine.layout,
                                                             self.engine.layout.context_ids(doc.text))))
            if doc.id in recorded and path not in recorded[doc.id]:
                updates[doc.id] = json.dumps(sorted(recorded[doc.id] | {path}))  # type: ignore[index]
        for batch in _batches(list(updates), self.max_batch_size):
            self._collection.update(ids=list(batch), metadatas=[{ENTRIES_KEY: updates[i]} for i in batch])

    def warm(self, engine: Engine | None = None, *, progress: Callable[[int, int], None] | None = None) -> AddReport:
        """Compute every missing KV cache of the stored documents (e.g. after ingesting without an engine);
        ``progress(done, total)`` as :meth:`add`'s ``kv_progress``."""
        if engine is not None:
            self.engine = engine
        if self.engine is None:
            raise InvalidOptionError("warm() needs an engine: pass one, or call open_engine() first")
        report = AddReport(unchanged=self.count())
        self._warm(self.all_documents(), report, progress)
        return report

    def delete(self, ids: Sequence[str]) -> int:
        """Remove documents and their KV caches; returns how many existed.

        A deleted document's cache entries are removed from the KV store (by the engine when one is attached,
        else from the entry files recorded at ingestion) unless another document of this store has the same
        text, so nothing computed from deleted text stays on disk. Another store holding the same text simply
        recomputes the entry at its next use (entries are shared by content across stores).
        """
        if isinstance(ids, str):
            raise InvalidOptionError("delete() takes a list of ids, not a single string: delete([id])")
        docs = self.get(list(ids))
        if docs:
            recorded = self._recorded_entries([d.id for d in docs])  # type: ignore[misc]
            for batch in _batches([d.id for d in docs], self.max_batch_size):
                self._collection.delete(ids=list(batch))
            self._forget_unreferenced([(d.text, recorded.get(d.id, set())) for d in docs])  # type: ignore[arg-type]
            self._lexical = None
        return len(docs)

    def _forget_unreferenced(self, texts: Iterable[tuple[str, set[str]]]) -> None:
        """Drop the KV caches of texts that no stored document has any more.

        Caches are keyed by content, so two documents with the same text share one: it stays while
        either exists. The engine, when attached, drops the entry from every tier; the entry files recorded
        for the text are removed too (the only way without an engine: the key needs the model). Recorded
        paths are trusted only inside ``kv_dir`` and with an entry's file name, so a forged record in a shared
        Chroma server cannot delete anything else.
        """
        paths_by_text: dict[str, set[str]] = {}
        for text, paths in texts:
            paths_by_text.setdefault(text, set()).update(paths)
        for text, paths in paths_by_text.items():
            if self.where({"content_hash": content_hash(text)}):
                continue
            if self.engine is not None:
                self.engine.store.forget(self.engine.layout, text)
            for recorded in paths:
                path = Path(recorded)
                if not _ENTRY_NAME.match(path.name) or self.kv_dir.resolve() not in path.resolve().parents:
                    continue
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass  # read-only or racing another process: the entry is unreachable by key anyway

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
