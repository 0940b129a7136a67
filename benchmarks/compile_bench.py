"""Compile time of the engine's programs, lowered from abstract weights (nothing is
allocated, so V4-Flash fits on a laptop): one plain decode step (batch 8, capacity 4096,
greedy) and one prefill chunk (one row, 256 tokens) per config; trace+lower and XLA
compile seconds. Also the number of programs `Engine.warmup()` compiles for the README's
engine (tiny, 8 slots, capacity 4096). Writes JSON.

    python benchmarks/compile_bench.py --configs tiny,small,v4-flash --out benchmarks/results/compile_cpu.json

Runs against the code it is imported with (before / after comparisons: run it from each
checkout; it adapts to the older engine layout).
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp

from results_io import write_result  # noqa: E402

import dsjax
from dsjax.params import abstract_params

try:  # the engine split into programs / slots (Dec 2026)
    from dsjax.engine import programs
    from dsjax.engine.slots import init_slots
    from dsjax.model import cache_shapes, model_specs

    try:  # prefill chunks admit their request, decode steps take the cancelled rows (2027)
        from dsjax.engine.requests import admission
    except ImportError:
        admission = None

    def _programs(cfg, opts):
        def decode(**kw):
            if admission is not None:
                kw["cancelled"] = jax.ShapeDtypeStruct(kw["slots"].active.shape, bool)
            return programs.decode_step.trace(**kw, opts=opts)

        def prefill(**kw):
            if admission is not None:
                kw["admission"] = _abstract(admission([None]))
            return programs.prefill_step.trace(**kw, opts=opts)

        return decode, prefill
except ImportError:  # the single-file engine before it
    from dsjax.engine import engine as programs
    from dsjax.engine.cache import cache_shapes
    from dsjax.engine.engine import _init_slots as init_slots
    from dsjax.model import model_specs

    def _programs(cfg, opts):
        def prefill(is_last, **kw):  # is_last was a scalar there
            return programs.prefill_step.trace(**kw, is_last=jax.ShapeDtypeStruct((), bool))

        return (lambda **kw: programs.decode_step.trace(**kw, batch_invariant=False)), prefill


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _timed(traced_fn):
    t = time.perf_counter()
    lowered = traced_fn().lower()
    t1 = time.perf_counter()
    lowered.compile()
    return {"trace_lower_s": t1 - t, "compile_s": time.perf_counter() - t1}


def program_times(name: str, batch: int = 8, capacity: int = 4096, chunk: int = 256) -> dict:
    cfg = dsjax.load_config(name)
    params = abstract_params(model_specs(cfg, jnp.bfloat16))
    cache = cache_shapes(cfg, batch, capacity, jnp.bfloat16)
    slots = jax.eval_shape(lambda: init_slots(batch, capacity))
    decode, prefill = _programs(cfg, dsjax.RuntimeOptions() if hasattr(dsjax, "RuntimeOptions") else None)
    i32 = jnp.int32
    row = {"layers": cfg.num_hidden_layers,
           "decode_step": _timed(lambda: decode(params=params, cache=cache, slots=slots, cfg=cfg, ctx_bucket=capacity,
                                                n_logprobs=0, n_steps=1))}
    tok = jax.ShapeDtypeStruct((1, chunk), i32)
    one = jax.ShapeDtypeStruct((1,), i32)
    row["prefill_chunk"] = _timed(lambda: prefill(params=params, cache=cache, slots=slots, slot=jax.ShapeDtypeStruct(
        (), i32), tokens=tok, n_valid=one, is_last=jax.ShapeDtypeStruct((1,), bool), cfg=cfg, ctx_bucket=capacity,
        n_logprobs=0))
    return row


def warmup_programs(name: str = "tiny") -> dict:
    """What the README's engine compiles before its first token."""
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiled.append(duration)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    model = dsjax.load_model(name, dtype="float32")
    t = time.perf_counter()
    engine = dsjax.Engine(model, max_slots=8, capacity=4096)
    shapes = engine.warmup()
    return {"config": name, "warmup_shapes": shapes, "programs_compiled": len(compiled),
            "compile_s_total": sum(compiled), "wall_s": time.perf_counter() - t}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,small,v4-flash")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/compile_cpu.json")
    args = ap.parse_args()
    result = {"jax": jax.__version__, "device": str(jax.devices()[0]), "platform": platform.platform(),
              "batch": 8, "capacity": 4096, "prefill_chunk": 256, "programs": {}}
    for name in args.configs.split(","):
        result["programs"][name] = program_times(name)
        print(name, result["programs"][name], flush=True)
    if not args.no_warmup:
        result["warmup"] = warmup_programs()
        print(result["warmup"], flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
