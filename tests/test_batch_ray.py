"""Batch jobs on Ray Data (dsjax.batch.ray_data, `dsjax batch --ray N`) in a local Ray
cluster: two replicas give what one process gives, bitwise (batch-invariant, tiny model).

Each pipeline starts two actors that load and compile the model (about a minute on two
cores), so one test drives the library path and one the command."""

import json
import sys
from pathlib import Path

import pytest

import dsjax
import dsjax.batch
from dsjax import cli
from dsjax.batch import RayPredictor
from dsjax.batch.manifest import manifest_path
from test_batch import SLOTS, _records

ROOT = Path(__file__).resolve().parents[1]
RECORDS = _records(8)
PREDICTOR = {"model": "tiny", "dtype": "float32", "batch_invariant": True, "max_slots": 4, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'dsjax[ray]'")
    pytest.importorskip("ray.data", reason="Ray Data is an optional extra: pip install 'dsjax[ray]'")
    # logical CPUs: two replicas hold one each, Ray Data's read tasks need another. The
    # workers import this checkout's dsjax (not whichever one is installed).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_process():
    """The oracle: the same records in this process, on one engine."""
    m = dsjax.load_model("tiny", dtype="float32")
    m = m.replace(options=m.options.replace(batch_invariant=True))
    return dsjax.batch.run(m, RECORDS, max_slots=4, max_new_tokens=6)


@pytest.fixture
def input_file(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_read_json_map_batches_equals_one_process(ray, one_process, input_file):
    """The library path as a user writes it: read_json rows (nulls where a line lacks a
    field), batches of 3 over 2 replicas."""
    ds = ray.data.read_json(str(input_file)).map_batches(
        RayPredictor, fn_constructor_kwargs=PREDICTOR, concurrency=2, batch_size=3, batch_format="pyarrow",
        num_cpus=1)
    rows = ds.take_all()
    got = {row["id"]: json.loads(row["output"]) for row in rows}
    assert len(rows) == len(RECORDS)
    assert got == {json.dumps(r["id"]): r for r in one_process}


def test_cli_ray_resumes_to_the_one_process_file(ray, one_process, input_file, tmp_path):
    """`dsjax batch --ray 2` resuming a one-process job cut after 3 lines (and a torn 4th):
    the finished file is the one-process file byte for byte, in input order."""
    out = tmp_path / "out.jsonl"
    argv = ["batch", "--input", str(input_file), "--output", str(out), "--model", "tiny", "--dtype", "float32",
            "--quiet", *SLOTS]
    assert cli.main(argv) == 0
    reference = out.read_bytes()
    assert [json.loads(line) for line in reference.splitlines()] == one_process
    out.write_bytes(b"".join(reference.splitlines(keepends=True)[:3]) + b'{"id": "r')
    assert cli.main([*argv, "--ray", "2", "--ray-batch-size", "2"]) == 0
    assert out.read_bytes() == reference
    assert json.loads(manifest_path(out).read_text())["complete"]


def test_missing_ray_is_one_line(monkeypatch, input_file, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    out = tmp_path / "out.jsonl"
    rc = cli.main(["batch", "--input", str(input_file), "--output", str(out), "--model", "tiny", "--ray", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and "pip install 'dsjax[ray]'" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
