"""The vocabulary head on XLA:CPU: XLA's products against the CPU head kernel
(`dsjax.kernels.cpu`), at a few row counts, fp32 and bf16 weights, through
`dsjax.layers.linear.linear` in programs compiled as the engine's are, interleaved round by
round (this machine's memory bandwidth drifts). XLA's forms are what an engine runs without
the kernel: the head as stored (one row: a matrix-vector loop, 2..16 rows: a fused
multiply-reduce) and, for fp32, transposed (`ColumnMajor`: what a one-slot fp32 engine keeps).

    python benchmarks/head_kernel.py [--hidden 256] [--rows 1,2,8,16] [--rounds 30]
        [--out benchmarks/results/head_kernel_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import interleaved_reads, write_result  # noqa: E402
from roofline import memory_bandwidth  # noqa: E402

from dsjax.engine.programs import program  # noqa: E402
from dsjax.kernels import cpu as cpu_kernels  # noqa: E402
from dsjax.layers.linear import linear  # noqa: E402
from dsjax.layers.quantized import ColumnMajor  # noqa: E402

VOCAB = 129280


def measure(hidden: int, rows: int, dtype: str, rounds: int) -> dict:
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((VOCAB, hidden), np.float32)).astype(dtype)
    x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))
    heads = {"xla_stored": w, "kernel": cpu_kernels.pack_head(w)}
    if dtype == "float32":
        heads["xla_transposed"] = ColumnMajor(jnp.transpose(w))
    run = program(linear)
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    for name, head in heads.items():
        np.testing.assert_allclose(np.asarray(run(x, head)), want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
    return {"hidden": hidden, "rows": rows, "weights": dtype, "head_bytes": int(w.nbytes),
            **interleaved_reads(run, x, heads, rounds, int(w.nbytes))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", default="1,2,8,16")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/head_kernel_cpu.json")
    args = ap.parse_args()
    if not cpu_kernels.available():
        sys.exit(f"the CPU head kernel is not available here: {cpu_kernels.status()}")
    bandwidth = memory_bandwidth()
    runs = []
    for dtype in ("float32", "bfloat16"):
        for rows in (int(r) for r in args.rows.split(",")):
            r = measure(args.hidden, rows, dtype, args.rounds)
            runs.append(r)
            forms = ", ".join(f"{k} {r[k]['median_s'] * 1e3:.2f}" for k in r if isinstance(r[k], dict))
            print(f"{dtype} weights, {rows} rows: median ms {forms}", flush=True)
    result = {"vocab": VOCAB, "jax": jax.__version__, "device": str(jax.devices()[0]), "cpus": os.cpu_count(),
              "platform": platform.platform(), "rounds": args.rounds, "kernel": cpu_kernels.status(),
              "read_bandwidth_bytes_per_s": bandwidth, "runs": runs}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
