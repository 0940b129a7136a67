"""One GPU run: compile every Pallas kernel (no interpret mode), check it against its
reference, and time kernel vs reference path. JSON out; meant to finish in < 8 minutes.

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

from dsjax.pallas_kernels import grouped_matmul, index_scores, sink_attention

FAMILIES = ("sink_attention", "grouped_matmul", "index_scores")


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
    failed = [k for k, row in result["kernels"].items() if not row.get("ok")]
    result["failed"] = failed
    write_result(result, args.out)
    print("failed:", failed or "none")


if __name__ == "__main__":
    main()
