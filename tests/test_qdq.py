"""V4.1 number formats and quantised products (dsjax/layers/qdq.py) against the spec (§0, §7.2-7.4).

Oracles live here and are written from the spec text alone: E4M3 rounding is ml_dtypes' float32 ->
float8_e4m3fn cast after the spec's clamp; E2M1 is a nearest-grid-point search with ties broken to
the even code; P(a, M) takes numpy's fp32 product and frexp; the round trips and the products are
numpy float64 loops. Closed-form values are worked out by hand in the comments."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax.config import load_config
from dsjax.layers import qdq
from dsjax.layers.linear import linear
from dsjax.layers.norms import rms_norm
from dsjax.layers.quantized import Fp8Weight
from dsjax.layers.rope import apply_rope, rope_cos_sin
from dsjax.layers.attention import grouped_output
from dsjax.model.v41.shared_attention import SharedAttention, project_q_kv

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])

qdq_fp8 = jax.jit(qdq.qdq_fp8, static_argnames="group")
qdq_fp4_e8m0 = jax.jit(qdq.qdq_fp4_e8m0, static_argnames="group")
qdq_fp4_e4m3 = jax.jit(qdq.qdq_fp4_e4m3, static_argnames="group")
e4m3_round = jax.jit(qdq.e4m3_round)
e2m1_round = jax.jit(qdq.e2m1_round)
pow2_exponent = jax.jit(qdq.pow2_exponent, static_argnums=1)


def pow2_scale(a, m):
    """P(a, m) from the exponent the QDQs use."""
    return 2.0 ** np.asarray(pow2_exponent(a, m), np.float64)
lin8 = jax.jit(qdq.lin8)
lin4 = jax.jit(qdq.lin4)


# ----------------------------------------------------------------------------- oracles (spec text)
def e4m3_ref(v) -> np.ndarray:
    """§7.2: RNE after clamping to ±448, from fp32."""
    return np.clip(np.asarray(v, np.float32), -448, 448).astype(E4M3).astype(np.float64)


def e2m1_ref(v) -> np.ndarray:
    """Nearest of ±{0, .5, 1, 1.5, 2, 3, 4, 6} after clamping to ±6; a tie (two nearest) takes the even code."""
    v = np.clip(np.asarray(v, np.float64), -6, 6)
    dist = np.abs(np.abs(v)[..., None] - E2M1_GRID)
    nearest = dist == dist.min(axis=-1, keepdims=True)
    even = nearest & (np.arange(8) % 2 == 0)
    code = np.where(nearest.sum(-1) > 1, even.argmax(-1), nearest.argmax(-1))
    return np.sign(v) * E2M1_GRID[code]


def pow2_ref(a, m) -> np.ndarray:
    """P(a, M): the product in fp32; 2^(e-1) when it is exactly a power of two (frexp mantissa 0.5), else 2^e."""
    p = np.asarray(a, np.float32) * np.float32(1.0 / m)
    mant, e = np.frexp(p)
    return np.ldexp(1.0, np.where(mant == 0.5, e - 1, e))


def bf16(v) -> np.ndarray:
    return np.asarray(v, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def groups(x, g):
    x = np.asarray(x, np.float64)
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def fp8_act_ref(x, g=32):
    """§7.3 activation quantisation: (q [..., K/g, g], s [..., K/g, 1]) in float64."""
    xg = groups(x, g)
    s = pow2_ref(np.maximum(np.abs(xg).max(-1, keepdims=True), np.float32(1e-4)), 448)
    return e4m3_ref(xg / s), s


def qdq_fp8_ref(x, g=32):
    q, s = fp8_act_ref(x, g)
    return bf16(q * s).reshape(np.shape(x))


def qdq_fp4_e8m0_ref(x, g=32):
    xg = groups(x, g)
    s = pow2_ref(np.maximum(np.abs(xg).max(-1, keepdims=True), 6 * 2.0 ** -126), 6)
    return bf16(e2m1_ref(xg / s) * s).reshape(np.shape(x))


def qdq_fp4_e4m3_ref(x, g=16):
    xg = groups(x, g)
    a = np.maximum(np.abs(xg).max(-1, keepdims=True), 6 * 2.0 ** -9)
    s = e4m3_ref(np.float32(a) / np.float32(6))  # the spec's fp32 a/6, then RNE to e4m3
    v = np.float32(xg) / np.float32(s)  # the spec's rounding fp32 division
    return bf16(e2m1_ref(v) * s).reshape(np.shape(x))


def block_linear_ref(x, w, w_scale):
    """bf16 of Σ over 32-wide K blocks, in order, of s_x·s_W·(block dot), in float64.
    x [..., K]; w [out, K] dequantisation-free values; w_scale [out, K/32]."""
    q, s = fp8_act_ref(x)
    y = np.zeros((*np.shape(x)[:-1], w.shape[0]))
    for k in range(w.shape[1] // 32):
        part = q[..., k, :] @ w[:, 32 * k: 32 * k + 32].T  # exact in float64 (8-bit products, 32 terms)
        y += part * s[..., k, :] * w_scale[:, k]
    return bf16(y)


def bf16_ulp(v):
    """The spacing of bf16 numbers at |v| (8 significant bits)."""
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -126)))
    return 2.0 ** (e - 7)


def bf16_input(rng, shape, spread=8):
    """bf16 values whose groups of 16 differ in magnitude by up to 2^±spread, with some exact zeros."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, (*shape[:-1], shape[-1] // 16, 1)
                                                          ).repeat(16, -1).reshape(shape)
    x[rng.random(shape) < 0.05] = 0
    return bf16(x)


