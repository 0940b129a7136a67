"""V4.1's number formats and the quantised products built on them (spec §0 Lin8 / Lin4, §7.2-7.4).

Formats (§7.2):

    E4M3FN   sign | 4-bit exponent (bias 7) | 3-bit mantissa; max ±448, subnormal step 2^-9, no ∞.
             e4m3(x) = RNE(clip(x, -448, 448)): saturates, never NaN.
    E2M1     codes 0..7 -> {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign; RNE with ties to the even code
             (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    UE8M0    exponent byte e, value 2^(e-127).
    P(a, M) = 2^ceil(log2(a · fp32(1/M))): the product p is formed in fp32, and the exponent is read
             from p's bit pattern, +1 when p's mantissa bits are not all zero (no float log2).

Round trips (all take bf16 input, as the vendor kernels do; groups run along the last axis):

    QDQ_fp8 /32          a = max(amax, 1e-4),    s = P(a, 448),  q = e4m3(x/s),                x̂ = bf16(q·s)
    QDQ_fp4 /32, e8m0    a = max(amax, 6·2^-126), s = P(a, 6),    x̂ = bf16(e2m1(clip(x/s, ±6))·s)
    QDQ_fp4 /16, e4m3    a = max(amax, 6·2^-9),   s = e4m3(a/6),  x̂ = bf16(e2m1(clip(x/s, ±6))·s)

Products (the activation is quantised FP8 per 32 along K, as in QDQ_fp8):

    Lin8(W, x)[o] = bf16( Σ_k  s_x[k] · s_W[o//b0, k] · Σ_{j<32} q_x[32k+j] · q_W[o, 32k+j] )
    Lin4(W, x)[o] = bf16( Σ_k  s_x[k] · 2^(S[o, k]-127) · Σ_{j<32} q_x[32k+j] · e2m1(W[o, 32k+j]) )

Each inner 32-term block sum is one fp32 dot (products of two 4-bit-significand numbers are exact
in fp32), the block is scaled by the product s_x · s_W, and the blocks are accumulated in fp32 in
K order, as the vendor kernel's register accumulator does; the output is rounded once to bf16.

Leading axes: x [..., K] and a weight [..., out, K] broadcast as in numpy over the axes before K
and before (out, K) respectively; a 2-D weight is a plain linear, x [E, T, K] against W [E, 1, out, K]
is a stacked one. The reference materialises the fp32 block sums [..., out, K/32] (K/32 times the
output) before the in-order accumulation: cheap for decode, a fused kernel's job for long prefills.

Rounding is done with integer exponent arithmetic rather than XLA's float8 conversion: that cast
turns values past 448 into NaN (the spec saturates), and how a backend lowers it is not ours to
rely on; the integer form is RNE from fp32 everywhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dsjax.layers.quantized import E2M1_SIGNED, MXFP4_GROUP, Fp8Weight
from dsjax.sharding.rules import current_mesh, reshape

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_ACT_GROUP = 32
FP8_ACT_FLOOR = 1e-4
FP4_E8M0_FLOOR = 6.0 * 2.0 ** -126
FP4_E4M3_FLOOR = 6.0 * 2.0 ** -9


# ----------------------------------------------------------------------------- exponent arithmetic
def _exponent_field(x: jax.Array) -> jax.Array:
    """The unbiased exponent of fp32 `x` as stored in its bit pattern (zero / subnormal: -127)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


def _exp2(e: jax.Array) -> jax.Array:
    """2^e in fp32 built from its bit pattern, exact for integer e (clipped to the normal range
    [-126, 127]); jnp.exp2 goes through a transcendental and need not be exact."""
    biased = (jnp.clip(e, -126, 127) + 127).astype(jnp.uint32)
    return lax.bitcast_convert_type(biased << 23, jnp.float32)


def ue8m0_value(e: jax.Array) -> jax.Array:
    """UE8M0 exponent bytes -> 2^(e-127) in fp32 (e = 0 gives the subnormal 2^-127, e = 255 NaN)."""
    e = e.astype(jnp.int32)
    return jnp.where(e == 255, jnp.nan, jnp.where(e == 0, np.float32(2.0 ** -127), _exp2(e - 127)))


