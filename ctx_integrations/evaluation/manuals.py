"""The ``manuals`` set: questions on nine GNU manuals, answered from real retrieval over their 1,130 passages.

Shipped with the package (``evaluation/data/``, see its README for the manuals, versions and licence): the passages
(``{"id", "title", "text"}``, at most 512 tokens of the evaluation model each, built by
``tools/build_manuals_set.py``) and questions keyed by hand (``{"id", "kind", "question", "answers",
"gold_passages", "absent"}``, and ``facts`` for ``two_doc``). Three kinds:

* ``single``: the answer (an option, a number, an exit status, a variable) is stated in one passage;
* ``two_doc``: it needs a fact from each of two passages (a comparison, a sum or difference of two defaults);
* ``unanswerable``: about the same programs, answered by no passage (``absent`` names strings that occur nowhere
  in the corpus); the answer must say the documents do not answer (or that the option asked about does not exist), as in
  the world set (:func:`~ctx_integrations.evaluation.metrics.abstains`, ``meta["answer_match"] = "abstention"``).

Retrieval is :mod:`ctx_integrations.evaluation.nq`'s: every passage goes into one store built with the library's
default embedder (``$CTX_CACHE_DIR/eval/manuals-<corpus hash>``, reused between runs), and each question's
documents are the ``top_k`` passages :class:`ScoredRetriever` returns for it. An example's gold support is the
indices of its gold passages among them (those retrieved; empty for ``unanswerable``), and its meta records
``gold_ranks`` (each gold passage's 1-based rank, ``None``: missed) and ``all_gold_retrieved``.

The recall rule: ``meta["gold_rank"]``, from which the runner reports recall@k, is the rank of the *worst-ranked*
gold passage when every gold passage was retrieved and ``None`` otherwise, so a ``two_doc`` question counts as
found at k only when both its passages are in the top k; ``unanswerable`` questions have no ``gold_rank`` and are
left out of recall.

Answers of ``single`` and ``two_doc`` are scored with :func:`~ctx_integrations.evaluation.metrics.bounded_match`
(``meta["answer_match"] = "bounded"``): SQuAD's normalisation turns ``-i`` into ``i``, which a substring test finds
in nearly any sentence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.nq import check_sample, corpus_retriever, gold_ranks, read_pair
from ctx_integrations.evaluation.sets import ABSTENTIONS, Example

MANUALS_KINDS = ("single", "two_doc", "unanswerable")
DEFAULT_TOP_K = 4
DEFAULT_QUESTIONS = 24
DATA = Path(__file__).parent / "data"
PASSAGES_FILE = DATA / "manuals_passages.jsonl.gz"
QUESTIONS_FILE = DATA / "manuals_questions.jsonl"
_QUESTION_KEYS = {"id", "kind", "question", "answers", "gold_passages", "absent"}


def parse_kinds(kinds: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"single,two_doc"`` or a sequence -> the kinds in :data:`MANUALS_KINDS` order; ``None``: all three."""
    if kinds is None:
        return MANUALS_KINDS
    names = [k.strip() for k in (kinds.split(",") if isinstance(kinds, str) else kinds) if k.strip()]
    unknown = [k for k in names if k not in MANUALS_KINDS]
    if unknown or not names:
        what = f"unknown question kind {unknown[0]!r}" if unknown else "no question kind given"
        raise InvalidOptionError(f"{what} for the manuals set: choose from {', '.join(MANUALS_KINDS)} "
                                 "(comma-separated, e.g. --kinds single,two_doc)")
    return tuple(k for k in MANUALS_KINDS if k in names)


