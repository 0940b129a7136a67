"""The host's share of a decode step: the engine's wall time per step in steady decode
against the time of the device program it dispatches, run alone on the same state.

    python benchmarks/host_share.py --out benchmarks/results/host_share_cpu_tiny.json

`Engine.step` in steady decode (every slot decoding) admits nothing and prefills nothing:
it dispatches the decode program and reads back a step's tokens (with overlap, the
previous step's, while the device runs this one) and books them. host = engine step -
program alone, per step; its share = host / engine step. Measured at batch 1 and 8 on
tiny, A/B in one run: overlap on (the default: the host books step n while the device runs
step n + 1) and off (the host waits for each step before dispatching the next), and four
decode steps a dispatch (`decode_steps=4`: the device loops, the host books four tokens a
row per dispatch; times are per position). On a shared CPU the host's microseconds are a
difference of two noisy timings (the fastest of `--rounds` rounds each): read their sign and
size, not their last digit. Also checked: steady decode makes no host-to-device transfer
(a step runs under `jax.transfer_guard_host_to_device("disallow_explicit")`): the decode
program's inputs are the device-resident cache, slots and the "none cancelled" rows
(`Runner.decode` builds a new array only on the step after a cancel).

`decoding_engine` and `step_split` are what gpu_engine.py measures the GPU's host share
with; `synthetic=True` gives the rows a context without prefilling it (see there).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from results_io import write_result

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.programs import decode_step
from dsjax.engine.requests import context_bucket
from dsjax.engine.sampler import SamplingParams


def capacity_for(cfg, tokens: int) -> int:
    """A cache capacity >= tokens, a multiple of the largest compression ratio."""
    ratio = max(cfg.compress_rate_csa, cfg.compress_rate_hca, 1)
    return -(-tokens // ratio) * ratio


def decoding_engine(model, batch: int, context: int, *, steps: int = 64, synthetic: bool = False,
                    **engine_kw) -> Engine:
    """An engine with `batch` requests decoding after `context` tokens each, its decode
    program compiled and outputs flowing, with room for `steps` more tokens a row.

    synthetic=False: each row prefills `context` random prompt tokens. synthetic=True: each
    row prefills one token, then every row's cache length is set to `context` + 1 and the
    host's counts to match: the cache rows past the prompt hold what they were initialised
    to (zeros), so a decode step reads and computes what it would at that context (every
    weight, the compressed caches up to `context`, the sliding window), on values that are no
    real context. It costs one small prefill program instead of a context's worth of prefill
    compiles and compute (the GPU run's 256 rows x 4k tokens)."""
    cfg = model.config
    prompt_len = 1 if synthetic else context
    capacity = capacity_for(cfg, context + steps + 8)
    engine = Engine(model, max_slots=batch, capacity=capacity,
                    prefill_chunk=capacity_for(cfg, max(prompt_len, 1)) if not synthetic else 128, **engine_kw)
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        engine.add_request(rng.integers(3, cfg.vocab_size, prompt_len).tolist(),
                           SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(r.state != "decoding" for r in engine.requests.values()):
        engine.step()
    if synthetic:
        with model.mesh_context():
            engine.cache = engine.cache.replace(length=engine.cache.length + context)
        for r in engine.requests.values():
            r.dispatched += context
    for _ in range(2):  # the decode program compiled, outputs flowing
        engine.step()
    jax.block_until_ready(engine.cache)
    return engine


def step_split(engine: Engine, rounds: int, steps: int = 4) -> dict:
    """Steady decode: the engine's wall seconds per step, and the decode program's alone: the
    same program called `steps` times in a row on a copy of the same state, each call's
    outputs the next one's inputs (as the engine chains them: the host dispatches call n + 1
    while the device runs call n, so dispatch overhead is hidden as it is in the engine), no
    host work between. The two take turns round by round (a shared machine's speed drifts);
    the fastest round of each (a shared machine's bursts only ever slow a round down) ->
    {engine_step_s, program_s, host_s, host_share}, per decoded position. host_s is the
    engine's host work the device does not hide."""
    needed = max(r.dispatched for r in engine.requests.values() if r.state == "decoding") + engine.decode_steps
    bucket = engine.capacity if engine.batch_invariant else context_bucket(needed, engine.capacity)
    run = functools.partial(decode_step, cfg=engine.cfg, opts=engine.opts, ctx_bucket=bucket,
                            n_logprobs=engine.logprob_width, n_steps=engine.decode_steps)
    step_times, program_times = [], []
    for _ in range(rounds + 1):  # round 0 warms both
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        jax.block_until_ready(engine.cache)  # the step still in flight (overlap) is this round's
        step_times.append((time.perf_counter() - t) / steps)
        with engine.model.mesh_context():  # the engine's program, on copies (it donates its state)
            c, s = jax.block_until_ready((jax.tree.map(jnp.copy, engine.cache), jax.tree.map(jnp.copy, engine.slots)))
            t = time.perf_counter()
            for _ in range(steps):
                c, s, out = run(engine.step_params, c, s, engine.runner.none_cancelled)
            jax.block_until_ready((c, out))
            program_times.append((time.perf_counter() - t) / steps)
            del c, s, out
    engine_step = min(step_times[1:]) / engine.decode_steps
    program = min(program_times[1:]) / engine.decode_steps
    host = engine_step - program
    return {"engine_step_s": engine_step, "program_s": program, "host_s": host, "host_share": host / engine_step}


def steady_transfers(engine: Engine, steps: int = 3) -> str:
    """"none" if `steps` steady decode steps make no host-to-device transfer, else the guard's error."""
    try:
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            for _ in range(steps):
                engine.step()
        return "none"
    except Exception as e:  # noqa: BLE001 - the guard's error names the transfer
        return f"{type(e).__name__}: {e}"[:300]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=25, help="rounds of 4 engine steps and 4 program calls")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "host_share_cpu_tiny.json"))
    args = ap.parse_args()
    model = dsjax.load_model(args.config, mtp=False)
    runs = []
    for batch in args.batches:
        for overlap, decode_steps in ((True, 1), (False, 1), (True, 4)):
            engine = decoding_engine(model, batch, args.context, steps=(args.rounds + 1) * 4 * decode_steps + 16,
                                     overlap=overlap, decode_steps=decode_steps)
            row = step_split(engine, args.rounds)
            row = {"batch": batch, "overlap": overlap, "decode_steps": decode_steps,
                   "host_us_per_step": 1e6 * row["host_s"], "engine_step_us": 1e6 * row["engine_step_s"],
                   "program_us": 1e6 * row["program_s"], "host_share": row["host_share"],
                   "steady_host_to_device_transfers": steady_transfers(engine)}
            print(row, flush=True)
            runs.append(row)
    write_result({"config": model.config.name, "dtype": str(jnp.dtype(model.dtype)), "context": args.context,
                  "rounds": args.rounds, "jax": jax.__version__, "device": str(jax.devices()[0]),
                  "cpus": os.cpu_count(), "platform": platform.platform(), "runs": runs}, args.out)


if __name__ == "__main__":
    main()
