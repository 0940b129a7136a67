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
`reference` is the same math in plain jnp on the equivalent dense mask [B, S, T]; the
model calls only the dispatch `sink_attention(..., impl=...)`.

Where p is rounded (`round_p`). V4 (HF's oracle): p is normalised, sink included, and cast
to the keys' dtype before PV (a no-op in fp32). DeepSeek-V4.1 (deepseek-v41.md §2.9, the
vendor kernel): p = e^{l - m} is rounded to bf16 against the max m of the logits (sink
excluded) before PV, and the fp32 sum of the unrounded p plus e^{sink - m} divides at the end:

    o_h = sum_i bf16(e^{l_i - m}) kv_i / (sum_i e^{l_i - m} + e^{sink_h - m})

where m is the vendor's online-softmax RUNNING max over consecutive blocks of 64 indices (from
-1e30): block b's p rounds against M_b = max(M_{b-1}, max of block b), acc and sum rescale by
e^{M_{b-1} - M_b}, the sink joins against the final max. `reference` computes this vectorised
(`_running_max_p`) over its key axis in order (the shared keys, then the query's own; a
masked key is a position in the blocking): the same up to fp32 rounding of the rescale
factors. The Mosaic GPU kernel's 64-key tiles are these blocks (it stages P in bf16 against
its running max whatever `round_p` says) when T is a multiple of 64 and the keys are not
split (decode `splits` > 1 rounds against each split's own max); the Pallas kernel's are
`block_k` shared keys (T padded to it) then all of a query's own keys as one block, so it is
the same with block_k=64, T a multiple of 64 and k <= 64. Elsewhere they differ from the
reference by the rounding of p (2^-9 relative per weight).

`mgpu_sink_attention` is the Hopper (sm90) kernel for Mosaic GPU. All query heads share
the one KV head, so a program takes 64 heads of ONE query as the 64 rows of a wgmma tile
(MQA-style, as DeepSeek's FlashMLA decode does): its visibility rule is then one mask per
key, and CSA's top-k keys of that query are shared by all 64 rows. Per program (batch x
query, head block, output half): Q [64, D] is copied to shared memory once; keys stream
through a double-buffered TMA pipeline ([block_k, D] tiles, 128-byte swizzle); the logits
[64, block_k] come from one wgmma, the online softmax runs on the fp32 accumulator in
registers, and P [64, block_k] (bf16, registers) times the key tile's output half (K = V in
V4) accumulates into [64, D/2] fp32 — the output dimension is split over programs because
a [64, 512] fp32 accumulator would not fit one warpgroup's registers. Operands are bf16,
accumulation fp32. In decode (one query per row, few programs) the keys are also split over
programs (flash-decoding, `num_splits`) and the partial outputs merged by log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.dispatch import kernel_choice, on_batch_shards
from dsjax.kernels.mgpu import (accumulate, interpret_params, layout, matmul_nt, operand_transforms, pad_axis,
                                       round_up, store_tile)
from dsjax.kernels.tpu_attention import tpu_sink_attention

NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free for fully masked rows
BLOCK_P = 64  # V4.1's vendor kernel: its online softmax's block of indices (deepseek-v41.md §2.9)


