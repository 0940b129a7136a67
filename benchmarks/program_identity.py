"""Do two checkouts run the same device programs for plain serving? Hashes of the lowered
HLO of the decode step and a prefill chunk (tiny, batch 8, capacity 256), and how many
programs warmup() plus a batch of unconstrained requests compile, per checkout.

    python benchmarks/program_identity.py --a /work/main --b . --out benchmarks/results/program_identity.json

Where a shared machine's load drowns a throughput A/B (ab_decode.py), equal HLO is the
load-independent answer to "did plain decoding change": the same programs run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from results_io import write_result

CHILD = r"""
import hashlib, json
import jax.numpy as jnp, numpy as np
import dsjax
from dsjax.engine import programs
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams

m = dsjax.load_model("tiny", dtype="float32")
eng = Engine(m, max_slots=8, capacity=256, prefill_chunk=128)
sha = lambda low: hashlib.sha256(low.as_text().encode()).hexdigest()[:16]
out = {"decode_step_hlo_sha": sha(programs.decode_step.lower(
           m.params, eng.cache, eng.slots, cfg=eng.cfg, opts=eng.opts, ctx_bucket=256, n_logprobs=0, n_steps=1)),
       "prefill_step_hlo_sha": sha(programs.prefill_step.lower(
           m.params, eng.cache, eng.slots, jnp.int32(0), np.zeros((1, 128), np.int32), np.zeros(1, np.int32),
           np.zeros(1, bool), cfg=eng.cfg, opts=eng.opts, ctx_bucket=256, n_logprobs=0)),
       "warmup_shapes": eng.warmup()}
rng = np.random.default_rng(0)
eng.generate([rng.integers(3, 1000, 128).tolist() for _ in range(8)], SamplingParams(max_tokens=32, ignore_eos=True))
out["programs_compiled"] = {n: getattr(programs, n)._cache_size() for n in dir(programs)
                            if hasattr(getattr(programs, n), "_cache_size") and getattr(programs, n)._cache_size()}
print("RESULT" + json.dumps(out))
"""


def run_side(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=root, capture_output=True, text=True, check=True)
    return json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--out", default="benchmarks/results/program_identity.json")
    args = ap.parse_args()
    sides = {s: run_side(Path(p).resolve()) for s, p in (("a", args.a), ("b", args.b))}
    result = {"a": str(Path(args.a).resolve()), "b": str(Path(args.b).resolve()), **sides,
              "same_programs": sides["a"] == sides["b"]}
    print(json.dumps(result, indent=1))
    write_result(result, args.out)


if __name__ == "__main__":
    main()
