"""Run decoding modes over an evaluation set and score every answer: :func:`evaluate`.

A *system* is one way of answering: a mode with options (``pced``, ``pced gamma=0``, ...), the
prompt-based citation baseline ``concat [n]`` (``concat`` over documents numbered ``[1]..[N]``,
asked to cite them with ``[n]`` markers; its citations are the markers it writes), and ``cite all``
(a citation baseline that answers nothing and cites every retrieved document). Examples are the
outer loop and systems the inner one, so a slow minute of a shared CPU hits every system alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ctx_integrations.documents import Document
from ctx_integrations.engine.core.citations import DEFAULT_THRESHOLD, cited_documents
from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.evaluation.metrics import (
    abstains,
    best_f1,
    bounded_match,
    bracket_citations,
    citation_precision,
    citation_recall,
    mean_defined,
    median_defined,
    recall_at_k,
    substring_match,
)
from ctx_integrations.evaluation.sets import Example

DEFAULT_MODES = ("pced", "concat", "ape", "soft_nbce", "single")
BRACKET_SYSTEM = "concat [n]"
CITE_ALL_SYSTEM = "cite all"
PCED_NO_PRIOR = "pced gamma=0"
BRACKET_INSTRUCTION = " Cite the documents you used by their numbers in brackets, like [1]."
# Options the evaluation turns on by default: APE records attention mass so its answers have citations. APE's
# own default (attribution=None) does so only on the eager kernel; True keeps it on CUDA too (eager forced).
EVAL_OPTIONS: dict[str, dict[str, Any]] = {"ape": {"attribution": True}}


@dataclass(frozen=True)
class System:
    """One way of answering: a name for the table, the mode that runs, its options, how it cites."""

    name: str
    mode: str | None  # None: answers nothing (the "cite all" baseline)
    options: dict[str, Any] = field(default_factory=dict)
    cites: str = "trace"  # "trace" (sentence citations), "brackets" ([n] markers), "all" (every document)


def default_systems(modes: Sequence[str], *, baselines: bool = True, pced_ablation: bool = True) -> list[System]:
    """The modes asked for, plus the citation baselines and PCED's gamma = 0 ablation (when pced is asked for)."""
    systems = [System(m, m, dict(EVAL_OPTIONS.get(m, {}))) for m in modes]
    if pced_ablation and "pced" in modes:
        systems.append(System(PCED_NO_PRIOR, "pced", {"gamma": 0.0}))
    if baselines:
        systems.append(System(BRACKET_SYSTEM, "concat", cites="brackets"))
        systems.append(System(CITE_ALL_SYSTEM, None, cites="all"))
    return systems


@dataclass
class EvalReport:
    """Every scored answer (``records``) and one summary row per system (``rows``)."""

    set_name: str
    records: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    settings: dict[str, Any]
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"set": self.set_name, "settings": self.settings, "elapsed_s": self.elapsed_s, "rows": self.rows,
                "records": self.records}


def evaluate(engine: Any, examples: Sequence[Example], modes: Sequence[str] = DEFAULT_MODES, *,
             max_new_tokens: int = 20, threshold: float = DEFAULT_THRESHOLD, baselines: bool = True,
             pced_ablation: bool = True, warm: bool = True, set_name: str = "custom",
             systems: Sequence[System] | None = None,
             progress: Callable[[str], None] | None = None,
             done: Sequence[dict[str, Any]] = (),
             on_record: Callable[[dict[str, Any]], None] | None = None) -> EvalReport:
    """Answer every example with every system and score it; return an :class:`EvalReport`.

    engine: an :class:`~ctx_integrations.Engine`. examples: from :mod:`ctx_integrations.evaluation.sets`.
    modes: registered mode names (each run with :data:`EVAL_OPTIONS`). threshold: the share of a
    sentence's content tokens a document must win to be cited. baselines: add ``concat [n]`` and
    ``cite all``. pced_ablation: add ``pced gamma=0`` when ``pced`` is among the modes. warm: compute
    the documents' KV caches before timing (what ingestion does), so TTFT is that of a warm store.
    systems: replace the systems built from the flags above. progress: called with one line per answer.
    done: records of an earlier run of the same set (e.g. read back from what ``on_record`` wrote): an
    (example, system) pair found there is not answered again, and its record joins the report, so a
    stopped run resumes and a new system can be added to a finished one. on_record: called with each new
    record as soon as it is scored (write it out, and a long run loses nothing when it is stopped).
    """
    if not examples:
        raise InvalidOptionError("evaluate needs at least one example")
    if max_new_tokens < 1:
        raise InvalidOptionError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    systems = list(systems) if systems is not None else default_systems(modes, baselines=baselines,
                                                                         pced_ablation=pced_ablation)
    for system in systems:
        if system.mode is not None and system.mode not in engine.modes:
            raise InvalidOptionError(f"unknown mode {system.mode!r}: choose from {', '.join(engine.modes)}")
    started = time.perf_counter()
    earlier = {(r["example"], r["system"]): r for r in done}
    todo = [(e, [s for s in systems if (e.id, s.name) not in earlier]) for e in examples]
    if any(pending for _, pending in todo):
        _warm_up(engine, [s for _, pending in todo for s in pending])
    records = []
    for example, pending in todo:
        if warm and any(s.mode is not None for s in pending):
            engine.warm(list(example.documents))
        for system in systems:
            if system not in pending:
                records.append(earlier[(example.id, system.name)])
                continue
            record = _answer(engine, example, system, max_new_tokens, threshold)
            records.append(record)
            if on_record is not None:
                on_record(record)
            if progress is not None:
                progress(f"{example.id} [{system.name}] em={record['substring_em']} {record['text'][:60]!r}")
    settings = {"modes": list(modes), "systems": [s.name for s in systems], "max_new_tokens": max_new_tokens,
                "threshold": threshold, "warm": warm, "examples": len(examples), "model": engine.loaded.name,
                "dtype": str(engine.loaded.dtype).removeprefix("torch."), "retrieval": retrieval_recall(examples)}
    return EvalReport(set_name, records, summarize(records, systems), settings, time.perf_counter() - started)


