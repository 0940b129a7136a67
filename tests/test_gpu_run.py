"""benchmarks/gpu_engine.py is the engine half of the one prepared GPU run
(benchmarks/gpu_run.sh), on scarce device minutes: its --smoke run (the same path on CPU,
tiny, seeded resident weights) must leave a JSON whose byte and MBU arithmetic is the
closed form, and which report.py renders as a table of rows."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import dsjax

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_engine_smoke_json(tmp_path):
    out = tmp_path / "gpu_run_smoke.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # one engine (CI's budget): decode at batch 2, reference kernels; gpu_run.sh runs every row
    subprocess.run([sys.executable, "gpu_engine.py", "--smoke", "--kernels", "reference", "--what", "decode",
                    "--batches", "2", "--out", str(out)],
                   cwd=ROOT / "benchmarks", env=env, check=True, capture_output=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["smoke"] and r["config"] == "tiny" and "error" not in r
    bw = r["hbm_copy_bandwidth_bytes_per_s"]
    assert bw > 0 and r["weight_bytes"] > 0 and r["n_routed_experts"] == 8
    rows = {row["row"]: row for row in r["rows"]}
    assert set(rows) == {"decode b=2 reference"}
    assert all("error" not in row and "skipped" not in row for row in rows.values()), rows
    assert r["acceptance"]["mbu_batch_1"] is None and set(r["acceptance"]["met"]) == {  # batch 1 was not run
        "mbu_batch_1", "mbu_batch_64", "host_share_batch_1", "pallas_over_reference_min", "warmup_s_max"}
    cfg = dsjax.load_config("tiny")
    h, e, k, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    for b in (2,):
        row, groups = rows[f"decode b={b} reference"], r["step_bytes_by_group"][f"batch {b}"]
        # MXFP4 experts: 4 layers x 8 experts x 3 matrices of inter x hidden codes at 1/2 byte
        # and one E8M0 byte per 32; a step reaches 1 - (1 - k/e)^b of them in expectation
        experts = cfg.num_hidden_layers * e * 3 * inter * h * (1 / 2 + 1 / 32)
        np.testing.assert_allclose(groups["routed_experts"], experts * (1 - (1 - k / e) ** b), rtol=1e-9)
        assert groups["embed"] == b * h * 4  # one fp32 embedding row a token
        assert groups["lm_head"] == cfg.vocab_size * h * 4
        np.testing.assert_allclose(row["step_bytes"], sum(groups.values()), rtol=1e-12)
        step_s = row["step_ms"] / 1e3
        np.testing.assert_allclose(row["mbu"], row["step_bytes"] / step_s / bw, rtol=1e-9)
        np.testing.assert_allclose(row["tokens_per_s"], b / step_s, rtol=1e-9)
        np.testing.assert_allclose(row["host_ms"], row["step_ms"] - row["program_ms"], rtol=1e-9, atol=1e-9)
        assert row["warmup_s"] > 0 and row["program_ms"] > 0
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    (tmp_path / "render").mkdir()
    (tmp_path / "render" / out.name).write_text(out.read_text())
    text = report.render(str(tmp_path / "render"))
    assert "gpu_engine.py" in text and "| decode b=2 reference |" in text, text[:2000]
