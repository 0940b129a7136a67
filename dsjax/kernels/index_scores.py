"""The Lightning Indexer's scores: the Pallas kernels, the reference, the dispatch.

    score[b, s, t] = sum_h w[b, s, h] * ReLU(q[b, s, h] . k[b, t]) * scale

(scale = d_I^-1/2; the 1/sqrt(H_I) is already in w). At long context this is the CSA
layers' dominant cost: every query scores every compressed entry (V4-Flash at 256k tokens:
64 heads x 65536 entries x 128 dims per query and layer), while attention itself reads only
the top-512 (benchmarks/indexer_bench.py measures the split). The reference materialises
the [B, S, H, T] dot products; the kernels keep them in registers and write only [B, S, T].
Selection (top-k of the visible scores) stays `select_topk_indices` on the kernels' output.

* `pallas_index_scores`: generic Pallas (grid: batch x query block x key block).
* `mgpu_index_scores`: Hopper / Mosaic GPU. A program takes one query and 64 keys: one
  wgmma gives the transposed dot products [64 keys, 64 heads] = K Q^T (fp32 accumulator),
  ReLU and the per-head weights apply along the columns and the head sum is a row
  reduction, so the [64] scores never leave registers before the store. Q (64 heads x d_I)
  and the key tile are copied in by TMA; bf16 operands, fp32 accumulation.

`index_scores(..., impl=...)` is the one entry point the model calls (dispatch.py's rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.dispatch import kernel_choice, on_batch_shards
from dsjax.kernels.mgpu import (interpret_params, layout, matmul_nt, operand_transforms, pad_axis, round_up,
                                       store_tile)
from dsjax.kernels.tpu_candidate_scores import tpu_candidate_scores
from dsjax.kernels.tpu_index_scores import tpu_index_scores

KEYS = 64  # keys per Mosaic GPU program: the wgmma M


def reference(q, keys, weights, *, scale: float):
    """q [B, S, H, d], keys [B, T, d], weights [B, S, H] -> [B, S, T] fp32."""
    dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32))
    return jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots) * scale, weights.astype(jnp.float32))


def _kernel(q_ref, k_ref, w_ref, o_ref, *, scale: float):
    q = q_ref[0].astype(jnp.float32)  # [bq, H, d]
    k = k_ref[0].astype(jnp.float32)  # [bt, d]
    dots = jax.nn.relu(jnp.einsum("qhd,td->qht", q, k)) * scale
    o_ref[0] = jnp.einsum("qht,qh->qt", dots, w_ref[0].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_t", "interpret"))
def pallas_index_scores(q, keys, weights, *, scale: float, block_q: int = 8, block_t: int = 128,
                        interpret: bool = False):
    """Same contract as `reference`; S and T are padded to the blocks here."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    bq, bt = min(block_q, s), min(block_t, round_up(t, 8))
    sp, tp = round_up(s, bq), round_up(t, bt)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale), grid=(b, sp // bq, tp // bt),
        in_specs=[pl.BlockSpec((1, bq, h, d), lambda i, j, k: (i, j, 0, 0)),
                  pl.BlockSpec((1, bt, d), lambda i, j, k: (i, k, 0)),
                  pl.BlockSpec((1, bq, h), lambda i, j, k: (i, j, 0))],
        out_specs=pl.BlockSpec((1, bq, bt), lambda i, j, k: (i, j, k)),
        out_shape=jax.ShapeDtypeStruct((b, sp, tp), jnp.float32), interpret=interpret,
    )(pad_axis(q, 1, sp), pad_axis(keys, 1, tp), pad_axis(weights, 1, sp))
    return out[:, :s, :t]


