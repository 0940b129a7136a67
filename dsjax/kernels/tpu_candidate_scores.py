"""DeepSeek-V4.1's index scores in the reference's bf16 pipeline, with layer 20's candidate-block
maxima, as a Mosaic TPU kernel (what kernels="mosaic_tpu" runs for a V4.1 index source under
its round trips; the pure-jnp rule is dsjax/layers/candidate_selection.py, spec
deepseek-v41.md §2.6, §2.8).

Where it differs from V4's indexer kernel (tpu_index_scores.py):
  * the numbers: each head's dot rounds to bf16, ReLU(dot) * w rounds to bf16, the heads are
    summed in fp32 in head order from +0.0 (not one MXU product in its own order), and the
    score rounds to bf16: the reference's values bit for bit where the dots are exact (V4.1's
    FP4-QDQ'd q and k: 2-bit mantissas);
  * the candidate source's block maxima: beta[b] = max over its `block` (8) entries of the
    visible scores (entries j < vis, a prefix; the others -inf), taken in VMEM from the scores
    tile by a doubling max over rolled lanes (lane 8b + 7 then holds block b's max) and picked
    by a one-hot MXU product (exact: one nonzero per sum; -inf travels as -2^127 through it).
What stays after the kernel, in XLA, on [B, S, T / 8] values: the pinned newest block, the top
k_blocks of beta and the mask (`candidate_selection.candidate_mask` given beta), and the top-k
entry list on the scores.

A program takes `block_q` query positions x H heads as MXU rows against `block_t` keys (as
V4's kernel); grid batch x query block x key block, all independent. The query blocks are an
axis of their own in every operand (q [B, S / block_q, block_q H, d], scores [B, S / block_q,
block_q, T]) and the maxima come out as [B, S / block_q, key blocks, block_q, block_t / 8],
laid out [B, S, T / 8] after: each block's last two dimensions are the array's or (8, 128)
multiples, as Mosaic TPU's block rules ask, at any block_q (v5e's 4 included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.mgpu import pad_axis, round_up
from dsjax.kernels.dispatch import out_struct
from dsjax.kernels.tpu_blocks import blocks, compiler_params, interpret_params, vmem_budget

NT = (((1,), (1,)), ((), ()))
NEG = -(2.0 ** 127)  # -inf through the one-hot product (exact in bf16; below any score)


def _kernel(q_ref, k_ref, w_ref, vis_ref, s_ref, beta_ref, *, bq: int, h: int, block: int):
    from jax.experimental.pallas import tpu as pltpu

    bt = k_ref.shape[1]
    f32, bf16 = jnp.float32, jnp.bfloat16
    dots = jax.lax.dot_general(q_ref[0, 0], k_ref[0], NT, preferred_element_type=f32).astype(bf16).astype(f32)
    terms = (jax.nn.relu(dots) * w_ref[0, 0]).astype(bf16).astype(f32)  # [bq H, bt]; w [bq H, 1]
    row = jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    scores = jnp.zeros((bq, bt), f32)
    for s in range(bq):
        total = jnp.zeros((1, bt), f32)
        for head in range(h):  # the reference's order: h = 0, 1, .., H - 1 from +0.0
            total = total + terms[s * h + head:s * h + head + 1, :]
        scores = jnp.where(row == s, total.astype(bf16).astype(f32), scores)
    s_ref[0, 0] = scores
    col = pl.program_id(2) * bt + jax.lax.broadcasted_iota(jnp.int32, (1, bt), 1)
    m = jnp.where(col < vis_ref[0, 0], scores, NEG)  # vis [bq, 1]
    shift = 1
    while shift < block:  # lane j: the max of lanes j - 2 shift + 1 .. j
        m = jnp.maximum(m, pltpu.roll(m, shift, 1))
        shift *= 2
    pick = (jax.lax.broadcasted_iota(jnp.int32, (bt, bt // block), 0)
            == block * jax.lax.broadcasted_iota(jnp.int32, (bt, bt // block), 1) + block - 1).astype(f32)
    beta = jnp.dot(m, pick, preferred_element_type=f32, precision=jax.lax.Precision.HIGHEST)
    beta_ref[0, 0, 0] = jnp.where(beta <= NEG, -jnp.inf, beta)


def _plan(b, s, h, d, t, dtype, block, *, block_q=None, block_t=None, gen=None):
    table = blocks("index_scores", gen)
    bq = 1 if s == 1 else min(block_q or table["block_q"], s)
    bt = min(block_t or table["block_t"], round_up(t, 128))
    rows = bq * h
    ins = [((1, 1, rows, d), dtype), ((1, bt, d), dtype), ((1, 1, rows, 1), jnp.float32), ((1, 1, bq, 1), jnp.int32)]
    outs = [((1, 1, bq, bt), jnp.float32), ((1, 1, 1, bq, bt // block), jnp.float32)]
    values = [((rows, bt), jnp.float32)] * 2 + [((bq, bt), jnp.float32)] * 2 + [((bt, bt // block), jnp.float32)]
    return dict(bq=bq, bt=bt, rows=rows, sp=round_up(s, bq), tp=round_up(t, bt), ins=ins, outs=outs, values=values)


def vmem(b, s, h, d, t, dtype=jnp.bfloat16, gen=None, block: int = 8) -> int:
    """VMEM bytes of `tpu_candidate_scores` at these shapes with generation `gen`'s blocks."""
    p = _plan(b, s, h, d, t, dtype, block, gen=gen)
    return vmem_budget(p["ins"] + p["outs"], [], p["values"])


