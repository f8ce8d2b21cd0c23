"""Evaluate decoding modes on answer quality, citation quality and speed (``ctx-experts eval``).

```python
from ctx_integrations import Engine
from ctx_integrations.evaluation import evaluate, world_set, write_report, markdown_table

engine = Engine.from_pretrained()
report = evaluate(engine, world_set(8, documents=4, document_tokens=64), modes=["pced", "concat", "ape"])
print(markdown_table(report))            # one row per system: EM, F1, citation P/R, TTFT, total, tok/s, cache hits
write_report(report, "eval_results")     # JSON + markdown + two PNG plots (matplotlib: the `eval` extra)
```

Sets: :func:`world_set` (invented-world QA with gold support), :func:`secret_code_set` (needs
``engine.layout``), :func:`musique_set` (the shared MuSiQue dev file), :func:`nq_set` (NQ-open questions
with real retrieval over a passage corpus). :func:`load_set` builds one by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.manuals import DEFAULT_QUESTIONS as MANUALS_QUESTIONS
from ctx_integrations.evaluation.manuals import DEFAULT_TOP_K as MANUALS_TOP_K
from ctx_integrations.evaluation.manuals import MANUALS_KINDS, manuals_set
from ctx_integrations.evaluation.metrics import (
    abstains,
    best_f1,
    bounded_match,
    bracket_citations,
    citation_precision,
    citation_recall,
    normalize_answer,
    recall_at_k,
    substring_match,
    token_f1,
)
from ctx_integrations.evaluation.nq import DEFAULT_TOP_K, nq_set
from ctx_integrations.evaluation.report import markdown_table, plot_report, write_report
from ctx_integrations.evaluation.runner import DEFAULT_MODES, EvalReport, System, default_systems, evaluate
from ctx_integrations.evaluation.sets import Example, musique_set, secret_code_set, world_set

SETS = ("world", "musique", "secret_code", "nq", "manuals")


def load_set(name: str, engine: Any = None, *, n_questions: int | None = None, documents: int | None = None,
             document_tokens: int | None = None, seed: int = 0, path: str | Path | Sequence[str | Path] | None = None,
             top_k: int | None = None, store_dir: str | Path | None = None,
             gold_retrieved_only: bool = False, kinds: str | Sequence[str] | None = None) -> list[Example]:
    """Build set ``name`` ("world", "musique", "secret_code", "nq", "manuals"); ``None`` arguments keep each set's
    defaults.

    ``secret_code`` needs ``engine`` (its prompt layout cuts documents); ``musique`` reads ``path`` (default
    ``$CTX_MUSIQUE``); ``nq`` reads ``path``, the passages and the questions files, and retrieves ``top_k``
    passages per question (8) from a store of the whole corpus (``store_dir``; see :func:`nq_set`); ``manuals``
    reads the shipped files unless ``path`` names two, samples ``n_questions`` (24) over ``kinds`` (all three)
    and retrieves ``top_k`` (4) passages per question (see :func:`manuals_set`).
    """
    sizes = {k: v for k, v in (("documents", documents), ("document_tokens", document_tokens)) if v is not None}
    if name not in ("nq", "manuals") and (top_k is not None or store_dir is not None):
        raise InvalidOptionError("top_k and store_dir are options of the nq set and the manuals set (real retrieval)")
    if name != "nq" and gold_retrieved_only:
        raise InvalidOptionError("gold_retrieved_only is an option of the nq set")
    if name != "manuals" and kinds is not None:
        raise InvalidOptionError("kinds is an option of the manuals set")
    if name == "world":
        return world_set(n_questions or 8, seed=seed, **sizes)
    if name == "secret_code":
        if engine is None:
            raise InvalidOptionError("the secret_code set needs the engine (its prompt layout cuts documents)")
        return secret_code_set(engine.layout, n_questions or 6, seed=seed, **sizes)
    if name == "musique":
        if sizes:
            raise InvalidOptionError("the musique set has fixed documents: drop documents / document_tokens")
        if isinstance(path, (list, tuple)):
            if len(path) != 1:
                raise InvalidOptionError(f"the musique set reads one file, got {len(path)}")
            path = path[0]
        return musique_set(path, n_questions or 12)
    if name == "nq":
        if sizes:
            raise InvalidOptionError("the nq set retrieves real passages: use top_k (--top-k) instead of documents / "
                                     "document_tokens")
        if path is None or isinstance(path, (str, Path)):
            raise InvalidOptionError("the nq set needs two files, the passages and the questions (--data PASSAGES "
                                     "QUESTIONS)")
        return nq_set(list(path), n_questions or 24, seed=seed, top_k=top_k or DEFAULT_TOP_K, store_dir=store_dir,
                      gold_retrieved_only=gold_retrieved_only)
    if name == "manuals":
        if sizes:
            raise InvalidOptionError("the manuals set retrieves real passages: use top_k (--top-k) instead of "
                                     "documents / document_tokens")
        if isinstance(path, (str, Path)):
            raise InvalidOptionError("the manuals set reads two files, the passages and the questions (--data "
                                     "PASSAGES QUESTIONS), or the shipped ones without --data")
        return manuals_set(path, n_questions or MANUALS_QUESTIONS, seed=seed, top_k=top_k or MANUALS_TOP_K,
                           kinds=kinds, store_dir=store_dir)
    raise InvalidOptionError(f"unknown evaluation set {name!r}: choose one of {', '.join(SETS)}")


__all__ = ["DEFAULT_MODES", "MANUALS_KINDS", "SETS", "EvalReport", "Example", "System", "abstains", "best_f1",
           "bounded_match", "bracket_citations", "citation_precision", "citation_recall", "default_systems",
           "evaluate", "load_set", "manuals_set", "markdown_table", "musique_set", "normalize_answer", "nq_set",
           "plot_report", "recall_at_k", "secret_code_set", "substring_match", "token_f1", "world_set", "write_report"]