def f64(y):
    return np.asarray(jnp.asarray(y, jnp.float32), np.float64)


# ----------------------------------------------------------------------------- E4M3 / E2M1 / P
def test_e4m3_matches_ml_dtypes_on_random_and_every_tie(rng):
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)))
    grid = grid[np.isfinite(grid)]  # 0, 2^-9, ..., 448
    mids = (grid[1:] + grid[:-1]) / 2  # every tie, subnormal ones included
    edges = np.concatenate([grid, mids, mids.astype(np.float32) * (1 + 2.0 ** -20),
                            mids.astype(np.float32) * (1 - 2.0 ** -20), [449, 464, 480, 1e5, 3e38]])
    rand = rng.standard_normal(20000) * 2.0 ** rng.integers(-16, 12, 20000)
    v = np.concatenate([edges, -edges, rand]).astype(np.float32)
    got = np.asarray(e4m3_round(v), np.float64)
    np.testing.assert_array_equal(got, e4m3_ref(v))


def test_e4m3_closed_form_saturation_and_subnormals():
    v = np.array([448, 449, 464, 480, 1e30, np.inf, -1e30, -np.inf,  # saturate, never NaN
                  432,  # tie 13·32 / 14·32 -> 448 (even mantissa)
                  2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 3 * 2.0 ** -10,  # 2^-9 is the smallest subnormal
                  7 * 2.0 ** -9, 7.5 * 2.0 ** -9, 2.0 ** -6 * (1 + 1 / 16)], np.float32)
    want = [448, 448, 448, 448, 448, 448, -448, -448, 448,
            2.0 ** -9, 0, 2.0 ** -9, 2.0 ** -8, 7 * 2.0 ** -9, 2.0 ** -6, 2.0 ** -6]
    np.testing.assert_array_equal(np.asarray(e4m3_round(v)), want)


def test_e2m1_ties_go_to_the_even_code():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_round(ties)), [0, 1, 1, 2, 2, 4, 4])
    np.testing.assert_array_equal(np.asarray(e2m1_round(-ties)), [0, -1, -1, -2, -2, -4, -4])
    v = np.linspace(-7, 7, 2801).astype(np.float32)  # step 1/200: every tie and both sides of it
    np.testing.assert_array_equal(np.asarray(e2m1_round(v)), e2m1_ref(v))


def test_pow2_scale_boundaries():
    k = np.arange(-20, 21)
    exact = np.float32(448 * 2.0 ** k)
    up, down = np.nextafter(exact, np.float32(np.inf)), np.nextafter(exact, np.float32(0))
    # 7 · fp32(1/7) = 1 + 3·2^-26, below half an fp32 ulp: a = 448·2^k gives exactly 2^k (s = 2^k), one ulp
    # more gives a non-zero mantissa (2^(k+1)), and one ulp less rounds back up onto 2^k (0.39 ulp away).
    np.testing.assert_array_equal(np.asarray(pow2_scale(exact, 448)), 2.0 ** k)
    np.testing.assert_array_equal(np.asarray(pow2_scale(up, 448)), 2.0 ** (k + 1))
    np.testing.assert_array_equal(np.asarray(pow2_scale(down, 448)), 2.0 ** k)
    # the floors: 1e-4/448 = 2^-22.09 -> 2^-22; 6·2^-126 · fp32(1/6) = 2^-126 (1 + 2^-25) -> 2^-126 exactly
    assert float(pow2_scale(np.float32(1e-4), 448)) == 2.0 ** -22
    assert float(pow2_scale(np.float32(6 * 2.0 ** -126), 6)) == 2.0 ** -126
    assert float(pow2_scale(np.float32(6), 6)) == 1 and float(pow2_scale(np.float32(3), 6)) == 0.5


