"""The Mosaic GPU kernels that read the checkpoint's stored FP8 / MXFP4 bytes
(dsjax/kernels/stored_matmul.py), checked without a GPU as test_mosaic_gpu.py checks the
others: in GPU interpret mode against the dequantize path on the same stored weights, and
lowered for sm90 at V4-Flash / V4.1-Flash shapes. (The model's logits through them:
tests/test_quantized.py.)

The oracle: `dense()` (dsjax/layers/quantized.py) dequantizes the same bytes to bf16, then
grouped_matmul.reference / an einsum with bf16 operands and fp32 accumulation. E2M1 and E4M3
values times a power of two are exact in bf16, so both sides multiply the very same numbers;
what differs is the order of the fp32 sums (the kernel walks K in 32-element steps, MXFP4's
even elements before its odd ones), ~1e-7 of the output's scale, and, in the FFN, a bf16
rounding of h that this order may move by one ulp. Tolerance: one bf16 ulp (2^-8) of the
output's largest magnitude.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mosaic_gpu import _unwaited_wgmma

from dsjax.layers.quantized import Fp4Weight, Fp8Weight
from dsjax.kernels import grouped_matmul, stored_matmul
from dsjax.kernels.mgpu import lower_for_cuda

BF16_ULP = 2.0 ** -8
S = jax.ShapeDtypeStruct


def _stored(rng, fmt, e, n, k, block):
    """Random stored bytes: every E2M1 code (signs, the subnormal 0.5, zero) / E4M3 values of
    either sign, exponents around 2^-3."""
    if fmt == "mxfp4":
        return Fp4Weight(jnp.asarray(rng.integers(-128, 128, (e, n, k // 2)), jnp.int8),
                         jnp.asarray(rng.integers(122, 128, (e, n, k // 32)), jnp.uint8))
    return Fp8Weight(jnp.asarray(rng.normal(size=(e, n, k)) * 4, jnp.float8_e4m3fn),
                     jnp.asarray(rng.integers(120, 126, (e, -(-n // block[0]), -(-k // block[1]))), jnp.uint8), block)


def _bytes(w):
    return (w.packed, w.scale_exp) if isinstance(w, Fp4Weight) else (w.q, w.scale_exp)


FFN_CASES = {  # group sizes (empty groups included), I, D; a pipeline step takes 1-4 of K's 32-groups here
    "prefill_ragged": ([3, 0, 70, 1], 64, 64),  # a group over two 64-row tiles, one empty
    "decode": ([1, 0, 0, 2, 0, 1, 0, 0], 128, 96),  # a few rows per expert, most empty; fewer rows than experts
    "one_group_padded": ([0, 0, 5], 96, 32),  # I off the 64-row block: the weights are padded
}


@pytest.mark.parametrize("fmt,block,case", [("mxfp4", None, c) for c in FFN_CASES]
                         + [("fp8", (128, 128), "prefill_ragged"), ("fp8", (32, 32), "decode"),  # V4's, V4.1's blocks
                            ("fp8", (128, 128), "one_group_padded")])
def test_stored_grouped_ffn_interpreted(fmt, block, case):
    sizes, i, d = FFN_CASES[case]
    rng = np.random.default_rng(len(sizes) + i)
    sizes = jnp.asarray(sizes, jnp.int32)
    m, e = int(sizes.sum()) + 2, len(sizes)  # two padding rows
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    w1, w3, w2 = (_stored(rng, fmt, e, n, k, block) for n, k in ((i, d), (i, d), (d, i)))
    got = np.asarray(stored_matmul.mgpu_stored_grouped_ffn(x, sizes, *map(_bytes, (w1, w3, w2)), fmt=fmt, block=block,
                                                           limit=3.0, interpret=True))
    want = np.asarray(grouped_matmul.reference(x, sizes, *(w.dense(jnp.bfloat16) for w in (w1, w3, w2)), limit=3.0))
    assert got.shape == (m, d)
    assert np.abs(got - want).max() <= BF16_ULP * np.abs(want).max()
    assert not got[-2:].any()  # rows past the groups are not computed


def test_stored_grouped_ffn_interpreted_v41_lin4():
    """DeepSeek-V4.1's Lin4 (`down`: the routing weight, then W2's FP8 round trip of h) between
    the two kernels, as grouped_matmul's kernel does it: where h's FP8 codes all agree with the
    reference's, rows differ by the summation order only (a code moved by that order moves its
    row by up to an FP8 step; the bf16 kernels' test allows 1 row in 10 the same way)."""
    from dsjax.layers.moe import lin4_down_input

    rng = np.random.default_rng(5)
    sizes = jnp.asarray([5, 0, 66, 2], jnp.int32)
    m, e, i, d = int(sizes.sum()), 4, 64, 64
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    w1, w3, w2 = (_stored(rng, "mxfp4", e, n, k, None) for n, k in ((i, d), (i, d), (d, i)))
    lin4 = dict(limit=3.0, scale=jnp.asarray(rng.uniform(0.1, 1.5, size=m), jnp.float32), down=lin4_down_input)
    got = np.asarray(stored_matmul.mgpu_stored_grouped_ffn(x, sizes, *map(_bytes, (w1, w3, w2)), fmt="mxfp4",
                                                           interpret=True, **lin4))
    want = np.asarray(grouped_matmul.reference(x, sizes, *(w.dense(jnp.bfloat16) for w in (w1, w3, w2)), **lin4))
    row_err = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert np.mean(row_err <= 1e-5) >= 0.9, np.sort(row_err)[::-1][:8]


@pytest.mark.parametrize("m,n,k,block", [(1, 96, 80, (128, 128)),  # one decode row; N and K off the tiles
                                         (5, 128, 64, (32, 32)),  # V4.1's blocks
                                         (70, 64, 256, (128, 128))])  # two row tiles, K split over two programs
