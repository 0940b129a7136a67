"""16-bit weights on XLA:CPU: the engine's decode step with one of the library's kernels against
XLA's ops, bench-78m with `store_weights`, at a few batch sizes. `--switch rows` (default):
the few-row product kernel (`dsjax.kernels.cpu.rows_product`: a 16-bit layer weight or expert
read where it lies) against XLA's products (`DSJAX_CPU_ROWS_KERNEL=off`); `--switch
layer_calls`: a sublayer's mHC input, the 16-bit MoE and W_oa as one library call each
(`cpu_kernels.layer_calls_available`) against XLA's ops (`DSJAX_CPU_LAYER_CALLS=off`). Each
round starts one process per variant, in turn (this machine's speed drifts by the hour; a
process compiles its own programs, JAX's cache off), and each process reports the median of its
step timings; the ratio is of the medians over rounds. The two variants' greedy tokens are
compared too (they differ only in the order of fp32 sums, so they may part after a near tie:
the count of equal tokens is reported). The read bandwidth (`roofline.memory_bandwidth`, best
of before and after the rounds) gives each step's fraction of its roofline (the bytes a 16-bit
step reads, `decode_step_bytes`).

    python benchmarks/rows_kernel.py [--switch rows|layer_calls] [--batches 1,8] [--rounds 4]
        [--steps 20] [--out benchmarks/results/{rows_kernel,layer_calls}_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import bench_config  # noqa: E402
from machine import cpu_info  # noqa: E402
from results_io import write_result  # noqa: E402
from roofline import memory_bandwidth  # noqa: E402

from dsjax.model.cache_layout import decode_step_bytes  # noqa: E402

SWITCHES = {"rows": ("DSJAX_CPU_ROWS_KERNEL", "rows_available"),
            "layer_calls": ("DSJAX_CPU_LAYER_CALLS", "layer_calls_available")}  # env var, what it turns off

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
out = {"kernel": getattr(cpu_kernels, sys.argv[4])(), "steps": {}, "tokens": {}}
for b in [int(x) for x in sys.argv[2].split(",")]:
    engine = decoding_engine(model, b, 128, room=400)
    out["steps"][b] = [step_seconds(engine, int(sys.argv[3])) for _ in range(8)]
prompt = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, 32)]
out["tokens"] = [int(t) for t in dsjax.generate(model, [prompt], max_new_tokens=24)[0]]
print("RESULT" + json.dumps(out))
'''


def child(variant: str, batches: str, steps: int, switch: str) -> dict:
    env = {**os.environ, "DSJAX_COMPILE_CACHE": "off"}
    name, check = SWITCHES[switch]
    if variant == "xla":
        env[name] = "off"
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", CHILD, here, batches, str(steps), check], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", default="rows", choices=sorted(SWITCHES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="default: benchmarks/results/{rows_kernel,layer_calls}_cpu.json")
    args = ap.parse_args()
    out = args.out or f"benchmarks/results/{'rows_kernel' if args.switch == 'rows' else 'layer_calls'}_cpu.json"
    variants = ("xla", "kernel")
    rounds = {v: [] for v in variants}
    bandwidth = memory_bandwidth()["best"]
    for r in range(args.rounds):
        for v in variants:
            got = child(v, args.batches, args.steps, args.switch)
            if got["kernel"] != (v == "kernel"):
                sys.exit(f"the {v} process had {args.switch} {'on' if got['kernel'] else 'off'}")
            rounds[v].append(got)
            print(r, v, {b: round(statistics.median(s) * 1e3, 3) for b, s in got["steps"].items()}, flush=True)
    bandwidth = max(bandwidth, memory_bandwidth()["best"])
    runs = []
    for b in args.batches.split(","):
        med = {v: [statistics.median(g["steps"][b]) for g in rounds[v]] for v in variants}
        row = {"batch": int(b), **{f"{v}_step_s": statistics.median(med[v]) for v in variants},
               **{f"{v}_rounds_s": med[v] for v in variants}}
        row["speedup"] = row["xla_step_s"] / row["kernel_step_s"]
        step_bytes = decode_step_bytes(bench_config(), batch=int(b), context=128 + 4 * args.steps,
                                       dtype=jnp.bfloat16)["total"]  # the mean context of its 8 x steps steps
        for v in variants:  # the bytes a 16-bit step reads, at the bandwidth read around the rounds
            row[f"{v}_fraction_of_roofline"] = step_bytes / bandwidth / row[f"{v}_step_s"]
        runs.append(row)
        print(f"batch {b}: XLA {row['xla_step_s'] * 1e3:.3f} ms, kernel {row['kernel_step_s'] * 1e3:.3f} ms a step "
              f"({row['speedup']:.2f}x)")
    a, b = rounds["xla"][0]["tokens"], rounds["kernel"][0]["tokens"]
    same = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    result = {"config": "bench-78m", "switch": args.switch, "weights": "bfloat16 (store_weights), fp32 compute",
              "cpu": cpu_info()["model"], "cpus": os.cpu_count(), "platform": platform.platform(),
              "read_bandwidth_bytes_per_s": bandwidth, "rounds": args.rounds,
              "steps_per_timing": args.steps, "greedy_tokens_equal_before_first_difference": same,
              "greedy_tokens": len(a), "runs": runs}
    write_result(result, out)


if __name__ == "__main__":
    main()
