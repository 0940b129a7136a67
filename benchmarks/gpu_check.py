"""One GPU run: compile every Pallas kernel (no interpret mode), check it against its
reference, and time kernel vs reference path. JSON out; meant to finish in < 8 minutes.

Families: sink_attention, grouped_matmul, index_scores (bf16 operands) and stored_matmul (the
kernels that read resident FP8 / MXFP4 bytes, against the XLA path that dequantizes them first).
Rows: `mosaic_gpu` are the Hopper kernels (what kernels="pallas" runs on a GPU); with
--with-generic also `generic`, the backend-neutral Pallas kernels compiled through Pallas'
default GPU backend (Triton, deprecated since jax 0.11; allowed to fail). On the H200 with jax
0.11.2 every generic row failed to lower (3-D dots, blocks over Triton's 2^20 elements) and
their compile attempts took most of a family's minute, so they are off by default.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check_smoke.json   # CPU dry run

On the lent H200: `bash benchmarks/gpu_run.sh` (installs the few packages its image lacks from
.whl/, then one process per kernel family and the engine check), or by hand from the repo root:
    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py --only index_scores --out $OUT/gpu_check_index.json

A kernel that fails to lower is recorded with its error rather than stopping the run.
"""

import argparse
import functools
import json
import platform
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from results_io import timed, write_result

from dsjax.layers.quantized import Fp4Weight, Fp8Weight
from dsjax.kernels import grouped_matmul, index_scores, sink_attention, stored_matmul

FAMILIES = ("sink_attention", "grouped_matmul", "index_scores", "stored_matmul")


def check(fn, args, want, t_ref, rel_tol, repeats=10):
    """Time and check one kernel; a failure to lower or run is recorded, not raised."""
    try:
        t_k, got = timed(fn, *args, repeats=repeats)
        err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        return {"reference_ms": 1e3 * t_ref, "kernel_ms": 1e3 * t_k, "speedup": t_ref / t_k, "max_abs_err": err,
                "ok": err <= rel_tol * float(jnp.abs(want.astype(jnp.float32)).max())}
    except Exception as e:  # noqa: BLE001 - record lowering failures per kernel
        return {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-2000:]}


def attention_cases(rng, smoke):
    """(name, args): prefill chunks, decode with many compressed entries (batch 32, and
    batch 1 at 1M tokens, where the keys are split over programs), CSA top-k."""
    d = 64 if smoke else 512
    cases = [("prefill_hca", 4, 256, 64, 2048, 0), ("decode_hca", 32, 1, 64, 4096, 0),
             ("decode_b1_hca_1m", 1, 1, 64, 8192 + 128, 0), ("decode_csa_topk", 32, 1, 64, 129, 512),
             ("prefill_csa_topk", 2, 128, 64, 256, 512)]
    for name, b, s, h, t, k in cases:
        if smoke:
            b, s, t, k = min(b, 2), min(s, 3), min(t, 300), min(k, 40)
        q = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.bfloat16)
        kv = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) + t, (b, s))
        lo = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        hi = lo + 10**6
        sinks = jnp.asarray(rng.normal(size=h), jnp.float32)
        kv_pq = mask = None
        if k:
            kv_pq = jnp.asarray(rng.normal(size=(b, s, k, d)), jnp.bfloat16)
            mask = jnp.asarray(rng.random((b, s, k)) < 0.9)
        yield name, (q, kv, lo, hi, pos, sinks, kv_pq, mask)


