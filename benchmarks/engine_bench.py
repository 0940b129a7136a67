"""Engine throughput on CPU, side by side with HF transformers `generate` on the same
config and weights; decode step time against context length; async-dispatch overlap;
batch-invariant mode cost; compile counts in steady state. Writes JSON.

    python benchmarks/engine_bench.py --config small --out benchmarks/results/engine_cpu.json

Needs the test extra (torch, transformers) for the HF side; `--no-hf` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import numpy as np

from results_io import write_result  # noqa: E402

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams


class CompileCounter:
    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


def _prompts(rng, batch, length, vocab):
    return [rng.integers(3, vocab, length).tolist() for _ in range(batch)]


def _engine_run(engine: Engine, prompts, max_tokens) -> float:
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t


def bench_dsjax(model, batch, prompt_len, new_tokens, *, capacity, repeats, **engine_kw):
    rng = np.random.default_rng(batch)
    engine = Engine(model, max_slots=batch, capacity=capacity, prefill_chunk=prompt_len, **engine_kw)
    warm = _prompts(rng, batch, prompt_len, model.config.vocab_size)
    _engine_run(engine, warm, new_tokens)  # compile prefill + decode buckets
    _engine_run(engine, warm, 1)
    prefill, total = [], []
    for _ in range(repeats):
        prompts = _prompts(rng, batch, prompt_len, model.config.vocab_size)
        prefill.append(_engine_run(engine, prompts, 1))
        total.append(_engine_run(engine, prompts, new_tokens))
    t_prefill, t_total = float(np.median(prefill)), float(np.median(total))
    return {"prefill_tokens_per_s": batch * prompt_len / t_prefill,
            "decode_tokens_per_s": batch * (new_tokens - 1) / max(t_total - t_prefill, 1e-9),
            "prefill_s": t_prefill, "generate_s": t_total}


def bench_hf(hf_model, batch, prompt_len, new_tokens, *, repeats):
    import torch

    rng = np.random.default_rng(batch)

    def run(ids, n):
        t = time.perf_counter()
        with torch.no_grad():
            hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        return time.perf_counter() - t

    ids = torch.tensor(_prompts(rng, batch, prompt_len, hf_model.config.vocab_size))
    run(ids, 2)
    prefill, total = [], []
    for _ in range(repeats):
        ids = torch.tensor(_prompts(rng, batch, prompt_len, hf_model.config.vocab_size))
        prefill.append(run(ids, 1))
        total.append(run(ids, new_tokens))
    t_prefill, t_total = float(np.median(prefill)), float(np.median(total))
    return {"prefill_tokens_per_s": batch * prompt_len / t_prefill,
            "decode_tokens_per_s": batch * (new_tokens - 1) / max(t_total - t_prefill, 1e-9),
            "prefill_s": t_prefill, "generate_s": t_total}


def context_sweep(model, contexts, steps):
    """Decode step time at each context length (one sequence, cache sized for the largest)."""
    capacity = max(contexts) + 128
    ratio = max(model.config.compress_rate_csa, model.config.compress_rate_hca)
    capacity = -(-capacity // ratio) * ratio
    engine = Engine(model, max_slots=1, capacity=capacity, prefill_chunk=512)
    rng = np.random.default_rng(0)
    out = {}
    for ctx in contexts:
        engine.add_request(rng.integers(3, model.config.vocab_size, ctx).tolist(),
                           SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True))
        while engine.requests[list(engine.requests)[-1]].state != "decoding":
            engine.step()
        for _ in range(steps):  # compile / warm this context's bucket
            engine.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        for _ in engine.run():
            pass
        out[str(ctx)] = {"decode_step_ms": 1e3 * float(np.median(times))}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/engine_cpu.json")
    args = ap.parse_args()

    cfg = dsjax.load_config(args.config)
    batches = [int(b) for b in args.batches.split(",")]
    result = {"config": args.config, "dtype": "float32", "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "jax": jax.__version__, "device": str(jax.devices()[0]),
              "cpus": os.cpu_count(), "platform": platform.platform(), "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = None
        if not args.no_hf:
            import torch
            from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

            torch.manual_seed(0)
            hf_model = DeepseekV4ForCausalLM(DeepseekV4Config(**dsjax.config.to_hf_dict(cfg))).eval()
            hf_model.save_pretrained(tmp)
            model = dsjax.load_model(tmp, dtype="float32")
            result["transformers"] = __import__("transformers").__version__
        else:
            model = dsjax.load_model(args.config, dtype="float32")
        capacity = 256
        while capacity < args.prompt_len + args.new_tokens:
            capacity *= 2
        for b in batches:
            row = {"dsjax": bench_dsjax(model, b, args.prompt_len, args.new_tokens, capacity=capacity,
                                        repeats=args.repeats),
                   "dsjax_decode_steps_4": bench_dsjax(model, b, args.prompt_len, args.new_tokens, capacity=capacity,
                                                       repeats=args.repeats, decode_steps=4)}
            if hf_model is not None:
                row["hf"] = bench_hf(hf_model, b, args.prompt_len, args.new_tokens, repeats=args.repeats)
                row["decode_speedup"] = row["dsjax"]["decode_tokens_per_s"] / row["hf"]["decode_tokens_per_s"]
                row["decode_speedup_decode_steps_4"] = (row["dsjax_decode_steps_4"]["decode_tokens_per_s"]
                                                        / row["hf"]["decode_tokens_per_s"])
                row["prefill_speedup"] = row["dsjax"]["prefill_tokens_per_s"] / row["hf"]["prefill_tokens_per_s"]
            result["batches"][str(b)] = row
            print(b, json.dumps(row), flush=True)

        b = 8
        counter = CompileCounter()
        sync = bench_dsjax(model, b, args.prompt_len, args.new_tokens, capacity=capacity, repeats=args.repeats,
                           overlap=False)
        invariant = bench_dsjax(model, b, args.prompt_len, args.new_tokens, capacity=capacity,
                                repeats=args.repeats, batch_invariant=True)
        result["batch8_no_overlap"] = sync
        result["batch8_batch_invariant"] = invariant
        result["overlap_decode_gain"] = (result["batches"].get("8", {}).get("dsjax", {}).get("decode_tokens_per_s", 0)
                                         / sync["decode_tokens_per_s"])
        print("no-overlap", json.dumps(sync), "\nbatch-invariant", json.dumps(invariant), flush=True)

        counter.n = 0
        engine = Engine(model, max_slots=4, capacity=capacity, prefill_chunk=args.prompt_len)
        rng = np.random.default_rng(1)
        engine.warmup()
        warm = counter.n
        for n in (1, 3, 4, 2):
            _engine_run(engine, [rng.integers(3, cfg.vocab_size, int(rng.integers(8, args.prompt_len))).tolist()
                                 for _ in range(n)], args.new_tokens)
        result["compiles"] = {"warmup": warm, "steady_state": counter.n - warm}

    contexts = [int(c) for c in args.contexts.split(",")]
    result["decode_vs_context"] = context_sweep(model, contexts, steps=16)
    lo, hi = result["decode_vs_context"][str(contexts[0])], result["decode_vs_context"][str(contexts[-1])]
    result["decode_step_ratio_longest_vs_shortest"] = hi["decode_step_ms"] / lo["decode_step_ms"]
    print(json.dumps(result["decode_vs_context"]), flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
