"""The sampler against closed forms: top-k / top-p sets, and a chi-square test of the
sampled distribution."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.engine.sampler import filter_logits


def _reference_keep(logits, k, p):
    """Brute force: the kept set of top-k then nucleus-p (ties at the cut-off kept)."""
    order = np.argsort(-logits, kind="stable")
    kept = np.zeros(len(logits), bool)
    kk = len(logits) if k == 0 else min(k, len(logits))
    cand = order[:kk]
    probs = np.exp(logits[cand] - logits[cand].max())
    probs /= probs.sum()
    mass, n = 0.0, 0
    for q in probs:
        if mass >= p and p < 1:
            break
        mass += q
        n += 1
    threshold = max(logits[cand[n - 1]], logits[cand[kk - 1]])
    kept[logits >= threshold] = True
    return kept


@pytest.mark.parametrize("k,p", [(0, 1.0), (5, 1.0), (0, 0.5), (7, 0.9), (1, 0.3), (0, 0.999)])
def test_filter_matches_brute_force(k, p):
    rng = np.random.default_rng(k * 100 + int(p * 100))
    logits = rng.normal(size=(16, 40)).astype(np.float32) * 2
    logits[3, :5] = logits[3, 0]  # ties
    out = np.asarray(filter_logits(jnp.asarray(logits), jnp.full((16,), k), jnp.full((16,), p, np.float32)))
    for row, got in zip(logits, out):
        np.testing.assert_array_equal(np.isfinite(got), _reference_keep(row, k, p))


def _chi2_critical(df, z=3.0902):  # alpha = 0.001, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature,k,p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_sampled_distribution_chi_square(temperature, k, p):
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 40000
    rows = jnp.broadcast_to(jnp.asarray(logits), (n, len(logits)))
    tokens = np.asarray(sample(rows, jnp.full((n,), temperature, np.float32), jnp.full((n,), k, np.int32),
                               jnp.full((n,), p, np.float32), jnp.full((n,), 7, np.uint32),
                               jnp.arange(n, dtype=np.int32)))
    keep = _reference_keep(logits / temperature, k, p)
    probs = np.where(keep, np.exp(logits / temperature), 0)
    probs /= probs.sum()
    counts = np.bincount(tokens, minlength=len(logits))
    assert counts[~keep].sum() == 0
    expected = probs[keep] * n
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    assert chi2 < _chi2_critical(keep.sum() - 1), chi2


def test_greedy_and_per_request_keys():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    temp = np.array([0, 1, 1, 0.5, 1, 0], np.float32)
    args = (jnp.asarray(temp), jnp.zeros(6, np.int32), jnp.ones(6, np.float32),
            jnp.asarray([1, 2, 3, 4, 5, 6], np.uint32), jnp.asarray([10, 11, 12, 13, 14, 15], np.int32))
    tokens = np.asarray(sample(jnp.asarray(logits), *args))
    np.testing.assert_array_equal(tokens[temp == 0], logits[temp == 0].argmax(-1))
    # each row alone, in another slot: same token (randomness from (seed, position) only)
    perm = np.array([5, 3, 1, 0, 4, 2])
    permuted = np.asarray(sample(jnp.asarray(logits[perm]), *(a[perm] for a in args)))
    np.testing.assert_array_equal(permuted, tokens[perm])
    for i in range(6):
        alone = np.asarray(sample(jnp.asarray(logits[i:i + 1]), *(a[i:i + 1] for a in args)))
        assert alone[0] == tokens[i]
