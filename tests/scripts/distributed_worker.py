"""One process of a multi-process dsjax run (used by tests/test_sharding.py).

    python distributed_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID MESH

Each process owns 4 CPU devices, brings its own share of the prompts, and prints the new
tokens of its prompts as JSON on the last line."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import dsjax  # noqa: E402
from dsjax.generate import generate_distributed  # noqa: E402
from dsjax.sharding.distributed import initialize  # noqa: E402
from dsjax.model import layer_slot  # noqa: E402

coordinator, n, pid, mesh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
assert initialize(coordinator, n, pid)
import jax  # noqa: E402

assert jax.device_count() == 4 * n and jax.local_device_count() == 4
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 5000, int(k)).tolist() for k in (5, 37, 12, 70, 3, 20, 44, 9)]
mine = prompts[pid::n]
model = dsjax.load_model("tiny", dtype="float32", mesh=mesh)
run, pos, _ = layer_slot(model.config, 1)
w1 = model.params.blocks[run][pos].moe.w1  # layer 1 stacked with its run (leading axis unsharded)
shard_bytes = sorted({s.data.nbytes for s in w1.addressable_shards})
out = generate_distributed(model, mine, 10)
print(json.dumps({"pid": pid, "tokens": out, "w1_shard_bytes": shard_bytes, "w1_total_bytes": w1.nbytes}))
