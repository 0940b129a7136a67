"""mHC's Sinkhorn (N x N, 20 iterations, every layer twice) in three forms, on this backend:
`rolled` (a fori_loop: one device loop iteration per step) and `unrolled` (the same ops
written out), dsjax's `hyper_connection.sinkhorn` with rolled=True / False, and
`elementwise` (rolled, the N x N entries as N^2 separate arrays, sums as adds). On the H200
the rolled loop made mHC ~4.5 of a 5.2 ms batch-1 decode step for 4 layers (gpu_engine.py
--profile): each device loop iteration cost ~26 us of loop overhead there. dsjax now writes it out
everywhere but XLA:CPU.

    python benchmarks/sinkhorn_forms.py --out /tmp/sinkhorn_cpu.json        # micro only
    python benchmarks/sinkhorn_forms.py --engine --out $OUT/sinkhorn_gpu.json   # + engine tok/s per form

Micro: 8 Sinkhorns in a scan (4 layers' worth) at decode (1, 16 rows) and prefill (4096
rows) sizes, time per call and max |diff| from `rolled`. --engine: gpu_engine.py's model
(V4-Flash widths, 4 layers; the tiny config on CPU), tok/s at batch 1 and 16 per form, and
each engine's warm-up time (mostly its programs' compiles: the forms differ there too).
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from results_io import median_seconds, write_result

from dsjax.layers import hyper_connection


def elementwise(logits, iters, eps):
    """An experiment, not in dsjax: no reductions, every op elementwise on [...] arrays."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    n = c.shape[-1]

    def cols(e):
        s = [sum(e[i][j] for i in range(n)) + eps for j in range(n)]
        return [[e[i][j] / s[j] for j in range(n)] for i in range(n)]

    def rows(e):
        s = [sum(e[i]) + eps for i in range(n)]
        return [[e[i][j] / s[i] for j in range(n)] for i in range(n)]

    e = cols([[c[..., i, j] for j in range(n)] for i in range(n)])
    e = jax.lax.fori_loop(0, iters - 1, lambda _, e: cols(rows(e)), e)
    return jnp.stack([jnp.stack(r, -1) for r in e], -2)


FORMS = {"rolled": functools.partial(hyper_connection.sinkhorn, rolled=True),
         "unrolled": functools.partial(hyper_connection.sinkhorn, rolled=False), "elementwise": elementwise}


def micro(repeats: int) -> dict:
    out = {}
    for rows in (1, 16, 4096):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(8, rows, 4, 4)), jnp.float32)
        want = None
        for name, form in FORMS.items():
            def layers(x, form=form):
                body = lambda carry, xi: (carry + form(xi + carry, 20, 1e-6), None)
                return jax.lax.scan(body, jnp.zeros_like(x[0]), x)[0]

            f = jax.jit(layers)
            t = time.perf_counter()
            got = jax.block_until_ready(f(x))
            compile_s = time.perf_counter() - t
            ms = 1e3 * median_seconds(f, x, repeats=repeats if rows < 4096 else max(3, repeats // 20))
            want = got if want is None else want
            out[f"{rows}_rows/{name}"] = {"ms": ms, "first_call_s": compile_s,
                                          "max_abs_diff_from_rolled": float(jnp.abs(got - want).max())}
            print(rows, name, out[f"{rows}_rows/{name}"], flush=True)
    return out


def engine(smoke: bool) -> dict:
    import dsjax
    from engine_bench import bench_dsjax
    from gpu_engine import gpu_config

    from dsjax.model import model_specs
    from dsjax.params import init_params

    cfg = gpu_config(smoke)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    model = dsjax.Model(cfg, init_params(model_specs(cfg, dtype), 0), dtype, None)
    prompt_len, new_tokens = (24, 4) if smoke else (256, 32)
    capacity = -(-(prompt_len + new_tokens) // 128) * 128
    out, original = {}, hyper_connection.sinkhorn
    try:
        for name, form in FORMS.items():
            hyper_connection.sinkhorn = form  # hc_mixes looks it up at trace time
            jax.clear_caches()  # the engine's programs re-traced with this form
            for b in (1, 2 if smoke else 16):
                row = bench_dsjax(model, b, prompt_len, new_tokens, capacity=capacity, repeats=3)
                out[f"{name}/batch_{b}"] = row
                print(name, b, row["decode_tokens_per_s"], flush=True)
    finally:
        hyper_connection.sinkhorn = original
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    smoke = jax.default_backend() == "cpu"
    result = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
              "platform": platform.platform(), "micro": micro(args.repeats)}
    if args.engine:
        result["engine"] = engine(smoke)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
