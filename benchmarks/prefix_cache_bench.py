"""What the prefix cache saves: time to first token and prompt tokens prefilled, with the
cache and without it (the same engine whose budget holds no block: the same chunk grid, no
hits), in two workloads at several prompt lengths:
- shared system prompt: a batch of requests behind one system prompt of L tokens (+ a short
  question each), all submitted at once;
- multi-turn chat: each turn's prompt is the previous prompt + the reply + a new user message,
  starting from a system prompt of L tokens; also with only prompts' blocks kept (no blocks
  of generated tokens), to show what caching the replies adds.
Every run with the cache is checked to give the tokens the run without it gives (greedy).
Writes JSON (and a PNG when matplotlib is installed).

    python benchmarks/prefix_cache_bench.py --config small --out benchmarks/results/prefix_cache_cpu_small.json \
        --plot benchmarks/results/prefix_cache_cpu_small.png
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np
from results_io import write_result

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.prefix_cache import PrefixCacheOptions
from dsjax.engine.sampler import SamplingParams


def _engine(model, args, cached: bool, replies: bool = True) -> Engine:
    engine = Engine(model, max_slots=args.slots, capacity=args.capacity, prefill_chunk=args.block,
                    prefix_cache=PrefixCacheOptions(device_bytes=(1 << 30) if cached else 0))
    engine.prefix.keeps_generated &= replies  # replies=False: only prompts' blocks are kept
    engine.warmup()
    return engine


def _run(engine, prompts, params):
    """Submit every prompt at once; -> (TTFT per request in s, tokens per request, prompt tokens prefilled)."""
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first = {}
    for event in engine.run():
        first.setdefault(event.request_id, time.perf_counter() - t0)
    reqs = [engine.requests[i] for i in ids]
    return [first[i] for i in ids], [r.tokens for r in reqs], sum(len(r.prompt) - r.cached_tokens for r in reqs)


def shared_prompt(model, args, rng, length: int) -> dict:
    system = rng.integers(10, model.config.vocab_size, length).tolist()
    prompts = [system + rng.integers(10, model.config.vocab_size, args.question).tolist() for _ in range(args.slots)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    out = {"system_tokens": length, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts))}
    tokens = {}
    for name, cached in (("without", False), ("with", True)):
        engine = _engine(model, args, cached)
        ttft, tokens[name], prefilled = _run(engine, prompts, params)
        out[name] = {"ttft_mean_s": float(np.mean(ttft)), "ttft_max_s": float(np.max(ttft)),
                     "prefill_tokens": prefilled, "prefix_metrics": engine.prefix_metrics()}
    out["same_tokens"] = tokens["with"] == tokens["without"]
    out["ttft_speedup"] = out["without"]["ttft_mean_s"] / out["with"]["ttft_mean_s"]
    return out


def chat(model, args, rng, length: int) -> dict:
    params = SamplingParams(max_tokens=args.reply_tokens, ignore_eos=True)
    out = {"system_tokens": length, "turns": args.turns, "reply_tokens": args.reply_tokens}
    tokens, seed = {}, int(rng.integers(1 << 30))
    for name, cached, replies in (("without", False, False), ("with_prompt_blocks_only", True, False),
                                  ("with", True, True)):
        turn_rng = np.random.default_rng(seed)  # the same user messages in every run
        engine = _engine(model, args, cached, replies)
        prompt = turn_rng.integers(10, model.config.vocab_size, length).tolist()
        turns, tokens[name] = [], []
        for _ in range(args.turns):
            prompt = prompt + turn_rng.integers(10, model.config.vocab_size, args.question).tolist()
            (ttft,), (reply,), prefilled = _run(engine, [prompt], params)
            turns.append({"prompt_tokens": len(prompt), "ttft_s": ttft, "prefill_tokens": prefilled})
            tokens[name].append(reply)
            prompt = prompt + reply
        out[name] = {"turns": turns, "ttft_total_s": sum(t["ttft_s"] for t in turns),
                     "prefill_tokens": sum(t["prefill_tokens"] for t in turns),
                     "prefix_metrics": engine.prefix_metrics()}
    out["same_tokens"] = tokens["with"] == tokens["without"] == tokens["with_prompt_blocks_only"]
    out["ttft_speedup"] = out["without"]["ttft_total_s"] / out["with"]["ttft_total_s"]
    return out


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed, so no plot (pip install -e ".[bench]"); the JSON is written')
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    shared = result["shared_prompt"]
    x = [r["system_tokens"] for r in shared]
    for name, style in (("without", "o--"), ("with", "o-")):
        ax[0].plot(x, [r[name]["ttft_mean_s"] for r in shared], style, label=f"{name} cache")
        ax[1].plot(x, [r[name]["prefill_tokens"] for r in shared], style, label=f"{name} cache")
    ax[0].set(title=f"shared system prompt, {shared[0]['requests']} requests: mean TTFT", xlabel="system prompt "
              "tokens", ylabel="s")
    ax[1].set(title="prompt tokens prefilled", xlabel="system prompt tokens", ylabel="tokens")
    for r in result["chat"]:
        for name, style in (("without", "--"), ("with_prompt_blocks_only", ":"), ("with", "-")):
            ax[2].plot(range(1, r["turns"] + 1), [t["ttft_s"] for t in r[name]["turns"]], style, marker="o",
                       label=f"system {r['system_tokens']}, {name.replace('_', ' ')} cache")
    ax[2].set(title="multi-turn chat: TTFT per turn", xlabel="turn", ylabel="s")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"prefix cache, {result['config']} ({result['device']}, block {result['block']} tokens)")
    fig.tight_layout()
    fig.savefig(path)
    print("wrote", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="256,512,1024,2048", help="system prompt lengths")
    p.add_argument("--slots", type=int, default=8, help="engine slots = requests of the shared-prompt batch")
    p.add_argument("--block", type=int, default=128, help="prefill chunk = prefix-cache block")
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--question", type=int, default=32, help="tokens of each request's own question / user turn")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens each shared-prompt request generates")
    p.add_argument("--reply-tokens", type=int, default=100, help="tokens of each chat reply")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/prefix_cache_cpu_small.json")
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    model = dsjax.load_model(args.config, dtype=args.dtype, seed=0)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {"config": args.config, "dtype": args.dtype, "device": jax.devices()[0].device_kind,
              "cpus": os.cpu_count(),
              "platform": platform.platform(), "jax": jax.__version__, "block": args.block, "slots": args.slots,
              "question_tokens": args.question, "new_tokens": args.new_tokens,
              "shared_prompt": [shared_prompt(model, args, rng, n) for n in lengths],
              "chat": [chat(model, args, rng, n) for n in lengths[:: max(len(lengths) // 2, 1)]]}
    for r in result["shared_prompt"]:
        print(f"shared {r['system_tokens']:5d}: TTFT {r['without']['ttft_mean_s']:.3f} -> {r['with']['ttft_mean_s']:.3f}"
              f" s ({r['ttft_speedup']:.2f}x), prefill {r['without']['prefill_tokens']} -> "
              f"{r['with']['prefill_tokens']} tokens, same tokens {r['same_tokens']}")
    for r in result["chat"]:
        print(f"chat {r['system_tokens']:5d}: TTFT over {r['turns']} turns {r['without']['ttft_total_s']:.3f} -> "
              f"{r['with_prompt_blocks_only']['ttft_total_s']:.3f} (prompt blocks) -> {r['with']['ttft_total_s']:.3f} "
              f"s ({r['ttft_speedup']:.2f}x), prefill {r['without']['prefill_tokens']} -> "
              f"{r['with_prompt_blocks_only']['prefill_tokens']} -> {r['with']['prefill_tokens']} tokens, "
              f"same tokens {r['same_tokens']}")
    write_result(result, args.out)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
