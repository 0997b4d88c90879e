"""Every notebook in ``notebooks/`` runs top to bottom (nbclient) and shows its plots.

The notebooks read the real traces when present and fall back to synthetic counts otherwise, so
they run on a machine without the traces too.
"""

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # executes the notebooks top to bottom

nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat")
nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
EXPECTED = {"quickstart.ipynb", "algorithms.ipynb", "serving.ipynb", "simulate.ipynb"}


def images(notebook) -> int:
    return sum("image/png" in output.get("data", {})
               for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs)


def test_the_three_notebooks_exist():
    assert EXPECTED <= {path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_notebook_shows_its_results(path):
    """The repository keeps notebooks executed, so a reader sees outputs and plots without running them."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code), "save the notebook executed"
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert images(notebook) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_top_to_bottom(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, when a cell fails
    assert images(notebook) >= 1