def _round_minifloat(x: jax.Array, mantissa_bits: int, min_exponent: int, max_value: float) -> jax.Array:
    """RNE of fp32 `x` onto a small float grid with `mantissa_bits` and smallest normal exponent
    `min_exponent` (below it the step stays 2^(min_exponent - mantissa_bits): subnormals), after
    clamping to ±max_value. Ties go to the even mantissa, which for these formats is the even code."""
    c = jnp.clip(x.astype(jnp.float32), -max_value, max_value)
    step_exp = jnp.maximum(_exponent_field(jnp.abs(c)), min_exponent) - mantissa_bits
    # c · 2^-step is exact (a power-of-two scale that cannot underflow), so the only rounding is jnp.round's,
    # which is half-to-even; a carry into the next binade (1.9375 -> 2 in E4M3) lands on a grid point too.
    return jnp.round(c * _exp2(-step_exp)) * _exp2(step_exp)


def e4m3_round(x: jax.Array) -> jax.Array:
    """fp32 values of e4m3(x): RNE to float8_e4m3fn after clamping to ±448 (saturate, never NaN);
    subnormals down to 2^-9. NaN stays NaN. XLA's own conversion (round to nearest even): on
    XLA:CPU bitwise `_round_minifloat(x, 3, -6, 448)` for all 2^32 fp32 inputs, in a few ops
    against its many (smaller programs: docs/numerics.md)."""
    return jnp.clip(x.astype(jnp.float32), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)


def e2m1_round(x: jax.Array) -> jax.Array:
    """fp32 values of e2m1(x): RNE onto {0, ±.5, ±1, ±1.5, ±2, ±3, ±4, ±6} after clamping to ±6,
    ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)."""
    return _round_minifloat(x, mantissa_bits=1, min_exponent=0, max_value=E2M1_MAX)


# E2M1 ties between code i-1 and code i (i = 1..7); the tie goes to the even code.
_E2M1_TIES = ((0.25, 1), (0.75, 2), (1.25, 3), (1.75, 4), (2.5, 5), (3.5, 6), (5.0, 7))


def e2m1_of_quotient(x: jax.Array, s: jax.Array) -> jax.Array:
    """fp32 values of e2m1(clip(x/s, ±6)) for the correctly rounded fp32 quotient, decided without
    dividing: code = #{ties t : |x| > t·s, or |x| = t·s and the code above t is even}.

    Why not `x / s`: XLA rewrites a division by a broadcast into a multiply by the reciprocal,
    which is not the rounded quotient and moves exact ties (150 / 30 = 5 -> 4, but 150 · fp32(1/30)
    = 5.0000005 -> 6). The comparisons are exact: t·s is exact in fp32 (t has ≤ 3 significant bits,
    an E4M3 s 4). They agree with the rounded quotient because, for bf16 x and E4M3 s, an x/s that is
    not exactly a tie lies further from it than fp32's rounding can move it.

    The value is summed from the steps between codes (exact: dyadic), not gathered from a table: a
    gather from an unsharded constant by sharded codes has no sharding under an explicit mesh."""
    mag = jnp.abs(x.astype(jnp.float32))
    steps = np.diff(E2M1_SIGNED[:8])  # value(code i) - value(code i-1), i = 1..7
    value = sum(jnp.where((mag > t * s) | ((mag == t * s) & (i % 2 == 0)), jnp.float32(step), jnp.float32(0))
                for (t, i), step in zip(_E2M1_TIES, steps))
    return jnp.copysign(value, x.astype(jnp.float32))


def pow2_exponent(a: jax.Array, m: float) -> jax.Array:
    """ceil(log2(a · fp32(1/m))) as int32, read off the fp32 product's bits (§7.2). Defined for a
    normal product (the callers' amax floors keep it normal); a zero or subnormal product counts
    its exponent field as -127."""
    p = a.astype(jnp.float32) * np.float32(1.0 / m)
    mantissa = lax.bitcast_convert_type(p, jnp.uint32) & 0x7FFFFF
    return _exponent_field(p) + (mantissa != 0).astype(jnp.int32)