def test_pow2_scale_matches_frexp(rng):
    a = np.float32(np.abs(rng.standard_normal(5000)) * 2.0 ** rng.integers(-60, 60, 5000))
    for m in (448, 6):
        np.testing.assert_array_equal(np.asarray(pow2_scale(a, m)), pow2_ref(a, m))
        np.testing.assert_array_equal(np.asarray(pow2_exponent(a, m)), np.log2(pow2_ref(a, m)))


# ----------------------------------------------------------------------------- round trips
def test_qdq_fp8_against_float64_oracle(rng):
    x = bf16_input(rng, (4, 3, 512))
    x[0, 0, :32] = 0  # a zero group: the floor keeps s finite, x̂ = 0
    x[0, 1, :32] = 1.5 * 2.0 ** -31  # below the 1e-4 floor (worked in the next test)
    np.testing.assert_array_equal(f64(qdq_fp8(jnp.asarray(x, jnp.bfloat16))), qdq_fp8_ref(x))


def test_qdq_fp8_closed_form():
    # group 0: amax 448 -> s = P(448, 448) = 1, so x̂ = e4m3(x): 440 = 13.75·32 -> 448.
    # group 1: 1.5·2^-31 is below the floor, so s = P(1e-4, 448) = 2^-22,
    # x/s = 1.5·2^-9 is a subnormal tie -> 2·2^-9, x̂ = 2^-30 (with no floor s would be 2^-39 and x̂ exact).
    x = np.zeros(64)
    x[:4] = [448, 440, -3.25, 2.0 ** -10]  # -3.25 -> -3.25 (step .25 in [2, 4)); 2^-10 -> tie -> 0
    x[32:34] = [1.5 * 2.0 ** -31, -1.5 * 2.0 ** -31]
    want = np.zeros(64)
    want[:4] = [448, 448, -3.25, 0]
    want[32:34] = [2.0 ** -30, -(2.0 ** -30)]
    np.testing.assert_array_equal(f64(qdq_fp8(jnp.asarray(x, jnp.bfloat16))), want)
    q, e = jax.jit(qdq.quant_fp8)(jnp.asarray(x, jnp.bfloat16))
    assert q.dtype == jnp.float8_e4m3fn and e.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(e), [127, 127 - 22])
    np.testing.assert_array_equal(f64(q)[32:34], [2.0 ** -8, -(2.0 ** -8)])


def test_quant_fp8_dequantizes_to_qdq(rng):
    x = bf16_input(rng, (2, 5, 128))
    q, e = jax.jit(qdq.quant_fp8)(jnp.asarray(x, jnp.bfloat16))
    deq = groups(f64(q), 32) * np.ldexp(1.0, np.asarray(e, np.int64) - 127)[..., None]
    np.testing.assert_array_equal(deq.reshape(x.shape), qdq_fp8_ref(x))


def test_qdq_fp4_e8m0_against_float64_oracle(rng):
    x = bf16_input(rng, (4, 3, 256))
    x[1, 2, 64:96] = 0
    np.testing.assert_array_equal(f64(qdq_fp4_e8m0(jnp.asarray(x, jnp.bfloat16))), qdq_fp4_e8m0_ref(x))


def test_qdq_fp4_e8m0_closed_form():
    # group 0: amax 6 -> s = P(6, 6) = 1, the E2M1 ties land on the even code.
    # group 1: 5·2^-126 is below the floor 6·2^-126 -> s = 2^-126, x/s = 5 -> 4, x̂ = 2^-124.
    x = np.zeros(64)
    x[:8] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -5]
    x[32] = 5 * 2.0 ** -126
    want = np.zeros(64)
    want[:8] = [6, 0, 1, 1, 2, 2, 4, -4]
    want[32] = 2.0 ** -124
    np.testing.assert_array_equal(f64(qdq_fp4_e8m0(jnp.asarray(x, jnp.bfloat16))), want)


