"""The tutorials run: every notebook under notebooks/ is executed top to bottom in a Jupyter kernel.

nbclient drives an ipykernel from this virtual environment (a kernelspec whose command is ``python`` is
started with the running interpreter), so the notebooks run exactly as a user's Jupyter would run them,
magics, top-level ``await`` and inline plots included. ``PYTHONPATH`` points the kernel at this checkout.
A cell that raises fails the test with the cell's source and traceback (``CellExecutionError``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The numbered tutorials are committed executed: their stored outputs (text and plots) are what readers see.
TUTORIALS = [p for p in NOTEBOOKS if p.name[:2].isdigit()]
# notes that were true while a feature was on a branch, and only confuse a reader once it is on main
STALE_NOTES = ("not yet on main", "the cell is skipped when", "next cell is skipped when")
CELL_TIMEOUT_S = 300


def _outputs(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def _images(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in output.get("data", {}) for output in _outputs(notebook))


def test_there_are_tutorials():
    assert NOTEBOOKS, "notebooks/ holds no tutorial"
    assert len(TUTORIALS) >= 5, f"expected the five numbered tutorials, found {[p.name for p in TUTORIALS]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path):
    """Catches a notebook committed without running it (no outputs; a tutorial without its plots), with a failed
    cell stored, or with a note that a feature is not on main yet."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in code), f"{path.name} has cells that were never executed"
    assert _outputs(notebook), f"{path.name} stores no output"
    assert not [o for o in _outputs(notebook) if o.output_type == "error"], f"{path.name} stores an error output"
    stale = [note for note in STALE_NOTES for cell in notebook.cells if note in cell.source]
    assert not stale, f"{path.name} still says {stale}"
    if path in TUTORIALS:
        assert _images(notebook) >= 1, f"{path.name} stores no plot"


def _execute(path: Path) -> nbformat.NotebookNode | str:
    """Run one notebook in its own kernel; the executed notebook, or the failing cell's source and traceback."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as error:
        return str(error)
    return notebook


@pytest.fixture(scope="module")
def executed_notebooks(tmp_path_factory):
    """Every notebook started at once, two kernels at a time, each kernel on one torch thread.

    Why: a tutorial's time is mostly the per-token Python of a 135M model, which a second thread barely
    shortens, so two one-thread kernels side by side finish the set in about half the time of one after
    another on two threads (CI's whole run has a 30-minute limit). The kernels inherit this environment,
    with ``TMPDIR`` in pytest's own temporary folder: the tutorials' ``tempfile.mkdtemp`` stores and reports
    are a reader's to keep, but a test run must not leave them in the system's ``/tmp`` (pytest prunes its own).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("kernels-tmp")))
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="notebook") as pool:
            # longest first, so the two kernels end together
            futures = {path: pool.submit(_execute, path) for path in sorted(NOTEBOOKS, key=_cells, reverse=True)}
            yield futures


def _cells(path: Path) -> int:
    return len(nbformat.read(path, as_version=4).cells)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, executed_notebooks):
    notebook = executed_notebooks[path].result()
    if isinstance(notebook, str):
        pytest.fail(f"{path.name} failed:\n{notebook}")
    printed = "".join(o.get("text", "") for o in _outputs(notebook) if o.output_type == "stream")
    assert printed.strip(), f"{path.name} printed nothing"
    if path in TUTORIALS:
        assert _images(notebook) >= 1, f"{path.name} drew no plot"