# ----------------------------------------------------------------------------- grouped round trips
def _whole_groups(x: jax.Array, group: int) -> jax.Array:
    """x, with its last axis gathered when it is sharded (tensor parallel) into shards that would
    split a group or hold a ragged share of them; else as is."""
    mesh = current_mesh()
    if mesh is None:
        return x
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    last = spec[x.ndim - 1]
    if last is None:
        return x
    shards = math.prod(mesh.shape[a] for a in (last if isinstance(last, tuple) else (last,)))
    if (x.shape[-1] // group) % shards == 0:
        return x
    return jax.sharding.reshard(x, P(*spec[:x.ndim - 1], None))


def _groups(x: jax.Array, group: int, what: str) -> jax.Array:
    """bf16 `x` [..., K] -> fp32 [..., K/group, group]."""
    if x.ndim == 0 or x.shape[-1] % group:
        raise ValueError(f"{what}: the last axis of x {tuple(x.shape)} must be a multiple of the group {group}")
    x = _whole_groups(x.astype(jnp.bfloat16).astype(jnp.float32), group)  # the vendor kernels read bf16
    return reshape(x, (*x.shape[:-1], x.shape[-1] // group, group))  # a sharded K keeps its sharding


def _amax(g: jax.Array, floor: float) -> jax.Array:
    """max(amax over each group, floor) as [..., n_groups, 1]."""
    return jnp.maximum(jnp.max(jnp.abs(g), axis=-1, keepdims=True), np.float32(floor))


def _fp8_groups(x: jax.Array, group: int, what: str) -> tuple[jax.Array, jax.Array]:
    """(q [..., K/g, g] e4m3 values in fp32, exponent [..., K/g, 1] int32 of s = P(max(amax, 1e-4), 448))."""
    g = _groups(x, group, what)
    e = pow2_exponent(_amax(g, FP8_ACT_FLOOR), E4M3_MAX)
    return e4m3_round(g * _exp2(-e)), e  # x/s is exact: s is a power of two


def quant_fp8(x: jax.Array, group: int = FP8_ACT_GROUP) -> tuple[jax.Array, jax.Array]:
    """§7.3 activation quantisation of bf16 x [..., K], groups of `group` along K:
    (q float8_e4m3fn [..., K], UE8M0 exponent byte uint8 [..., K/group]) with x ≈ q · 2^(byte-127)."""
    q, e = _fp8_groups(x, group, "quant_fp8")
    return reshape(q, x.shape).astype(jnp.float8_e4m3fn), (e[..., 0] + 127).astype(jnp.uint8)


def qdq_fp8(x: jax.Array, group: int = FP8_ACT_GROUP) -> jax.Array:
    """QDQ_fp8 (§7.3): bf16(e4m3(x/s) · s), s = P(max(amax, 1e-4), 448) per group of `group` along
    the last axis. Used for window, draft and main-ring KV (16 groups of 32 over 512 channels)."""
    q, e = _fp8_groups(x, group, "qdq_fp8")
    return reshape(q * _exp2(e), x.shape).astype(jnp.bfloat16)  # q · s is exact in fp32 and in bf16


def qdq_fp4_e8m0(x: jax.Array, group: int = MXFP4_GROUP) -> jax.Array:
    """QDQ_fp4/32,e8m0 (§7.4, indexer q and k): bf16(e2m1(clip(x/s, ±6)) · s),
    s = P(max(amax, 6·2^-126), 6) per group along the last axis."""
    g = _groups(x, group, "qdq_fp4_e8m0")
    e = pow2_exponent(_amax(g, FP4_E8M0_FLOOR), E2M1_MAX)
    return reshape(e2m1_round(g * _exp2(-e)) * _exp2(e), x.shape).astype(jnp.bfloat16)


def qdq_fp4_e4m3(x: jax.Array, group: int = 16) -> jax.Array:
    """QDQ_fp4/16,e4m3 (§7.4, compressed KV): bf16(e2m1(clip(x/s, ±6)) · s), s = e4m3(max(amax, 6·2^-9)/6)
    per group along the last axis. s is not a power of two, so the fp32 division x/s rounds; see
    `e2m1_of_quotient` for why it is decided by comparisons. (XLA also turns a/6 into a·fp32(1/6); for
    bf16 a that cannot change e4m3(a/6): a tie a/6 has ≤ 5 significant bits and the product's relative
    error of 2^-25 rounds back onto it, and a non-tie lies some 2^-9 (relative) away from one.)"""
    g = _groups(x, group, "qdq_fp4_e4m3")
    s = e4m3_round(_amax(g, FP4_E4M3_FLOOR) / np.float32(E2M1_MAX))
    return reshape(e2m1_of_quotient(g, s) * s, x.shape).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- quantised products
def _block_linear(x: jax.Array, w_blocks: jax.Array, w_scale: jax.Array, what: str) -> jax.Array:
    """bf16( Σ_k in order  (s_x[k] · w_scale[o, k]) · Σ_j q_x[k, j] · w_blocks[o, k, j] ).

    x [..., K] bf16; w_blocks [..., out, K/32, 32] (values exact in bf16); w_scale [..., out, K/32] fp32.
    The leading axes of x and of the weight (those before `out`) broadcast as in numpy.
    """
    q, e = _fp8_groups(x, FP8_ACT_GROUP, what)  # [..., nb, 32], [..., nb, 1]
    if q.shape[-2:] != w_blocks.shape[-2:]:
        raise ValueError(f"{what}: x has K = {x.shape[-1]} but the weight's input dimension is "
                         f"{w_blocks.shape[-2] * w_blocks.shape[-1]}")
    # E4M3 and E2M1 values are exact in bf16, so bf16 operands lose nothing; each product is exact in fp32.
    partial = jnp.einsum("...kj,...okj->...ok", q.astype(jnp.bfloat16), w_blocks.astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32)  # [..., out, nb]
    scaled = partial * (_exp2(e[..., 0])[..., None, :] * w_scale)
    # Accumulate the K blocks in order (fp32 addition is not associative; the vendor kernel walks K).
    total, _ = lax.scan(lambda acc, t: (acc + t, None), jnp.zeros(scaled.shape[:-1], jnp.float32),
                        jnp.moveaxis(scaled, -1, 0))
    return total.astype(jnp.bfloat16)


def lin8(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """Lin8 (§0, §7.3): x [..., K] bf16 times a V4.1 FP8 weight [..., out, K] (32-wide K blocks;
    any block height) -> [..., out] bf16. The activation is FP8 per 32 along K; see the module doc."""
    b0, b1 = w.block
    if b1 != FP8_ACT_GROUP:
        raise ValueError(f"lin8: the weight's block {w.block} must be {FP8_ACT_GROUP} wide along K, "
                         f"the activation's group (V4.1 stores 32x32 tiles)")
    *lead, out, inn = w.q.shape
    if inn % b1:
        raise ValueError(f"lin8: the weight's input dimension {inn} is not a multiple of {b1}")
    if w.scale_exp.shape[-2:] != (-(-out // b0), inn // b1):
        raise ValueError(f"lin8: scale_exp {tuple(w.scale_exp.shape)} does not tile the weight "
                         f"{tuple(w.q.shape)} in {w.block} blocks")
    w_scale = jnp.repeat(ue8m0_value(w.scale_exp), b0, axis=-2)[..., :out, :]  # [..., out, K/32]
    return _block_linear(x, w.q.reshape(*lead, out, inn // b1, b1), w_scale, "lin8")


def lin4(x: jax.Array, packed: jax.Array, scale_exp: jax.Array) -> jax.Array:
    """Lin4 (§0, §7.4): x [..., K] bf16 times an MXFP4 routed-expert weight -> [..., out] bf16.
    packed int8 [..., out, K/2] (element 2i in the low nibble, 2i+1 in the high one; bit 3 of a
    code is the sign), scale_exp UE8M0 uint8 [..., out, K/32]. The activation is FP8 per 32."""
    *lead, out, half = packed.shape
    inn = 2 * half
    if inn % MXFP4_GROUP or scale_exp.shape[-2:] != (out, inn // MXFP4_GROUP):
        raise ValueError(f"lin4: scale_exp {tuple(scale_exp.shape)} must be [..., {out}, {inn}/{MXFP4_GROUP}] "
                         f"for packed {tuple(packed.shape)}")
    b = packed if packed.dtype == jnp.uint8 else lax.bitcast_convert_type(packed, jnp.uint8)
    codes = jnp.stack([b & 0x0F, b >> 4], axis=-1).astype(jnp.int32)  # [..., out, K/2, 2]
    values = jnp.asarray(E2M1_SIGNED)[codes].reshape(*lead, out, inn // MXFP4_GROUP, MXFP4_GROUP)
    return _block_linear(x, values, ue8m0_value(scale_exp), "lin4")
