"""The Lightning Indexer's scores as a Mosaic TPU kernel (index_scores.py holds the
reference and the one dispatch; this is what kernels="mosaic_tpu" runs there):

    score[b, s, t] = sum_h w[b, s, h] * ReLU(q[b, s, h] . k[b, t]) * scale

A program takes `block_q` query positions x H index heads as the rows of one MXU product
against a block of `block_t` keys, so the per-head dot products [rows, block_t] exist only in
VMEM; the head sum is a second MXU product with the block's weights laid out
block-diagonally, W [block_q, rows] (row s holds w[s, :] * scale in columns s H .. s H + H - 1),
which leaves the scores [block_q, block_t] to write. Grid: batch x query block x key
block, all independent. Whatever block_q is, the query blocks are an axis of their own
(q [B, S / block_q, block_q H, d], scores [B, S / block_q, block_q, T]), so every block's last
two dimensions are the array's or (8, 128) multiples, as Mosaic TPU's block rules ask (v5e's
block_q = 4 included). Operands in q's dtype (bf16 on the MXU), accumulation and the
weighted sum in fp32. Selection (top-k of the visible scores) stays on the kernel's output.
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


def _kernel(q_ref, k_ref, w_ref, o_ref):
    dots = jax.lax.dot_general(q_ref[0, 0], k_ref[0], NT, preferred_element_type=jnp.float32)  # [rows, bt]
    o_ref[0, 0] = jnp.dot(w_ref[0, 0], jnp.maximum(dots, 0.0), preferred_element_type=jnp.float32)


def _plan(b, s, h, d, t, dtype, *, block_q=None, block_t=None, gen=None):
    table = blocks("index_scores", gen)
    bq = 1 if s == 1 else min(block_q or table["block_q"], s)
    bt = min(block_t or table["block_t"], round_up(t, 128))
    rows = bq * h
    ins = [((1, 1, rows, d), dtype), ((1, bt, d), dtype), ((1, 1, bq, rows), jnp.float32)]
    return dict(bq=bq, bt=bt, rows=rows, sp=round_up(s, bq), tp=round_up(t, bt), ins=ins,
                out=((1, 1, bq, bt), jnp.float32), values=[((rows, bt), jnp.float32)])


def vmem(b, s, h, d, t, dtype=jnp.bfloat16, gen=None) -> int:
    """VMEM bytes of `tpu_index_scores` at these shapes with generation `gen`'s blocks."""
    p = _plan(b, s, h, d, t, dtype, gen=gen)
    return vmem_budget(p["ins"] + [p["out"]], [], p["values"])


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_t", "interpret"))
def tpu_index_scores(q, keys, weights, *, scale: float, block_q: int | None = None, block_t: int | None = None,
                     interpret=False):
    """Same contract as `index_scores.reference`: q [B, S, H, d], keys [B, T, d], weights
    [B, S, H] -> [B, S, T] fp32. S and T are padded to the blocks here (padding queries get
    zero weights, padding keys' scores are cut off)."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    p = _plan(b, s, h, d, t, q.dtype, block_q=block_q, block_t=block_t)
    bq, bt, rows, sp = p["bq"], p["bt"], p["rows"], p["sp"]
    qf = pad_axis(q, 1, sp).reshape(b, sp // bq, rows, d)
    w = pad_axis(weights.astype(jnp.float32) * scale, 1, sp).reshape(b, sp // bq, bq, h)
    w = jnp.einsum("bnsh,su->bnsuh", w, jnp.eye(bq, dtype=jnp.float32)).reshape(b, sp // bq, bq, rows)
    out = pl.pallas_call(
        _kernel, name="dsjax_index_scores", grid=(b, sp // bq, p["tp"] // bt),
        in_specs=[pl.BlockSpec((1, 1, rows, d), lambda i, j, k: (i, j, 0, 0)),
                  pl.BlockSpec((1, bt, d), lambda i, j, k: (i, k, 0)),
                  pl.BlockSpec((1, 1, bq, rows), lambda i, j, k: (i, j, 0, 0))],
        out_specs=pl.BlockSpec((1, 1, bq, bt), lambda i, j, k: (i, j, 0, k)),
        out_shape=out_struct((b, sp // bq, bq, p["tp"]), jnp.float32, q),
        compiler_params=compiler_params("parallel", "parallel", "parallel"),
        interpret=interpret_params(interpret),
    )(qf, pad_axis(keys.astype(q.dtype), 1, p["tp"]), w)
    return out.reshape(b, sp, p["tp"])[:, :s, :t]
