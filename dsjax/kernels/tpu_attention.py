"""Attention with sinks over one shared KV head as a Mosaic TPU kernel (sink_attention.py
holds the reference and the one dispatch; this is what kernels="mosaic_tpu" runs there).

All query heads share the one KV head, so a program takes `block_q` query positions x H heads
as the rows of its MXU products (decode: one position, the 64 or 128 heads of V4): Q
[rows, D] stays in VMEM while the keys stream past it in blocks over the last grid axis,
which runs in order ("arbitrary") and carries the online softmax in VMEM scratch:

    m_r  = max(m_r, max_t l_rt),   l_r = l_r e^{m_old - m_r} + sum_t e^{l_rt - m_r},
    acc_r = acc_r e^{m_old - m_r} + sum_t e^{l_rt - m_r} k_t          (V = K in V4)

The key axis has two phases: the shared keys kv [B, T, D] in blocks of `block_k` (a key is
visible to a query position inside its [k_lo, k_hi] interval), then CSA's per-query keys
kv_pq [B, S, k, D] in blocks of `block_own`, where each query position's H rows meet its own
keys (one [H, D] x [D, block_own] product per position). The last step adds the sink to the
denominator, exactly as the reference: o = acc e^{m - M} / (l e^{m - M} + e^{sink - M}) with
M = max(m, sink). A shared-key block no query of the program can see skips its compute
(its span and the queries' come in by scalar prefetch); its copy into VMEM still happens
(not yet redirected by the index map). Operands stay in the inputs' dtype (bf16 on
the MXU), logits, softmax and accumulation in fp32; P goes into the PV product in the keys'
dtype (round_p: via bf16 against the running max, V4.1's rounding over `block_k` blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.mgpu import pad_axis, round_up
from dsjax.kernels.dispatch import out_struct
from dsjax.kernels.tpu_blocks import blocks, compiler_params, interpret_params, vmem_budget

NEG = -1e30  # finite "minus infinity", as in sink_attention.py
NT = (((1,), (1,)), ((), ()))  # a [r, D] x [t, D] -> [r, t] contraction (keys as stored)


def _kernel(span_ref, qspan_ref, pos_ref, q_ref, kv_ref, lo_ref, hi_ref, sink_ref, *rest, heads: int,
            block_q: int, n_shared: int, n_own: int, scale: float, round_p: bool):
    if n_own:
        kvq_ref, mq_ref, o_ref, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, m_ref, l_ref, acc_ref = rest
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(rows, q, k, visible):
        """The online softmax over one key block for the scratch rows `rows`."""
        logits = jax.lax.dot_general(q, k, NT, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(visible, logits, NEG)
        m_old = m_ref[rows]
        m_new = jnp.maximum(m_old, jnp.max(logits, axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)  # a row with nothing visible yet adds 0
        l_ref[rows] = l_ref[rows] * alpha + jnp.sum(p, axis=1, keepdims=True)
        pv = (p.astype(jnp.bfloat16) if round_p else p).astype(k.dtype)
        acc_ref[rows] = acc_ref[rows] * alpha + jnp.dot(pv, k, preferred_element_type=jnp.float32)
        m_ref[rows] = m_new

    # the block's keys span positions [first lo, last hi]; this program's queries [first, last]
    jk = jnp.minimum(j, n_shared - 1)
    seen = (span_ref[b, 2 * jk] <= qspan_ref[b, 2 * i + 1]) & (span_ref[b, 2 * jk + 1] >= qspan_ref[b, 2 * i])

    @pl.when((j < n_shared) & seen)
    def _():
        pos = pos_ref[0]  # [rows, 1]
        visible = (pos >= lo_ref[0]) & (pos <= hi_ref[0])  # [rows, block_k]
        update(..., q_ref[0], kv_ref[0], visible)

    if n_own:
        @pl.when(j >= n_shared)
        def _():
            for s in range(block_q):  # each query position's heads meet its own top-k keys
                rows = pl.ds(s * heads, heads)
                update(rows, q_ref[0, rows, :], kvq_ref[0, s], mq_ref[0, s] != 0)

    @pl.when(j == n_shared + n_own - 1)
    def _():
        m, sink = m_ref[...], sink_ref[...]
        top = jnp.maximum(m, sink)
        keep = jnp.exp(m - top)
        o_ref[0] = (acc_ref[...] * (keep / (l_ref[...] * keep + jnp.exp(sink - top)))).astype(o_ref.dtype)


def _plan(b, s, h, d, t, k_own, dtype, *, block_q=None, block_k=None, block_own=None, gen=None):
    """Static block sizes, padded lengths, the grid and every block / scratch shape: what the
    kernel runs and what `vmem` counts."""
    table = blocks("attention", gen)
    bq = 1 if s == 1 else min(block_q or table["block_q"], s)
    bk = min(block_k or table["block_k"], round_up(t, 8))
    bo = min(block_own or table["block_own"], round_up(k_own, 8)) if k_own else 0
    sp, tp, kp = round_up(s, bq), round_up(t, bk), (round_up(k_own, bo) if k_own else 0)
    rows = bq * h
    n_shared, n_own = tp // bk, (kp // bo if k_own else 0)
    f32, i32 = jnp.float32, jnp.int32
    ins = [((1, rows, 1), i32), ((1, rows, d), dtype), ((1, bk, d), dtype), ((1, 1, bk), i32), ((1, 1, bk), i32),
           ((rows, 1), f32)]
    if k_own:
        ins += [((1, bq, bo, d), dtype), ((1, bq, 1, bo), i32)]
    out = ((1, rows, d), dtype)
    scratch = [((rows, 1), f32), ((rows, 1), f32), ((rows, d), f32)]
    values = [((rows, max(bk, bo)), f32)] * 2  # logits and p of one block
    return dict(bq=bq, bk=bk, bo=bo, sp=sp, tp=tp, kp=kp, rows=rows, n_shared=n_shared, n_own=n_own,
                grid=(b, sp // bq, n_shared + n_own), ins=ins, out=out, scratch=scratch, values=values)


def vmem(b, s, h, d, t, k_own, dtype=jnp.bfloat16, gen=None) -> int:
    """VMEM bytes of `tpu_sink_attention` at these shapes with generation `gen`'s blocks."""
    p = _plan(b, s, h, d, t, k_own, dtype, gen=gen)
    return vmem_budget(p["ins"] + [p["out"]], p["scratch"], p["values"])