def _stored(rng, fmt, e, n, k, block):
    """Random stored weights (bytes, E8M0 exponents), drawn on the device (a host copy of 64
    V4-Flash experts in float64 would not fit)."""
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2 ** 31))))
    if fmt == "mxfp4":
        return (jax.random.randint(k1, (e, n, k // 2), -128, 128, jnp.int32).astype(jnp.int8),
                jax.random.randint(k2, (e, n, k // 32), 118, 124, jnp.int32).astype(jnp.uint8))
    return (jax.random.normal(k1, (e, n, k), jnp.bfloat16).astype(jnp.float8_e4m3fn),
            jax.random.randint(k2, (e, -(-n // block[0]), -(-k // block[1])), 116, 122, jnp.int32).astype(jnp.uint8))


def stored_cases(rng, smoke):
    """(name, args, kernel, reference) for the kernels that read stored FP8 / MXFP4 bytes, against
    the XLA path (dequantize every weight inside the program, then the bf16 product): V4-Flash's
    experts (64 of them, to keep the run short) at decode and prefill sizes, MXFP4 and FP8, and
    FP8 projections at batch 1 and 64 (V4-Flash's W_qb, V4.1-Flash's W_qa)."""
    def deq(fmt, block):
        return lambda w: (Fp4Weight(*w) if fmt == "mxfp4" else Fp8Weight(*w, block=block)).dense(jnp.bfloat16)

    experts = {"experts_mxfp4_decode": ("mxfp4", None, 96), "experts_mxfp4_prefill": ("mxfp4", None, 8192),
               "experts_fp8_decode": ("fp8", (128, 128), 96)}
    for name, (fmt, block, m) in experts.items():
        e, i, d = (4, 128, 128) if smoke else (64, 2048, 4096)
        m = min(m, 100) if smoke else m
        sizes = jnp.asarray(np.bincount(rng.integers(0, e, m), minlength=e), jnp.int32)
        x = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
        ws = [_stored(rng, fmt, e, n, k, block) for n, k in ((i, d), (i, d), (d, i))]
        kernel = functools.partial(stored_matmul.mgpu_stored_grouped_ffn, fmt=fmt, block=block, limit=10.0)
        reference = lambda x, sizes, *w, deq=deq(fmt, block): grouped_matmul.reference(  # noqa: E731
            x, sizes, *map(deq, w), limit=10.0)
        yield name, (x, sizes, *ws), kernel, reference
    linears = {"fp8_linear_v4_b1": (1, 32768, 1024, (128, 128)), "fp8_linear_v41_b64": (64, 1280, 5120, (32, 32))}
    for name, (m, n, k, block) in linears.items():
        n, k = (128, 256) if smoke else (n, k)
        q, s = (a[0] for a in _stored(rng, "fp8", 1, n, k, block))
        x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
        reference = lambda x, q, s, block=block: jnp.einsum(  # noqa: E731
            "mk,nk->mn", x, Fp8Weight(q, s, block).dense(jnp.bfloat16), preferred_element_type=jnp.float32)
        yield name, (x, q, s), functools.partial(stored_matmul.mgpu_fp8_linear, block=block), reference


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu_check.json")
    ap.add_argument("--smoke", action="store_true",
                    help="small shapes, kernels in interpret mode: checks this script on a CPU before a GPU run")
    ap.add_argument("--only", choices=FAMILIES, action="append",
                    help="run only these kernel families (repeatable): one process each keeps a hang in one "
                         "family from costing the others")
    ap.add_argument("--with-generic", action="store_true",
                    help="also the generic Pallas kernels through Pallas' Triton GPU backend (deprecated)")
    args = ap.parse_args()
    smoke, generic = args.smoke, args.with_generic
    families = args.only or FAMILIES
    rng = np.random.default_rng(0)
    result = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
              "platform": platform.platform(), "smoke": smoke, "kernels": {}}
    ip = {"interpret": True} if smoke else {}

    def run(family, name, kernels, args, reference, rel_tol):
        t_ref, want = timed(jax.jit(reference), *args, repeats=1 if smoke else 10)
        for kind, fn in kernels.items() if generic else [("mosaic_gpu", kernels["mosaic_gpu"])]:
            row = check(jax.jit(functools.partial(fn, **ip)), args, want, t_ref, rel_tol, repeats=1 if smoke else 10)
            result["kernels"][f"{family}/{kind}/{name}"] = row
            print(family, kind, name, json.dumps(row)[:300], flush=True)

    for name, a in attention_cases(rng, smoke) if "sink_attention" in families else ():
        run("sink_attention", name, {"mosaic_gpu": sink_attention.mgpu_sink_attention,
                                     "generic": functools.partial(sink_attention.pallas_sink_attention, block_q=16,
                                                                  block_k=128)},
            a, sink_attention.reference, 4 * 2.0 ** -8)
    moe = {"moe_prefill": (8192, 64, 2048, 4096), "moe_decode": (192, 64, 2048, 4096)}
    for name, (m, e, i, d) in moe.items() if "grouped_matmul" in families else ():
        if smoke:
            m, e, i, d = min(m, 100), 4, 128, 128
        sizes = jnp.asarray(np.bincount(rng.integers(0, e, m), minlength=e), jnp.int32)
        x = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
        w1, w3 = (jnp.asarray(rng.normal(size=(e, i, d)) * 0.02, jnp.bfloat16) for _ in range(2))
        w2 = jnp.asarray(rng.normal(size=(e, d, i)) * 0.02, jnp.bfloat16)
        run("grouped_matmul", name, {"mosaic_gpu": functools.partial(grouped_matmul.mgpu_grouped_ffn, limit=10.0),
                                     "generic": functools.partial(grouped_matmul.pallas_grouped_ffn, limit=10.0,
                                                                  rows=128)},
            (x, sizes, w1, w3, w2), functools.partial(grouped_matmul.reference, limit=10.0), 1e-2)
    index = {"index_decode_256k": (32, 1, 65536), "index_prefill": (2, 256, 8192)}
    for name, (b, s, t) in index.items() if "index_scores" in families else ():
        if smoke:
            b, s, t = 2, min(s, 3), 300
        a = (jnp.asarray(rng.normal(size=(b, s, 64, 128)), jnp.bfloat16),
             jnp.asarray(rng.normal(size=(b, t, 128)), jnp.bfloat16), jnp.asarray(rng.normal(size=(b, s, 64)), jnp.float32))
        scale = {"scale": 128 ** -0.5}
        run("index_scores", name, {"mosaic_gpu": functools.partial(index_scores.mgpu_index_scores, **scale),
                                   "generic": functools.partial(index_scores.pallas_index_scores, **scale)},
            a, functools.partial(index_scores.reference, **scale), 1e-4)
    for name, a, kernel, reference in stored_cases(rng, smoke) if "stored_matmul" in families else ():
        run("stored_matmul", name, {"mosaic_gpu": kernel}, a, reference, 1e-2)
    failed = [k for k, row in result["kernels"].items() if not row.get("ok")]
    result["failed"] = failed
    write_result(result, args.out)
    print("failed:", failed or "none")


if __name__ == "__main__":
    main()