def test_qdq_fp4_e4m3_against_float64_oracle(rng):
    x = bf16_input(rng, (4, 3, 256), spread=12)
    x[2, 0, :16] = 0
    x[2, 1, :16] = 2.0 ** -9 * rng.integers(-12, 13, 16)  # scales in E4M3's subnormal range
    np.testing.assert_array_equal(f64(qdq_fp4_e4m3(jnp.asarray(x, jnp.bfloat16))), qdq_fp4_e4m3_ref(x))


def test_qdq_fp4_e4m3_closed_form():
    # amax 6·1.125 = 6.75: s = e4m3(1.125) = 1.125 (not a power of two), x/s rounds in fp32:
    # 1/1.125 = 0.888.. -> 1, 2/1.125 = 1.777.. -> 2, 6.75/1.125 = 6. Floor group: 2^-9 alone has
    # a = 6·2^-9, s = 2^-9, x̂ = 2^-9 (without the floor a/6 would round to s = 0).
    x = np.zeros(32)
    x[:4] = [6.75, 1, 2, -0.5]  # -0.5/1.125 = -0.444 -> -0.5 -> -0.5625
    x[16] = 2.0 ** -9
    want = np.zeros(32)
    want[:4] = [6.75, 1.125, 2.25, -0.5625]
    want[16] = 2.0 ** -9
    np.testing.assert_array_equal(f64(qdq_fp4_e4m3(jnp.asarray(x, jnp.bfloat16))), want)


def test_qdq_fp4_e4m3_rounds_exact_ties_of_the_quotient_and_of_the_scale():
    # group 0: amax 180 -> s = e4m3(30) = 30; 150/30 = 5 and 75/30 = 2.5 are exact E2M1 ties -> 4 and 2
    #   (a multiply by fp32(1/30) would give 5.0000005 -> 6 and 2.5000002 -> 3).
    # group 1: amax 6.375 -> a/6 = 1.0625, an E4M3 tie between 1 and 1.125 -> s = 1 (even mantissa);
    #   6.375/1 -> 6, 1.0625 -> 1.
    # group 2: amax 7.125 -> a/6 = 1.1875, a tie between 1.125 and 1.25 -> s = 1.25; 7.125/1.25 = 5.7 -> 6 -> 7.5.
    x = np.zeros(48)
    x[:3] = [180, 150, -75]
    x[16:18] = [6.375, 1.0625]
    x[32] = 7.125
    want = np.zeros(48)
    want[:3] = [180, 120, -60]
    want[16:18] = [6, 1]
    want[32] = 7.5
    np.testing.assert_array_equal(f64(qdq_fp4_e4m3(jnp.asarray(x, jnp.bfloat16))), want)


def test_e2m1_of_quotient_matches_the_rounded_division(rng):
    """Against the oracle's numpy fp32 division (correctly rounded) on bf16 x and every positive E4M3 s."""
    s = np.unique(np.arange(1, 127, dtype=np.uint8).view(E4M3).astype(np.float32))  # 2^-9 .. 448
    x = bf16(rng.standard_normal((s.size, 64)) * 4 * s[:, None]).astype(np.float32)
    x[:, :8] = (np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7])[None] * s[:, None]).astype(np.float32)
    got = np.asarray(jax.jit(qdq.e2m1_of_quotient)(x, s[:, None]))
    np.testing.assert_array_equal(got, e2m1_ref(x / s[:, None]))


def test_qdq_is_idempotent(rng):
    """A QDQ output fed back is unchanged: its group amax re-derives the same scale, or half of it
    for P-scales when the amax rounded down to 224·s (FP8) or 3·s (FP4), and the doubled grid values
    are still on the grid. For the E4M3-scaled FP4 this needs a normal scale (a/6 ≥ 2^-6): s then
    has error ≤ 2^-4, amax/s rounds to 6, and s' = e4m3(6s/6) = s."""
    x = bf16_input(rng, (6, 512))
    for f in (qdq_fp8, qdq_fp4_e8m0):
        once = f(jnp.asarray(x, jnp.bfloat16))
        np.testing.assert_array_equal(f64(f(once)), f64(once))
    x = groups(x, 16)
    x[np.abs(x).max(-1) < 0.1] += 0.1 * np.sign(rng.standard_normal(16))  # every group amax >= 6·2^-6
    once = qdq_fp4_e4m3(jnp.asarray(bf16(x.reshape(6, 512)), jnp.bfloat16))
    np.testing.assert_array_equal(f64(qdq_fp4_e4m3(once)), f64(once))


