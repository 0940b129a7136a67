"""benchmarks/REPORT.md is generated from benchmarks/results/*.json by benchmarks/report.py:
the committed file must be what the JSON gives now, so the figures cannot drift from it."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report_module():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_is_up_to_date():
    report = _report_module()
    committed = (ROOT / "benchmarks" / "REPORT.md").read_text(encoding="utf-8")
    assert report.render() == committed, "benchmarks/REPORT.md is stale: run python benchmarks/report.py"


def test_render_is_deterministic_and_covers_every_result():
    report = _report_module()
    text = report.render()
    assert text == report.render()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        assert f"## {path.stem}\n" in text, path.name


def test_a_table_names_its_machine(tmp_path):
    report = _report_module()
    (tmp_path / "x_cpu.json").write_text('{"platform": "Linux-x86_64", "cpus": 2, "runs": '
                                         '[{"batch": 1, "tok_s": 100.123456}, {"batch": 8, "tok_s": 700.0}]}')
    text = report.render(str(tmp_path))
    assert "Machine: platform `Linux-x86_64`; cpus `2`." in text
    assert "| batch 1 | batch 8 |" in text and "| tok_s | 100.1 | 700 |" in text
