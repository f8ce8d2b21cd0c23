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
``engine.layout``), :func:`musique_set` (the shared MuSiQue dev file). :func:`load_set` builds one by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.metrics import (
    best_f1,
    bracket_citations,
    citation_precision,
    citation_recall,
    normalize_answer,
    substring_match,
    token_f1,
)
from ctx_integrations.evaluation.report import markdown_table, plot_report, write_report
from ctx_integrations.evaluation.runner import DEFAULT_MODES, EvalReport, System, default_systems, evaluate
from ctx_integrations.evaluation.sets import Example, musique_set, secret_code_set, world_set

SETS = ("world", "musique", "secret_code")


def load_set(name: str, engine: Any = None, *, n_questions: int | None = None, documents: int | None = None,
             document_tokens: int | None = None, seed: int = 0, path: str | Path | None = None) -> list[Example]:
    """Build set ``name`` ("world", "musique", "secret_code"); ``None`` arguments keep each set's defaults.

    ``secret_code`` needs ``engine`` (its documents are cut to exact token counts in the engine's layout);
    ``musique`` reads ``path`` (default ``$CTX_MUSIQUE``).
    """
    sizes = {k: v for k, v in (("documents", documents), ("document_tokens", document_tokens)) if v is not None}
    if name == "world":
        return world_set(n_questions or 8, seed=seed, **sizes)
    if name == "secret_code":
        if engine is None:
            raise InvalidOptionError("the secret_code set needs the engine (its prompt layout cuts documents)")
        return secret_code_set(engine.layout, n_questions or 6, seed=seed, **sizes)
    if name == "musique":
        if sizes:
            raise InvalidOptionError("the musique set has fixed documents: drop documents / document_tokens")
        return musique_set(path, n_questions or 12)
    raise InvalidOptionError(f"unknown evaluation set {name!r}: choose one of {', '.join(SETS)}")


__all__ = ["DEFAULT_MODES", "SETS", "EvalReport", "Example", "System", "best_f1", "bracket_citations",
           "citation_precision", "citation_recall", "default_systems", "evaluate", "load_set", "markdown_table",
           "musique_set", "normalize_answer", "plot_report", "secret_code_set", "substring_match", "token_f1",
           "world_set", "write_report"]
