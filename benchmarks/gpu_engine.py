"""The engine half of the prepared GPU run (benchmarks/gpu_run.sh): a full-depth one-GPU
config (`v4-flash-1gpu`, `v41-flash-1gpu`) with seeded weights drawn on the device as
stored (quantized="resident": FP8 + E8M0, MXFP4 experts), decoded and prefilled with
kernels="reference" and "pallas", against the HBM bandwidth measured in the same run.

    PYTHONPATH=. python3 benchmarks/gpu_engine.py --config v4-flash-1gpu --out $OUT/gpu_run_v4-flash-1gpu.json
    python benchmarks/gpu_engine.py --smoke --out /tmp/gpu_run_smoke.json     # the same path, CPU, tiny

Records (JSON, rewritten after every row, so a run cut short still leaves what it measured):
  * hbm_copy_bandwidth: a jitted copy of a large array (x + 1 over uint32), bytes read +
    written / the best of several calls;
  * the config as run: routed experts cut further where the device's memory needs it (the
    largest of n, n/2, ... whose stored weights and a `--kv-batch` x context KV cache fit
    in FIT_SHARE of it: 128 on a 139 GiB H200, 64 on a 78 GiB H100), weight bytes, load seconds;
  * rows, per kernel choice: decode at each batch with a `--context`-token context (the rows'
    caches given that length without prefilling it: host_share.decoding_engine's synthetic
    context; every weight and the caches are read as at that context) and prefill of one
    `--prefill-tokens` prompt. A decode row: tok/s from the engine's wall time per step in
    steady decode, the decode program's own time (chained, host_share.step_split), the
    host's share (engine step - program), the bytes the step must read (roofline.
    decode_step_bytes over the stored specs: dense weights, the routed experts the batch's
    batch x top-k picks reach in expectation, the embedding rows, the KV cache whole) and
    MBU = those bytes / step time / the measured bandwidth; warmup_s: engine construction to
    steady decode (its prefill and decode compiles). A prefill row: tok/s of the second of
    two runs, the first's seconds (compile) as warmup_s.
Rows run in PLAN order (batch 1 and 64 first) while `--budget-s` lasts; a row that would
not fit the time left is recorded as skipped, a failing row with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from host_share import capacity_for, decoding_engine, step_split
from results_io import write_result
from dsjax.model.cache_layout import decode_step_bytes

import dsjax
from dsjax.config import to_hf_dict
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.memory import device_memory
from dsjax.model.cache_layout import cache_shapes
from dsjax.model.stored import weight_specs
from dsjax.params import spec_leaves

FIT_SHARE = 0.85  # of the device's memory for weights + KV: the rest for activations and XLA's scratch
PLAN = (("decode", 1), ("decode", 64), ("prefill", None), ("decode", 16), ("decode", 256))
SMOKE = {"config": "tiny", "context": 64, "prefill_tokens": 128, "rounds": 3,
         "bandwidth_bytes": 64 << 20, "kv_batch": 2}


def hbm_copy_bandwidth(nbytes: int, repeats: int = 10) -> dict:
    """Bytes read + written per second by a jitted elementwise copy (x + 1) of `nbytes`."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    copy = jax.jit(lambda a: a + 1)
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - t)
    moved = 2 * x.size * 4
    return {"bytes_per_s": moved / min(times), "median_bytes_per_s": moved / statistics.median(times),
            "array_bytes": x.size * 4, "repeats": repeats}


def stored_specs(cfg, dtype):
    """The spec tree a named config loads quantized="resident" with (as its release stores it)."""
    return weight_specs(cfg, dtype, "resident")[0]


def fitting_config(cfg, device_bytes: int, kv_batch: int, context: int, dtype):
    """The config with the most routed experts (n, n/2, ... >= top-k) whose stored weights and
    a kv_batch x context cache fit FIT_SHARE of device_bytes -> (cfg, weight bytes, cache bytes)."""
    experts = cfg.n_routed_experts
    while True:
        c = cfg.replace(n_routed_experts=experts)
        weights = sum(s.nbytes for _, s in spec_leaves(stored_specs(c, dtype)))
        cache = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
            cache_shapes(c, kv_batch, capacity_for(c, context + 128), dtype)))
        if weights + cache <= FIT_SHARE * device_bytes or experts // 2 < c.num_experts_per_tok:
            return c, weights, cache
        experts //= 2


