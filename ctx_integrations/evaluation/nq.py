"""The NQ-open set: real single-hop questions answered from real retrieval over a whole passage corpus.

Two jsonl files (plain or gzip): the corpus, rows of ``{"id", "title", "text"}``, and the questions, rows of
``{"id", "question", "answers", "gold_passage"}`` (the format of "Lost in the Middle"'s NQ-open split; each
file is recognised by its rows, so they may be given in either order). Every passage goes into a
:class:`~ctx_integrations.retrieval.store.DocumentStore` built with the library's default embedder (or the
one given), and each question's documents are what :class:`~ctx_integrations.retrieval.retriever.ScoredRetriever`
returns for it over the whole corpus: the gold passage is found or not, as in production. The gold
support of an example is the gold passage's index among the retrieved documents (none when it was missed),
its kind ``gold_retrieved`` or ``gold_missed``, and ``meta["gold_rank"]`` its 1-based rank (``None``:
missed), from which the runner reports the retriever's recall@k.

The store holds no KV caches (no engine is attached): the evaluation warms each question's documents, as
an application would at ingestion, before timing the answers.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.sets import Example

NQ_KINDS = ("gold_retrieved", "gold_missed")
DEFAULT_TOP_K = 8


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a jsonl file, gzip-compressed or not (told by its first two bytes, not its name)."""
    location = Path(path)
    if not location.is_file():
        raise InvalidOptionError(f"data file {location} not found: pass the passages and questions files "
                                 "(--data PASSAGES QUESTIONS)")
    raw = location.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    rows = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as error:
                raise InvalidOptionError(f"{location} line {number} is not JSON ({error})") from None
            if not isinstance(row, dict):
                raise InvalidOptionError(f"{location} line {number} is not a JSON object")
            rows.append(row)
    if not rows:
        raise InvalidOptionError(f"{location} holds no rows")
    return rows


_PASSAGE_KEYS = {"id", "title", "text"}
_QUESTION_KEYS = {"id", "question", "answers", "gold_passage"}


