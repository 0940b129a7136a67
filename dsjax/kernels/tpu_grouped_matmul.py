"""The routed experts' grouped FFN (clamped SwiGLU) as Mosaic TPU kernels, megablox-style
(grouped_matmul.py holds the reference and the one dispatch; this is what
kernels="mosaic_tpu" runs there).

Rows come sorted by expert with ragged group sizes (empty groups allowed) and stay in that
order: no tile gather or scatter. The rows are cut into (tm)-row tiles; a tile may hold the
rows of several experts, so the kernels walk a list of *visits*, one per (row tile, expert)
pair that share rows (`group_visits`; at most tiles + E - 1, known statically), in row order.
A visit multiplies the whole tile by its expert's weights and keeps only its expert's rows
(a masked store into the output tile, which stays in VMEM across the tile's consecutive
visits and is zeroed on the first). The visit list, the visits' experts and tiles and the
groups' row bounds arrive by scalar prefetch (`pltpu.PrefetchScalarGridSpec`) and pick the
blocks each grid step copies; the visits past the used ones repeat the last one (no new
copy) and compute nothing.

Two kernels, each over a grid (output column block, visit, contraction block) with the
contraction innermost and an fp32 accumulator in VMEM scratch:
  1. gate and up [tm, tn] = x W1[e]^T, x W3[e]^T over D in (tk) blocks; on the last block
     the clamped SwiGLU, h [M, I] out in x's dtype;
  2. y [tm, tn] = h W2[e]^T over I, out in fp32.
Operands are x's dtype (bf16 on the MXU), accumulation fp32; the weights are read as
[E, out, in] blocks, the layout the checkpoint stores. Rows past sum(group_sizes) come out 0.

MXFP4 weights (V4 / V4.1's routed experts with quantized="resident") come as stored: a step
copies the tile's bytes [tn, tk/2] and its rows' E8M0 exponents [tn, K/32], rebuilds both
nibbles' E2M1 values from their bits, scales them (`_mxfp4_tile`; exact in bf16) and feeds
x's even and odd columns against the low and high nibbles, never interleaving the bytes.

FP8 weights (E4M3 with E8M0 exponents per (b0, b1) block: V4's (128, 128), V4.1's (32, 32))
come as stored too: a step copies the tile's bytes [tn, tk] (the E4M3 bits as int8) and the
whole expert's exponents [N/b0, K/b1] (a few KiB, copied again only when the expert changes),
decodes E4M3 by its bits and scales each element by its block's 2^(e - 127), spread over the
tile by two one-hot MXU products (`_fp8_tile`; exact in bf16), then the MXU as for bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.mgpu import pad_axis, round_up
from dsjax.kernels.dispatch import out_struct
from dsjax.kernels.tpu_blocks import blocks, compiler_params, interpret_params, vmem_budget

NT = (((1,), (1,)), ((), ()))  # x [tm, tk] . w [tn, tk] -> [tm, tn]


def group_visits(group_sizes: jax.Array, m: int, tm: int):
    """-> (expert per visit, row tile per visit, first row per group, end row per group,
    [number of used visits]) for tiles(m) + E - 1 visits, int32. The visits are the (tile,
    expert) pairs that share rows, in row order; the unused ones repeat the last used one."""
    e = group_sizes.shape[0]
    tiles = -(-m // tm)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first, last = starts // tm, (ends - 1) // tm
    per_group = jnp.where(group_sizes > 0, last - first + 1, 0)
    visit_end = jnp.cumsum(per_group)
    used = visit_end[-1]
    v = jnp.arange(tiles + e - 1)
    v = jnp.minimum(v, jnp.maximum(used - 1, 0))  # unused visits: the last used one again
    expert = jnp.minimum(jnp.searchsorted(visit_end, v, side="right"), e - 1)
    tile = jnp.clip(first[expert] + v - (visit_end[expert] - per_group[expert]), 0, tiles - 1)
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    return i32(expert), i32(tile), i32(starts), i32(ends), i32(used)[None]


def _mxfp4_tile(packed, exps, k, half: int):
    """A stored MXFP4 weight tile -> its even and odd K columns [tn, half] in fp32, exact:
    packed [tn, half] int8 (element 2j in the low nibble of byte j, 2j + 1 in the high),
    exps [tn, K/32] E8M0 exponents of the whole rows; this is K block k of `half` bytes."""
    b = packed.astype(jnp.int32) & 0xFF
    g = jax.lax.broadcasted_iota(jnp.int32, (exps.shape[1], half), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (exps.shape[1], half), 1)
    pick = (g == k * (half // 16) + (col >> 4)).astype(jnp.float32)  # byte j is in 32-group j // 16
    scale = jax.lax.bitcast_convert_type(exps.astype(jnp.int32) << 23, jnp.float32)  # 2^(e - 127)
    scale = jnp.dot(scale, pick, preferred_element_type=jnp.float32)  # [tn, half]: one-hot, exact

    def e2m1(code):  # E2M1 by its fp32 bits: 0, 0.5 (subnormal), (1 + m / 2) 2^(e - 1); bit 3 the sign
        e, m = (code >> 1) & 3, code & 1
        bits = jnp.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((code >> 3) << 31)
        return jax.lax.bitcast_convert_type(bits, jnp.float32) * scale

    return e2m1(b & 15), e2m1(b >> 4)


def _pow2_shift(b: int) -> int:
    if b < 1 or b & (b - 1):
        raise ValueError(f"FP8 block sides must be powers of two for the Mosaic TPU kernel, got {b}")
    return b.bit_length() - 1


def _fp8_tile(codes, exps, n, k, block):
    """A stored FP8 weight tile -> its values [tn, tk] in fp32, exact: codes [tn, tk] int8 (the
    E4M3 bits), exps [N/b0, K/b1] E8M0 exponents of the whole expert; this is row block n and K
    block k. E4M3FN by its bits: (1 + m/8) 2^(e - 7), subnormals m 2^-9, bit 7 the sign (the
    NaN code 0x7F / 0xFF, which no checkpoint holds, reads as 480)."""
    tn, tk = codes.shape
    nb, kb = exps.shape
    sh0, sh1 = (_pow2_shift(b) for b in block)
    b = codes.astype(jnp.int32) & 0xFF
    e, m = (b >> 3) & 15, b & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 2.0 ** -9, normal)
    scale = jax.lax.bitcast_convert_type(exps.astype(jnp.int32) << 23, jnp.float32)  # 2^(e - 127) [nb, kb]
    # one-hot spreads (exact: one power of two per sum): a tile row's row block, a tile column's K block
    rows = ((n * tn + jax.lax.broadcasted_iota(jnp.int32, (tn, nb), 0)) >> sh0
            == jax.lax.broadcasted_iota(jnp.int32, (tn, nb), 1)).astype(jnp.float32)
    cols = (jax.lax.broadcasted_iota(jnp.int32, (kb, tk), 0)
            == (k * tk + jax.lax.broadcasted_iota(jnp.int32, (kb, tk), 1)) >> sh1).astype(jnp.float32)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    if tn * kb * (nb + tk) <= nb * tk * (kb + tn):  # the cheaper order of the two products
        spread = dot(dot(rows, scale), cols)
    else:
        spread = dot(rows, dot(scale, cols))
    return jnp.where(b >= 128, -mag, mag) * spread


def _kernel(expert_ref, tile_ref, start_ref, end_ref, used_ref, *refs, tm: int, n_k: int, limit,
            round_products: bool, mxfp4: bool = False, fp8=None):
    swiglu = limit is not None
    n_w = 2 if swiglu else 1
    per_w = 2 if (mxfp4 or fp8) else 1  # refs per weight (bytes, exponents)
    n_x = 2 if mxfp4 else 1
    xs, refs = refs[:n_x], refs[n_x:]  # x, or its even and odd columns (MXFP4)
    weights = [refs[i * per_w:(i + 1) * per_w] for i in range(n_w)]
    o_ref, accs = refs[n_w * per_w], refs[n_w * per_w + 1:]
    v, k = pl.program_id(1), pl.program_id(2)
    active = v < used_ref[0]

    @pl.when(k == 0)
    def _():
        for a in accs:
            a[...] = jnp.zeros(a.shape, jnp.float32)

    @pl.when(active)
    def _():
        for a, w in zip(accs, weights):
            if mxfp4:  # dequantized in VMEM to x's dtype (exact), then the MXU
                low, high = _mxfp4_tile(w[0][0], w[1][0], k, xs[0].shape[1])
                dt = xs[0].dtype
                a[...] += (jax.lax.dot_general(xs[0][...], low.astype(dt), NT, preferred_element_type=jnp.float32)
                           + jax.lax.dot_general(xs[1][...], high.astype(dt), NT, preferred_element_type=jnp.float32))
            elif fp8:  # dequantized in VMEM to x's dtype (exact), then the MXU
                wt = _fp8_tile(w[0][0], w[1][0], pl.program_id(0), k, fp8).astype(xs[0].dtype)
                a[...] += jax.lax.dot_general(xs[0][...], wt, NT, preferred_element_type=jnp.float32)
            else:
                a[...] += jax.lax.dot_general(xs[0][...], w[0][0], NT, preferred_element_type=jnp.float32)

    @pl.when(k == n_k - 1)
    def _():
        @pl.when((v == 0) | (tile_ref[v] != tile_ref[jnp.maximum(v - 1, 0)]))
        def _():  # the tile's first visit: rows no expert of it owns stay 0
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        @pl.when(active)
        def _():
            e = expert_ref[v]
            row = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
            mine = (row >= start_ref[e]) & (row < end_ref[e])
            if swiglu:
                gate, up = accs[0][...], accs[1][...]
                if round_products:  # DeepSeek-V4.1: the products are Lin4 outputs, bf16
                    gate, up = (a.astype(jnp.bfloat16).astype(jnp.float32) for a in (gate, up))
                gate = jnp.minimum(gate, limit)
                y = gate * jax.nn.sigmoid(gate) * jnp.clip(up, -limit, limit)
            else:
                y = accs[0][...]
            o_ref[...] = jnp.where(mine, y.astype(o_ref.dtype), o_ref[...])


def fit(block: int, dim: int) -> int:
    """The widest multiple of 128 lanes up to `block` that divides `dim` (rounded up to 128):
    no padded copy of the weights at a model's widths (V4.1-Flash's I = 2304 takes 768)."""
    lanes = round_up(dim, 128) // 128
    return 128 * max(c for c in range(1, max(block // 128, 1) + 1) if lanes % c == 0)


def _plan(m, k_dim, n_dim, dtype, out_dtype, n_weights, *, tm=None, tk=None, tn=None, gen=None, mxfp4=False,
          fp8=None):
    """Static tiles, padded sizes and every block / scratch shape of one of the two kernels.
    MXFP4: the activations come as even and odd columns, a weight as its bytes [tn, tk / 2] and
    its rows' exponents [tn, K / 32], dequantized in VMEM (the values that takes). fp8: the FP8
    block (b0, b1); a weight comes as its bytes [tn, tk] and the expert's exponents [N/b0, K/b1]."""
    table = blocks("grouped_ffn", gen)
    tm = min(tm or table["tm"], round_up(m, 8))
    tk = fit(tk or table["tk"], k_dim // 2) * 2 if mxfp4 else fit(tk or table["tk"], k_dim)  # MXFP4: tk / 2 lanes
    tn = fit(tn or table["tn"], n_dim)
    mp, kp, np_ = round_up(m, tm), round_up(k_dim, tk), round_up(n_dim, tn)
    if mxfp4:
        ins = [((tm, tk // 2), dtype)] * 2 + [((1, tn, tk // 2), jnp.int8), ((1, tn, kp // 32), jnp.uint8)] * n_weights
        values = [((tn, tk // 2), jnp.float32)] * 3 + [((tm, tn), jnp.float32)] * n_weights
    elif fp8:
        nb, kb = -(-n_dim // fp8[0]), -(-k_dim // fp8[1])
        ins = [((tm, tk), dtype)] + [((1, tn, tk), jnp.int8), ((1, nb, kb), jnp.uint8)] * n_weights
        # the codes, their magnitudes, the spread scales and the one-hots / half-spread, the tile in x's dtype
        values = [((tn, tk), jnp.int32), ((tn, tk), jnp.float32), ((tn, tk), jnp.float32),
                  ((tn, max(nb, kb)), jnp.float32), ((max(nb, kb), tk), jnp.float32), ((tn, tk), dtype)] + [
                      ((tm, tn), jnp.float32)] * n_weights
    else:
        ins = [((tm, tk), dtype)] + [((1, tn, tk), dtype)] * n_weights
        values = [((tm, tn), jnp.float32)] * n_weights  # the products before they join the accumulators
    return dict(tm=tm, tk=tk, tn=tn, mp=mp, kp=kp, np=np_, ins=ins, out=((tm, tn), out_dtype),
                scratch=[((tm, tn), jnp.float32)] * n_weights, values=values)


def vmem(m, d, inter, dtype=jnp.bfloat16, gen=None, mxfp4=False, fp8=None) -> int:
    """VMEM bytes of the larger of `tpu_grouped_ffn`'s two kernels at these shapes (fp8: the
    FP8 experts' block)."""
    plans = [_plan(m, d, inter, dtype, dtype, 2, gen=gen, mxfp4=mxfp4, fp8=fp8),
             _plan(m, inter, d, dtype, jnp.float32, 1, gen=gen, mxfp4=mxfp4, fp8=fp8)]
    return max(vmem_budget(p["ins"] + [p["out"]], p["scratch"], p["values"]) for p in plans)


def _gmm(x, w, meta, *, limit, out_dtype, tiles, interpret, round_products=False, block=None):
    """One kernel: x [M, K] rows sorted by expert, w: one or two [E, N, K] -> [M, N]; an MXFP4
    weight is (bytes [E, N, K / 2] int8, exponents [E, N, K / 32] uint8), an FP8 one (E4M3
    [E, N, K] float8_e4m3fn, exponents [E, N/b0, K/b1] uint8) with `block` = (b0, b1)."""
    from jax.experimental.pallas import tpu as pltpu

    stored = isinstance(w[0], tuple)
    fp8 = tuple(block) if stored and w[0][0].dtype == jnp.float8_e4m3fn else None
    mxfp4 = stored and fp8 is None
    m, k_dim = x.shape
    n_dim = w[0][0].shape[1] if stored else w[0].shape[1]
    p = _plan(m, k_dim, n_dim, x.dtype, out_dtype, len(w), mxfp4=mxfp4, fp8=fp8, **tiles)
    tm, tk, tn = p["tm"], p["tk"], p["tn"]
    x = pad_axis(pad_axis(x, 0, p["mp"]), 1, p["kp"])
    x_at = lambda n, v, k, e, t, *_: (t[v], k)  # noqa: E731
    w_at = lambda n, v, k, e, t, *_: (e[v], n, k)  # noqa: E731
    if mxfp4:  # the product is x_even W_low^T + x_odd W_high^T: the bytes are never interleaved
        xs = [x[:, 0::2], x[:, 1::2]]
        ws = [a for packed, exps in w for a in (pad_axis(pad_axis(packed, 1, p["np"]), 2, p["kp"] // 2),
                                                  pad_axis(pad_axis(exps, 1, p["np"]), 2, p["kp"] // 32, 127))]
        specs = [pl.BlockSpec((tm, tk // 2), x_at)] * 2 + [
            pl.BlockSpec((1, tn, tk // 2), w_at), pl.BlockSpec((1, tn, p["kp"] // 32), lambda n, v, k, e, t, *_:
                                                               (e[v], n, 0))] * len(w)
    elif fp8:  # the E4M3 bits as int8 (a same-width bitcast); the expert's exponents whole
        xs = [x]
        ws = [a for q, exps in w for a in (
            pad_axis(pad_axis(jax.lax.bitcast_convert_type(q, jnp.int8), 1, p["np"]), 2, p["kp"]), exps)]
        nb, kb = w[0][1].shape[1:]
        specs = [pl.BlockSpec((tm, tk), x_at)] + [
            pl.BlockSpec((1, tn, tk), w_at), pl.BlockSpec((1, nb, kb), lambda n, v, k, e, t, *_: (e[v], 0, 0))] * len(w)
    else:
        xs = [x]
        ws = [pad_axis(pad_axis(a.astype(x.dtype), 1, p["np"]), 2, p["kp"]) for a in w]
        specs = [pl.BlockSpec((tm, tk), x_at)] + [pl.BlockSpec((1, tn, tk), w_at)] * len(w)
    grid = (p["np"] // tn, meta[0].shape[0], p["kp"] // tk)  # (column block, visit, contraction block)
    kernel = functools.partial(_kernel, tm=tm, n_k=grid[2], limit=limit, round_products=round_products, mxfp4=mxfp4,
                               fp8=fp8)
    out = pl.pallas_call(
        kernel, name="dsjax_grouped_ffn_" + ("gate_up" if limit is not None else "down"),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta), grid=grid, in_specs=specs,
            out_specs=pl.BlockSpec((tm, tn), lambda n, v, k, e, t, *_: (t[v], n)),
            scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in p["scratch"]]),
        out_shape=out_struct((p["mp"], p["np"]), out_dtype, x),
        # the visits of one tile write the same output block: in order on one core
        compiler_params=compiler_params("parallel", "arbitrary", "arbitrary"),
        interpret=interpret_params(interpret),
    )(*meta, *xs, *ws)
    return out[:m, :n_dim]


@functools.partial(jax.jit, static_argnames=("limit", "tm", "tk", "tn", "interpret", "down", "block"))
def tpu_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, limit: float, tm: int | None = None, tk: int | None = None,
                    tn: int | None = None, interpret=False, scale=None, down=None, block=None):
    """Same contract as `grouped_matmul.reference`: x_sorted [M, D] rows sorted by expert,
    group_sizes [E], w1 / w3 [E, I, D], w2 [E, D, I] -> [M, D] fp32; or each weight MXFP4 as
    stored, (bytes [E, N, K / 2] int8, E8M0 exponents [E, N, K / 32] uint8), dequantized in VMEM
    to x's dtype (exact: E2M1 values times a power of two) before the MXU; or each FP8 as
    stored, (E4M3 [E, N, K] float8_e4m3fn, E8M0 exponents [E, ceil(N/b0), ceil(K/b1)] uint8)
    with `block` = (b0, b1) (powers of two), dequantized the same way. Tiles default to this
    TPU generation's (tpu_blocks.BLOCKS); D and I are padded to them with zeros (which add
    nothing). With `down` (`grouped_matmul.hidden`, DeepSeek-V4.1's Lin4) the first kernel
    rounds gate and up to bf16 and writes h in fp32, and `down(h, scale)` runs between the two
    kernels, in `hidden`'s order."""
    m = x_sorted.shape[0]
    tiles = dict(tm=tm, tk=tk, tn=tn)
    row_tm = _plan(m, 1, 1, x_sorted.dtype, x_sorted.dtype, 1, **tiles)["tm"]  # both kernels' row tile
    meta = group_visits(group_sizes.astype(jnp.int32), m, row_tm)
    h = _gmm(x_sorted, [w1, w3], meta, limit=limit, tiles=tiles, interpret=interpret, block=block,
             out_dtype=x_sorted.dtype if down is None else jnp.float32, round_products=down is not None)
    if down is not None:
        h = down(h, scale).astype(x_sorted.dtype)
    y = _gmm(h, [w2], meta, limit=None, out_dtype=jnp.float32, tiles=tiles, interpret=interpret, block=block)
    return jnp.where((jnp.arange(m) < jnp.sum(group_sizes))[:, None], y, 0.0)  # rows no visit reaches
