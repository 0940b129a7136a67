"""Notebooks run top to bottom (their code cells, in one namespace), so they cannot rot."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {}
    for i, cell in enumerate(cells):
        exec(compile("".join(cell["source"]), f"{path.name}[{i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "prefill vs full forward" in out
    diff = float(out.split("prefill vs full forward, max |diff|:")[1].split()[0])
    assert diff < 1e-5
