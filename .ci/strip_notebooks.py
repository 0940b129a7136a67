"""Strip outputs and execution counts from notebooks (default: notebooks/*.ipynb), so the
repository holds only their code; tests/test_notebooks.py fails on a notebook that keeps any.

    python .ci/strip_notebooks.py [NOTEBOOK ...]
"""

import sys
from pathlib import Path

import nbformat


def strip(path: Path) -> bool:
    """Strip one notebook in place; True when it changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count, changed = [], None, True
        if cell.metadata.pop("execution", None) is not None:
            changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path(__file__).parents[1].glob("notebooks/*.ipynb"))
    for p in paths:
        if strip(p):
            print(f"stripped {p}")