def read_manuals(paths: Sequence[str | Path] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(passages, questions)``: the shipped files, or two given ones (either order); every question row checked."""
    passages, questions = read_pair(list(paths) if paths is not None else [PASSAGES_FILE, QUESTIONS_FILE],
                                    _QUESTION_KEYS, "manuals")
    known = {str(row["id"]) for row in passages}
    seen: set[str] = set()
    for number, row in enumerate(questions, 1):
        where = f"question row {number} ({row.get('id')!r})"
        if str(row["id"]) in seen:
            raise InvalidOptionError(f"{where}: the id is repeated; every question needs its own")
        seen.add(str(row["id"]))
        if row["kind"] not in MANUALS_KINDS:
            raise InvalidOptionError(f"{where}: kind {row['kind']!r} is not one of {', '.join(MANUALS_KINDS)}")
        answers, gold = row["answers"], row["gold_passages"]
        if not isinstance(answers, list) or not isinstance(gold, list) or not isinstance(row["absent"], list):
            raise InvalidOptionError(f"{where}: answers, gold_passages and absent must be lists")
        wanted = {"single": 1, "two_doc": 2, "unanswerable": 0}[row["kind"]]
        if (len(gold) != wanted if wanted < 2 else len(set(gold)) < 2) or bool(answers) != bool(wanted):
            raise InvalidOptionError(f"{where}: a {row['kind']} question needs "
                                     + {"single": "answers and one gold passage",
                                        "two_doc": "answers and two or more different gold passages",
                                        "unanswerable": "no answers and no gold passages"}[row["kind"]])
        missing = [g for g in gold if str(g) not in known]
        if missing:
            raise InvalidOptionError(f"{where}: gold passage {missing[0]!r} is not in the passages file")
    return passages, questions


def stratified_sample(questions: Sequence[dict[str, Any]], n_questions: int | None, kinds: Sequence[str],
                      seed: int) -> list[int]:
    """Indices of a seeded sample of ``n_questions`` (``None``: all) questions of ``kinds``, spread over the kinds
    as evenly as they allow (a kind with too few questions leaves its share to the others), in the file's order."""
    pools = {kind: [i for i, q in enumerate(questions) if q["kind"] == kind] for kind in kinds}
    for kind in kinds:
        random.Random(f"{seed}:{kind}").shuffle(pools[kind])
    total = sum(len(pool) for pool in pools.values())
    wanted = total if n_questions is None else min(n_questions, total)
    taken = dict.fromkeys(kinds, 0)
    while sum(taken.values()) < wanted:  # one more from each kind in turn, skipping the exhausted ones
        for kind in kinds:
            if taken[kind] < len(pools[kind]) and sum(taken.values()) < wanted:
                taken[kind] += 1
    return sorted(i for kind in kinds for i in pools[kind][:taken[kind]])


def manuals_set(paths: Sequence[str | Path] | None = None, n_questions: int | None = DEFAULT_QUESTIONS, *,
                seed: int = 0, top_k: int = DEFAULT_TOP_K, kinds: str | Sequence[str] | None = None,
                store_dir: str | Path | None = None, embedder: Any = None, retriever: Any = None) -> list[Example]:
    """A seeded, kind-stratified sample of ``n_questions`` manuals questions (``None``: all), each with its ``top_k``
    retrieved passages.

    paths: the passages and questions files (default: the shipped ones). kinds: a subset of :data:`MANUALS_KINDS`
    (``"single,two_doc"`` or a list). embedder / store_dir / retriever: as :func:`~ctx_integrations.evaluation.nq.
    nq_set` (default store ``$CTX_CACHE_DIR/eval/manuals-<corpus hash>``).
    """
    check_sample("manuals", n_questions, top_k)
    chosen = parse_kinds(kinds)
    passages, questions = read_manuals(paths)
    picked = stratified_sample(questions, n_questions, chosen, seed)
    if not picked:
        raise InvalidOptionError(f"the questions file has no question of kind {', '.join(chosen)}")
    retriever = corpus_retriever(passages, retriever, store_dir, embedder, set_name="manuals")
    return [_example(questions[i], retriever.retrieve(str(questions[i]["question"]), top_k=top_k)) for i in picked]


def _example(row: dict[str, Any], documents: list[Document]) -> Example:
    gold_ids = [str(g) for g in row["gold_passages"]]
    meta: dict[str, Any] = {"gold_passages": gold_ids}
    if row["kind"] == "unanswerable":
        return Example(str(row["id"]), str(row["question"]), ABSTENTIONS, tuple(documents), (), row["kind"],
                       meta={**meta, "answer_match": "abstention"})
    ranks = gold_ranks(documents, gold_ids)
    found = all(rank is not None for rank in ranks)
    meta.update(gold_ranks=ranks, all_gold_retrieved=found, gold_rank=max(ranks) if found else None,
                answer_match="bounded")
    return Example(str(row["id"]), str(row["question"]), tuple(str(a) for a in row["answers"]), tuple(documents),
                   tuple(sorted(rank - 1 for rank in ranks if rank is not None)), row["kind"], meta=meta)
