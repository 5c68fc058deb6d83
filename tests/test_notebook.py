"""notebooks/quickstart.ipynb: runs end to end in a fresh kernel on 8 simulated CPU devices, and learns."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import importorfail

nbclient = importorfail("nbclient")
import nbformat  # noqa: E402  (an nbclient dependency)

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
LOSS_LINE = re.compile(r"first_loss=(?P<first>[0-9.]+) -> last_loss=(?P<last>[0-9.]+)")


def _stream_text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and o.name == "stdout")


def test_notebook_is_committed_clean():
    """Valid nbformat 4, kernel python3, no outputs or execution counts."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def test_quickstart_runs_and_loss_goes_down(monkeypatch):
    # The kernel is a subprocess: it inherits these. JAX in it must see 8 simulated CPU devices.
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=8".strip())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("DISPLAY", raising=False)  # headless
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own (inline) backend

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = _stream_text(nb)
    assert "8 device(s)" in text, text[:500]
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs), \
        "the loss curve was not rendered"
    m = LOSS_LINE.search(text)
    assert m, f"no loss line in the notebook's output:\n{text[-1000:]}"
    first, last = float(m["first"]), float(m["last"])
    assert last < 0.8 * first, (first, last)
