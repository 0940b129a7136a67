"""What batch-invariant mode costs: decode and prefill throughput at batch 1, 8 and 16,
default mode against batch_invariant=True, on the same engine settings as engine_bench.py
(prompt 128 tokens, 32 new, capacity 512). Also checks, on the same runs, that each
request's greedy logprobs are bitwise identical at every batch size in batch-invariant mode
(and reports whether they happen to be in the default mode). Writes JSON.

    python benchmarks/invariance_bench.py --config tiny --out benchmarks/results/invariance_cpu_tiny.json
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
import numpy as np
from engine_bench import bench_dsjax
from results_io import write_result

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.model.block import INVARIANT_ROWS


def logprobs_by_batch(model, prompts, batches, **engine_kw) -> dict[int, list[np.ndarray]]:
    """Each prompt's generated-token logprobs, at each batch size (engine max_slots)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    out = {}
    for b in batches:
        engine = Engine(model, max_slots=b, capacity=512, prefill_chunk=128, max_logprobs=1, **engine_kw)
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in engine.run():
            pass
        out[b] = [np.asarray(engine.requests[i].logprobs, np.float32) for i in ids]
    return out


def identical(runs: dict[int, list[np.ndarray]]) -> bool:
    first = next(iter(runs.values()))
    return all(all(np.array_equal(a, b) for a, b in zip(first, r)) for r in runs.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/invariance_cpu_tiny.json")
    args = ap.parse_args()
    model = dsjax.load_model(args.config, dtype="float32", seed=0)
    result = {"config": args.config, "dtype": "float32", "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "invariant_rows": INVARIANT_ROWS, "jax": jax.__version__,
              "device": str(jax.devices()[0]), "cpus": os.cpu_count(), "platform": platform.platform(),
              "batches": {}}
    for b in [int(x) for x in args.batches.split(",")]:
        row = {}
        for name, invariant in (("default", False), ("batch_invariant", True)):
            row[name] = bench_dsjax(model, b, args.prompt_len, args.new_tokens, capacity=512, repeats=args.repeats,
                                    batch_invariant=invariant)
        row["decode_cost_ratio"] = row["default"]["decode_tokens_per_s"] / row["batch_invariant"]["decode_tokens_per_s"]
        row["prefill_cost_ratio"] = (row["default"]["prefill_tokens_per_s"]
                                     / row["batch_invariant"]["prefill_tokens_per_s"])
        result["batches"][str(b)] = row
        print(b, {k: round(v, 3) for k, v in row.items() if k.endswith("ratio")},
              {k: round(row[k]["decode_tokens_per_s"], 1) for k in ("default", "batch_invariant")}, flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, int(n)).tolist() for n in rng.integers(5, 120, 12)]
    batches = (1, 4, 16)
    result["logprobs_bitwise_identical_over_batches"] = {
        "batches": list(batches),
        "batch_invariant": identical(logprobs_by_batch(model, prompts, batches, batch_invariant=True)),
        "default": identical(logprobs_by_batch(model, prompts, batches))}
    print(result["logprobs_bitwise_identical_over_batches"])
    write_result(result, args.out)


if __name__ == "__main__":
    main()