def load(cfg, dtype) -> tuple:
    """load_model(quantized="resident") of a config (possibly cut here): via its HF JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{cfg.name}.json")
        with open(path, "w") as f:
            json.dump(to_hf_dict(cfg), f)
        t = time.perf_counter()
        model = dsjax.load_model(path, dtype=dtype, quantized="resident", mtp=False)
        jax.block_until_ready(model.params)
        return model, time.perf_counter() - t


def decode_row(model, batch: int, context: int, rounds: int, bandwidth: float) -> dict:
    t = time.perf_counter()
    ratio = model.config.max_compress_ratio  # the synthetic context keeps each row's place in its compression groups
    if context % ratio:
        raise ValueError(f"--context {context} must be a multiple of the largest compression ratio ({ratio})")
    engine = decoding_engine(model, batch, context, steps=(rounds + 1) * 4 + 16, synthetic=True)
    warmup = time.perf_counter() - t
    split = step_split(engine, rounds)
    cfg = model.config
    need = decode_step_bytes(cfg, batch=batch, context=context + 1, dtype=model.dtype,
                             specs=stored_specs(cfg, model.dtype))
    del engine
    return {"tokens_per_s": batch / split["engine_step_s"], "step_ms": 1e3 * split["engine_step_s"],
            "program_ms": 1e3 * split["program_s"], "host_ms": 1e3 * split["host_s"],
            "host_share": split["host_share"], "step_bytes": need["total"],
            "mbu": need["total"] / split["engine_step_s"] / bandwidth,
            "mbu_program": need["total"] / split["program_s"] / bandwidth, "warmup_s": warmup,
            "by_group": need["by_group"]}


def prefill_row(model, tokens: int) -> dict:
    cfg = model.config
    capacity = capacity_for(cfg, tokens + 16)
    engine = Engine(model, max_slots=1, capacity=capacity, prefill_chunk=capacity_for(cfg, tokens))
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, tokens).tolist()
    times = []
    for _ in range(2):  # the first compiles
        t = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        times.append(time.perf_counter() - t)
    return {"tokens_per_s": tokens / times[1], "prefill_s": times[1], "warmup_s": times[0]}


def acceptance(rows: list[dict]) -> dict:
    """Issue 48's GPU criteria, read off the rows run (None where a row is missing): MBU >= 0.5
    at batch 1 and 64, "pallas" at least as fast as "reference" in every row run with both,
    host share <= 0.1 at batch 1, every warm-up <= 120 s."""
    done = {(r["what"], r["batch"], r["kernels"]): r for r in rows if "tokens_per_s" in r}
    best = lambda what, b, key: max((r[key] for (w, bb, _), r in done.items() if (w, bb) == (what, b)),  # noqa: E731
                                    default=None)
    pairs = [(r, done.get((w, b, "reference"))) for (w, b, k), r in done.items() if k == "pallas"]
    pairs = [(p, q) for p, q in pairs if q is not None]
    warm = [r["warmup_s"] for r in done.values()]
    out = {"mbu_batch_1": best("decode", 1, "mbu"), "mbu_batch_64": best("decode", 64, "mbu"),
           "host_share_batch_1": min((r["host_share"] for (w, b, _), r in done.items() if (w, b) == ("decode", 1)),
                                     default=None),
           "pallas_over_reference_min": min((p["tokens_per_s"] / q["tokens_per_s"] for p, q in pairs), default=None),
           "warmup_s_max": max(warm, default=None)}
    limits = {"mbu_batch_1": (0.5, 1), "mbu_batch_64": (0.5, 1), "host_share_batch_1": (0.1, -1),
              "pallas_over_reference_min": (1.0, 1), "warmup_s_max": (120, -1)}
    out["met"] = {k: None if out[k] is None else (out[k] >= lim if sign > 0 else out[k] <= lim)
                  for k, (lim, sign) in limits.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="default v4-flash-1gpu; --smoke: tiny (or tiny-v41)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="the tiny config on CPU (the Pallas kernels interpreted)")
    ap.add_argument("--kernels", default="reference,pallas")
    ap.add_argument("--what", default="decode,prefill", help="the row kinds to run")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--batches", help="decode batches (default 1,16,64,256; --smoke: 1,2)")
    ap.add_argument("--kv-batch", type=int, default=64, help="sequences of --context tokens the KV budget holds")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of 4 engine steps + 4 program calls a decode row")
    ap.add_argument("--budget-s", type=float, default=330, help="seconds this process may run")
    args = ap.parse_args()
    start = time.perf_counter()
    if not args.smoke and jax.default_backend() == "cpu":
        raise SystemExit("gpu_engine.py: no accelerator here (JAX's backend is cpu): the full-depth configs are for a "
                         "GPU; use --smoke for the CPU dry run")
    bandwidth_bytes = 4 << 30
    if args.smoke:
        args.config, args.context, args.prefill_tokens = args.config or SMOKE["config"], SMOKE["context"], \
            SMOKE["prefill_tokens"]
        args.rounds, args.kv_batch, bandwidth_bytes = SMOKE["rounds"], SMOKE["kv_batch"], SMOKE["bandwidth_bytes"]
    args.config = args.config or "v4-flash-1gpu"
    batches = [int(b) for b in (args.batches or ("1,2" if args.smoke else "1,16,64,256")).split(",")]
    device = jax.devices()[0]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    result = {"config": args.config, "smoke": args.smoke, "backend": jax.default_backend(), "device": str(device),
              "device_kind": getattr(device, "device_kind", ""), "jax": jax.__version__,
              "platform": platform.platform(), "dtype": jnp.dtype(dtype).name, "context": args.context,
              "prefill_tokens": args.prefill_tokens, "kv_batch": args.kv_batch, "budget_s": args.budget_s,
              "decode_context": "synthetic: each row's cache given --context tokens without prefilling them",
              "rows": []}
    out = lambda: write_result(result, args.out)  # noqa: E731
    try:
        bw = hbm_copy_bandwidth(bandwidth_bytes)
        result["hbm_copy_bandwidth_bytes_per_s"] = bw["bytes_per_s"]
        result["hbm_copy_bandwidth"] = bw
        print(f"copy bandwidth {bw['bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
        have = device_memory(device)
        cfg, weights, cache = fitting_config(dsjax.load_config(args.config), have, args.kv_batch, args.context, dtype)
        result.update(n_routed_experts=cfg.n_routed_experts, device_memory_bytes=have, weight_bytes=weights,
                      kv_budget_bytes=cache)
        out()
        model, result["load_s"] = load(cfg.replace(name=f"{args.config}-{cfg.n_routed_experts}e"), dtype)
        print(f"{cfg.n_routed_experts} experts, {weights / 2**30:.1f} GiB stored, loaded in {result['load_s']:.1f} s",
              flush=True)
    except Exception as e:  # noqa: BLE001 - the JSON says what failed
        result["error"] = f"{type(e).__name__}: {e}"[:3000]
        result["trace"] = traceback.format_exc()[-3000:]
        out()
        raise SystemExit(1)
    out()
    kernels = args.kernels.split(",")
    spent: dict[tuple, float] = {}  # (what, batch) -> seconds the last kernel choice took: the next one's estimate
    plan = [p for p in PLAN if p[0] == "prefill" or p[1] in batches] + \
        [("decode", b) for b in batches if ("decode", b) not in PLAN]
    for what, batch in [p for p in plan if p[0] in args.what.split(",")]:
        for k in kernels:
            row = {"row": f"{what} {'' if batch is None else f'b={batch} '}{k}", "kernels": k, "what": what,
                   "batch": batch or 1, "context": args.context if what == "decode" else args.prefill_tokens}
            left = args.budget_s - (time.perf_counter() - start)
            if spent.get((what, batch), 0) * 1.2 > left or left < 10:
                row["skipped"] = f"time: {left:.0f} s of --budget-s left"
                result["rows"].append(row)
                out()
                continue
            t = time.perf_counter()
            m = model.replace(options=model.options.replace(kernels=k))
            try:
                bw = result["hbm_copy_bandwidth_bytes_per_s"]
                row.update(decode_row(m, batch, args.context, args.rounds, bw) if what == "decode"
                           else prefill_row(m, args.prefill_tokens))
                if "by_group" in row:  # the same for every kernel choice: once per batch, beside the rows
                    result.setdefault("step_bytes_by_group", {})[f"batch {batch}"] = row.pop("by_group")
            except Exception as e:  # noqa: BLE001 - record a row's failure, keep the others
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(traceback.format_exc()[-2000:], flush=True)
            spent[(what, batch)] = time.perf_counter() - t
            row["row_s"] = spent[(what, batch)]
            print({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()
                   if not isinstance(v, dict)}, flush=True)
            result["rows"].append(row)
            result["acceptance"] = acceptance(result["rows"])
            out()
    result["acceptance"] = acceptance(result["rows"])
    result["total_s"] = time.perf_counter() - start
    out()


if __name__ == "__main__":
    main()
