"""Expert-parallel dispatch vs replicated experts on 8 (fake) CPU devices, and the
per-device weight memory of a full-size config on a mesh. Writes JSON.

    python benchmarks/ep_bench.py --config small --out benchmarks/results/ep_cpu.json

The 8 devices share this machine's cores, so times measure the dispatch overhead of each
layout rather than a real 8-way speed-up; the memory columns are exact.
"""

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from results_io import write_result  # noqa: E402

import dsjax  # noqa: E402
from dsjax.config import load_config  # noqa: E402
from dsjax.model import model_specs  # noqa: E402
from dsjax.sharding.rules import bytes_per_device  # noqa: E402


def time_forward(model, ids, repeats):
    model.logits(ids)  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.logits(ids)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-config", default="v4-flash")
    ap.add_argument("--out", default="benchmarks/results/ep_cpu.json")
    args = ap.parse_args()
    ids = np.random.default_rng(0).integers(0, 5000, (args.batch, args.seq))
    layouts = {"replicated_experts (data=8)": "data=8", "expert_parallel (expert=8)": "expert=8",
               "expert_parallel + tensor (data=2,expert=2,tensor=2)": "data=2,expert=2,tensor=2"}
    result = {"config": args.config, "batch": args.batch, "seq": args.seq, "devices": jax.device_count(),
              "jax": jax.__version__, "layouts": {}}
    reference = None
    for name, mesh in layouts.items():
        model = dsjax.load_model(args.config, dtype="float32", mesh=mesh)
        seconds = time_forward(model, ids, args.repeats)
        logits = model.logits(ids)
        reference = logits if reference is None else reference
        per_device = bytes_per_device(model_specs(model.config, jnp.float32), model.mesh)
        result["layouts"][name] = {
            "mesh": mesh, "forward_s": seconds, "tokens_per_s": args.batch * args.seq / seconds,
            "routed_expert_bytes_per_device": per_device["routed_experts"],
            "weight_bytes_per_device": sum(per_device.values()),
            "max_abs_diff_vs_first_layout": float(np.abs(logits - reference).max())}
        print(name, json.dumps(result["layouts"][name]), flush=True)
    cfg = load_config(args.memory_config)
    result["memory"] = {mesh: bytes_per_device(model_specs(cfg, jnp.bfloat16), mesh_sizes)
                        for mesh, mesh_sizes in (("expert=8", {"expert": 8}),
                                                 ("data=2,expert=4", {"data": 2, "expert": 4}),
                                                 ("expert=8,tensor=2", {"expert": 8, "tensor": 2}),
                                                 ("expert=64", {"expert": 64}))}
    result["memory_config"] = args.memory_config
    write_result(result, args.out)


if __name__ == "__main__":
    main()
