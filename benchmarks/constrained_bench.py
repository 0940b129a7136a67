"""What structured output costs the engine: decode tokens/s of a batch with 0, 1 and all rows
constrained, and where a constrained step's time goes (the host's read-back + grammar
advance + masks, which run while the device runs the forward, against the whole step).

    python benchmarks/constrained_bench.py --config tiny --out benchmarks/results/constrained_cpu_tiny.json

Greedy, prompts of random ids; the constraint is a JSON string of at least 4000 characters
(the grammar never lets the row stop, and inside a string nearly every token is allowed:
the library's largest masks), and the bench JSON schema of grammar_bench.py (structure:
small masks, forced tokens) cut at max_tokens. Per split step: `masks_ms` (the host
computing the batch's masks: pure host work) and `read_back_ms` (waiting for the previous
step's tokens and advancing the grammars), both while the device runs the forward.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from grammar_bench import SCHEMA
from results_io import write_result

import dsjax
from dsjax.engine.constraints import ConstraintCompiler
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.engine.scheduler import Scheduler

LONG_STRING = {"type": "string", "minLength": 4000}


def run(engine: Engine, prompts, new_tokens: int, constraints) -> tuple[float, int]:
    """-> (seconds, tokens made). Unconstrained rows ignore EOS; constrained ones end when
    their grammar does (the long string never lets them before max_tokens)."""
    reqs = [engine.requests[engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=c is None),
                                               constraint=c)] for p, c in zip(prompts, constraints)]
    t = time.perf_counter()
    for _ in engine.run():
        pass
    return time.perf_counter() - t, sum(len(r.tokens) for r in reqs)


def _ms(name: str, seconds: list[float]) -> dict:
    if not seconds:
        return {}
    return {f"{name}_ms_p50": float(np.median(seconds) * 1e3), f"{name}_ms_p99": float(np.percentile(seconds, 99) * 1e3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/constrained_cpu_tiny.json")
    args = ap.parse_args()
    model = dsjax.load_model(args.config, dtype="float32")
    compiler = ConstraintCompiler.for_model(model)
    engine = Engine(model, max_slots=args.batch, capacity=256, prefill_chunk=args.prompt_len)
    engine.warmup(constrained=True)
    rng = np.random.default_rng(0)
    V, B = model.config.vocab_size, args.batch

    # per split step, between dispatching the forward and dispatching its sampling: the wait
    # for the previous step's tokens + advancing the grammars (read), and the masks (pure host)
    read, masks_t = [], []
    before, make_masks = Engine._before_sample, Scheduler.masks

    def timed_masks(self, decode):
        t = time.perf_counter()
        out = make_masks(self, decode)
        masks_t.append(time.perf_counter() - t)
        return out

    def timed_before(self, output, decode):
        t = time.perf_counter()
        out = before(self, output, decode)
        read.append(time.perf_counter() - t - masks_t[-1])
        return out

    Engine._before_sample, Scheduler.masks = timed_before, timed_masks
    cases = {"unconstrained": lambda: [None] * B,
             "1_of_8_long_string" if B == 8 else "1_long_string":
                 lambda: [compiler.compile("json_schema", LONG_STRING)] + [None] * (B - 1),
             "all_long_string": lambda: [compiler.compile("json_schema", LONG_STRING) for _ in range(B)],
             "all_schema": lambda: [compiler.compile("json_schema", SCHEMA) for _ in range(B)]}
    result = {"config": args.config, "batch": B, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "cases": {}}
    runs = {name: {"tok_s": [], "step_ms": [], "read": [], "masks": []} for name in cases}
    for r in range(args.repeats + 1):  # cases alternate within a round: a shared machine's drift hits all
        for name, make in cases.items():
            prompts = [rng.integers(3, V, args.prompt_len).tolist() for _ in range(B)]
            prefill, _ = run(engine, prompts, 1, [None] * B)  # the same prompts' prefill, to subtract
            read.clear(), masks_t.clear()
            total, tokens = run(engine, prompts, args.new_tokens, make())
            if r:  # the first round warms the grammars' lazy lexer states and the jit caches
                got = runs[name]
                got["tok_s"].append((tokens - B) / max(total - prefill, 1e-9))
                got["step_ms"].append((total - prefill) / (args.new_tokens - 1) * 1e3)
                got["read"] += read
                got["masks"] += masks_t
    for name, got in runs.items():
        result["cases"][name] = {"decode_tokens_per_s": float(np.median(got["tok_s"])), "runs": got["tok_s"],
                                 "decode_ms_per_step": float(np.median(got["step_ms"])),
                                 "split_steps": len(got["masks"]), **_ms("masks", got["masks"]),
                                 **_ms("read_back", got["read"])}
        print(name, result["cases"][name], flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
