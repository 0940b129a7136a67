"""Engine throughput on CPU, side by side with HF transformers `generate` on the same
config and weights, in the same run: decode tokens/s with fp32 and with 16-bit weights
(`dsjax.store_weights`), each one and four decode steps a dispatch (`decode_steps`, the batch
jobs' default: 4), the ratio to HF, and the fraction of the measured memory roofline
(benchmarks/roofline.py: read bandwidth from threaded reductions, bytes a decode step must
read; fp32 engines of at most `cpu_kernels.screen_rows()` slots find greedy tokens from the
head's bf16 screen, so their step reads the head in bf16: `dsjax_no_screen` is the fp32
engine without it). With --extras: decode step time against context length, async-dispatch
overlap, batch-invariant mode cost, compile counts in steady state. Also a prefill row: one
`--prompt-len` prompt at batch 1, the engine's time to its first token (the prompt-chunk program
plus the first token's sampling) with fp32 and 16-bit weights, and HF's forward on the same
prompt (`model(ids, logits_to_keep=1)`: the last position's logits, as `generate`, the engine
and llama.cpp's prompt processing compute). The JSON names the CPU (model, AVX2 / FMA /
AVX-512 / AVX512-BF16 / AMX flags) and the load average beside each row. Writes JSON.

The model is `bench_checkpoint`'s (HF's init under seed 0, saved and loaded by dsjax):
benchmarks/llamacpp/run.sh converts the same checkpoint to GGUF and runs llama.cpp on it in
the same sitting (docs/cpu-decode.md, "Against llama.cpp").

    python benchmarks/engine_bench.py --config bench-78m --batches 1,8 --new-tokens 64 \
        --out benchmarks/results/engine_cpu_bench78m.json

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
import jax.numpy as jnp
import numpy as np

from decode_profile import bench_config  # noqa: E402
from machine import cpu_info, load_average  # noqa: E402
from results_io import write_result  # noqa: E402
from roofline import memory_bandwidth, screened_step_bytes  # noqa: E402

from dsjax.model.cache_layout import decode_step_bytes  # noqa: E402

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.kernels import cpu as cpu_kernels
from dsjax.model import model_specs
from dsjax.params import init_params


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


def dsjax_runner(model, batch, prompt_len, new_tokens, *, capacity, **engine_kw):
    """A compiled, warmed engine -> run(prompts) -> (seconds to the first token, seconds for all)."""
    engine = Engine(model, max_slots=batch, capacity=capacity, prefill_chunk=prompt_len, **engine_kw)
    warm = _prompts(np.random.default_rng(batch), batch, prompt_len, model.config.vocab_size)
    _engine_run(engine, warm, new_tokens)  # compile prefill + decode buckets
    _engine_run(engine, warm, 1)
    return lambda prompts: (_engine_run(engine, prompts, 1), _engine_run(engine, prompts, new_tokens))


def hf_runner(hf_model, batch, prompt_len, new_tokens):
    import torch

    def run(prompts, n):
        t = time.perf_counter()
        with torch.no_grad():
            hf_model.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=2)
        return time.perf_counter() - t

    run(_prompts(np.random.default_rng(batch), batch, prompt_len, hf_model.config.vocab_size), 2)
    return lambda prompts: (run(prompts, 1), run(prompts, new_tokens))


def bench_checkpoint(cfg, path):
    """The benchmark's model: HF's DeepseekV4ForCausalLM of `cfg` initialised under seed 0, saved
    (safetensors + config.json) to `path` -> the HF model. dsjax and llama.cpp (via GGUF) load it."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    hf_model = DeepseekV4ForCausalLM(DeepseekV4Config(**dsjax.config.to_hf_dict(cfg))).eval()
    hf_model.save_pretrained(path)
    return hf_model