def _mgpu_kernel(q_gmem, k_gmem, w_gmem, o_gmem, q_smem, k_smem, w_smem, bars, *, n_query: int, scale: float,
                 interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bs, j = jax.lax.axis_index("bs"), jax.lax.axis_index("keys")
    heads = q_smem.shape[0]
    plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(bs * heads, heads)], q_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(k_gmem.at[bs // n_query, pl.ds(j * KEYS, KEYS)], k_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(w_gmem.at[bs], w_smem, bars.at[2])
    for i in range(3):
        plgpu.barrier_wait(bars.at[i])
    scores = jnp.zeros((KEYS,), jnp.float32)
    for c in range(heads // 64):  # 64 heads per wgmma (V4: exactly one block)
        dots = matmul_nt([(k_smem, q_smem.at[pl.ds(c * 64, 64)])], interpret)  # [64 keys, 64 heads]
        w = layout(w_smem[pl.ds(c * 64, 64)], "cols", interpret)
        relu = jnp.maximum(dots, 0.0) * jax.lax.broadcast_in_dim(w * scale, dots.shape, [1])
        scores = scores + relu.sum(axis=1)
    store_tile(scores, o_gmem.at[bs, pl.ds(j * KEYS, KEYS)])


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def mgpu_index_scores(q, keys, weights, *, scale: float, interpret: bool = False):
    """Same contract as `reference`, on Mosaic GPU. Heads are padded to 64 (zero weights),
    d_I to 64, T to 64 keys (scores of padding keys are cut off)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, s, h, d = q.shape
    t = keys.shape[1]
    dt = jnp.bfloat16
    hp, dp, tp = round_up(h, 64), round_up(d, 64), round_up(t, KEYS)
    qf = pad_axis(pad_axis(q.astype(dt), 2, hp), 3, dp).reshape(b * s * hp, dp)
    kp = pad_axis(pad_axis(keys.astype(dt), 1, tp), 2, dp)
    wp = pad_axis(weights.astype(jnp.float32), 2, hp).reshape(b * s, hp)
    tf = operand_transforms(dt, dp)
    out = plgpu.kernel(
        functools.partial(_mgpu_kernel, n_query=s, scale=scale, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((b * s, tp), jnp.float32), grid=(b * s, tp // KEYS), grid_names=("bs", "keys"),
        scratch_types=[plgpu.SMEM((hp, dp), dt, transforms=tf), plgpu.SMEM((KEYS, dp), dt, transforms=tf),
                       plgpu.SMEM((hp,), jnp.float32), plgpu.Barrier(num_barriers=3)],
        interpret=interpret_params(interpret),
    )(qf, kp, wp)
    return out.reshape(b, s, tp)[:, :, :t]


def index_scores(q, keys, weights, *, scale: float, impl: str = "reference"):
    """THE dispatch (dispatch.py's rule): "reference"; "pallas" (Mosaic GPU on Hopper+,
    Mosaic TPU on a TPU, else generic Pallas, interpreted on CPU); "mosaic_gpu" /
    "mosaic_tpu" (interpreted off their hardware; the TPU one is tpu_index_scores.py)."""
    kind, interpret = kernel_choice(impl)
    if kind == "reference":
        return reference(q, keys, weights, scale=scale)
    fn = {"mosaic_gpu": mgpu_index_scores, "mosaic_tpu": tpu_index_scores}.get(kind, pallas_index_scores)
    return on_batch_shards(lambda q, keys, w: fn(q, keys, w, scale=scale, interpret=interpret), (q, keys, weights))


def candidate_scores_kernel(impl: str) -> bool:
    """Whether `impl` runs DeepSeek-V4.1's bf16 index scores with the candidate blocks' maxima
    as a kernel (`candidate_scores`): the Mosaic TPU one (interpreted off a TPU); elsewhere the
    layers run candidate_selection.py's pure-jnp rule."""
    return kernel_choice(impl)[0] == "mosaic_tpu"


def candidate_scores(q, keys, weights, vis, *, block: int, impl: str):
    """DeepSeek-V4.1's bf16 index scores and the candidate blocks' maxima through
    tpu_candidate_scores.py (per device on a mesh): q [B, S, H, d], keys [B, T, d], weights
    [B, S, H] (omega), vis [B, S] visible entries per row -> (scores [B, S, T], beta [B, S, T / block])."""
    kind, interpret = kernel_choice(impl)
    if kind != "mosaic_tpu":
        raise ValueError(f"candidate_scores runs the Mosaic TPU kernel only, not {kind!r}")
    return on_batch_shards(lambda q, k, w, v: tpu_candidate_scores(q, k, w, v, block=block, interpret=interpret),
                           (q, keys, weights, vis))
