"""The committed notebooks execute top to bottom (at their "tiny" size, on CPU) without an error.

"tiny" is the smallest size each notebook runs at: the test checks that every cell runs, not its numbers, and on CPU
the kernels' interpreter takes time with every token."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("name", ["fused_vs_unfused.ipynb"])
def test_notebook_executes_at_tiny_size(name, monkeypatch):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    # Committed with its outputs, figures included.
    committed_figures = sum(
        "image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", [])
    )
    assert committed_figures > 0, f"{name} was committed without its figures: execute it and save the outputs"
    # The kernel inherits this environment: tiny live sizes; the committed GPU results are plotted as they are.
    monkeypatch.setenv("MOE_JAX_NOTEBOOK_SIZE", "tiny")
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
    text = "".join(
        output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []) if "text" in output
    )
    assert "size 'tiny'" in text
