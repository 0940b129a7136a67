"""benchmarks/tpu_roofline.py's arithmetic: one indexer-scores call's HBM bytes and MXU FLOPs,
counted by walking the kernel's grid, against the closed form of its block plan; the expected
time against the chip table's figures."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def roofline():
    spec = importlib.util.spec_from_file_location("tpu_roofline", ROOT / "benchmarks" / "tpu_roofline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("b,s,t", [(3, 1, 3000), (2, 6, 1100)])  # decode; a query block and a ragged one
def test_index_scores_call_against_its_closed_form(roofline, b, s, t):
    """v5e's blocks (block_q 4, block_t 512), H 4 heads of d 128, bf16: per (row, query block)
    Q [bq H, d] bf16 and the block-diagonal weights [bq, bq H] fp32 are read once, and per key
    block the keys [512, d] bf16 are read and the scores [bq, 512] fp32 written;
    FLOPs 2 bq H 512 d (q . k) + 2 bq (bq H) 512 (the weighted head sum) per grid step."""
    h, d, bt = 4, 128, 512
    bq = 1 if s == 1 else 4
    q_blocks, k_blocks = -(-s // bq), -(-t // bt)
    rows = bq * h
    want_bytes = b * q_blocks * (rows * d * 2 + bq * rows * 4 + k_blocks * (bt * d * 2 + bq * bt * 4))
    want_flops = b * q_blocks * k_blocks * (2 * rows * bt * d + 2 * bq * rows * bt)
    assert roofline.index_scores_cost(b, s, h, d, t, gen="v5e") == (want_bytes, want_flops)


def test_expected_time_is_the_slower_of_hbm_and_mxu(roofline):
    """v7x's figures are per chip of two devices: a device gets half (3690 GB/s, 1153.5 TFLOP/s)."""
    dev = roofline.device("v7x")
    assert (dev["hbm"], dev["flops"]) == (3690e9, 1153.5e12)
    memory = roofline.call_time(3690e6, 1e9, "v7x")  # 1 ms of HBM, under 1 us of MXU
    assert memory["expected_us"] == pytest.approx(1000) and memory["bound"] == "HBM"
    mxu = roofline.call_time(1e3, 1153.5e9, "v7x")
    assert mxu["expected_us"] == pytest.approx(1000) and mxu["bound"] == "MXU"
