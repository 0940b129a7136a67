"""DeepSeek-V4.1's bf16 index scores with the candidate blocks' maxima as a Mosaic TPU kernel
(dsjax/kernels/tpu_candidate_scores.py), checked as test_mosaic_tpu.py checks the others: in
TPU interpret mode with the race detector against the pure-jnp rule
(dsjax/layers/candidate_selection.py), in the tiny V4.1 model, and lowered for TPU at
V4.1-Flash shapes.

The oracle is bit equality: with q and k on the FP4 grid (as V4.1's round trips leave them)
every dot is exact in fp32 in any order, the kernel rounds where the rule rounds and sums the
heads in the rule's order, and a block's max is a selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
import test_mosaic_tpu

import dsjax
from dsjax.kernels.tpu_blocks import GENERATIONS, blocks
from dsjax.kernels.tpu_candidate_scores import tpu_candidate_scores
from dsjax.layers import candidate_selection as cs

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
S = jax.ShapeDtypeStruct
race_detector = test_mosaic_tpu.race_detector  # the autouse fixture: every kernel call here with the detector on
_exported_for_tpu = test_mosaic_tpu._exported_for_tpu


def _fp4(rng, shape):
    return (rng.choice(E2M1, shape) * rng.choice([-1, 1], shape) * 2.0 ** rng.integers(-2, 2, shape)).astype(np.float32)


def _reference_beta(scores, visible, block):
    b, s, t = scores.shape
    n = -(-t // block)
    masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    masked = jnp.pad(masked, [(0, 0), (0, 0), (0, n * block - t)], constant_values=-jnp.inf)
    return jnp.max(masked.reshape(b, s, n, block), axis=-1)


@pytest.mark.parametrize("b,s,h,d,t,block,tiles", [
    (2, 3, 4, 64, 300, 8, dict(block_q=2, block_t=128)),  # 3 key blocks (a remainder), 2 query blocks (one padded)
    (3, 1, 2, 32, 130, 2, dict(block_t=128)),  # decode; tiny-v41's 2-entry blocks
])
def test_candidate_scores_match_the_bf16_rule(b, s, h, d, t, block, tiles):
    """Scores and block maxima bit for bit; rows that see nothing (a padding query), a block cut
    by the visibility bound and blocks past it; the candidate mask from the kernel's maxima is
    the rule's."""
    rng = np.random.default_rng(t)
    q, keys = jnp.asarray(_fp4(rng, (b, s, h, d)), jnp.bfloat16), jnp.asarray(_fp4(rng, (b, t, d)), jnp.bfloat16)
    w = cs.index_head_weights(jnp.asarray(rng.normal(size=(b, s, h)), jnp.float32), head_dim=d)
    pos = jnp.asarray(rng.integers(-1, 4 * t, (b, s)))
    visible = cs.visible_entries(pos, t, 4)
    scores, beta = tpu_candidate_scores(q, keys, w, jnp.sum(visible, -1, dtype=jnp.int32), block=block,
                                        interpret=True, **tiles)
    want = cs.index_scores_bf16(q, keys, w).astype(jnp.float32)
    np.testing.assert_array_equal(scores, want)
    np.testing.assert_array_equal(np.asarray(beta) + 0.0, np.asarray(_reference_beta(want, visible, block)) + 0.0)
    assert np.isneginf(np.asarray(beta)).any() and np.isfinite(np.asarray(beta)).any()
    mask = dict(k_blocks=3, block=block)
    np.testing.assert_array_equal(cs.candidate_mask(scores, visible, beta=beta, **mask),
                                  cs.candidate_mask(want, visible, **mask))


def test_v41_model_with_the_candidate_kernel(rng, monkeypatch):
    """tiny-v41 (round trips on; candidate source layer 10, 2-entry blocks, 2 kept of 4 at 32
    tokens, restricted layers after it) on the reference path with only its index scores and
    candidate maxima taken by the kernel: the reference's logits bit for bit."""
    import dsjax.model.v41.shared_attention as sa

    calls = []

    def kernel(q, keys, w, vis, *, block, impl):
        calls.append(block)
        return tpu_candidate_scores(q, keys, w, vis, block=block, interpret=True)

    model = dsjax.load_model("tiny-v41", dtype="float32")
    ids = rng.integers(0, 500, (1, 32))
    want = np.asarray(model.logits(ids))
    jax.clear_caches()  # the forward traced again, through the kernel
    monkeypatch.setattr(sa, "candidate_scores_kernel", lambda impl: True)
    monkeypatch.setattr(sa, "candidate_scores", kernel)
    got = np.asarray(model.logits(ids))
    jax.clear_caches()
    assert calls and set(calls) == {model.config.v41.candidate_block_size}
    np.testing.assert_array_equal(got, want)


def test_v41_model_logits_with_mosaic_tpu_kernels(rng):
    """tiny-v41 with every Mosaic TPU kernel (shared-KV attention, the grouped FFN, the indexer's)
    against the reference, in fp32 mechanism numerics (`round_trips=False`: the kernels reduce
    in their own order, and under the reference's FP8 round trips one fp32 ulp can move an FP8
    rounding a whole step, after which the two runs part; measured 0.17-0.23 of the logits'
    scale on this model, against 5e-7 without round trips)."""
    base = dsjax.load_model("tiny-v41", dtype="float32")
    ref = base.replace(options=base.options.replace(round_trips=False, index_keys_from_owner=True))
    tpu = ref.replace(options=ref.options.replace(kernels="mosaic_tpu"))
    ids = rng.integers(3, 5000, (1, 32))
    want = np.asarray(ref.logits(ids))
    np.testing.assert_allclose(np.asarray(tpu.logits(ids)), want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("b,s,t", [(32, 1, 262144), (2, 256, 8192), (1, 100, 8192)])
@pytest.mark.parametrize("gen", GENERATIONS)
def test_candidate_scores_lower_for_tpu(b, s, t, gen):
    """V4.1-Flash's indexer (32 heads x 128, 8-entry blocks): decode at 1M tokens of context, a
    prefill chunk, a chunk no query block divides; each generation's blocks (v5e's 4-query
    blocks included)."""
    avals = [S((b, s, 32, 128), jnp.bfloat16), S((b, t, 128), jnp.bfloat16), S((b, s, 32), jnp.bfloat16),
             S((b, s), jnp.int32)]
    text = _exported_for_tpu(lambda *a: tpu_candidate_scores(*a, block=8, **blocks("index_scores", gen)), *avals)
    assert "tpu_custom_call" in text and "dsjax_candidate_scores" in text


def test_the_dispatch_picks_the_kernel_under_mosaic_tpu_only():
    from dsjax.kernels.index_scores import candidate_scores, candidate_scores_kernel

    assert candidate_scores_kernel("mosaic_tpu") and not candidate_scores_kernel("reference")
    with pytest.raises(ValueError, match="Mosaic TPU kernel only"):
        candidate_scores(None, None, None, None, block=8, impl="reference")
    with pltpu.force_tpu_interpret_mode(None), pytest.raises(ValueError, match="power of two"):
        tpu_candidate_scores(jnp.zeros((1, 1, 2, 32)), jnp.zeros((1, 8, 32)), jnp.zeros((1, 1, 2)),
                             jnp.zeros((1, 1), jnp.int32), block=6)