def retrieval_recall(examples: Sequence[Example]) -> dict[str, float] | None:
    """The retriever's recall@k over the examples whose set knows the gold passage's rank
    (``meta["gold_rank"]``, 1-based, ``None``: not retrieved); ``None`` when no example does."""
    ranked = [e for e in examples if "gold_rank" in e.meta]
    if not ranked:
        return None
    return recall_at_k([e.meta["gold_rank"] for e in ranked], max(len(e.documents) for e in ranked))


def _warm_up(engine: Any, systems: Sequence[System]) -> None:
    """One tiny answer per mode first, so no system's first measured answer pays one-time setup."""
    doc = [Document("Warm-up text.", id="warm-up")]
    for mode in dict.fromkeys(s.mode for s in systems if s.mode is not None):
        engine.generate("Warm up?", doc, mode=mode, max_new_tokens=1)


def _answer(engine: Any, example: Example, system: System, max_new_tokens: int, threshold: float) -> dict[str, Any]:
    documents = list(example.documents)
    record: dict[str, Any] = {"example": example.id, "kind": example.kind, "system": system.name,
                              "gold": list(example.gold), "has_gold": example.has_gold}
    if "gold_rank" in example.meta:
        record["gold_rank"] = example.meta["gold_rank"]
    if system.mode is None:
        cited, text, answer = list(range(len(documents))), "", None
    elif system.cites == "brackets":
        numbered = [Document(f"[{i + 1}] {d.text}", id=d.id, score=d.score, metadata=d.metadata)
                    for i, d in enumerate(documents)]
        answer = engine.generate(example.question + BRACKET_INSTRUCTION, numbered, mode=system.mode,
                                 max_new_tokens=max_new_tokens, **system.options)
        text = answer.text
        cited = bracket_citations(text, len(documents))
    else:
        answer = engine.generate(example.question, documents, mode=system.mode, max_new_tokens=max_new_tokens,
                                 **system.options)
        text = answer.text
        cited = cited_documents(answer.citations(engine.loaded.tokenizer, threshold))
    record.update(text=text, cited=cited)
    if answer is not None:
        record.update(substring_em=score_answer(example, text), f1=best_f1(text, example.answers),
                      ttft_s=answer.timings["ttft_s"], total_s=answer.timings["total_s"],
                      tokens_per_s=answer.timings["tokens_per_s"], new_tokens=len(answer.token_ids),
                      cache_hits=answer.cache_hits, cache_misses=answer.cache_misses,
                      # the document that won each token (None: no document), for reading losses back
                      trace=[step.document for step in answer.trace])
    else:
        record.update(substring_em=None, f1=None)
    gold = example.gold if example.has_gold else None
    record.update(citation_precision=None if gold is None else citation_precision(cited, gold),
                  citation_recall=None if gold is None else citation_recall(cited, gold))
    return record


def score_answer(example: Example, text: str) -> float:
    """1.0 when ``text`` holds one of the example's answers (its set's matcher), else 0.0: a set of technical answers
    (options, exit statuses) asks for :func:`bounded_match` (``meta["answer_match"] == "bounded"``: ``-i`` is not
    found in "ignore"), a question no document answers for :func:`abstains` (``"abstention"``: the answer must say
    so; "does not" in an invented answer is not enough), every other set for :func:`substring_match`."""
    match = example.meta.get("answer_match")
    if match == "abstention":
        return abstains(text)
    return (bounded_match if match == "bounded" else substring_match)(text, example.answers)


_AVERAGED = ("substring_em", "f1", "citation_precision", "citation_recall", "ttft_s", "total_s", "tokens_per_s",
             "new_tokens", "cache_hits", "cache_misses")


def summarize(records: Sequence[dict[str, Any]], systems: Sequence[System]) -> list[dict[str, Any]]:
    """One row per system: means over its examples (citation metrics over the examples where defined;
    ``citation_precision_supported`` over those with gold support only), per-kind substring EM, and TTFT /
    total time relative to ``concat`` on the same examples."""
    rows = []
    for system in systems:
        mine = [r for r in records if r["system"] == system.name]
        row: dict[str, Any] = {"system": system.name, "mode": system.mode, "examples": len(mine)}
        for key in _AVERAGED:
            row[key] = mean_defined(r.get(key) for r in mine)
        for key in ("ttft_s", "total_s"):  # one slow minute of a shared CPU moves a mean, not a median
            row[key.replace("_s", "_median_s")] = median_defined(r.get(key) for r in mine)
        # an unanswerable question has no gold support, so any citation of it scores precision 0: this column
        # separates "cites the wrong document" from "answers (and cites) where it should abstain"
        row["citation_precision_supported"] = mean_defined(r.get("citation_precision") for r in mine if r["gold"])
        for kind in dict.fromkeys(r["kind"] for r in mine):
            row[f"em_{kind}"] = mean_defined(r.get("substring_em") for r in mine if r["kind"] == kind)
        rows.append(row)
    concat = next((r for r in rows if r["system"] == "concat"), None)
    for row in rows:
        for key in ("ttft_s", "total_s"):
            base = concat.get(key) if concat else None
            row[f"{key.removesuffix('_s')}_vs_concat"] = (base / row[key]) if base and row.get(key) else None
    return rows