def reference(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, round_p: bool = False):
    """The reference math, on the dense mask the intervals stand for.

    q [B, S, H, D]; kv [B, T, D] keys shared by all queries, key t visible to query s iff
    k_lo[b, t] <= q_pos[b, s] <= k_hi[b, t]; optionally kv_pq [B, S, k, D] (CSA: each
    query's top-k compressed entries, gathered) with mask_pq [B, S, k]. sinks [H] fp32
    adds exp(sink_h) to the denominator only. round_p: V4.1's rounding of p (module
    docstring); a query with no visible key gives 0. -> o [B, S, H, D] in q's dtype."""
    mask = (q_pos[:, :, None] >= k_lo[:, None, :]) & (q_pos[:, :, None] <= k_hi[:, None, :])  # [B, S, T]
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bshd,btd->bsht", q, kv, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    if kv_pq is not None:
        extra = jnp.einsum("bshd,bskd->bshk", q, kv_pq, preferred_element_type=jnp.float32) * scale
        logits = jnp.concatenate([logits, jnp.where(mask_pq[:, :, None, :], extra, -jnp.inf)], axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None], (*logits.shape[:3], 1))
    if round_p:  # V4.1: the vendor's online softmax over blocks of 64 keys, p to bf16 unnormalised
        p, denom = _running_max_p(logits, sink)  # fp32: bf16(e) times e^{M_b - M_last}, not re-rounded
    else:
        m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
        p = jnp.exp(logits - m)
        p = (p / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m))).astype(kv.dtype)
    t = kv.shape[1]
    o = jnp.einsum("bsht,btd->bshd", p[..., :t], kv, preferred_element_type=jnp.float32)
    if kv_pq is not None:
        o = o + jnp.einsum("bshk,bskd->bshd", p[..., t:], kv_pq, preferred_element_type=jnp.float32)
    if round_p:
        o = o / denom
    return o.astype(q.dtype)


def _running_max_p(logits, sink, block: int = BLOCK_P):
    """V4.1's p and denominator (§2.9), vectorised: the key axis (shared keys, then the
    per-query ones) in consecutive blocks of `block`, a masked (-inf) key a position that adds
    nothing. Block b's running max M_b = max(M_{b-1}, max of block b), M_0 = NEG; its keys'
    p = bf16(e^{l - M_b}); the online softmax's rescales by e^{M_{b-1} - M_b} multiply out to
    w_b = e^{M_b - M_last} (equal up to fp32 rounding of the factors), so
    o = sum_i w_b(i) bf16(p_i) kv_i / (sum_i w_b(i) p_i + e^{sink - M_last}).
    -> (weights [..., N] fp32, denominator [..., 1]); no visible key: denominator inf, o = 0."""
    n = logits.shape[-1]
    nb = max(1, -(-n // block))  # one all-masked block when there is no key
    blocks = jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, nb * block - n)], constant_values=-jnp.inf)
    blocks = blocks.reshape(*logits.shape[:-1], nb, block)
    running = jax.lax.cummax(jnp.max(blocks, axis=-1, initial=NEG), axis=blocks.ndim - 2)  # M_b [..., nb]
    e = jnp.exp(blocks - running[..., None])  # against the running max
    w = jnp.exp(running - running[..., -1:])[..., None]  # e^{M_b - M_last}
    denom = jnp.sum(e * w, axis=(-2, -1))[..., None] + jnp.exp(sink - running[..., -1:])
    p = e.astype(jnp.bfloat16).astype(jnp.float32) * w
    return p.reshape(*logits.shape[:-1], nb * block)[..., :n], denom


def _kernel(q_ref, pos_ref, kv_ref, lo_ref, hi_ref, sink_ref, *rest, block_k: int, n_kblocks: int, scale: float,
            per_query: bool, round_p: bool = False):
    if per_query:
        kvq_ref, mq_ref, o_ref = rest
    else:
        (o_ref,) = rest
    q = q_ref[0].astype(jnp.float32)  # [bq, H, D]
    bq, h, d = q.shape
    pos = pos_ref[0][:, 0]  # [bq]
    m = jnp.full((bq, h), NEG, jnp.float32)
    l = jnp.zeros((bq, h), jnp.float32)
    acc = jnp.zeros((bq, h, d), jnp.float32)

    def update(carry, logits, values):
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[..., None])
        pv = p.astype(jnp.bfloat16).astype(jnp.float32) if round_p else p  # V4.1: against the running max
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + values(pv)

    def key_block(j, carry):
        start = j * block_k
        k = kv_ref[0, pl.ds(start, block_k), :].astype(jnp.float32)  # [bk, D]
        lo, hi = lo_ref[0, 0, pl.ds(start, block_k)], hi_ref[0, 0, pl.ds(start, block_k)]
        visible = (pos[:, None] >= lo[None, :]) & (pos[:, None] <= hi[None, :])  # [bq, bk]
        logits = jnp.einsum("qhd,kd->qhk", q, k) * scale
        logits = jnp.where(visible[:, None, :], logits, NEG)
        return update(carry, logits, lambda p: jnp.einsum("qhk,kd->qhd", jnp.where(visible[:, None, :], p, 0), k))

    carry = jax.lax.fori_loop(0, n_kblocks, key_block, (m, l, acc))
    if per_query:
        k = kvq_ref[0].astype(jnp.float32)  # [bq, k, D]
        visible = mq_ref[0] != 0  # [bq, k]
        logits = jnp.where(visible[:, None, :], jnp.einsum("qhd,qkd->qhk", q, k) * scale, NEG)
        carry = update(carry, logits,
                       lambda p: jnp.einsum("qhk,qkd->qhd", jnp.where(visible[:, None, :], p, 0), k))
    m, l, acc = carry
    sink = sink_ref[...].astype(jnp.float32)  # [1, H]
    m_all = jnp.maximum(m, sink)
    denom = l * jnp.exp(m - m_all) + jnp.exp(sink - m_all)
    o_ref[0] = (acc * jnp.exp(m - m_all)[..., None] / denom[..., None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "round_p"))