def test_qdq_fp4_e4m3_is_not_idempotent_with_a_subnormal_scale():
    """The spec taken literally: 9·2^-9 -> a/6 = 1.5·2^-9 -> s = 2·2^-9 (tie to even), x/s = 4.5 -> 4,
    x̂ = 2^-6; again: a/6 = 1.33·2^-9 -> s = 2^-9, x/s = 8 -> clip 6, x̂ = 6·2^-9."""
    x = jnp.zeros(16, jnp.bfloat16).at[0].set(9 * 2.0 ** -9)
    once = qdq_fp4_e4m3(x)
    assert f64(once)[0] == 2.0 ** -6 and f64(qdq_fp4_e4m3(once))[0] == 6 * 2.0 ** -9


def test_bad_group_names_the_shape():
    with pytest.raises(ValueError, match=r"qdq_fp8: the last axis of x \(3, 40\).*group 32"):
        qdq.qdq_fp8(jnp.zeros((3, 40), jnp.bfloat16))


# ----------------------------------------------------------------------------- Lin8 / Lin4
def random_fp8_weight(rng, lead, out, inn, block=(32, 32)):
    q = (rng.standard_normal((*lead, out, inn)) * 40).astype(np.float32)
    q = np.clip(q, -448, 448).astype(E4M3)
    e = rng.integers(110, 135, (*lead, -(-out // block[0]), inn // block[1])).astype(np.uint8)
    return Fp8Weight(q=jnp.asarray(q), scale_exp=jnp.asarray(e), block=block), q.astype(np.float64), e


def fp8_weight_scale(e, out, b0):
    """[ceil(out/b0), K/32] exponent bytes -> [out, K/32] scales."""
    return np.ldexp(1.0, e.astype(np.int64) - 127)[np.arange(out) // b0]


def assert_within_one_bf16_ulp(got, want):
    """The oracle accumulates in float64 (block sums exact), the code in fp32 in K order: the two
    agree to fp32 accuracy before the one bf16 rounding, so they may differ by that rounding's ulp."""
    assert np.all(np.abs(got - want) <= bf16_ulp(want)), np.max(np.abs(got - want) / bf16_ulp(want))
    assert np.mean(got == want) > 0.95  # most outputs are the same bf16 number (catches a biased rounding)


def test_lin8_against_numpy_block_loop(rng):
    x = bf16_input(rng, (3, 2, 256))
    w, wq, we = random_fp8_weight(rng, (), 40, 256)  # out 40: the last row block is partial
    want = block_linear_ref(x, wq, fp8_weight_scale(we, 40, 32))
    assert_within_one_bf16_ulp(f64(lin8(jnp.asarray(x, jnp.bfloat16), w)), want)


def test_linear_with_fp8_activations_is_lin8(rng):
    """The model's Lin8 (`linear(..., fp8_act=True)`: the activation's FP8 round trip, then a
    plain GEMM of the dequantized weight) is the reference's block product, and without the
    round trip most outputs are off."""
    x = bf16_input(rng, (3, 2, 256))
    w, wq, we = random_fp8_weight(rng, (), 40, 256)
    want = block_linear_ref(x, wq, fp8_weight_scale(we, 40, 32))
    xb = jnp.asarray(x, jnp.bfloat16)
    assert_within_one_bf16_ulp(f64(jax.jit(functools.partial(linear, fp8_act=True))(xb, w)), want)
    plain = f64(jax.jit(linear)(xb, w))
    assert np.mean(np.abs(plain - want) > bf16_ulp(want)) > 0.5


def test_lin8_stacked_weights_broadcast(rng):
    """Weight [2, 3, out, K] with x [2, 1, K]: each (i, j) is the 2-D product of x[i, 0] and W[i, j];
    a 128-row block height checks the scale rows repeat over `out`."""
    x = bf16_input(rng, (2, 1, 128))
    w, wq, we = random_fp8_weight(rng, (2, 3), 48, 128, block=(128, 32))
    got = f64(lin8(jnp.asarray(x, jnp.bfloat16), w))
    assert got.shape == (2, 3, 48)
    for i in range(2):
        for j in range(3):
            want = block_linear_ref(x[i, 0], wq[i, j], fp8_weight_scale(we[i, j], 48, 128))
            assert_within_one_bf16_ulp(got[i, j], want)


def test_lin8_rejects_v4_blocks_and_a_k_mismatch():
    w = Fp8Weight(q=jnp.zeros((128, 128), jnp.float8_e4m3fn), scale_exp=jnp.zeros((1, 1), jnp.uint8))
    with pytest.raises(ValueError, match=r"lin8: the weight's block \(128, 128\) must be 32 wide"):
        qdq.lin8(jnp.zeros((1, 128), jnp.bfloat16), w)
    w = Fp8Weight(q=jnp.zeros((8, 64), jnp.float8_e4m3fn), scale_exp=jnp.zeros((1, 2), jnp.uint8), block=(32, 32))
    with pytest.raises(ValueError, match=r"lin8: x has K = 96 but the weight's input dimension is 64"):
        qdq.lin8(jnp.zeros((1, 96), jnp.bfloat16), w)


def test_lin4_against_numpy_block_loop(rng):
    out, inn = 24, 192
    codes = rng.integers(0, 16, (2, out, inn))  # two stacked experts
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)  # even element low
    values = np.where(codes >= 8, -1.0, 1.0) * E2M1_GRID[codes & 7]
    e = rng.integers(115, 135, (2, out, inn // 32)).astype(np.uint8)
    x = bf16_input(rng, (2, 5, inn))
    # x [2, 5, K] against weights [2, 1, out, .]: leading axes broadcast as in numpy
    got = f64(lin4(jnp.asarray(x, jnp.bfloat16), jnp.asarray(packed[:, None]), jnp.asarray(e[:, None])))
    assert got.shape == (2, 5, out)
    for i in range(2):
        want = block_linear_ref(x[i], values[i], np.ldexp(1.0, e[i].astype(np.int64) - 127))
        assert_within_one_bf16_ulp(got[i], want)


def test_v41_attention_products_are_lin8(rng):
    """With round trips, V4.1 attention's FP8-weight products are Lin8 (spec §2.2, §2.3, §2.10):
    q_a, q_b and kv in `project_q_kv`, o_b after the plain per-group wo_a GEMM in
    `grouped_output`, against qdq.lin8 on the same FP8 weights (tiny-v41's shapes)."""
    cfg = load_config("tiny-v41")
    layer = cfg.layers[0]
    d, h, hd, rq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, ro = cfg.o_groups, cfg.o_lora_rank
    (wqa, *_), (wqb, *_), (wkv, *_), (wob, *_) = (random_fp8_weight(rng, (), o, i) for o, i in
                                                  ((rq, d), (h * hd, rq), (hd, d), (d, g * ro)))
    norm = lambda n: jnp.asarray(1 + 0.2 * rng.standard_normal(n), jnp.float32)
    woa = jnp.asarray(rng.standard_normal((g * ro, h * hd // g)) * 0.05, jnp.bfloat16)
    p = SharedAttention(q_a_proj=wqa, q_a_norm=norm(rq), q_b_proj=wqb, kv_proj=wkv, kv_norm=norm(hd),
                        o_a_proj=woa, o_b_proj=wob, sinks=jnp.zeros(h, jnp.float32))
    x = jnp.asarray(bf16_input(rng, (2, 3, d)), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(3), (2, 3))
    o = jnp.asarray(bf16_input(rng, (2, 3, h, hd)), jnp.bfloat16)

    def model(round_trips):
        cq, q, kv, _, _ = project_q_kv(p, x, positions, layer, cfg, round_trips)
        return cq, q, kv, grouped_output(p, o, cfg, round_trips)

    cos, sin = rope_cos_sin(positions, cfg.rope(layer.rope), cfg.qk_rope_head_dim)
    cq = rms_norm(lin8(x, wqa), p.q_a_norm, cfg.rms_norm_eps)
    q = apply_rope(lin8(cq, wqb).reshape(2, 3, h, hd), cos[..., None, :], sin[..., None, :])
    kv = qdq.qdq_fp8(apply_rope(rms_norm(lin8(x, wkv), p.kv_norm, cfg.rms_norm_eps), cos, sin))
    z = jnp.einsum("bsgi,goi->bsgo", o.reshape(2, 3, g, -1), woa.reshape(g, ro, -1),
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    want = [f64(a) for a in (cq, q, kv, lin8(z.reshape(2, 3, -1), wob))]
    got, plain = jax.jit(model, static_argnums=0)(True), jax.jit(model, static_argnums=0)(False)
    for name, w, a, b in zip(("cq", "q", "kv", "o_b"), want, got, plain):
        # fp32 sums in another order may round a bf16 output (and so a later FP8 code) the other way
        assert np.mean(np.abs(f64(a) - w) <= bf16_ulp(w)) > 0.97, name
        assert np.mean(np.abs(f64(b) - w) <= bf16_ulp(w)) < 0.6, name  # without the activations' round trips
