"""Does the Lightning Indexer matter at long context? One CSA layer's decode-time attention
core at V4-Flash's dimensions (64 heads x 512, indexer 64 heads x 128, top-512 of the
compressed entries, ratio 4, window 128, bf16), split into

  * indexer: scores of all compressed entries + top-k selection (`index_scores`,
    `select_topk_indices`),
  * attention: gathering the top-k entries + attention over window + top-k (reference),

for growing context. Projections, compressors and the MoE are left out (they do not grow
with context). Reference (jnp) path on this backend; JSON out.

    python benchmarks/indexer_bench.py --out benchmarks/results/indexer_cpu.json
"""

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
from results_io import timed, write_result

from dsjax.layers.indexer import select_topk_indices
from dsjax.kernels import index_scores, sink_attention

H, D, H_I, D_I, TOPK, WINDOW, RATIO = 64, 512, 64, 128, 512, 128, 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/indexer_cpu.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--contexts", default="16384,65536,262144")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    b, dt = args.batch, jnp.bfloat16
    rows = []
    for context in map(int, args.contexts.split(",")):
        n = context // RATIO
        q_i = jnp.asarray(rng.normal(size=(b, 1, H_I, D_I)), dt)
        keys_i = jnp.asarray(rng.normal(size=(b, n, D_I)), dt)
        w = jnp.asarray(rng.normal(size=(b, 1, H_I)), jnp.float32)
        entries = jnp.asarray(rng.normal(size=(b, n, D)), dt)
        q = jnp.asarray(rng.normal(size=(b, 1, H, D)), dt)
        ring = jnp.asarray(rng.normal(size=(b, WINDOW, D)), dt)
        pos = jnp.full((b, 1), context, jnp.int32)

        @jax.jit
        def indexer(q_i, keys_i, w):
            scores = index_scores.reference(q_i, keys_i, w, scale=D_I ** -0.5)
            return select_topk_indices(scores, jnp.ones(scores.shape, bool), TOPK)

        @jax.jit
        def attention(top, valid, entries, q, ring):
            kv_pq = jnp.take_along_axis(entries[:, None], top[..., None], axis=2)
            lo = jnp.broadcast_to(context - WINDOW + jnp.arange(WINDOW, dtype=jnp.int32), (b, WINDOW))
            return sink_attention.reference(q, ring, lo, lo + WINDOW - 1, pos, jnp.zeros(H), kv_pq, valid)

        top, valid = indexer(q_i, keys_i, w)
        t_index = 1e3 * timed(indexer, q_i, keys_i, w, repeats=5)[0]
        t_attention = 1e3 * timed(attention, top, valid, entries, q, ring, repeats=5)[0]
        row = {"context_tokens": context, "compressed_entries": n, "indexer_ms": t_index,
               "attention_ms": t_attention, "indexer_share": t_index / (t_index + t_attention),
               "indexer_gflop_per_query": 2 * H_I * D_I * n / 1e9,
               "attention_gflop_per_query": 4 * H * D * (TOPK + WINDOW) / 1e9}
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    write_result({"backend": jax.default_backend(), "jax": jax.__version__, "platform": platform.platform(),
                  "batch": b, "dims": {"heads": H, "head_dim": D, "index_heads": H_I, "index_dim": D_I,
                                       "topk": TOPK, "window": WINDOW, "ratio": RATIO}, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
