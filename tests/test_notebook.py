"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parent.parent / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kernel inherits this environment
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {i: "".join(o.get("text", "") for o in cell.get("outputs", []))
               for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "8 devices (data=4, tensor=2)" in text
    start, end = (float(x) for x in text.split("loss ", 1)[1].split("\n")[0].split(" -> "))
    assert end < start - 0.5  # it trained
    assert "parameters identical: True" in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for cell in notebook.cells for o in cell.get("outputs", []))  # the inline plot
    assert "'def " in text
