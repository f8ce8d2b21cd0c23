"""The package's modules import each other without cycles, lazy (function-level) imports included.

A cycle hidden behind a function-level import still ties two modules together; the layering
(frameworks -> retrieval -> engine modes -> engine core) only holds if there is none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ctx_integrations

ROOT = Path(ctx_integrations.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Edges module -> every ctx_integrations module it imports anywhere in its source."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "ctx_integrations.engine.core.engine" in graph["ctx_integrations"]  # the graph sees real edges
    assert cycles(graph) == []


def test_the_core_never_imports_a_mode_or_a_framework():
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("ctx_integrations.engine.core."):
            bad = [t for t in targets if t.startswith(("ctx_integrations.engine.modes", "ctx_integrations.llama_index",
                                                       "ctx_integrations.langchain", "ctx_integrations.retrieval"))]
            assert bad == [], f"{name} imports {bad}"


# -- the framework edges import the engine only through the package root (the public facade) ------------------------
FRONT_ENDS = ("langchain", "llama_index", "serve", "adapters.py")
ENGINE = "ctx_integrations.engine"


def _absolute(package: str, module: str | None, level: int) -> str:
    """``from <level dots><module> import ...`` inside ``package`` as an absolute module name."""
    if not level:
        return module or ""
    parts = package.split(".")
    return ".".join(parts[: len(parts) - level + 1] + ([module] if module else []))


def engine_imports(source: str, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of ``ctx_integrations.engine`` or a module under it in ``source``, a
    module of ``package``: module level or inside a function, ``import x`` and ``from x import y`` (relative ones
    resolved, ``from ctx_integrations import engine`` included) and ``importlib.import_module("...")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(package, node.module, node.level)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        for name in names:
            if name == ENGINE or name.startswith(ENGINE + "."):
                found.append((node.lineno, name))
                break
    return found


def front_end_files() -> list[Path]:
    return sorted(path for part in FRONT_ENDS for path in ([ROOT / part] if part.endswith(".py")
                                                          else (ROOT / part).rglob("*.py")))


def test_the_facade_checker_finds_every_form_of_engine_import():
    package = "ctx_integrations.langchain"
    planted = {
        "from ctx_integrations.engine.core.engine import Engine": f"{ENGINE}.core.engine",
        "import ctx_integrations.engine.core.model as model": f"{ENGINE}.core.model",
        "def f():\n    from ctx_integrations.engine.core.registry import check_options": f"{ENGINE}.core.registry",
        "from ..engine.core import tools": f"{ENGINE}.core",
        "from .. import engine": ENGINE,
        "from ctx_integrations import engine": ENGINE,
        "import importlib\nimportlib.import_module('ctx_integrations.engine.core.model')": f"{ENGINE}.core.model",
    }
    for source, module in planted.items():
        assert [name for _, name in engine_imports(source, package)] == [module], source
    allowed = ("from ctx_integrations import Answer, Engine, check_mode\nfrom ctx_integrations.errors import X\n"
               "from ..adapters import aliased\nfrom . import convert\nimport ctx_integrations\n"
               "from ctx_integrations.engines_elsewhere import y")
    assert engine_imports(allowed, package) == []


def test_adapters_and_the_server_import_only_the_public_facade():
    """LangChain, LlamaIndex, the HTTP server and ``adapters.py`` reach the engine through ``ctx_integrations``
    (the package root's names), never a module under ``ctx_integrations.engine``: the engine's modules can then
    move and change behind the facade without touching a front end."""
    files = front_end_files()
    assert ROOT / "adapters.py" in files and ROOT / "serve" / "backend.py" in files  # the walk sees real files
    bad = []
    for path in files:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bad += [f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
                for line, module in engine_imports(path.read_text(), package)]
    assert bad == [], "import these from ctx_integrations (the package root) instead:\n" + "\n".join(bad)


def test_the_facade_names_are_lazy_listed_and_torch_free_to_import():
    """Every public name resolves, ``__all__`` and ``dir()`` list exactly the lazy names, and importing the package
    (and reading the two defaults) loads no torch, in a fresh interpreter."""
    import subprocess
    import sys

    lazy = ctx_integrations._LAZY
    assert sorted(ctx_integrations.__all__) == sorted(lazy)
    assert set(lazy) <= set(dir(ctx_integrations))
    for name in lazy:
        assert getattr(ctx_integrations, name) is getattr(__import__(lazy[name], fromlist=[name]), name)
    code = ("import sys, ctx_integrations; from ctx_integrations import DEFAULT_MAX_NEW_TOKENS, EMBEDDED_MODEL_NAME, "
            "Document; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
