"""The notebooks: committed without outputs, and executed top to bottom by a real kernel
(nbclient) with small settings."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = os.path.join(os.path.dirname(__file__), "..", "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))
# Each notebook reads its size from these, defaulting to what a reader would run.
SMALL = {"STEPCREDIT_NOTEBOOK_TASKS": "2", "STEPCREDIT_NOTEBOOK_SEEDS": "1",
         "STEPCREDIT_NOTEBOOK_ITERATIONS": "2"}


def test_the_notebooks_are_there():
    names = {os.path.basename(p) for p in NOTEBOOKS}
    assert {"credit_assignment_tour.ipynb", "train_and_diagnose.ipynb",
            "sweep_results.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_in_a_kernel(path, monkeypatch):
    for name, value in SMALL.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": NOTEBOOK_DIR}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "stream" and o.text.strip() for o in outputs)
    if "matplotlib" in "".join(c.source for c in notebook.cells):
        assert any("image/png" in o.get("data", {}) for o in outputs)  # the plots were drawn
