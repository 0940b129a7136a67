"""Checkpoint loading on CPU: a synthetic multi-GB checkpoint in DeepSeek's original naming
(bf16, sharded with an index), loaded with dsjax's streaming reader, converted to orbax,
and restored. Each load runs in a fresh process; reports wall time and peak RSS. JSON out.

    python benchmarks/load_bench.py --out benchmarks/results/load_cpu.json

On a CPU "device" the weights live in host memory, so peak RSS can never be below the
model's bytes; what streaming bounds is the overhead on top of it (one shard at a time).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from results_io import write_result

import dsjax
from dsjax.checkpoint import write_safetensors
from dsjax.checkpoint.names import per_layer_paths, weight_names
from dsjax.model import model_specs
from dsjax.params import spec_leaves, unstacked

CHILD = r"""
import json, sys, time
import dsjax, jax

def status(key):  # /proc, not ru_maxrss: that one keeps the forking parent's high-water mark across exec
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

baseline = status("VmRSS")  # interpreter + jax, before loading
t = time.perf_counter()
model = dsjax.load_model(sys.argv[1], dtype="bfloat16", mesh=sys.argv[2] or None)
jax.block_until_ready(model.params)
seconds = time.perf_counter() - t
leaves = jax.tree.leaves(model.params)
print(json.dumps({"seconds": seconds, "peak_rss_bytes": status("VmHWM"),
                  "baseline_rss_bytes": baseline, "param_bytes": sum(x.nbytes for x in leaves),
                  "device_bytes": sum(s.data.nbytes for x in leaves for s in x.addressable_shards)}))
"""


def write_checkpoint(cfg, directory, shard_bytes=512 << 20) -> int:
    """Random bf16 weights (hash tables int64), original names, ~shard_bytes per file."""
    rng = np.random.default_rng(0)
    table = weight_names(cfg)
    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            current, size = {}, 0

    leaves = []
    for path, spec in spec_leaves(model_specs(cfg, ml_dtypes.bfloat16)):
        layers = per_layer_paths(cfg, path)  # a weight stacked over a layer run: one tensor per layer
        leaves += [(path, spec)] if layers is None else [(p, unstacked(spec)) for p in layers]
    for path, spec in leaves:
        src = table[path]
        if np.issubdtype(np.dtype(spec.dtype), np.integer):
            arrays = {src.name: rng.integers(0, cfg.n_routed_experts, spec.shape).astype(np.int64)}
        elif src.expert is None:
            arrays = {src.name: rng.standard_normal(spec.shape, np.float32).astype(np.dtype(spec.dtype))}
        else:
            arrays = {f"{src.name}.{e}.{src.expert}.weight":
                      rng.standard_normal(spec.shape[1:], np.float32).astype(np.dtype(spec.dtype))
                      for e in range(spec.shape[0])}
        for name, a in arrays.items():
            current[name] = a
            size += a.nbytes
            total += a.nbytes
            if size >= shard_bytes:
                flush()
    flush()
    weight_map = {}
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(directory, fname), tensors)
        weight_map.update({n: fname for n in tensors})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dsjax.config.to_hf_dict(cfg), f)
    return total


def child_load(path, mesh=""):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", CHILD, path, mesh], capture_output=True, text=True, env=env,
                         timeout=3000)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/load_cpu.json")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    cfg = dsjax.load_config("small").replace(
        hidden_size=1024, moe_intermediate_size=512, n_routed_experts=64, num_experts_per_tok=4, name="bench-2g")
    work = args.workdir or tempfile.mkdtemp(prefix="dsjax_load_")
    ckpt, orbax_dir = os.path.join(work, "safetensors"), os.path.join(work, "orbax")
    os.makedirs(ckpt, exist_ok=True)
    t = time.perf_counter()
    total = write_checkpoint(cfg, ckpt)
    result = {"config": cfg.name, "checkpoint_bytes": total, "write_seconds": time.perf_counter() - t,
              "files": len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])}
    result["safetensors_one_device"] = child_load(ckpt)
    result["safetensors_mesh_expert8"] = child_load(ckpt, "expert=8")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dsjax.cli", "convert", ckpt, orbax_dir], check=True,
                   capture_output=True)
    result["convert_seconds"] = time.perf_counter() - t
    result["orbax_one_device"] = child_load(orbax_dir)
    result["orbax_mesh_expert8"] = child_load(orbax_dir, "expert=8")
    for key in ("safetensors_one_device", "safetensors_mesh_expert8", "orbax_one_device", "orbax_mesh_expert8"):
        r = result[key]
        # what loading added beyond the weights' own bytes on all (fake) devices and the baseline
        r["transient_host_bytes"] = r["peak_rss_bytes"] - r["baseline_rss_bytes"] - r["device_bytes"]
        r["gib_per_s"] = r["param_bytes"] / r["seconds"] / 2**30
        print(key, json.dumps(r), flush=True)
    write_result(result, args.out)
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
