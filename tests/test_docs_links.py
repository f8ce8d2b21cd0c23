"""The docs point at things that exist, and nothing points outside the repository.

Bugs caught: a relative link in README.md or docs/*.md to a moved or missing file or heading; a doc path
named in the code or tests (``docs/<page>.md``, with an anchor or not) that does not exist; a file that
cites documents the project does not contain (a methods or design note kept outside the repository).
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"\bdocs/[\w.-]+\.md(?:#[\w-]+)?")
OUTSIDE = re.compile(r"\b(?:METHODS|DESIGN)\.md\b|\.\./shared\b")


@cache
def anchors(document: Path) -> frozenset[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in document.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(found)


def missing(base: Path, target: str) -> str | None:
    """Why ``target`` (a path relative to ``base``, maybe with ``#anchor``) does not resolve, or None."""
    path, _, anchor = target.partition("#")
    file = (base / path).resolve() if path else None
    if file is not None and not file.exists():
        return f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
    if anchor and (file is None or file.suffix == ".md") and anchor not in anchors(file or base):
        return f"{target}: no heading with anchor #{anchor}"
    return None


def relative_links(document: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", document.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("document", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    broken = []
    for target in relative_links(document):
        path = target.partition("#")[0]
        base = document.parent if path else document  # "#anchor" alone: a heading of this document
        reason = missing(base, target) if path else missing(document.parent, document.name + target)
        if reason:
            broken.append(reason)
    assert not broken, f"{document.relative_to(ROOT)} links to what does not exist: {broken}"


def test_every_doc_path_named_in_the_code_exists():
    broken = []
    for source in [*sorted((ROOT / "ctx_integrations").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]:
        for target in DOC_PATH.findall(source.read_text(encoding="utf-8")):
            reason = missing(ROOT, target)
            if reason:
                broken.append(f"{source.relative_to(ROOT)}: {reason}")
    assert not broken, broken


def test_the_methods_page_has_a_section_per_mode():
    assert {"layout", "scores", "pced", "ape", "rapid", "ippd", "soft-nbce", "baselines", "references"} <= anchors(
        ROOT / "docs" / "methods.md")


def test_no_file_refers_to_documents_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".yml", ".yaml"} or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and path != Path(__file__).resolve():
                offenders.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not offenders, offenders
