"""The example notebook runs headless, as Jupyter runs it (nbclient with an ipykernel kernel), and shows
streamscope's results as tables and figures rather than tensors."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "first_hour.ipynb"


def test_the_example_notebook_runs_and_displays_results(tmp_path):
    notebook = nbformat.read(str(NOTEBOOK), as_version=4)
    # The kernel imports this checkout's streamscope (the suite's PYTHONPATH reaches it).
    root = str(NOTEBOOK.parent.parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
                   "TOKENIZERS_PARALLELISM": "false"}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=environment)
    outputs = {index: cell.get("outputs", []) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    errors = [output for cell in outputs.values() for output in cell if output.get("output_type") == "error"]
    assert not errors, errors

    def shown(source_start: str) -> dict:
        cell = next(cell for cell in notebook.cells if cell.source.startswith(source_start))
        return {kind: data for output in cell.outputs for kind, data in output.get("data", {}).items()}

    lens = shown("lens = ")
    assert "image/png" in lens and lens["text/html"].startswith("<table>") and "tensor(" not in lens["text/plain"]
    assert shown("patching = ")["text/plain"].startswith("Patching(layer_output, effects [3, ")
    assert "pattern" in shown("cache = ")["text/html"]
    assert shown("generation = ")["text/plain"].startswith("Generation(2 prompts, ")
    assert (tmp_path / "attention.png").stat().st_size > 0
