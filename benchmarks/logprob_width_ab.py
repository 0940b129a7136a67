"""A / B decode throughput of an engine without logprob programs (logprob_width 0, the
Python API's default) against one built as `dsjax serve` builds it (logprob_width 20,
logprobs behind a condition), serving requests that ask for no logprobs, in one process,
interleaved round by round so that a shared machine's drift falls on both alike. Also the
serve-like engine with every request asking for 5 logprobs (what a step that computes them
costs). Greedy decode, engine.step() timed in steady state; ratios are the median of each
round's ratio to the width-0 engine.

    python benchmarks/logprob_width_ab.py --batches 1,8 --rounds 5 \
        --out benchmarks/results/ab_logprob_width_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from results_io import write_result

import dsjax
from dsjax import Engine, SamplingParams


def engines(model, batch: int, capacity: int) -> dict:
    return {"width0": (Engine(model, max_slots=batch, capacity=capacity), 0),
            "serve": (Engine(model, max_slots=batch, capacity=capacity, max_logprobs=5, logprob_width=20), 0),
            "serve_asking": (Engine(model, max_slots=batch, capacity=capacity, max_logprobs=5, logprob_width=20), 5)}


def fill(engine: Engine, batch: int, logprobs: int, tokens: int, rng) -> None:
    """Admit `batch` greedy requests and step until every one decodes."""
    for _ in range(batch):
        engine.add_request(rng.integers(3, 5000, 16).tolist(),
                           SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=logprobs))
    while any(r.state != "decoding" for r in engine.requests.values() if not r.done):
        engine.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a named config (default: the built-in model)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per engine per round")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--out", default="benchmarks/results/ab_logprob_width_cpu.json")
    args = ap.parse_args()
    model = dsjax.load_model(args.config) if args.config else dsjax.load_model()
    rng = np.random.default_rng(0)
    summary = {}
    for batch in map(int, args.batches.split(",")):
        sides = engines(model, batch, args.capacity)
        for engine, logprobs in sides.values():
            fill(engine, batch, logprobs, 16 + (args.rounds + 1) * args.steps, rng)
            for _ in range(args.steps):  # compile and warm the decode program
                engine.step()
        runs = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                engine = sides[name][0]
                t = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                runs[name].append(batch * args.steps / (time.perf_counter() - t))
            print(batch, r, {k: round(v[-1], 1) for k, v in runs.items()}, flush=True)
        med = {name: statistics.median(v) for name, v in runs.items()}
        paired = lambda name: statistics.median(a / b for a, b in zip(runs[name], runs["width0"]))  # noqa: E731
        summary[str(batch)] = {"median_tok_s": med, "serve_over_width0": paired("serve"),
                               "asking_over_width0": paired("serve_asking"), "runs": runs}
    result = {"model": args.config or "built-in", "rounds": args.rounds, "steps": args.steps,
              "load_average": os.getloadavg(), "summary": summary}
    write_result(result, args.out)
    print({b: (round(s["serve_over_width0"], 3), round(s["asking_over_width0"], 3)) for b, s in summary.items()})


if __name__ == "__main__":
    main()
