"""16-bit layer weights on XLA:CPU: the engine's decode step with the few-row product kernel
(`dsjax.kernels.cpu.rows_product`: a 16-bit layer weight or expert read where it lies, for up
to 8 rows a pass) against XLA's products (`DSJAX_CPU_ROWS_KERNEL=off`), bench-78m with
`store_weights`, at a few batch sizes. Each round starts one process per variant, in turn
(this machine's speed drifts by the hour; a process compiles its own programs, JAX's cache
off), and each process reports the median of its step timings; the ratio is of the medians
over rounds. The two variants' greedy tokens are compared too (they differ only in the order
of fp32 sums, so they may part after a near tie: the count of equal tokens is reported).

    python benchmarks/rows_kernel.py [--batches 1,8] [--rounds 4] [--steps 20]
        [--out benchmarks/results/rows_kernel_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_info  # noqa: E402
from results_io import write_result  # noqa: E402

CHILD = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import jax.numpy as jnp
import numpy as np
import dsjax
from decode_profile import bench_config, decoding_engine, model_specs, step_seconds
from dsjax.kernels import cpu as cpu_kernels
from dsjax.params import init_params

cfg = bench_config()
model = dsjax.store_weights(dsjax.Model(cfg, init_params(model_specs(cfg, jnp.float32), 0), jnp.float32, None))
out = {"rows_kernel": cpu_kernels.rows_available(), "steps": {}, "tokens": {}}
for b in [int(x) for x in sys.argv[2].split(",")]:
    engine = decoding_engine(model, b, 128, room=400)
    out["steps"][b] = [step_seconds(engine, int(sys.argv[3])) for _ in range(8)]
prompt = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, 32)]
out["tokens"] = [int(t) for t in dsjax.generate(model, [prompt], max_new_tokens=24)[0]]
print("RESULT" + json.dumps(out))
'''


def child(variant: str, batches: str, steps: int) -> dict:
    env = {**os.environ, "DSJAX_COMPILE_CACHE": "off"}
    if variant == "xla":
        env["DSJAX_CPU_ROWS_KERNEL"] = "off"
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", CHILD, here, batches, str(steps)], env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/rows_kernel_cpu.json")
    args = ap.parse_args()
    variants = ("xla", "kernel")
    rounds = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            got = child(v, args.batches, args.steps)
            if got["rows_kernel"] != (v == "kernel"):
                sys.exit(f"the {v} process had the few-row kernel {'on' if got['rows_kernel'] else 'off'}")
            rounds[v].append(got)
            print(r, v, {b: round(statistics.median(s) * 1e3, 3) for b, s in got["steps"].items()}, flush=True)
    runs = []
    for b in args.batches.split(","):
        med = {v: [statistics.median(g["steps"][b]) for g in rounds[v]] for v in variants}
        row = {"batch": int(b), **{f"{v}_step_s": statistics.median(med[v]) for v in variants},
               **{f"{v}_rounds_s": med[v] for v in variants}}
        row["speedup"] = row["xla_step_s"] / row["kernel_step_s"]
        runs.append(row)
        print(f"batch {b}: XLA {row['xla_step_s'] * 1e3:.3f} ms, kernel {row['kernel_step_s'] * 1e3:.3f} ms a step "
              f"({row['speedup']:.2f}x)")
    a, b = rounds["xla"][0]["tokens"], rounds["kernel"][0]["tokens"]
    same = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    result = {"config": "bench-78m", "weights": "bfloat16 (store_weights), fp32 compute", "cpu": cpu_info()["model"],
              "cpus": os.cpu_count(), "platform": platform.platform(), "rounds": args.rounds,
              "steps_per_timing": args.steps, "greedy_tokens_equal_before_first_difference": same,
              "greedy_tokens": len(a), "runs": runs}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
