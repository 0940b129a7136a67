"""The engine on a GPU: a V4-Flash-shaped model cut to a few layers (its attention, indexer
and expert shapes; fewer layers, experts and vocabulary; random bf16 weights), run with
kernels="reference" (pure jnp through XLA) and kernels="pallas" (the Mosaic GPU kernels on a
Hopper GPU). Records, per kernel choice: full-forward logits against the reference's and
against an fp32-weight reference run (max |diff| over the logits' scale, argmax agreement:
the second shows how far bf16 alone moves them), greedy tokens of a batch against the
reference's, and decode / prefill tok/s at batch 1 and `--batch` (engine_bench.py's
measurement: median of 3, prefill timed on its own and taken off the generate time; each
engine's warm-up seconds, mostly compiles); batch-1 decode at four steps a dispatch. A
failure is recorded per kernel choice, not raised. JSON out.

    PYTHONPATH=. python3 benchmarks/gpu_engine.py --profile --out $OUT/gpu_engine.json
    python benchmarks/gpu_engine.py --smoke --out /tmp/gpu_engine_smoke.json   # CPU dry run
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from engine_bench import bench_dsjax
from results_io import write_result

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.model import model_specs
from dsjax.params import init_params


def gpu_config(smoke: bool):
    """V4-Flash's first 4 layers (sliding, sliding, CSA, HCA; 3 hash-routed) at its widths,
    8 experts, a 32k vocabulary; --smoke: the tiny config."""
    if smoke:
        return dsjax.load_config("tiny")
    flash = dsjax.load_config("v4-flash")
    return flash.replace(name="v4-flash-4l-8e", num_hidden_layers=4, layer_types=flash.layer_types[:4],
                         mlp_layer_types=flash.mlp_layer_types[:4], n_routed_experts=8, vocab_size=32768)


def compare(logits, want) -> dict:
    return {"max_abs_diff_over_scale": float(np.abs(logits - want).max() / np.abs(want).max()),
            "argmax_agreement": float((logits.argmax(-1) == want.argmax(-1)).mean())}


def run_choice(model, kernels, prompts, new_tokens, capacity, want_logits, want_tokens, float32_logits):
    """One kernel choice: logits compared, greedy tokens of the batch compared (tokens equal before
    the first difference, per row), tok/s at batch 1 and len(prompts) (engine_bench's timing)."""
    row = {}
    m = model.replace(options=model.options.replace(kernels=kernels))
    t = time.perf_counter()
    logits = m.logits(np.asarray(prompts[:2]))
    row["logits_first_call_s"] = time.perf_counter() - t
    row["logits_vs_float32_reference"] = compare(logits, float32_logits)  # bf16's own noise, for scale
    if want_logits is not None:
        row["logits_vs_reference"] = compare(logits, want_logits)
    batch, prompt_len = len(prompts), len(prompts[0])
    for b in sorted({1, batch}):
        row[f"batch_{b}"] = bench_dsjax(m, b, prompt_len, new_tokens, capacity=capacity, repeats=3)
        print(kernels, b, {k: v for k, v in row[f"batch_{b}"].items() if k.endswith("per_s")}, flush=True)
    if kernels == "reference":  # four decode steps a dispatch: how much of a step is the host's
        row["batch_1_decode_steps_4"] = bench_dsjax(m, 1, prompt_len, new_tokens, capacity=capacity, repeats=3,
                                                    decode_steps=4)
        print(kernels, "1, 4 steps a dispatch", row["batch_1_decode_steps_4"]["decode_tokens_per_s"], flush=True)
    # the batch's engine programs are compiled by now (same shapes): no new compile here
    engine = Engine(m, max_slots=batch, capacity=capacity, prefill_chunk=prompt_len)
    tokens = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    if want_tokens is not None:
        row["greedy_prefix_agreement"] = [sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, w)))
                                          for a, w in zip(tokens, want_tokens)]
    return row, logits, tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu_engine.json")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (the Pallas kernels interpreted)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--profile", action="store_true",
                    help="also decode_profile.py's split of a decode step (reference kernels): the program's own "
                         "time against the engine's step (host overhead) and per op group")
    args = ap.parse_args()
    if args.smoke:
        args.prompt_len, args.new_tokens, args.batch = 24, 4, 2
    cfg = gpu_config(args.smoke)
    t = time.perf_counter()
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    model = dsjax.Model(cfg, init_params(model_specs(cfg, dtype), 0), dtype, None)
    result = {"config": cfg.name, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
              "jax": jax.__version__, "platform": platform.platform(), "init_s": time.perf_counter() - t,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "choices": {}}
    print("weights ready in", result["init_s"], "s", flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    capacity = -(-(args.prompt_len + args.new_tokens) // 128) * 128
    want_logits = want_tokens = None
    as32 = lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
    model32 = model.replace(params=jax.tree.map(as32, model.params), dtype=jnp.float32)
    float32_logits = model32.logits(np.asarray(prompts[:2]))  # kernels="reference", fp32 weights
    del model32
    for kernels in ("reference", "pallas"):
        try:
            row, logits, tokens = run_choice(model, kernels, prompts, args.new_tokens, capacity, want_logits,
                                             want_tokens, float32_logits)
        except Exception as e:  # noqa: BLE001 - record a kernel choice's failure, keep the other
            row = {"error": f"{type(e).__name__}: {e}"[:3000], "trace": traceback.format_exc()[-3000:]}
            print(kernels, "FAILED", row["error"][:500], flush=True)
            result["choices"][kernels] = row
            continue
        if kernels == "reference":
            want_logits, want_tokens = logits, tokens
        result["choices"][kernels] = row
    if args.profile:
        from decode_profile import profile
        from roofline import memory_bandwidth

        bandwidth = memory_bandwidth()["best"]
        result["decode_profile"] = {}
        for b in sorted({1, args.batch}):
            row = profile(model, b, args.prompt_len, repeats=10, bandwidth=bandwidth)
            result["decode_profile"][str(b)] = row
            print("profile", b, {k: round(1e3 * v, 3) for k, v in row["groups_s"].items()}, "ms; engine step",
                  round(1e3 * row["engine_step_s"], 3), "ms", flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
