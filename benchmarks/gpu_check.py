"""One GPU run: compile every Pallas kernel (no interpret mode), check it against its
reference, and time kernel vs reference path. JSON out; meant to finish in < 8 minutes.

Rows: `mosaic_gpu` are the Hopper kernels (what kernels="pallas" runs on a GPU); `generic`
are the backend-neutral Pallas kernels compiled through Pallas' default GPU backend (Triton,
deprecated since jax 0.11 — recorded for comparison, allowed to fail).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json

A kernel that fails to lower is recorded with its error rather than stopping the run.
"""

import argparse
import json
import platform
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from results_io import timed, write_result

from dsjax.pallas_kernels import grouped_matmul, index_scores, sink_attention


def check(fn, args, want, t_ref, rel_tol):
    """Time and check one kernel; a failure to lower or run is recorded, not raised."""
    try:
        t_k, got = timed(fn, *args)
        err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        return {"reference_ms": 1e3 * t_ref, "kernel_ms": 1e3 * t_k, "speedup": t_ref / t_k, "max_abs_err": err,
                "ok": err <= rel_tol * float(jnp.abs(want.astype(jnp.float32)).max())}
    except Exception as e:  # noqa: BLE001 - record lowering failures per kernel
        return {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-2000:]}


def attention_cases(rng):
    # (name, b, s, h, t, k): prefill chunk, decode with a wrapped ring + compressed entries, CSA top-k
    for name, b, s, h, t, k in [("prefill_hca", 4, 256, 64, 2048, 0), ("decode_hca", 32, 1, 64, 4096, 0),
                                ("decode_csa_topk", 32, 1, 64, 129, 512), ("prefill_csa_topk", 2, 128, 64, 256, 512)]:
        d = 512
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
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    result = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
              "platform": platform.platform(), "kernels": {}}
    ref_attention = jax.jit(sink_attention.reference)
    kernels = {"mosaic_gpu": sink_attention.mgpu_sink_attention,
               "generic": lambda *x: sink_attention.pallas_sink_attention(*x, block_q=16, block_k=128)}
    for name, a in attention_cases(rng):
        t_ref, want = timed(ref_attention, *a)
        for kind, fn in kernels.items():
            row = check(fn, a, want, t_ref, 4 * 2.0 ** -8)
            result["kernels"][f"sink_attention/{kind}/{name}"] = row
            print(kind, name, json.dumps(row)[:300], flush=True)
    for name, (m, e, i, d) in {"moe_prefill": (8192, 64, 2048, 4096), "moe_decode": (192, 64, 2048, 4096)}.items():
        sizes = jnp.asarray(np.bincount(rng.integers(0, e, m), minlength=e), jnp.int32)
        x = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
        w1, w3 = (jnp.asarray(rng.normal(size=(e, i, d)) * 0.02, jnp.bfloat16) for _ in range(2))
        w2 = jnp.asarray(rng.normal(size=(e, d, i)) * 0.02, jnp.bfloat16)
        a = (x, sizes, w1, w3, w2)
        t_ref, want = timed(jax.jit(lambda *a: grouped_matmul.reference(*a, limit=10.0)), *a)
        for kind, fn in {"mosaic_gpu": lambda *a: grouped_matmul.mgpu_grouped_ffn(*a, limit=10.0),
                         "generic": lambda *a: grouped_matmul.pallas_grouped_ffn(*a, limit=10.0, rows=128)}.items():
            row = check(jax.jit(fn), a, want, t_ref, 1e-2)
            result["kernels"][f"grouped_matmul/{kind}/{name}"] = row
            print(kind, name, json.dumps(row)[:300], flush=True)
    for name, (b, s, t) in {"index_decode_256k": (32, 1, 65536), "index_prefill": (2, 256, 8192)}.items():
        a = (jnp.asarray(rng.normal(size=(b, s, 64, 128)), jnp.bfloat16),
             jnp.asarray(rng.normal(size=(b, t, 128)), jnp.bfloat16), jnp.asarray(rng.normal(size=(b, s, 64)), jnp.float32))
        t_ref, want = timed(jax.jit(lambda *a: index_scores.reference(*a, scale=128 ** -0.5)), *a)
        for kind, fn in {"mosaic_gpu": lambda *a: index_scores.mgpu_index_scores(*a, scale=128 ** -0.5),
                         "generic": lambda *a: index_scores.pallas_index_scores(*a, scale=128 ** -0.5)}.items():
            row = check(jax.jit(fn), a, want, t_ref, 1e-4)
            result["kernels"][f"index_scores/{kind}/{name}"] = row
            print(kind, name, json.dumps(row)[:300], flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
