"""A one-slot CPU engine with its scanned layer runs as stored (stacked [repeats, ...],
sliced in the layer scan: what it runs with) and layer by layer (`LayerByLayer`, see
`dsjax.model.v4.decoder.one_row_params`), both with the transposed head. Two engines of the
same model in one process step in turn, `--steps` steps a round (this machine's memory
bandwidth drifts); their sampled tokens must agree. Also the decode program's compile time
each way.

    python benchmarks/layer_layout.py [--config bench-78m] [--rounds 12] [--steps 16]
        [--out benchmarks/results/layer_layout_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import bench_config  # noqa: E402
from results_io import write_result  # noqa: E402

import dsjax  # noqa: E402
from dsjax.engine.engine import Engine  # noqa: E402
from dsjax.engine.programs import decode_step  # noqa: E402
from dsjax.engine.sampler import SamplingParams  # noqa: E402
from dsjax.model import model_specs  # noqa: E402
from dsjax.model.block import LayerByLayer  # noqa: E402
from dsjax.model.v4.decoder import one_row_params  # noqa: E402
from dsjax.params import init_params  # noqa: E402

PROMPT = 40


def engine(model, layout: str, new_tokens: int) -> Engine:
    e = Engine(model, max_slots=1, capacity=256, prefill_chunk=64)
    if layout == "layer_by_layer":
        e.step_params = one_row_params(model.params, model.config, model.dtype)  # the head transposed too
    assert isinstance(e.step_params.blocks[-1], LayerByLayer) == (layout == "layer_by_layer")
    prompt = np.random.default_rng(1).integers(3, model.config.vocab_size, PROMPT).tolist()
    e.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    for _ in range(4):  # prefill, the first decode steps: both programs compiled
        e.step()
    return e


def compile_seconds(e: Engine) -> float:
    jax.clear_caches()
    t = time.perf_counter()
    decode_step.lower(e.step_params, e.cache, e.slots, jnp.zeros(e.rows, bool), cfg=e.cfg, opts=e.opts,
                      ctx_bucket=256, n_logprobs=0).compile()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="bench-78m", help="bench-78m (the CPU-speed issue's model) or a named config")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "layer_layout_cpu.json"))
    args = ap.parse_args()
    cfg = bench_config() if args.config == "bench-78m" else dsjax.load_config(args.config)
    if not any(run.repeats > 1 for run in cfg.layer_runs):
        sys.exit(f"{cfg.name} has no scanned layer run: both layouts are the same")
    model = dsjax.Model(cfg, init_params(model_specs(cfg, jnp.float32), 0), jnp.float32, None)
    new_tokens = 4 + args.rounds * args.steps  # every timed step decodes (one context bucket: < 256)
    if PROMPT + new_tokens >= 256:
        sys.exit("--rounds x --steps too large for the 256-token context of this probe")
    engines = {layout: engine(model, layout, new_tokens) for layout in ("stacked", "layer_by_layer")}
    times = {layout: [] for layout in engines}
    for _ in range(args.rounds):
        for layout, e in engines.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                e.step()
            jax.block_until_ready(e.cache)
            times[layout].append((time.perf_counter() - t) / args.steps)
    tokens = {layout: [r.tokens for r in e.requests.values()] for layout, e in engines.items()}
    if tokens["stacked"] != tokens["layer_by_layer"]:
        sys.exit("the two layouts sampled different tokens")
    result = {"config": cfg.name, "jax": jax.__version__, "platform": platform.platform(), "rounds": args.rounds,
              "steps_per_round": args.steps, "layouts": {}}
    for layout, e in engines.items():
        step = float(np.median(times[layout]))
        result["layouts"][layout] = {"step_s_median": step, "step_s_min": float(np.min(times[layout])),
                                     "tokens_per_s": 1 / step, "step_s_rounds": times[layout],
                                     "decode_compile_s": compile_seconds(e)}
        print(f"{layout:15s} median step {step * 1e3:6.2f} ms ({1 / step:6.1f} tok/s), min "
              f"{np.min(times[layout]) * 1e3:6.2f} ms, decode program compile "
              f"{result['layouts'][layout]['decode_compile_s']:.1f} s")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