def prefill_row(models: dict, hf_model, prompt_len, *, capacity, repeats) -> dict:
    """One prompt at batch 1: each dsjax model's engine time to the first token (its prompt-chunk
    program, one chunk of `prompt_len`, and the first token's sampling) and HF's forward on the
    same prompt (the last position's logits only), interleaved repeat by repeat -> {name:
    {prefill_s, prefill_tokens_per_s (at the median time), prefill_tokens_per_s_best}}."""
    runs = {}
    for name, m in models.items():
        engine = Engine(m, max_slots=1, capacity=capacity, prefill_chunk=prompt_len)
        _engine_run(engine, _prompts(np.random.default_rng(0), 1, prompt_len, m.config.vocab_size), 1)
        runs[name] = lambda p, engine=engine: _engine_run(engine, p, 1)
    if hf_model is not None:
        import torch

        def hf_forward(p):
            t = time.perf_counter()
            with torch.no_grad():
                hf_model(torch.tensor(p), logits_to_keep=1)  # the next token's logits, as generate's prefill
            return time.perf_counter() - t
        hf_forward(_prompts(np.random.default_rng(0), 1, prompt_len, hf_model.config.vocab_size))
        runs["hf_forward"] = hf_forward
    rng = np.random.default_rng(prompt_len)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        prompts = _prompts(rng, 1, prompt_len, hf_model.config.vocab_size if hf_model else 129280)
        for name, run in runs.items():
            times[name].append(run(prompts))
    out = {name: {"prefill_s": float(np.median(ts)), "prefill_tokens_per_s": prompt_len / float(np.median(ts)),
                  "prefill_tokens_per_s_best": prompt_len / min(ts)} for name, ts in times.items()}
    if hf_model is not None:
        for name in models:
            out[name]["vs_hf_forward"] = out[name]["prefill_tokens_per_s"] / out["hf_forward"]["prefill_tokens_per_s"]
    return out


def measure(runners: dict, batch, prompt_len, new_tokens, vocab, repeats) -> dict:
    """Each runner on the same prompts, interleaved repeat by repeat (this machine's speed drifts
    by tens of percent over minutes: interleaving keeps the ratios fair) -> medians per runner."""
    rng = np.random.default_rng(batch)
    times = {name: [] for name in runners}
    for _ in range(repeats):
        prompts = _prompts(rng, batch, prompt_len, vocab)
        for name, run in runners.items():
            times[name].append(run(prompts))
    out = {}
    for name, ts in times.items():
        t_prefill, t_total = (float(np.median([t[i] for t in ts])) for i in (0, 1))
        decode = [batch * (new_tokens - 1) / max(total - prefill, 1e-9) for prefill, total in ts]
        out[name] = {"prefill_tokens_per_s": batch * prompt_len / t_prefill,
                     "decode_tokens_per_s": float(np.median(decode)), "decode_tokens_per_s_all": decode,
                     "prefill_s": t_prefill, "generate_s": t_total}
    return out


