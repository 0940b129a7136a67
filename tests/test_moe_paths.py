"""The routed-expert implementations (weight gather, sorted grouped matmul via ragged_dot,
the CPU tile loop) are the same function: compared on random, skewed and empty routings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers.moe import routed_experts


@pytest.fixture(scope="module")
def tiny():
    m = dsjax.load_model("tiny", dtype="float32", seed=3)
    return m.config, m.params.blocks[1].moe


def _dense_reference(p, x, weights, idx, limit):
    """Per token, per chosen expert, in numpy float64."""
    x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, p.w1, p.w3, p.w2))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(idx[t])):
            g = np.minimum(w1[e] @ x[t], limit)
            u = np.clip(w3[e] @ x[t], -limit, limit)
            out[t] += float(weights[t, j]) * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    return out


ROUTINGS = {
    "random": lambda rng, t, k, e: np.stack([rng.permutation(e)[:k] for _ in range(t)]),
    "all_one_expert": lambda rng, t, k, e: np.tile(np.arange(k), (t, 1)),  # others empty
    "two_experts_skewed": lambda rng, t, k, e: np.stack([[0 if rng.random() < 0.9 else 5, 7] for _ in range(t)]),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_paths_agree(tiny, routing, tokens):
    cfg, p = tiny
    rng = np.random.default_rng(tokens)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    x = jnp.asarray(rng.normal(size=(tokens, cfg.hidden_size)) * 3, jnp.float32)
    idx = jnp.asarray(ROUTINGS[routing](rng, tokens, k, e), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.5, size=(tokens, k)), jnp.float32)
    want = _dense_reference(p, x, weights, idx, cfg.swiglu_limit)
    scale = np.abs(want).max()
    for path in ("gather", "grouped", "tiled", "pallas"):
        got = jax.jit(lambda p, x, w, i: routed_experts(p, x, w, i, cfg, path=path))(p, x, weights, idx)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale, rtol=0, err_msg=path)
