"""The docs point at things that exist, and nothing points outside the repository.

Bugs caught: a relative link in README.md or docs/*.md to a moved or missing file or heading; a doc path
named in the code or tests (``docs/<page>.md``, with an anchor or not) that does not exist; a file that
cites documents the project does not contain (a methods or design note kept outside the repository); a
package registry's host name written into a tracked file (a download URL where ``pip download`` by name does).
"""

from __future__ import annotations

import hashlib
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
HOST = re.compile(r"\b(?:[a-z0-9-]+\.)+[a-z]{2,}\b")
# sha256 prefixes of package registries' host names (the Python index, its file host and upload host, the npm
# registry, Debian's mirror): compared by hash so that this test does not write the names it looks for
REGISTRY_HOSTS = frozenset({"c899567ee9068517", "a4aa2ac280bb8d1a", "d6d7019ca9fcbf07", "9495278a74715c7e",
                            "0dc11026ac75c015", "e680c440a2e92079", "9ab2ad663f3d2a5e"})


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


def tracked_lines() -> list[tuple[str, int, str]]:
    """Every line of the repository's text files (tracked or new, not ignored): ``(name, number, line)``."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    lines = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".yml", ".yaml"} or not path.is_file():
            continue
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        lines.extend((name, number, line) for number, line in enumerate(text.splitlines(), 1))
    return lines


def test_no_file_refers_to_documents_outside_the_repository():
    offenders = [f"{name}:{number}: {line.strip()[:100]}" for name, number, line in tracked_lines()
                 if OUTSIDE.search(line)]
    assert not offenders, offenders


def registry_hosts(line: str) -> list[str]:
    return [host for host in HOST.findall(line.lower())
            if hashlib.sha256(host.encode()).hexdigest()[:16] in REGISTRY_HOSTS]


def test_the_registry_check_recognises_a_registry_download_url():
    """The check below can fail: a download URL of the kind docs/peer-llamacpp.md once carried is found."""
    host = ".".join(("files", "python" + "hosted", "org"))  # assembled, so this file never holds the name
    assert registry_hosts(f"curl -sSLo x.tar.gz https://{host}/packages/19/81/x.tar.gz") == [host]
    assert registry_hosts("see https://huggingface.co/docs and example.org") == []


def test_no_file_names_a_package_registry_host():
    """Packages are fetched by name (``pip download --no-deps --no-binary=...``), never by a registry's URL."""
    offenders = [f"{name}:{number}: {line.strip()[:100]}" for name, number, line in tracked_lines()
                 if registry_hosts(line)]
    assert not offenders, offenders


EXTRAS_LINE = re.compile(r"ctx-integrations\[([\w,\-]+)\]")


def test_every_install_line_names_extras_that_exist():
    """A ``pip install 'ctx-integrations[x]'`` in the docs or README installs what it says (a renamed or removed
    extra would make pip warn and install nothing of it)."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {extra for doc in MARKDOWN for group in EXTRAS_LINE.findall(doc.read_text(encoding="utf-8"))
             for extra in group.split(",")}
    assert named and not named - extras, f"extras named in the docs that pyproject.toml lacks: {named - extras}"


def test_readme_says_which_extra_structured_output_needs():
    """Each README section on a framework that promises structured output names the extra it needs (xgrammar),
    since the framework's own install line does not bring it."""
    sections = re.split(r"^### ", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.M)
    for title in ("LlamaIndex", "LangChain"):
        section = next(s for s in sections if s.startswith(title))
        assert "structured" in section.lower(), f"README's {title} section no longer mentions structured output"
        assert re.search(r"ctx-integrations\[[\w,\-]*structured", section), \
            f"README's {title} section promises structured output without the [structured] extra's install line"


def _numbers(text: str) -> set[float]:
    return {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text.replace(",", ""))}


def test_every_number_in_readmes_measured_table_is_on_a_page_it_links():
    """Docs cannot drift: each number a row of README's Measured table quotes (``77.1x``, ``0.220 s``, ``3/6``)
    is written on one of the pages that row links to, where its measurement and command are. A README number
    edited by hand, or a page re-measured without the README, fails here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "](docs/" in line]
    assert len(rows) >= 15, "README's Measured table lost its rows"
    drifted = []
    for row in rows:
        what, headline = [cell.strip() for cell in row.strip("|").split("|")][:2]
        pages = {ROOT / link for link in re.findall(r"\]\((docs/[\w.-]+\.md)", row)}
        written = set().union(*(_numbers(page.read_text(encoding="utf-8")) for page in pages))
        quoted = re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?=x|/\d| s\b| tok/s| steps/s)|(?<=/)\d+", headline)
        drifted += [f"{what[:40]}: {n}" for n in quoted if float(n) not in written]
    assert not drifted, f"README quotes numbers its linked pages do not have: {drifted}"
