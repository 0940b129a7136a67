"""Pallas kernels (interpret mode on CPU) against their pure-jnp references, over a seeded
sweep of shapes, and end to end with kernels="pallas"."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers.attention import entry_intervals, ring_positions, window_intervals
from dsjax.kernels import grouped_matmul, index_scores, sink_attention
from dsjax.config import KERNELS
from dsjax.kernels.dispatch import kernel_choice, mosaic_gpu_available, resolve_kernels
from dsjax.kernels.tpu_blocks import tpu_available


def _attention_case(rng, b, s, h, d, window, n_entries, ratio, start, per_query_k, dtype):
    """Realistic keys: the window ring (wrapped), the chunk, compressed entries."""
    starts = jnp.asarray(start, jnp.int32)
    positions = starts[:, None] + jnp.arange(s)
    slot_pos = ring_positions(starts, window)
    lo, hi = window_intervals(jnp.concatenate([slot_pos, positions], axis=1),
                              jnp.concatenate([slot_pos >= 0, jnp.ones(positions.shape, bool)], axis=1), window)
    e_lo, e_hi = entry_intervals(lo, n_entries, ratio)
    lo, hi = jnp.concatenate([lo, e_lo], 1), jnp.concatenate([hi, e_hi], 1)
    t = window + s + n_entries
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), dtype)
    kv = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    sinks = jnp.asarray(rng.normal(size=h), jnp.float32)
    kv_pq = mask_pq = None
    if per_query_k:
        kv_pq = jnp.asarray(rng.normal(size=(b, s, per_query_k, d)), dtype)
        mask_pq = jnp.asarray(rng.random((b, s, per_query_k)) < 0.7)
    return q, kv, lo, hi, positions, sinks, kv_pq, mask_pq


CASES = [
    # b, s, h, d, window, entries, ratio, start (per row), per-query k
    (2, 5, 4, 32, 8, 6, 4, [0, 3], 0),  # ring filling up; no visible entries at row 0
    (2, 1, 16, 64, 16, 40, 4, [37, 150], 0),  # decode, ring wrapped, many heads
    (1, 17, 2, 16, 8, 0, 4, [0], 0),  # window-only, chunk longer than the window
    (3, 4, 8, 32, 8, 12, 8, [5, 60, 95], 5),  # CSA: top-k per query on top of the window
    (1, 1, 1, 16, 4, 3, 128, [1000], 3),  # one token, one head
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sink_attention_kernel_fp32(case):
    args = _attention_case(np.random.default_rng(case), *CASES[case], jnp.float32)
    want = sink_attention.reference(*args)
    got = sink_attention.pallas_sink_attention(*args, block_q=4, block_k=8, interpret=True)
    chex.assert_shape(got, want.shape)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", [1, 3])
def test_sink_attention_kernel_bf16(case):
    """The reference rounds the probabilities to bf16 before the PV product (as DeepSeek's
    kernel does); the Pallas kernel keeps them fp32. Both outputs round to bf16 (2^-8
    relative), so they may differ by a few bf16 ulps of the largest output."""
    args = _attention_case(np.random.default_rng(case), *CASES[case], jnp.bfloat16)
    want = np.asarray(sink_attention.reference(*args), np.float32)
    got = np.asarray(sink_attention.pallas_sink_attention(*args, block_q=4, block_k=8, interpret=True), np.float32)
    assert np.abs(got - want).max() <= 4 * 2.0 ** -8 * np.abs(want).max()



@pytest.mark.parametrize("case", [0, 3])
def test_sink_attention_kernel_rounds_p_like_the_reference(case):
    """V4.1's round_p in an fp32 run: p to bf16 before PV, the fp32 sum in the denominator. With
    all shared keys in one kernel block the kernel's running max is the reference's max until
    the per-query keys (case 3) raise it; then one p rounding may differ (2^-9 relative)."""
    args = _attention_case(np.random.default_rng(case), *CASES[case], jnp.float32)
    want = np.asarray(sink_attention.reference(*args, round_p=True))
    got = np.asarray(sink_attention.pallas_sink_attention(*args, block_q=4, block_k=64, interpret=True, round_p=True))
    scale = np.abs(want).max()
    bound = 1e-6 if CASES[case][-1] == 0 else 2.0 ** -8
    assert np.abs(got - want).max() <= bound * scale
    plain = np.asarray(sink_attention.reference(*args))  # V4's form: differs by the rounding of p
    assert np.abs(plain - want).max() > 1e-4 * scale

def rising_max_case():
    """V4.1 attention over > 64 keys (shared 128 = two blocks of 64, a few masked, then <= 40
    per-query keys), bf16-exact fp32 inputs with spread logits: the running max of the vendor's
    64-blocking rises after the first block in many (query, head) rows."""
    rng = np.random.default_rng(0)
    b, s, h, d, t, k = 1, 3, 4, 32, 128, 40
    bf = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    q, kv, kv_pq = bf(rng.normal(size=(b, s, h, d)) * 2.5), bf(rng.normal(size=(b, t, d))), bf(rng.normal(size=(b, s, k, d)))
    lo = jnp.zeros((b, t), jnp.int32).at[:, 5:9].set(1)  # masked for query 0: positions in the blocking all the same
    hi = jnp.full((b, t), 1 << 30, jnp.int32)
    sinks = jnp.asarray(rng.normal(size=h), jnp.float32)
    mask_pq = jnp.asarray(rng.random((b, s, k)) < 0.8)
    return q, kv, lo, hi, jnp.arange(s, dtype=jnp.int32)[None], sinks, kv_pq, mask_pq


def block_maxes(args, block=64):
    """[B, S, H, n_blocks] max logit of each block of `block` keys (shared, then per-query)."""
    q, kv, lo, hi, pos, _, kv_pq, mask_pq = (np.asarray(a, np.float64) for a in args)
    seen = (pos[:, :, None] >= lo[:, None]) & (pos[:, :, None] <= hi[:, None])
    scale = q.shape[-1] ** -0.5
    logits = np.concatenate([np.where(seen[:, :, None], np.einsum("bshd,btd->bsht", q, kv) * scale, -np.inf),
                             np.where(mask_pq[:, :, None] != 0, np.einsum("bshd,bskd->bshk", q, kv_pq) * scale,
                                      -np.inf)], -1)
    n = -(-logits.shape[-1] // block) * block
    logits = np.pad(logits, [(0, 0)] * 3 + [(0, n - logits.shape[-1])], constant_values=-np.inf)
    return logits.reshape(*logits.shape[:3], -1, block).max(-1)


def test_sink_attention_round_p_running_max_over_64_blocks():
    """V4.1 (§2.9): p rounds to bf16 against the vendor's running max over blocks of 64 keys.
    With block_k=64 the Pallas kernel's online softmax is that blocking (shared keys: 128 = two
    blocks; the per-query keys: a third), so it matches the reference to fp32 rounding even where
    the max rises in a later block; the overall-max form is ~1e-3 away (2^-9 per weight)."""
    args = rising_max_case()
    bm = block_maxes(args)
    assert (bm[..., 1:] > np.maximum.accumulate(bm, -1)[..., :-1]).sum() >= 5  # the max rises late
    want = np.asarray(sink_attention.reference(*args, round_p=True))
    got = np.asarray(sink_attention.pallas_sink_attention(*args, block_q=4, block_k=64, interpret=True, round_p=True))
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


GROUPS = {
    "ragged": [3, 0, 7, 1, 0, 12, 2, 5],
    "empty_experts": [0, 0, 9, 0, 0, 0, 0, 4],
    "all_in_one_expert": [0, 0, 0, 30, 0, 0, 0, 0],
    "single_row": [0, 1, 0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("rows", [4, 8])
def test_grouped_matmul_kernel(groups, rows):
    rng = np.random.default_rng(rows)
    sizes = jnp.asarray(GROUPS[groups], jnp.int32)
    m, e, i, d = int(sizes.sum()) + 3, 8, 24, 16  # 3 padding rows past the groups
    x = jnp.asarray(rng.normal(size=(m, d)) * 2, jnp.float32)
    w1, w3 = (jnp.asarray(rng.normal(size=(e, i, d)), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(e, d, i)), jnp.float32)
    want = grouped_matmul.reference(x, sizes, w1, w3, w2, limit=7.0)
    got = grouped_matmul.pallas_grouped_ffn(x, sizes, w1, w3, w2, limit=7.0, rows=rows, interpret=True)
    chex.assert_shape(got, (m, d))
    chex.assert_trees_all_close(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert not np.asarray(got[-3:]).any()  # rows past the groups are not computed


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("rows", [4, 8])
def test_grouped_matmul_tile_loop(groups, rows):
    """The CPU formulation of the reference (what grouped_ffn runs for impl="reference" on
    CPU) over the same tile table as the kernels."""
    rng = np.random.default_rng(rows)
    sizes = jnp.asarray(GROUPS[groups], jnp.int32)
    m, e, i, d = int(sizes.sum()) + 3, 8, 24, 16
    x = jnp.asarray(rng.normal(size=(m, d)) * 2, jnp.float32)
    w1, w3 = (jnp.asarray(rng.normal(size=(e, i, d)), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(e, d, i)), jnp.float32)
    want = grouped_matmul.reference(x, sizes, w1, w3, w2, limit=7.0)
    got = grouped_matmul.tile_loop(x, sizes, w1, w3, w2, limit=7.0, rows=rows)
    chex.assert_shape(got, (m, d))
    chex.assert_trees_all_close(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert not np.asarray(got[-3:]).any()  # rows past the groups are not computed
    dispatched = grouped_matmul.grouped_ffn(x, sizes, w1, w3, w2, limit=7.0)
    chex.assert_trees_all_close(dispatched, want, atol=1e-5 * np.abs(want).max(), rtol=0)


INDEX_CASES = [
    # b, s, h, d, t
    (2, 3, 2, 32, 37),  # tiny's indexer; T off the key block
    (1, 1, 64, 128, 300),  # V4: decode, 64 index heads of 128
    (3, 9, 4, 64, 8),  # more queries than keys, S off the query block
    (1, 2, 128, 64, 130),  # 128 heads
]


def index_case(rng, b, s, h, d, t, dtype=jnp.float32):
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), dtype)
    keys = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    weights = jnp.asarray(rng.normal(size=(b, s, h)), jnp.float32)
    return q, keys, weights


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_scores_kernel(case):
    rng = np.random.default_rng(sum(case))
    q, keys, w = index_case(rng, *case)
    scale = case[3] ** -0.5
    want = index_scores.reference(q, keys, w, scale=scale)
    got = index_scores.pallas_index_scores(q, keys, w, scale=scale, interpret=True)
    chex.assert_shape(got, case[:2] + case[-1:])
    chex.assert_trees_all_close(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.fixture(scope="module")
def tiny_pair():
    return (dsjax.load_model("tiny", dtype="float32"), dsjax.load_model("tiny", dtype="float32", kernels="pallas"))


def test_model_logits_with_pallas_kernels(tiny_pair, rng):
    """Every layer type (window, CSA with the indexer's top-k gather at this length, HCA),
    both MoE kinds."""
    ref, pallas = tiny_pair
    assert pallas.options.kernels == "pallas"
    ids = rng.integers(0, 5000, (2, 72))
    np.testing.assert_allclose(pallas.logits(ids), ref.logits(ids), atol=1e-5, rtol=0)


def test_engine_greedy_with_pallas_kernels(tiny_pair, rng):
    """Prefill and decode through the kernels give the reference's tokens."""
    ref, pallas = tiny_pair
    prompts = [rng.integers(0, 5000, n).tolist() for n in (70, 9)]
    assert dsjax.generate(pallas, prompts, 6) == dsjax.generate(ref, prompts, 6)


def _lower_for_tpu(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("tpu",)).as_text()


def test_generic_kernels_block_shapes_lower_for_tpu():
    """Pallas' TPU lowering checks every block's last two dims ((8, 128)-multiples or whole):
    the attention and indexer kernels pass at tiny and at V4 shapes."""
    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    for b, s, h, t, d, k in [(2, 5, 4, 19, 32, 3), (8, 1, 64, 4096, 512, 0), (2, 128, 64, 256, 512, 512)]:
        avals = [S((b, s, h, d), bf16), S((b, t, d), bf16), S((b, t), i32), S((b, t), i32), S((b, s), i32),
                 S((h,), jnp.float32)] + ([S((b, s, k, d), bf16), S((b, s, k), jnp.bool_)] if k else [])
        assert "tpu_custom_call" in _lower_for_tpu(sink_attention.pallas_sink_attention, *avals)
    for b, s, h, d, t in [(2, 3, 2, 32, 37), (2, 64, 64, 128, 8192)]:
        avals = [S((b, s, h, d), bf16), S((b, t, d), bf16), S((b, s, h), jnp.float32)]
        assert "tpu_custom_call" in _lower_for_tpu(lambda *a: index_scores.pallas_index_scores(*a, scale=0.1), *avals)


def test_auto_picks_the_kernels_only_on_hopper_or_tpu():
    assert dsjax.load_model("tiny", kernels="auto").options.kernels == (
        "pallas" if mosaic_gpu_available() or tpu_available() else "reference")
    with pytest.raises(ValueError, match="kernels must be"):
        dsjax.load_model("tiny", kernels="triton")


def test_one_kernel_choice_rule():
    """dispatch.py's table, as every kernel file's dispatch reads it on this machine."""
    hopper, tpu = mosaic_gpu_available(), tpu_available()
    assert kernel_choice("reference") == ("reference", False)
    assert kernel_choice("mosaic_gpu") == ("mosaic_gpu", not hopper)
    assert kernel_choice("mosaic_tpu") == ("mosaic_tpu", not tpu)
    assert kernel_choice("pallas") == (("mosaic_tpu", False) if tpu else ("mosaic_gpu", False) if hopper
                                       else ("pallas", jax.default_backend() == "cpu"))
    assert resolve_kernels("auto") == ("pallas" if hopper or tpu else "reference")
    assert [resolve_kernels(k) for k in KERNELS] == list(KERNELS)
    with pytest.raises(ValueError, match="'reference', 'pallas', 'mosaic_gpu', 'mosaic_tpu', 'auto'"):
        resolve_kernels("triton")
    with pytest.raises(ValueError, match="kernel impl must be"):
        kernel_choice("auto")
