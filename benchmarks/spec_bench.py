"""Speculative decoding on CPU: tokens/s and accepted tokens per target step, with vs
without MTP drafts, batch 1 and 8, acceptance against draft length. Writes JSON.

    python benchmarks/spec_bench.py --out benchmarks/results/spec_cpu_tiny.json

The tiny model's random MTP layer never agrees with it, so the drafter is first trained by
self-distillation (dsjax.train.mtp_distill) on the target's greedy continuations of the benchmark
prompts; `held_out` reports the same drafter on prompts it never saw. Greedy decoding, so
every speculative run must reproduce the plain run's tokens (checked, `identical`).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from results_io import write_result  # noqa: E402

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.train.mtp_distill import random_prompts, train_mtp


def run(model, prompts, new_tokens, repeats, **engine_kw) -> dict:
    """Median wall time of engine.generate after a warm-up run (compiles everything)."""
    engine = Engine(model, max_slots=len(prompts), capacity=256, prefill_chunk=32, **engine_kw)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)
    times, tokens = [], None
    for _ in range(repeats):
        engine.spec_totals = dict.fromkeys(engine.spec_totals, 0)
        t = time.perf_counter()
        tokens = engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
    seconds = float(np.median(times))
    out = {"seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds, "tokens": tokens}
    if engine.num_draft_tokens:
        m = engine.spec_metrics()
        out.update({k: m[k] for k in ("drafts_proposed", "drafts_accepted", "acceptance_rate",
                                      "tokens_per_row_step", "tokens_per_target_step", "verify_costs")})
        out["accepted_per_row_step"] = m["drafts_accepted"] / max(m["row_steps"], 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-drafts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/spec_cpu_tiny.json")
    ap.add_argument("--save", default="", help="also save the model with its trained MTP layer here (orbax)")
    ap.add_argument("--load", default="", help="skip training: the model an earlier --save run saved")
    args = ap.parse_args()

    model = dsjax.load_model("tiny", dtype="float32", seed=args.seed, mtp=True)
    vocab = model.config.vocab_size
    prompts = random_prompts(vocab, 8, args.prompt_len, args.seed + 100)
    held_out = random_prompts(vocab, 8, args.prompt_len, args.seed + 200)

    if args.load:  # a model saved by an earlier --save run (same seed and prompts)
        trained = dsjax.load_model(args.load, dtype="float32")
        training = json.loads(Path(args.load, "training.json").read_text())
    else:
        t = time.perf_counter()
        mtp, history = train_mtp(model, prompts, new_tokens=args.new_tokens, steps=args.steps, seed=args.seed)
        trained = model.replace(mtp=mtp)
        training = {"steps": args.steps, "seconds": time.perf_counter() - t, "sequences": len(prompts),
                    "loss_first": history["loss"][0], "loss_last": history["loss"][-1],
                    "agreement_first": history["agreement"][0], "agreement_last": history["agreement"][-1]}
        if args.save:
            from dsjax.checkpoint import orbax_io

            orbax_io.save(trained, args.save, quantized="dequantize")
            Path(args.save, "training.json").write_text(json.dumps(training))
    result = {
        "platform": platform.processor() or platform.machine(), "jax": jax.__version__,
        "devices": str(jax.devices()), "model": "tiny (float32)", "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "decoding": "greedy",
        "training": training,
        "runs": {},
    }
    for batch in (1, 8):
        rows = prompts[:batch]
        runs = {"plain": run(trained, rows, args.new_tokens, args.repeats),
                "plain_decode_steps4": run(trained, rows, args.new_tokens, args.repeats, decode_steps=4)}
        for k in range(1, args.max_drafts + 1):
            runs[f"fixed_k{k}"] = run(trained, rows, args.new_tokens, args.repeats, num_draft_tokens=k,
                                      spec_policy="fixed")
        runs[f"confidence_k{args.max_drafts}"] = run(trained, rows, args.new_tokens, args.repeats,
                                                     num_draft_tokens=args.max_drafts, spec_policy="confidence")
        base = runs["plain"]
        expected = base["tokens"]
        for name, r in runs.items():
            r["speedup_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["identical"] = r.pop("tokens") == expected
        result["runs"][f"batch{batch}"] = runs
        print(f"batch {batch}:", {n: (round(r["tokens_per_s"], 1), round(r.get("tokens_per_row_step", 1.0), 2))
                                   for n, r in runs.items()}, flush=True)
    held = {"plain": run(trained, held_out, args.new_tokens, args.repeats),
            "fixed_k3": run(trained, held_out, args.new_tokens, args.repeats, num_draft_tokens=3, spec_policy="fixed"),
            f"confidence_k{args.max_drafts}": run(trained, held_out, args.new_tokens, args.repeats,
                                                  num_draft_tokens=args.max_drafts, spec_policy="confidence")}
    expected = held["plain"]["tokens"]
    for r in held.values():
        r["speedup_vs_plain"] = r["tokens_per_s"] / held["plain"]["tokens_per_s"]
        r["identical"] = r.pop("tokens") == expected
    result["held_out_batch8"] = held
    result["acceptance_vs_draft_length"] = {
        k: {key: result["runs"]["batch8"][f"fixed_k{k}"][key]
            for key in ("acceptance_rate", "accepted_per_row_step", "tokens_per_row_step")}
        for k in range(1, args.max_drafts + 1)}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
