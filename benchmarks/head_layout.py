"""The vocabulary head at one row on XLA:CPU, as stored ([V, D], read as x @ w.T) and kept
transposed (`ColumnMajor` [D, V], read as x @ t: what a one-slot engine runs, see
`dsjax.model.head.one_row_head`), for a 129280-token vocabulary at a few hidden sizes.
Both through `dsjax.layers.linear.linear` in a program compiled as the engine's are, the
layouts interleaved round by round (this machine's memory bandwidth drifts).

    python benchmarks/head_layout.py [--hidden 128,256,512,1024] [--rounds 40]
        [--out benchmarks/results/head_layout_cpu.json]
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
from dsjax.layers.linear import linear  # noqa: E402
from dsjax.layers.quantized import ColumnMajor  # noqa: E402

VOCAB = 129280


def measure(hidden: int, rounds: int) -> dict:
    rng = np.random.default_rng(hidden)
    w = rng.standard_normal((VOCAB, hidden), np.float32)
    x = jnp.asarray(rng.standard_normal((1, hidden), np.float32))
    heads = {"stored_v_by_d": jnp.asarray(w), "transposed_d_by_v": ColumnMajor(jnp.asarray(np.ascontiguousarray(w.T)))}
    run = program(linear)
    outs = {name: np.asarray(run(x, head)) for name, head in heads.items()}
    np.testing.assert_allclose(outs["transposed_d_by_v"], outs["stored_v_by_d"], rtol=0,
                               atol=1e-5 * np.abs(outs["stored_v_by_d"]).max())
    row = {"hidden": hidden, "head_bytes": int(w.nbytes),
           **interleaved_reads(run, x, heads, rounds, int(w.nbytes))}
    row["speedup_at_median"] = row["stored_v_by_d"]["median_s"] / row["transposed_d_by_v"]["median_s"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="128,256,512,1024")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results/head_layout_cpu.json")
    args = ap.parse_args()
    bandwidth = memory_bandwidth()
    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        rows.append(measure(hidden, args.rounds))
        r = rows[-1]
        print(f"hidden {hidden}: as stored {r['stored_v_by_d']['median_s'] * 1e3:.2f} ms, transposed "
              f"{r['transposed_d_by_v']['median_s'] * 1e3:.2f} ms (median of {args.rounds}; "
              f"{r['speedup_at_median']:.2f}x)", flush=True)
    result = {"vocab": VOCAB, "rows": 1, "jax": jax.__version__, "device": str(jax.devices()[0]),
              "cpus": os.cpu_count(), "platform": platform.platform(), "rounds": args.rounds,
              "read_bandwidth_bytes_per_s": bandwidth, "runs": rows}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