def read_nq(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(passages, questions)`` from two files, each recognised by its rows' keys (either order)."""
    return read_pair(paths, _QUESTION_KEYS, "nq")


def read_pair(paths: Sequence[str | Path], question_keys: set[str],
              set_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(passages, questions)`` of a retrieval set from two files, each recognised by its rows' keys (either
    order): passages have ``id, title, text``, questions at least ``question_keys``; every row is checked."""
    if len(paths) != 2:
        raise InvalidOptionError(f"the {set_name} set needs two files, the passages and the questions (--data "
                                 f"PASSAGES QUESTIONS), got {len(paths)}")
    found: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        rows = read_jsonl(path)
        kind = "passages" if _PASSAGE_KEYS <= rows[0].keys() else "questions" if question_keys <= rows[0].keys() \
            else None
        if kind is None or kind in found:
            raise InvalidOptionError(
                f"{path}: expected one file of passages (rows with {sorted(_PASSAGE_KEYS)}) and one of questions "
                f"(rows with {sorted(question_keys)}); its first row has {sorted(rows[0])}")
        keys = _PASSAGE_KEYS if kind == "passages" else question_keys
        bad = next((i for i, row in enumerate(rows, 1) if not keys <= row.keys()), None)
        if bad is not None:
            raise InvalidOptionError(f"{path} row {bad} lacks {sorted(keys - rows[bad - 1].keys())}")
        found[kind] = rows
    return found["passages"], found["questions"]


def passage_text(row: dict[str, Any]) -> str:
    """What a retrieved passage reads as, to the embedder and to the model: its title line, then its text."""
    return f"Title: {row['title']}\n{row['text']}" if row.get("title") else str(row["text"])


def corpus_key(passages: Sequence[dict[str, Any]]) -> str:
    """A short content hash of the corpus: the default store folder is named by it, so another corpus never
    reuses an index built for this one."""
    digest = hashlib.sha256()
    for row in passages:
        digest.update(json.dumps([row["id"], passage_text(row)], ensure_ascii=False).encode("utf-8"))
    return digest.hexdigest()[:16]


def build_store(passages: Sequence[dict[str, Any]], store_dir: str | Path | None = None, embedder: Any = None, *,
                set_name: str = "nq") -> Any:
    """A :class:`DocumentStore` holding every passage (``store_dir``, default ``<cache>/eval/<set>-<corpus hash>``,
    collection ``<set>_passages``).

    Adding to an existing store re-embeds nothing that is unchanged, so a second run starts at once.
    """
    from ctx_integrations.paths import cache_root
    from ctx_integrations.retrieval.store import DocumentStore

    ids = [str(row["id"]) for row in passages]
    if len(set(ids)) != len(ids):
        raise InvalidOptionError("the passages file repeats an id: every passage needs its own")
    folder = Path(store_dir) if store_dir is not None else \
        cache_root() / "eval" / f"{set_name}-{corpus_key(passages)}"
    store = DocumentStore(folder, embedder=embedder, collection=f"{set_name}_passages")
    store.add([Document(passage_text(row), id=str(row["id"]), metadata={"title": str(row.get("title") or "")})
               for row in passages], warm=False)
    return store


def check_sample(set_name: str, n_questions: int | None, top_k: int) -> None:
    """The sample's sizes, refused by name before anything is read."""
    if n_questions is not None and n_questions < 1:
        raise InvalidOptionError(f"the {set_name} set needs n_questions >= 1, got {n_questions}")
    if top_k < 1:
        raise InvalidOptionError(f"the {set_name} set needs top_k >= 1, got {top_k}")


def corpus_retriever(passages: Sequence[dict[str, Any]], retriever: Any = None, store_dir: str | Path | None = None,
                     embedder: Any = None, *, set_name: str = "nq") -> Any:
    """``retriever`` if given, else a :class:`ScoredRetriever` over a store of the whole corpus (see build_store)."""
    from ctx_integrations.retrieval.retriever import ScoredRetriever

    return retriever if retriever is not None else \
        ScoredRetriever(build_store(passages, store_dir, embedder, set_name=set_name))


def seeded_order(count: int, seed: int) -> list[int]:
    """``range(count)`` shuffled by ``seed``: the order in which a set samples its questions."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


def gold_ranks(documents: Sequence[Document], gold_ids: Sequence[str]) -> list[int | None]:
    """Each gold passage's 1-based rank among the retrieved ``documents`` (``None``: not retrieved)."""
    ids = [doc.id for doc in documents]
    return [ids.index(gold) + 1 if gold in ids else None for gold in gold_ids]


def nq_set(paths: Sequence[str | Path], n_questions: int | None = 24, *, seed: int = 0, top_k: int = DEFAULT_TOP_K,
           store_dir: str | Path | None = None, embedder: Any = None, retriever: Any = None,
           gold_retrieved_only: bool = False) -> list[Example]:
    """A seeded sample of ``n_questions`` NQ-open questions (``None``: all), each with its ``top_k`` retrieved passages.

    paths: the passages and the questions files. seed: which questions are sampled (the same seed, files and
    ``n_questions`` give the same questions, in the file's order). embedder: for the store (default: the
    library's default, all-MiniLM-L6-v2); retriever: a ready :class:`ScoredRetriever` over a store that holds
    the corpus (then ``store_dir`` and ``embedder`` are unused). gold_retrieved_only: keep sampling until
    ``n_questions`` questions whose gold passage was retrieved (the protocol of a reader-only comparison;
    the default scores the retriever's misses too, as a user would meet them).
    """
    check_sample("nq", n_questions, top_k)
    passages, questions = read_nq(paths)
    known = {str(row["id"]) for row in passages}
    missing = [q["id"] for q in questions if str(q["gold_passage"]) not in known]
    if missing:
        raise InvalidOptionError(f"{len(missing)} questions name a gold passage that is not in the passages file "
                                 f"(first: {missing[0]}): give the corpus these questions were drawn from")
    retriever = corpus_retriever(passages, retriever, store_dir, embedder)
    order = seeded_order(len(questions), seed)
    wanted = len(questions) if n_questions is None else min(n_questions, len(questions))
    examples: list[tuple[int, Example]] = []
    for index in order:
        if len(examples) == wanted:
            break
        example = _example(questions[index], retriever.retrieve(str(questions[index]["question"]), top_k=top_k))
        if gold_retrieved_only and not example.gold:
            continue
        examples.append((index, example))
    return [example for _, example in sorted(examples, key=lambda pair: pair[0])]


def _example(row: dict[str, Any], documents: list[Document]) -> Example:
    rank = gold_ranks(documents, [str(row["gold_passage"])])[0]
    answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
    return Example(str(row["id"]), str(row["question"]), tuple(str(a) for a in answers), tuple(documents),
                   () if rank is None else (rank - 1,), "gold_retrieved" if rank else "gold_missed",
                   meta={"gold_passage": str(row["gold_passage"]), "gold_rank": rank})