def _spans(lo, hi, pos, block_k, block_q):
    """Scalar-prefetch tables: per (row, key block) the first lo and last hi of its keys,
    per (row, query block) its first and last position, interleaved [B, 2 n]."""
    blo = lo.reshape(lo.shape[0], -1, block_k).min(axis=2)
    bhi = hi.reshape(hi.shape[0], -1, block_k).max(axis=2)
    qb = pos.reshape(pos.shape[0], -1, block_q)
    qlo, qhi = jnp.where(qb >= 0, qb, jnp.iinfo(jnp.int32).max).min(axis=2), qb.max(axis=2)
    return (jnp.stack([blo, bhi], -1).reshape(lo.shape[0], -1).astype(jnp.int32),
            jnp.stack([qlo, qhi], -1).reshape(pos.shape[0], -1).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "block_own", "interpret", "round_p"))
def tpu_sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, *, block_q: int | None = None,
                       block_k: int | None = None, block_own: int | None = None, interpret=False,
                       round_p: bool = False):
    """Same contract as `sink_attention.reference`. Blocks default to this TPU generation's
    (tpu_blocks.BLOCKS); S, T and k are padded to them here (padding keys: empty intervals,
    padding queries: position -1, dropped)."""
    from jax.experimental.pallas import tpu as pltpu

    b, s, h, d = q.shape
    k_own = 0 if kv_pq is None else kv_pq.shape[2]
    p = _plan(b, s, h, d, kv.shape[1], k_own, q.dtype, block_q=block_q, block_k=block_k, block_own=block_own)
    bq, bk, bo, rows, n_shared = p["bq"], p["bk"], p["bo"], p["rows"], p["n_shared"]
    pos = pad_axis(q_pos.astype(jnp.int32), 1, p["sp"], -1)  # [B, Sp]
    lo = pad_axis(k_lo.astype(jnp.int32), 1, p["tp"], 1)  # padding keys: the empty interval [1, 0]
    hi = pad_axis(k_hi.astype(jnp.int32), 1, p["tp"], 0)
    span, qspan = _spans(lo, hi, pos, bk, bq)
    rows_pos = jnp.repeat(pos, h, axis=1)[..., None]  # [B, Sp H, 1]: each head row's position
    qf = pad_axis(q, 1, p["sp"]).reshape(b, p["sp"] * h, d)
    args = [rows_pos, qf, pad_axis(kv.astype(q.dtype), 1, p["tp"]), lo[:, None], hi[:, None],
            jnp.tile(sinks.astype(jnp.float32), bq)[:, None]]
    last = n_shared - 1
    in_specs = [pl.BlockSpec((1, rows, 1), lambda b, i, j, *_: (b, i, 0)),
                pl.BlockSpec((1, rows, d), lambda b, i, j, *_: (b, i, 0)),
                pl.BlockSpec((1, bk, d), lambda b, i, j, *_: (b, jnp.minimum(j, last), 0)),
                pl.BlockSpec((1, 1, bk), lambda b, i, j, *_: (b, 0, jnp.minimum(j, last))),
                pl.BlockSpec((1, 1, bk), lambda b, i, j, *_: (b, 0, jnp.minimum(j, last))),
                pl.BlockSpec((rows, 1), lambda b, i, j, *_: (0, 0))]
    if k_own:
        kvq = pad_axis(pad_axis(kv_pq.astype(q.dtype), 1, p["sp"]), 2, p["kp"])
        mq = pad_axis(pad_axis(mask_pq.astype(jnp.int32), 1, p["sp"]), 2, p["kp"])[:, :, None]  # [B, Sp, 1, kp]
        own = lambda j: jnp.maximum(j - n_shared, 0)  # noqa: E731
        in_specs += [pl.BlockSpec((1, bq, bo, d), lambda b, i, j, *_: (b, i, own(j), 0)),
                     pl.BlockSpec((1, bq, 1, bo), lambda b, i, j, *_: (b, i, 0, own(j)))]
        args += [kvq, mq]
    kernel = functools.partial(_kernel, heads=h, block_q=bq, n_shared=n_shared, n_own=p["n_own"],
                               scale=d ** -0.5, round_p=round_p)
    out = pl.pallas_call(
        kernel, name="dsjax_sink_attention",
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=p["grid"], in_specs=in_specs,
            out_specs=pl.BlockSpec((1, rows, d), lambda b, i, j, *_: (b, i, 0)),
            scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in p["scratch"]]),
        out_shape=out_struct((b, p["sp"] * h, d), q.dtype, q),
        compiler_params=compiler_params("parallel", "parallel", "arbitrary"),
        interpret=interpret_params(interpret),
    )(span, qspan, *args)
    return out.reshape(b, p["sp"], h, d)[:, :s]
