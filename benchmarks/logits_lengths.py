"""`Model.logits` over many prompt lengths, as a researcher scoring prompts calls it: the wall
time of one call per length 1..N on the built-in model from a cold start (no persistent
compile cache), and the programs compiled, with `Model.logits`' padded shapes
(`dsjax.api.padded_size`) against the forward at each exact shape (what `Model.logits` ran
before it padded). Each side runs in a fresh process, alternating round by round.

    python benchmarks/logits_lengths.py [--lengths 96] [--batch 1] [--rounds 2]
        [--out benchmarks/results/logits_lengths_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from results_io import write_result

CHILD = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import dsjax
from dsjax.model.forward_pass import forward
side, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = dsjax.load_model()
ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (batch, n)).astype(np.int32)

def exact(x):  # the forward at the exact shape, as Model.logits ran before it padded
    return np.asarray(forward(model.sequence_params(x), jnp.asarray(x), model.config, opts=model.options)[0])

call = model.logits if side == "padded" else exact
t = time.perf_counter()
for s in range(1, n + 1):
    call(ids[:, :s])
wall = time.perf_counter() - t
t = time.perf_counter()
for s in range(1, n + 1):  # again: every program compiled, the calls alone
    call(ids[:, :s])
print("RESULT" + json.dumps({"wall_s": wall, "warm_wall_s": time.perf_counter() - t,
                             "programs": forward._cache_size()}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, default=96, help="call lengths 1..N")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "logits_lengths_cpu.json"))
    args = ap.parse_args()
    env = {**os.environ, "DSJAX_COMPILE_CACHE": "off"}
    runs = {"padded": [], "exact": []}
    for r in range(args.rounds):
        for side in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, side, str(args.lengths), str(args.batch)], env=env,
                                 capture_output=True, text=True, check=True)
            runs[side].append(json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))[6:]))
            print(r, side, runs[side][-1], flush=True)
    sides = {side: {"programs": rs[0]["programs"], "wall_s": statistics.median(x["wall_s"] for x in rs),
                    "warm_wall_s": statistics.median(x["warm_wall_s"] for x in rs),
                    "wall_s_each_round": [x["wall_s"] for x in rs]} for side, rs in runs.items()}
    for side, v in sides.items():
        print(f"{side}: {v['programs']} programs, lengths 1..{args.lengths} in {v['wall_s']:.1f} s cold, "
              f"{v['warm_wall_s']:.2f} s warm")
    write_result({"model": "dsjax-tiny-py (built in)", "lengths": args.lengths, "batch": args.batch,
                  "rounds": args.rounds, "compile_cache": "off", "platform": platform.platform(),
                  "cpus": os.cpu_count(), "sides": sides,
                  "cold_wall_ratio_padded_to_exact": sides["padded"]["wall_s"] / sides["exact"]["wall_s"]}, args.out)


if __name__ == "__main__":
    main()
