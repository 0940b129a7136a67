"""Every notebook runs top to bottom in a fresh kernel, as a reader would run it: its own
process (so sharding.ipynb can set XLA_FLAGS before JAX starts), and any cell error fails
the test. The notebooks assert their own numbers against an oracle (the cached forward
against the full one, sharded logits against one device, speculative output against plain
decoding), so a notebook that runs is also right. Committed notebooks carry no outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
# per cell: a cold compile cache on a loaded 2-core machine compiles every program first
CELL_TIMEOUT_S = 600


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} keep outputs; run `python .ci/strip_notebooks.py` before committing"
