"""The sampler's device work per decode step, by setting: `sample_tokens` on [B, V] logits
(V: V4's 129280) for greedy, temperature alone, top-p, top-k and both, and `filter_logits`
alone; median ms per call after a warm-up. Top-p / top-k find their thresholds by 32-pass
bisections over [B, V]; each runs only when some row uses its filter.

    python benchmarks/sampler_bench.py --out benchmarks/results/sampler_cpu.json
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
from results_io import median_seconds, write_result

from dsjax.engine.sampler import SamplingState, filter_logits, sample_tokens

SETTINGS = {"greedy": (0.0, 0, 1.0), "temperature": (0.7, 0, 1.0), "top_p": (0.7, 0, 0.95),
            "top_k": (0.7, 50, 1.0), "top_k_and_top_p": (0.7, 50, 0.95)}


def state(b: int, temperature: float, top_k: int, top_p: float) -> SamplingState:
    f32, i32 = (lambda x: jnp.full((b,), x, jnp.float32)), (lambda x: jnp.full((b,), x, jnp.int32))
    return SamplingState(temperature=f32(temperature), top_k=i32(top_k), top_p=f32(top_p), min_p=f32(0.0),
                         seed=jnp.arange(b, dtype=jnp.uint32), repetition_penalty=f32(1.0),
                         presence_penalty=f32(0.0), frequency_penalty=f32(0.0),
                         history=jnp.zeros((b, 8), jnp.int32), prompt_len=i32(0),
                         bias_ids=jnp.zeros((b, 1), jnp.int32), bias_values=jnp.zeros((b, 1), jnp.float32),
                         logprobs=i32(0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/sampler_cpu.json")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    result = {"backend": jax.default_backend(), "jax": jax.__version__, "platform": platform.platform(),
              "vocab": args.vocab, "ms": {}}
    sample = jax.jit(sample_tokens)
    filt = jax.jit(filter_logits)
    for b in (1, 8):
        logits = jnp.asarray(np.random.default_rng(b).normal(size=(b, args.vocab)) * 2, jnp.float32)
        positions = jnp.zeros((b,), jnp.int32)
        for name, (t, k, p) in SETTINGS.items():
            s = state(b, t, k, p)
            row = {"sample_tokens": 1e3 * median_seconds(sample, logits, s, positions, repeats=args.repeats)}
            if k or p < 1:
                row["filter_logits"] = 1e3 * median_seconds(filt, logits, s.top_k, s.top_p, repeats=args.repeats)
            result["ms"][f"batch_{b}/{name}"] = row
            print(b, name, {key: round(v, 3) for key, v in row.items()}, flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
