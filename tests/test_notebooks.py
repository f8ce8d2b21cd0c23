"""The tutorials run: every code cell of every notebook under notebooks/, in order, in one namespace.

Executed with plain ``exec`` rather than a Jupyter kernel, so the test needs no Jupyter install;
a cell that raises fails the test with the cell's number and source.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_tutorials():
    assert NOTEBOOKS, "notebooks/ holds no tutorial"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, capsys):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    for number, cell in enumerate(cells, start=1):
        source = "".join(cell["source"])
        try:
            exec(compile(source, f"{path.name}[code cell {number}]", "exec"), namespace)
        except Exception as error:  # report which cell broke
            pytest.fail(f"{path.name}, code cell {number} raised {type(error).__name__}: {error}\n{source}")
    assert capsys.readouterr().out.strip(), "the notebook printed nothing"