def bench_dsjax(model, batch, prompt_len, new_tokens, *, capacity, repeats, **engine_kw):
    """measure()'s row for one engine, and the seconds its construction and warm-up took
    (`warmup_s_with_compiles`: mostly its programs' compiles where they are not cached)."""
    t = time.perf_counter()
    run = dsjax_runner(model, batch, prompt_len, new_tokens, capacity=capacity, **engine_kw)
    warmup = time.perf_counter() - t
    row = measure({"x": run}, batch, prompt_len, new_tokens, model.config.vocab_size, repeats)["x"]
    return {**row, "warmup_s_with_compiles": warmup}


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
    ap.add_argument("--config", default="bench-78m", help="bench-78m (the CPU-decode issue's model) or a named config")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--extras", action="store_true", help="also overlap, batch-invariant, compiles, "
                    "and the context sweep")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/engine_cpu.json")
    args = ap.parse_args()

    cfg = bench_config() if args.config == "bench-78m" else dsjax.load_config(args.config)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = memory_bandwidth()
    result = {"config": cfg.name, "dtype": "float32", "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "jax": jax.__version__, "device": str(jax.devices()[0]),
              "cpus": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_info(),
              "read_bandwidth_bytes_per_s": bandwidth, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = None
        if not args.no_hf:
            hf_model = bench_checkpoint(cfg, tmp)
            model = dsjax.load_model(tmp, dtype="float32")
            result["transformers"] = __import__("transformers").__version__
        else:
            model = dsjax.Model(cfg, init_params(model_specs(cfg, jnp.float32), 0), jnp.float32, None)
        capacity = 256
        while capacity < args.prompt_len + args.new_tokens:
            capacity *= 2
        stored = dsjax.store_weights(model)
        context = args.prompt_len + args.new_tokens // 2  # the mean context of the decode steps
        load = load_average()
        result["prefill"] = prefill_row({"dsjax": model, "dsjax_bf16_weights": stored}, hf_model, args.prompt_len,
                                        capacity=capacity, repeats=max(5, 2 * args.repeats))
        result["prefill"]["load"] = {"load_average_before": load, "load_average_after": load_average()}
        for name, r in result["prefill"].items():
            if "prefill_tokens_per_s" in r:
                print(f"prefill {args.prompt_len} {name:24s} {r['prefill_tokens_per_s']:8.1f} tok/s", flush=True)
        for b in batches:
            runners, weight_dtype = {}, {}
            for steps, suffix in ((1, ""), (4, "_decode_steps_4")):  # 4: the batch jobs' default
                for name, m, dtype in (("dsjax", model, jnp.float32), ("dsjax_bf16_weights", stored, jnp.bfloat16)):
                    runners[name + suffix] = dsjax_runner(m, b, args.prompt_len, args.new_tokens, capacity=capacity,
                                                          decode_steps=steps)
                    weight_dtype[name + suffix] = dtype
            # fp32 without the greedy screen: the head's fp32 product every step (what sampled rows read)
            runners["dsjax_no_screen"] = dsjax_runner(model, b, args.prompt_len, args.new_tokens, capacity=capacity,
                                                      greedy_screen=False)
            weight_dtype["dsjax_no_screen"] = jnp.float32
            if hf_model is not None:
                runners["hf"] = hf_runner(hf_model, b, args.prompt_len, args.new_tokens)
            before, load = memory_bandwidth()["best"], load_average()
            row = measure(runners, b, args.prompt_len, args.new_tokens, cfg.vocab_size, args.repeats)
            row["read_bandwidth_bytes_per_s"] = max(before, memory_bandwidth()["best"])  # the better of before / after
            row["load"] = {"load_average_before": load, "load_average_after": load_average()}
            for name, dtype in weight_dtype.items():
                need = decode_step_bytes(cfg, batch=b, context=context, dtype=dtype)
                row[name]["step_bytes"] = need["total"]
                if dtype == jnp.float32 and name != "dsjax_no_screen" and cpu_kernels.worth_screening(dtype, b):
                    # the greedy screen reads the head in bf16 (and its rows' norms), not in fp32: the
                    # fraction against the bytes it reads, and against an fp32 step's (over 1 if faster)
                    row[name]["fraction_of_fp32_step_roofline"] = (row[name]["decode_tokens_per_s"] * need["total"]
                                                                   / (b * row["read_bandwidth_bytes_per_s"]))
                    row[name]["step_bytes"] = screened_step_bytes(need, cfg)["total"]
                row[name]["roofline_tokens_per_s"] = b * row["read_bandwidth_bytes_per_s"] / row[name]["step_bytes"]
                row[name]["fraction_of_roofline"] = (row[name]["decode_tokens_per_s"]
                                                     / row[name]["roofline_tokens_per_s"])
                if hf_model is not None:
                    row[name]["decode_vs_hf"] = row[name]["decode_tokens_per_s"] / row["hf"]["decode_tokens_per_s"]
                    row[name]["prefill_vs_hf"] = row[name]["prefill_tokens_per_s"] / row["hf"]["prefill_tokens_per_s"]
            result["batches"][str(b)] = row
            for name in [k for k in row if k.startswith("dsjax")]:
                r = row[name]
                print(f"batch {b} {name:34s} {r['decode_tokens_per_s']:7.1f} tok/s  "
                      f"{r.get('decode_vs_hf', float('nan')):5.2f}x HF  "
                      f"{r.get('fraction_of_roofline', float('nan')):.0%} of the roofline", flush=True)
            if "hf" in row:
                print(f"batch {b} {'hf':34s} {row['hf']['decode_tokens_per_s']:7.1f} tok/s", flush=True)
        if not args.extras:
            write_result(result, args.out)
            return

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
