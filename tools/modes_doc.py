"""Write docs/modes.md, the table of every built-in mode and its options, from the modes' declarations.

``python tools/modes_doc.py`` rewrites it; ``tests/test_modes_doc.py`` fails when the file and the declarations
(``ctx_integrations/engine/modes/specs.py``) differ, so the table cannot drift from what the library checks. Modes
that other installed packages declare (the test plugin's ``cad``) are theirs to document: the table is the same
whatever else is installed.
"""

from __future__ import annotations

from pathlib import Path

from ctx_integrations import DEFAULT_BATCH_MODE, DEFAULT_MODE, available_modes, mode_spec
from ctx_integrations.engine.core.mode_spec import CONFORMANCE, ORIGINS

DOC = Path(__file__).resolve().parents[1] / "docs" / "modes.md"

HEADER = """# Modes and their options

Every decoding mode, the paper it implements and each option it takes: the type and values it accepts, its default,
what it does and where it comes from. Generated from the modes' declarations
(`ctx_integrations/engine/modes/specs.py`) by `python tools/modes_doc.py`; a test fails when the two differ. The same
declarations check a mode's options before anything runs (`check_mode`, the command line's `--option` before the
model loads, the server's requests at the edge) and are listed by the server at `GET /v1/modes`
([serving.md](serving.md)), and by `ctx-experts modes`. The methods themselves, their formulas and measured
variants: [methods.md](methods.md).

Every mode, these included, is declared by an entry point of the group `ctx_integrations.modes` naming its
`ModeSpec`, so a separate package adds one with no edit to the library; its modes are listed by `GET /v1/modes` and
`ctx-experts modes`, not here. How: [adding-a-mode.md](adding-a-mode.md).

Origin: {origins}.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def library_modes() -> list[str]:
    """The available modes this library implements (its declaration names a module of ``ctx_integrations``)."""
    return [name for name in available_modes() if (mode_spec(name).module or "").startswith("ctx_integrations.")]


def render() -> str:
    """The whole of docs/modes.md, from the declarations."""
    origins = "; ".join(f"**{name}**, {meaning}" for name, meaning in ORIGINS.items())
    parts = [HEADER.format(origins=origins)]
    for name in library_modes():
        spec = mode_spec(name)
        about = f"{spec.summary[0].upper()}{spec.summary[1:]}. Paper: {spec.paper}."
        if spec.many:
            about += " It answers every question of `generate_many` in one decode."
        if not spec.picks_each_token:
            about += (" It does not pick each token from one score vector, so `top_k`, `min_p`, the penalties, "
                      "structured output and logprobs are refused for it.")
        for prop, why in spec.exemptions:
            about += f" Not held to `{prop}` ({CONFORMANCE[prop]}): {why}."
        if name == DEFAULT_MODE:
            about += " **The default mode**: what answers when no mode is named."
        if name == DEFAULT_BATCH_MODE:
            about += " **The default of many questions over one set of documents** (`generate_many`)."
        parts.append(f"## `{name}`\n\n{about}\n")
        if not spec.options:
            parts.append("No options.\n")
            continue
        rows = ["| option | accepts | default | origin | what it does |", "|---|---|---|---|---|"]
        rows += [f"| `{o.name}` | {_cell(o.expected())} | `{o.default!r}` | {o.origin} | {_cell(o.help)} |"
                 for o in spec.options]
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def main() -> None:
    DOC.write_text(render(), encoding="utf-8")
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