def pallas_sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, *, block_q: int = 16,
                          block_k: int = 128, interpret: bool = False, round_p: bool = False):
    """Same contract as `reference` (round_p: against the running max); S and T are padded to
    the block sizes here."""
    b, s, h, d = q.shape
    t = kv.shape[1]
    bq = min(block_q, s)
    bk = max(8, min(block_k, t))
    sp, tp = -(-s // bq) * bq, max(bk, -(-t // bk) * bk)
    pad_s = lambda x, fill=0: jnp.pad(x, [(0, 0), (0, sp - s)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)  # noqa: E731
    # Layouts keep every block's last two dims TPU-legal (multiples of (8, 128) or whole):
    # positions as [B, S, 1], key intervals as [B, 1, T], sinks as [1, H], masks as int32.
    q_p, pos_p = pad_s(q), pad_s(q_pos, -1)[..., None]
    kv_p = jnp.pad(kv, [(0, 0), (0, tp - t), (0, 0)])
    lo_p = jnp.pad(k_lo, [(0, 0), (0, tp - t)], constant_values=1)[:, None]  # padding keys: empty interval
    hi_p = jnp.pad(k_hi, [(0, 0), (0, tp - t)], constant_values=0)[:, None]
    per_query = kv_pq is not None
    in_specs = [
        pl.BlockSpec((1, bq, h, d), lambda i, j: (i, j, 0, 0)),
        pl.BlockSpec((1, bq, 1), lambda i, j: (i, j, 0)),
        pl.BlockSpec((1, tp, d), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((1, 1, tp), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((1, 1, tp), lambda i, j: (i, 0, 0)),
        pl.BlockSpec((1, h), lambda i, j: (0, 0)),
    ]
    args = [q_p, pos_p, kv_p, lo_p, hi_p, sinks.reshape(1, h)]
    if per_query:
        kq = kv_pq.shape[2]
        in_specs += [pl.BlockSpec((1, bq, kq, d), lambda i, j: (i, j, 0, 0)),
                     pl.BlockSpec((1, bq, kq), lambda i, j: (i, j, 0))]
        args += [pad_s(kv_pq), pad_s(mask_pq.astype(jnp.int32), 0)]
    kernel = functools.partial(_kernel, block_k=bk, n_kblocks=tp // bk, scale=d ** -0.5, per_query=per_query,
                               round_p=round_p)
    out = pl.pallas_call(
        kernel, grid=(b, sp // bq), in_specs=in_specs,
        out_specs=pl.BlockSpec((1, bq, h, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, sp, h, d), q.dtype), interpret=interpret)(*args)
    return out[:, :s]


ROWS = 64  # one warpgroup's wgmma M


def _mgpu_kernel(q_gmem, kv_gmem, lo_gmem, hi_gmem, pos_gmem, sink_gmem, *rest, n_query: int, block_k: int,
                 n_kblocks: int, n_pq_blocks: int, n_splits: int, dv: int, scale: float, steps: int,
                 interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rest = list(rest)
    kvq_gmem, mq_gmem = (rest.pop(0), rest.pop(0)) if n_pq_blocks else (None, None)
    o_gmem, lse_gmem = (rest.pop(0), rest.pop(0)) if n_splits > 1 else (rest.pop(0), None)
    q_smem, p_smem, sink_smem, bars = rest
    n_chunks = q_smem.shape[0]  # Q is kept as D / dv contiguous [64, dv] chunks = output halves
    bs, hb, part = (jax.lax.axis_index(n) for n in ("bs", "heads", "part"))
    split, half = part // n_chunks, part % n_chunks  # part: (key split, output half)
    b, s = bs // n_query, bs % n_query
    row0 = bs * sink_gmem.shape[0] + hb * ROWS  # q rows are (batch, query, padded head)
    for c in range(n_chunks):
        plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(row0, ROWS), pl.ds(c * dv, dv)], q_smem.at[c], bars.at[c])
    plgpu.copy_gmem_to_smem(sink_gmem.at[pl.ds(hb * ROWS, ROWS)], sink_smem, bars.at[n_chunks])
    for c in range(n_chunks + 1):
        plgpu.barrier_wait(bars.at[c])
    pos = pos_gmem[b, s]
    init = (layout(jnp.zeros((ROWS, dv), jnp.float32), "tile", interpret),
            layout(jnp.full((ROWS,), NEG, jnp.float32), "rows", interpret),
            layout(jnp.zeros((ROWS,), jnp.float32), "rows", interpret))

    def update(k_smem, visible, carry):
        acc, m, l = carry

        chunks = [(q_smem.at[c], k_smem.at[:, pl.ds(c * dv, dv)]) for c in range(n_chunks)]
        logits = matmul_nt(chunks, interpret) * scale
        vis = jax.lax.broadcast_in_dim(visible, (ROWS, block_k), [1])
        logits = jnp.where(vis, logits, NEG)
        m_new = jnp.maximum(m, logits.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(logits - jax.lax.broadcast_in_dim(m_new, (ROWS, block_k), [0])), 0.0)
        l = l * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

        p_smem[...] = p.astype(p_smem.dtype)  # wgmma's A operand, staged in shared memory
        plgpu.commit_smem()
        # V = K in V4: this program's half of the key tile's columns
        acc = accumulate(acc, p_smem, k_smem.at[:, pl.ds(half * dv, dv)], interpret)
        return acc, m_new, l

    def shared_keys(_, k_smem, lo_smem, hi_smem, carry):
        lo = layout(lo_smem[...], "cols", interpret)
        hi = layout(hi_smem[...], "cols", interpret)
        return update(k_smem, (lo <= pos) & (pos <= hi), carry)

    d = n_chunks * dv
    tf = operand_transforms(q_smem.dtype, d)
    per_split = n_kblocks // n_splits  # this program's key blocks: [split * per_split, ...)
    carry = plgpu.emit_pipeline(
        shared_keys, grid=(per_split,), max_concurrent_steps=steps, init_carry=init,
        in_specs=[plgpu.BlockSpec((block_k, d), lambda j: (split * per_split + j, 0), transforms=tf),
                  plgpu.BlockSpec((block_k,), lambda j: (split * per_split + j,)),
                  plgpu.BlockSpec((block_k,), lambda j: (split * per_split + j,))],
    )(kv_gmem.at[b], lo_gmem.at[b], hi_gmem.at[b])
    if n_pq_blocks:  # CSA: this query's own top-k entries, shared by its 64 head rows
        def own_keys(_, k_smem, m_smem, carry):
            return update(k_smem, layout(m_smem[...], "cols", interpret) != 0, carry)

        carry = plgpu.emit_pipeline(
            own_keys, grid=(n_pq_blocks,), max_concurrent_steps=steps, init_carry=carry,
            in_specs=[plgpu.BlockSpec((block_k, d), lambda j: (j, 0), transforms=tf),
                      plgpu.BlockSpec((block_k,), lambda j: (j,))],
        )(kvq_gmem.at[b, s], mq_gmem.at[b, s])
    acc, m, l = carry
    if n_splits == 1:  # finish here: the sink joins the denominator
        sink = layout(sink_smem[...], "rows", interpret)
        m_all = jnp.maximum(m, sink)
        keep = jnp.exp(m - m_all)
        factor = keep / (l * keep + jnp.exp(sink - m_all))
        o_dst = o_gmem.at[pl.ds(row0, ROWS), pl.ds(half * dv, dv)]
    else:  # a partial: normalised output and log-sum-exp, merged (with the sink) outside
        l_safe = jnp.maximum(l, 1e-30)  # a split that sees no key: output 0, lse ~ -1e30
        factor = 1.0 / l_safe
        o_dst = o_gmem.at[split, pl.ds(row0, ROWS), pl.ds(half * dv, dv)]

        @pl.when(half == 0)
        def _():
            store_tile(m + jnp.log(l_safe), lse_gmem.at[split, pl.ds(row0, ROWS)])
    o_smem = q_smem.at[0]  # Q is no longer needed: its first chunk takes the output
    o_smem[...] = (acc * jax.lax.broadcast_in_dim(factor, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_dst)
    plgpu.wait_smem_to_gmem(0)


def num_splits(programs: int, key_blocks: int, sms: int | None = None) -> int:
    """Split the keys over programs (flash-decoding) when the grid would leave SMs idle:
    decode has few (batch x head block x half) programs and long key lists. Each split keeps
    >= 2 key blocks so its pipeline still overlaps copies with compute."""
    if sms is None:
        sms = getattr(jax.devices()[0], "core_count", None) or 132  # H100 / H200: 132 SMs
    return max(1, min(sms // max(programs, 1), key_blocks // 2))


@functools.partial(jax.jit, static_argnames=("block_k", "steps", "splits", "interpret", "round_p"))
def mgpu_sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, *, block_k: int | None = None,
                        steps: int = 2, splits: int | None = None, interpret: bool = False, round_p: bool = False):
    """Same contract as `reference`, on Mosaic GPU (bf16 operands, fp32 accumulation; P is
    always bf16 against the running max, so `round_p` changes nothing here). Heads
    are padded to a multiple of 64, D to a multiple of 64 (of 256 above 256), keys to
    block_k; padding keys are invisible and padded heads are dropped.

    Decode (one query per row): the query's own top-k keys join the shared keys, and the
    keys are split over `splits` programs per head block (default `num_splits`) whose
    partial outputs are merged here by their log-sum-exp, with the sink."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, s, h, d = q.shape
    if s == 1 and kv_pq is not None:  # decode: per-query keys are this row's keys
        kv = jnp.concatenate([kv, kv_pq[:, 0].astype(kv.dtype)], axis=1)
        k_lo = jnp.concatenate([k_lo, jnp.where(mask_pq[:, 0], 0, 1).astype(k_lo.dtype)], axis=1)
        k_hi = jnp.concatenate([k_hi, jnp.where(mask_pq[:, 0], jnp.iinfo(jnp.int32).max, 0).astype(k_hi.dtype)],
                               axis=1)
        kv_pq = mask_pq = None
    t = kv.shape[1]
    dt = jnp.bfloat16
    dp = round_up(d, 64)
    dv = dp if dp <= 256 else 256
    dp = round_up(dp, dv)
    bk = block_k or 64  # shared memory: Q + `steps` key tiles + P (D=512: 200 KiB of 227)
    hp = round_up(h, ROWS)
    n_halves = dp // dv
    if s > 1 or kv_pq is not None:
        splits = 1
    elif splits is None:
        splits = num_splits(b * hp // ROWS * n_halves, -(-t // bk))
    tp = round_up(max(t, 1), bk * splits)
    qf = pad_axis(pad_axis(q.astype(dt), 2, hp), 3, dp).reshape(b * s * hp, dp)
    kvp = pad_axis(pad_axis(kv.astype(dt), 1, tp), 2, dp)
    lo = pad_axis(k_lo.astype(jnp.int32), 1, tp, 1)  # padding keys: empty interval
    hi = pad_axis(k_hi.astype(jnp.int32), 1, tp, 0)
    args = [qf, kvp, lo, hi, q_pos.astype(jnp.int32), pad_axis(sinks.astype(jnp.float32), 0, hp)]
    n_pq = 0
    if kv_pq is not None:
        kq = round_up(kv_pq.shape[2], bk)
        n_pq = kq // bk
        args += [pad_axis(pad_axis(kv_pq.astype(dt), 2, kq), 3, dp),
                 pad_axis(mask_pq.astype(jnp.int32), 2, kq, 0)]
    body = functools.partial(_mgpu_kernel, n_query=s, block_k=bk, n_kblocks=tp // bk, n_pq_blocks=n_pq,
                             n_splits=splits, dv=dv, scale=d ** -0.5, steps=steps, interpret=interpret)
    rows = b * s * hp
    out_type = jax.ShapeDtypeStruct((rows, dp), dt)
    if splits > 1:
        out_type = (jax.ShapeDtypeStruct((splits, rows, dp), dt), jax.ShapeDtypeStruct((splits, rows), jnp.float32))
    out = plgpu.kernel(
        body, out_type=out_type, grid=(b * s, hp // ROWS, splits * n_halves), grid_names=("bs", "heads", "part"),
        scratch_types=[plgpu.SMEM((dp // dv, ROWS, dv), dt, transforms=operand_transforms(dt, dv)),
                       plgpu.SMEM((ROWS, bk), dt, transforms=operand_transforms(dt, bk)),
                       plgpu.SMEM((ROWS,), jnp.float32), plgpu.Barrier(num_barriers=dp // dv + 1)],
        interpret=interpret_params(interpret),
    )(*args)
    if splits > 1:
        out = merge_splits(*out, jnp.tile(args[5], b * s))
    return out.reshape(b, s, hp, dp)[:, :, :h, :d].astype(q.dtype)


def merge_splits(outs: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """Partial outputs [n, R, D] (each normalised over its own keys) with their log-sum-exps
    [n, R] and the sink logits [R] -> the attention output [R, D] in fp32."""
    top = jnp.maximum(lse.max(axis=0), sinks)
    weights = jnp.exp(lse - top)  # [n, R]
    denom = weights.sum(axis=0) + jnp.exp(sinks - top)
    return jnp.einsum("nr,nrd->rd", weights / denom, outs.astype(jnp.float32))


def sink_attention(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq=None, mask_pq=None, *, impl: str = "reference",
                   round_p: bool = False):
    """THE dispatch (dispatch.py's rule): "reference" (jnp); "pallas": the Mosaic GPU kernel
    on Hopper+, the Mosaic TPU kernel on a TPU, else the generic Pallas kernel (interpreted
    on CPU); "mosaic_gpu" / "mosaic_tpu": that kernel (interpret mode off its hardware;
    the TPU one is tpu_attention.py). round_p: V4.1's rounding of p."""
    kind, interpret = kernel_choice(impl)
    if kind == "reference":
        return reference(q, kv, k_lo, k_hi, q_pos, sinks, kv_pq, mask_pq, round_p)
    fn = {"mosaic_gpu": mgpu_sink_attention, "mosaic_tpu": tpu_sink_attention}.get(kind, pallas_sink_attention)
    kernel = lambda q, kv, k_lo, k_hi, q_pos, kv_pq, mask_pq, sinks: fn(  # noqa: E731
        q, kv, k_lo, k_hi, q_pos, sinks, kv_pq, mask_pq, interpret=interpret, round_p=round_p)
    return on_batch_shards(kernel, (q, kv, k_lo, k_hi, q_pos, kv_pq, mask_pq), (sinks,))
