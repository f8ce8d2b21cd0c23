"""Write an :class:`~ctx_integrations.evaluation.runner.EvalReport` out: JSON, a markdown table, plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ctx_integrations.errors import missing_dependency
from ctx_integrations.evaluation.runner import EvalReport

TABLE_COLUMNS = ("system", "examples", "substring_em", "f1", "citation_precision", "citation_precision_supported",
                 "citation_recall", "ttft_s", "ttft_median_s", "total_s", "total_median_s", "tokens_per_s",
                 "cache_hits", "ttft_vs_concat", "total_vs_concat")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def markdown_table(report: EvalReport, columns: tuple[str, ...] = TABLE_COLUMNS) -> str:
    """The summary as a markdown table (``-`` where a metric does not apply), then substring EM per kind, then the
    retriever's recall@k where the set knows each gold passage's rank."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in report.rows]
    kinds = [k for k in dict.fromkeys(key for row in report.rows for key in row) if k.startswith("em_")]
    answering = [row for row in report.rows if row["mode"] is not None]
    if len(kinds) > 1 and answering:
        lines += ["", "| system | " + " | ".join(k.removeprefix("em_") for k in kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        lines += ["| " + row["system"] + " | " + " | ".join(_cell(row.get(k)) for k in kinds) + " |"
                  for row in answering]
    recall = report.settings.get("retrieval")
    if recall:
        lines += ["", "retriever: " + ", ".join(f"{k} {v:.3f}" for k, v in recall.items())]
    return "\n".join(lines)


def write_report(report: EvalReport, output: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write ``<output>/<set>.json``, ``<set>.md`` and (``plots``) ``<set>_quality_vs_ttft.png`` and
    ``<set>_citations.png``; return the paths by kind."""
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / f"{report.set_name}.json", "markdown": folder / f"{report.set_name}.md"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=1, default=str), encoding="utf-8")
    paths["markdown"].write_text(markdown_table(report) + "\n", encoding="utf-8")
    if plots:
        paths.update(plot_report(report, folder))
    return paths


def plot_report(report: EvalReport, folder: str | Path) -> dict[str, Path]:
    """Two PNGs: answer quality (substring EM) vs mean TTFT per system, and citation precision / recall bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise missing_dependency("matplotlib", "eval") from error
    folder = Path(folder)
    paths = {}
    answering = [r for r in report.rows if r["mode"] is not None and r.get("ttft_s") is not None]
    figure, axes = plt.subplots(figsize=(6, 4), dpi=90)
    for i, row in enumerate(answering):  # labels alternate above / below so close points stay readable
        axes.scatter(row["ttft_s"], row["substring_em"] or 0.0, s=40)
        axes.annotate(row["system"], (row["ttft_s"], row["substring_em"] or 0.0), textcoords="offset points",
                      xytext=(4, 5 if i % 2 == 0 else -11), fontsize=8)
    axes.set_xlabel("mean time to first token (s)")
    axes.set_ylabel("substring EM")
    axes.set_title(f"{report.set_name}: answer quality vs time to first token", fontsize=10)
    axes.set_ylim(-0.05, 1.05)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    paths["quality_plot"] = folder / f"{report.set_name}_quality_vs_ttft.png"
    figure.savefig(paths["quality_plot"])
    plt.close(figure)

    cited = [r for r in report.rows if r.get("citation_precision") is not None or r.get("citation_recall") is not None]
    if cited:
        figure, axes = plt.subplots(figsize=(7, 4), dpi=90)
        positions = range(len(cited))
        axes.bar([p - 0.2 for p in positions], [r["citation_precision"] or 0.0 for r in cited], width=0.4,
                 label="precision")
        axes.bar([p + 0.2 for p in positions], [r["citation_recall"] or 0.0 for r in cited], width=0.4,
                 label="recall")
        axes.set_xticks(list(positions), [r["system"] for r in cited], rotation=30, ha="right", fontsize=8)
        axes.set_ylim(0, 1.05)
        axes.set_title(f"{report.set_name}: citation precision / recall vs gold support", fontsize=10)
        axes.legend(fontsize=8)
        figure.tight_layout()
        paths["citation_plot"] = folder / f"{report.set_name}_citations.png"
        figure.savefig(paths["citation_plot"])
        plt.close(figure)
    return paths
