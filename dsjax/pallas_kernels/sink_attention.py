"""Attention with sinks over one shared KV head: the Pallas kernel, its reference, dispatch.

    p_hs = exp(q_h.k_s * scale) / (sum_s' exp(q_h.k_s' * scale) + exp(sink_h)),  o_h = sum_s p_hs k_s

Keys come in two sets:
  * shared keys kv [B, T, D] (window ring, the chunk itself, HCA / dense-CSA compressed
    entries), each visible to the query positions in [k_lo, k_hi] (a window key at position
    p: [p, p + W - 1]; a compressed entry w of ratio m: [(w + 1) m - 1, inf); an empty
    slot: an empty interval) — so no [S, T] mask is ever materialised;
  * optional per-query keys kv_pq [B, S, k, D] with mask_pq [B, S, k]: CSA's top-k entries,
    gathered by index.

The kernel (grid: batch x query blocks) runs an online softmax over key blocks, then over
the query's own top-k keys, and adds exp(sink - m) to the denominator at the end.
`reference` is dsjax.layers.attention.sink_attention on the equivalent dense mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free for fully masked rows


def dense_mask(q_pos: jax.Array, k_lo: jax.Array, k_hi: jax.Array) -> jax.Array:
    """[B, S, T]: key visible to the query iff k_lo <= q_pos <= k_hi."""
    return (q_pos[:, :, None] >= k_lo[:, None, :]) & (q_pos[:, :, None] <= k_hi[:, None, :])


def reference(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None):
    from dsjax.layers.attention import sink_attention

    return sink_attention(q, kv, dense_mask(q_pos, k_lo, k_hi), sinks, kv_pq, mask_pq)


def _kernel(q_ref, pos_ref, kv_ref, lo_ref, hi_ref, sink_ref, *rest, block_k: int, n_kblocks: int, scale: float,
            per_query: bool):
    if per_query:
        kvq_ref, mq_ref, o_ref = rest
    else:
        (o_ref,) = rest
    q = q_ref[0].astype(jnp.float32)  # [bq, H, D]
    bq, h, d = q.shape
    pos = pos_ref[0]  # [bq]
    m = jnp.full((bq, h), NEG, jnp.float32)
    l = jnp.zeros((bq, h), jnp.float32)
    acc = jnp.zeros((bq, h, d), jnp.float32)

    def update(carry, logits, values):
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + values(p)

    def key_block(j, carry):
        start = j * block_k
        k = kv_ref[0, pl.ds(start, block_k), :].astype(jnp.float32)  # [bk, D]
        lo, hi = lo_ref[0, pl.ds(start, block_k)], hi_ref[0, pl.ds(start, block_k)]
        visible = (pos[:, None] >= lo[None, :]) & (pos[:, None] <= hi[None, :])  # [bq, bk]
        logits = jnp.einsum("qhd,kd->qhk", q, k) * scale
        logits = jnp.where(visible[:, None, :], logits, NEG)
        return update(carry, logits, lambda p: jnp.einsum("qhk,kd->qhd", jnp.where(visible[:, None, :], p, 0), k))

    carry = jax.lax.fori_loop(0, n_kblocks, key_block, (m, l, acc))
    if per_query:
        k = kvq_ref[0].astype(jnp.float32)  # [bq, k, D]
        visible = mq_ref[0]  # [bq, k]
        logits = jnp.where(visible[:, None, :], jnp.einsum("qhd,qkd->qhk", q, k) * scale, NEG)
        carry = update(carry, logits,
                       lambda p: jnp.einsum("qhk,qkd->qhd", jnp.where(visible[:, None, :], p, 0), k))
    m, l, acc = carry
    sink = sink_ref[...].astype(jnp.float32)[None, :]  # [1, H]
    m_all = jnp.maximum(m, sink)
    denom = l * jnp.exp(m - m_all) + jnp.exp(sink - m_all)
    o_ref[0] = (acc * jnp.exp(m - m_all)[..., None] / denom[..., None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret"))
def pallas_sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, *, block_q: int = 16,
                          block_k: int = 128, interpret: bool = False):
    """Same contract as `reference`; S and T are padded to the block sizes here."""
    b, s, h, d = q.shape
    t = kv.shape[1]
    bq = min(block_q, s)
    bk = max(8, min(block_k, t))
    sp, tp = -(-s // bq) * bq, max(bk, -(-t // bk) * bk)
    pad_s = lambda x, fill=0: jnp.pad(x, [(0, 0), (0, sp - s)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)  # noqa: E731
    q_p, pos_p = pad_s(q), pad_s(q_pos, -1)
    kv_p = jnp.pad(kv, [(0, 0), (0, tp - t), (0, 0)])
    lo_p = jnp.pad(k_lo, [(0, 0), (0, tp - t)], constant_values=1)  # padding keys: empty interval
    hi_p = jnp.pad(k_hi, [(0, 0), (0, tp - t)], constant_values=0)
    per_query = kv_pq is not None
    in_specs = [
        pl.BlockSpec((1, bq, h, d), lambda i, j: (i, j, 0, 0)),
        pl.BlockSpec((1, bq), lambda i, j: (i, j)),
        pl.BlockSpec((1, tp, d), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((1, tp), lambda i, j: (i, 0)),
        pl.BlockSpec((1, tp), lambda i, j: (i, 0)),
        pl.BlockSpec((h,), lambda i, j: (0,)),
    ]
    args = [q_p, pos_p, kv_p, lo_p, hi_p, sinks]
    if per_query:
        kq = kv_pq.shape[2]
        in_specs += [pl.BlockSpec((1, bq, kq, d), lambda i, j: (i, j, 0, 0)),
                     pl.BlockSpec((1, bq, kq), lambda i, j: (i, j, 0))]
        args += [pad_s(kv_pq), pad_s(mask_pq, False)]
    kernel = functools.partial(_kernel, block_k=bk, n_kblocks=tp // bk, scale=d ** -0.5, per_query=per_query)
    out = pl.pallas_call(
        kernel, grid=(b, sp // bq), in_specs=in_specs,
        out_specs=pl.BlockSpec((1, bq, h, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, sp, h, d), q.dtype), interpret=interpret)(*args)
    return out[:, :s]


def sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, *, impl: str = "reference"):
    """Dispatch: "reference" (jnp), "pallas" (the kernel; interpreted on CPU)."""
    if impl == "reference":
        return reference(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq, mask_pq)
    return pallas_sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq, mask_pq,
                                 interpret=jax.default_backend() == "cpu")
