"""`dsjax batch` as one jax.distributed job of 2 processes x 4 CPU devices (gloo), its mesh
spanning both: the output file must equal a one-process run's on the same mesh (8 fake
devices, this test process), error lines in place, and only process 0 writes. A mesh must
span both processes; what process 0 reads reaches process 1 as is."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsjax import cli
from dsjax.batch.manifest import manifest_path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--model", "tiny", "--dtype", "float32", "--mesh", "data=2,expert=4", "--max-slots", "8",
       "--max-new-tokens", "5", "--prefill-chunk", "16", "--quiet"]


def _records() -> list[str]:
    """More records than slots (admission as slots free), greedy / seeded / derived-seed
    sampling, logprobs, a stop string, and one bad line."""
    out = []
    for i in range(11):
        r = {"id": f"r{i}", "max_tokens": 2 + i % 4}
        if i % 2:
            r["prompt_ids"] = [0] + [100 + 11 * j for j in range(2 * i + 1)]
        else:
            r["prompt"] = "def f(n):" + " x" * i
        if i % 3 == 1:
            r.update(temperature=0.8, top_p=0.9, seed=i)
        elif i % 3 == 2:
            r.update(temperature=0.7)
        out.append(json.dumps(r))
    out[3] = json.dumps({**json.loads(out[3]), "logprobs": 2})
    out[4] = json.dumps({**json.loads(out[4]), "stop": [" "]})
    out.insert(2, json.dumps({"id": "bad", "prompt": "x", "max_tokens": -1}))
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    """A process of 4 CPU devices running this checkout's dsjax."""
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _launch(inp: Path, outs: list[Path], extra: list[str]) -> list[subprocess.Popen]:
    """`python -m dsjax batch` twice, as processes 0 and 1 of one job (each its own --output,
    so a write by process 1 would show)."""
    port = _port()
    env = _env()
    procs = []
    for i, out in enumerate(outs):
        with open(f"{out}.stderr", "w") as err:  # a file, not a pipe: nothing blocks on a full pipe
            procs.append(subprocess.Popen([sys.executable, "-m", "dsjax", "batch", "--input", str(inp), "--output",
                                           str(out), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                           "--process-id", str(i), *extra], env=env, stdout=subprocess.DEVNULL,
                                          stderr=err))
    return procs


def _wait(procs: list[subprocess.Popen], outs: list[Path]) -> list[tuple[int, str]]:
    """(exit status, stderr) of each."""
    try:
        return [(p.wait(timeout=400), Path(f"{out}.stderr").read_text()) for p, out in zip(procs, outs)]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise


def test_two_processes_equal_one(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(line + "\n" for line in _records()))
    # the reference: this process, 8 devices; before the job, whose two processes need both cores
    one = tmp_path / "one.jsonl"
    assert cli.main(["batch", "--input", str(inp), "--output", str(one), *JOB]) == 0
    outs = [tmp_path / "p0.jsonl", tmp_path / "p1.jsonl"]
    for status, err in _wait(_launch(inp, outs, JOB), outs):
        assert status == 0, err[-3000:]
    assert outs[0].read_bytes() == one.read_bytes()
    assert not outs[1].exists() and not manifest_path(outs[1]).exists()
    lines = [json.loads(line) for line in one.read_text().splitlines()]
    assert [r["id"] for r in lines] == [json.loads(r)["id"] for r in _records()]
    assert "error" in lines[2] and "logprobs" in lines[4] and all("ids" in r for i, r in enumerate(lines) if i != 2)
    m0, m1 = json.loads(manifest_path(outs[0]).read_text()), json.loads(manifest_path(one).read_text())
    assert m0["complete"] and m0["settings"] == m1["settings"] and m0["environment"] == m1["environment"]


@pytest.mark.parametrize("mesh, message", [("expert=4", "must span all 8 of its devices"),
                                           ("", "needs a --mesh over all 8 devices")])
def test_mesh_must_span_every_process(tmp_path, mesh, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text(_records()[0] + "\n")
    outs = [tmp_path / "p0.jsonl", tmp_path / "p1.jsonl"]
    job = [a for a in JOB if a not in ("--mesh", "data=2,expert=4")] + (["--mesh", mesh] if mesh else [])
    for status, err in _wait(_launch(inp, outs, job), outs):
        assert status != 0 and message in err, err[-3000:]


BROADCAST = """
import json, sys
from dsjax.sharding.distributed import broadcast_bytes, broadcast_json, initialize, is_lead
assert initialize(sys.argv[1], 2, int(sys.argv[2]))
lead = is_lead()
got = [broadcast_bytes(b if lead else None) for b in (b"", b"\\x00\\xff" * 70001, "\\u00e9".encode())]
print(json.dumps([g.hex() if len(g) < 10 else len(g) for g in got] + [broadcast_json(["a", 1] if lead else 7)]))
"""


def test_broadcast_from_process_zero():
    """What process 0 read (the input, a resumed job's finished ids) reaches process 1 as is."""
    port = _port()
    env = _env()
    procs = [subprocess.Popen([sys.executable, "-c", BROADCAST, f"127.0.0.1:{port}", str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [json.loads(o.strip().splitlines()[-1]) for o in outs] == [["", 140002, "c3a9", ["a", 1]]] * 2