def test_fp8_linear_interpreted(m, n, k, block):
    rng = np.random.default_rng(m)
    w = _stored(rng, "fp8", 1, n, k, block)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    got = np.asarray(stored_matmul.mgpu_fp8_linear(x, w.q[0], w.scale_exp[0], block=block, interpret=True))
    want = np.asarray(jnp.einsum("mk,nk->mn", x, w.dense(jnp.bfloat16)[0], preferred_element_type=jnp.float32))
    assert got.shape == (m, n)
    assert np.abs(got - want).max() <= BF16_ULP * np.abs(want).max()


def test_decode_projections_split_k_to_fill_the_gpu():
    assert stored_matmul.k_splits(programs=8, k_steps=32) == 16  # V4-Flash W_qa at batch 1: 8 column blocks
    assert stored_matmul.k_splits(programs=32, k_steps=64) == 4  # W_ob (N = 4096)
    assert stored_matmul.k_splits(programs=256, k_steps=8) == 1  # W_qb (N = 32768): the grid is full
    assert stored_matmul.k_splits(programs=2, k_steps=2) == 2  # the interpreted (70, 64, 256) case above


def test_stored_weights_the_kernels_cannot_read_are_refused():
    q, s = jnp.zeros((64, 64), jnp.float8_e4m3fn), jnp.zeros((1, 4), jnp.uint8)
    with pytest.raises(ValueError, match=r"weight: FP8 block \(128, 16\).*multiple of 32"):
        stored_matmul.mgpu_fp8_linear(jnp.zeros((1, 64)), q, s, block=(128, 16), interpret=True)
    with pytest.raises(ValueError, match=r"weight: FP8 scales \(1, 4\) do not tile the weight \(64, 64\) in \(32, 32\)"):
        stored_matmul.mgpu_fp8_linear(jnp.zeros((1, 64)), q, s, block=(32, 32), interpret=True)
    packed, bad = jnp.zeros((2, 64, 32), jnp.int8), jnp.zeros((2, 64, 3), jnp.uint8)
    with pytest.raises(ValueError, match=r"w1: MXFP4 scales \(2, 64, 3\) do not cover packed bytes \(2, 64, 32\)"):
        stored_matmul.mgpu_stored_grouped_ffn(jnp.zeros((4, 64), jnp.bfloat16), jnp.asarray([4, 0], jnp.int32),
                                              (packed, bad), (packed, bad), (packed, bad), fmt="mxfp4", limit=1.0,
                                              interpret=True)


def _ffn_avals(fmt, m, e, i, d, block):
    def w(n, k):
        if fmt == "mxfp4":
            return S((e, n, k // 2), jnp.int8), S((e, n, k // 32), jnp.uint8)
        return S((e, n, k), jnp.float8_e4m3fn), S((e, -(-n // block[0]), -(-k // block[1])), jnp.uint8)

    return [S((m, d), jnp.bfloat16), S((e,), jnp.int32), w(i, d), w(i, d), w(d, i)]


def _ffn(fmt, block):
    return lambda *a: stored_matmul.mgpu_stored_grouped_ffn(*a, fmt=fmt, block=block, limit=10.0)


@pytest.mark.parametrize("fmt,m,e,i,d,block", [
    ("mxfp4", 96, 256, 2048, 4096, None),  # V4-Flash experts, a decode batch of 16 tokens x 6
    ("mxfp4", 4096, 384, 2304, 5120, None),  # V4.1-Flash experts, a prefill chunk
    ("fp8", 96, 256, 2048, 4096, (128, 128)),  # V4-Flash widths with experts stored FP8
])
def test_stored_grouped_ffn_lowers_for_hopper(fmt, m, e, i, d, block):
    """Mosaic GPU's lowering checks the 8- and 16-bit register arithmetic, the layouts of the
    scale rows' broadcast, the wgmma operand swizzles and sm90's shared-memory budget."""
    assert lower_for_cuda(_ffn(fmt, block), *_ffn_avals(fmt, m, e, i, d, block)).count("mosaic_gpu") >= 2


@pytest.mark.parametrize("m,n,k,block", [(8, 32768, 1024, (128, 128)),  # V4-Flash W_qb, batch 8
                                         (1, 4096, 8192, (128, 128)),  # V4-Flash W_ob (o_groups x o_lora_rank)
                                         (64, 1280, 5120, (32, 32))])  # V4.1-Flash W_qa, batch 64
def test_fp8_linear_lowers_for_hopper(m, n, k, block):
    avals = [S((m, k), jnp.bfloat16), S((n, k), jnp.float8_e4m3fn),
             S((-(-n // block[0]), -(-k // block[1])), jnp.uint8)]
    assert "mosaic_gpu" in lower_for_cuda(functools.partial(stored_matmul.mgpu_fp8_linear, block=block), *avals)


@pytest.mark.parametrize("fmt,block", [("mxfp4", None), ("fp8", (32, 32))])
def test_stored_kernels_wait_for_wgmma_before_refilling_its_operands(fmt, block):
    """As test_mosaic_gpu's check: each step also rewrites its dequantized scratch tiles, which
    the previous step's wgmma must have finished reading."""
    assert _unwaited_wgmma(_ffn(fmt, block), *_ffn_avals(fmt, 128, 2, 128, 128, block)) == []
    assert _unwaited_wgmma(functools.partial(stored_matmul.mgpu_fp8_linear, block=(128, 128)),
                           S((4, 256), jnp.bfloat16), S((128, 256), jnp.float8_e4m3fn), S((1, 2), jnp.uint8)) == []