@functools.partial(jax.jit, static_argnames=("block", "block_q", "block_t", "interpret"))
def tpu_candidate_scores(q, keys, weights, vis, *, block: int = 8, block_q: int | None = None,
                         block_t: int | None = None, interpret=False):
    """q [B, S, H, d], keys [B, T, d] (bf16), weights [B, S, H] (omega, scale included), vis
    [B, S] int32 (entries j < vis are visible) -> (scores [B, S, T] fp32 holding the bf16
    values of `candidate_selection.index_scores_bf16`, unmasked; beta [B, S, ceil(T / block)]
    fp32, each block's max visible score, -inf where it has none). block: a power of two."""
    if block < 1 or block & (block - 1) or block > 128:
        raise ValueError(f"the candidate block must be a power of two up to 128, got {block}")
    b, s, h, d = q.shape
    t = keys.shape[1]
    bf16 = jnp.bfloat16
    p = _plan(b, s, h, d, t, bf16, block, block_q=block_q, block_t=block_t)
    bq, bt, rows, sp, tp = p["bq"], p["bt"], p["rows"], p["sp"], p["tp"]
    qf = pad_axis(q.astype(bf16), 1, sp).reshape(b, sp // bq, rows, d)
    w = pad_axis(weights.astype(bf16).astype(jnp.float32), 1, sp).reshape(b, sp // bq, rows, 1)
    v = pad_axis(vis.astype(jnp.int32), 1, sp).reshape(b, sp // bq, bq, 1)  # padding queries see nothing
    scores, beta = pl.pallas_call(
        functools.partial(_kernel, bq=bq, h=h, block=block), name="dsjax_candidate_scores",
        grid=(b, sp // bq, tp // bt),
        in_specs=[pl.BlockSpec((1, 1, rows, d), lambda i, j, k: (i, j, 0, 0)),
                  pl.BlockSpec((1, bt, d), lambda i, j, k: (i, k, 0)),
                  pl.BlockSpec((1, 1, rows, 1), lambda i, j, k: (i, j, 0, 0)),
                  pl.BlockSpec((1, 1, bq, 1), lambda i, j, k: (i, j, 0, 0))],
        out_specs=[pl.BlockSpec((1, 1, bq, bt), lambda i, j, k: (i, j, 0, k)),
                   pl.BlockSpec((1, 1, 1, bq, bt // block), lambda i, j, k: (i, j, k, 0, 0))],
        out_shape=[out_struct((b, sp // bq, bq, tp), jnp.float32, q),
                   out_struct((b, sp // bq, tp // bt, bq, bt // block), jnp.float32, q)],
        compiler_params=compiler_params("parallel", "parallel", "parallel"),
        interpret=interpret_params(interpret),
    )(qf, pad_axis(keys.astype(bf16), 1, tp), w, v)
    beta = jnp.swapaxes(beta, 2, 3).reshape(b, sp, tp // block)
    return scores.reshape(b, sp, tp)[:, :s, :t], beta[:, :s, :-(-t // block)]
