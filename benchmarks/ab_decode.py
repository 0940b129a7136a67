"""A / B decode throughput of two checkouts on this machine, alternating runs so that drift
of a shared machine falls on both sides alike: engine decode tokens/s (engine_bench's
`bench_dsjax`: 128-token prompts, 32 new tokens, greedy) per config and batch.

    python benchmarks/ab_decode.py --a ../dsjax-before --b . --configs tiny,small --rounds 3 \
        --out benchmarks/results/ab_decode_cpu.json

Each round runs one fresh process per side (compile excluded: bench_dsjax warms up first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from results_io import write_result

CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
import dsjax
from engine_bench import bench_dsjax
model = dsjax.load_model({config!r}, dtype="float32")
out = {{}}
for b in {batches!r}:
    out[str(b)] = bench_dsjax(model, b, 128, 32, capacity=256, repeats={repeats})["decode_tokens_per_s"]
print("RESULT" + json.dumps(out))
"""


def run_side(root: Path, config: str, batches: list[int], repeats: int) -> dict:
    code = CHILD.format(bench=str(root / "benchmarks"), config=config, batches=batches, repeats=repeats)
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="checkout A (e.g. before a change)")
    ap.add_argument("--b", required=True, help="checkout B (e.g. after)")
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/ab_decode_cpu.json")
    args = ap.parse_args()
    sides = {"a": Path(args.a).resolve(), "b": Path(args.b).resolve()}
    batches = [int(b) for b in args.batches.split(",")]
    runs = {cfg: {s: [] for s in sides} for cfg in args.configs.split(",")}
    for r in range(args.rounds):
        for cfg in runs:
            for s in (("a", "b") if r % 2 == 0 else ("b", "a")):
                runs[cfg][s].append(run_side(sides[s], cfg, batches, args.repeats))
                print(r, cfg, s, runs[cfg][s][-1], flush=True)
    summary = {}
    for cfg, per_side in runs.items():
        summary[cfg] = {}
        for b in map(str, batches):
            med = {s: statistics.median(x[b] for x in per_side[s]) for s in sides}
            summary[cfg][b] = {"a_median_tok_s": med["a"], "b_median_tok_s": med["b"], "b_over_a": med["b"] / med["a"],
                               "a_runs": [x[b] for x in per_side["a"]], "b_runs": [x[b] for x in per_side["b"]]}
    write_result({"a": str(sides["a"]), "b": str(sides["b"]), "rounds": args.rounds, "summary": summary}, args.out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
