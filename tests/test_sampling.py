"""The sampler against closed forms: top-k / top-p / min-p sets, penalties, token
statistics, logprobs, chi-square tests of the sampled distribution, and the
(seed, position)-only key derivation."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.engine.sampler import (MAX_LOGIT_BIAS, SamplingParams, SamplingState, apply_penalties, filter_logits, record_tokens, sample_tokens,
                                  token_stats, top_logprobs)

_sample_tokens = jax.jit(sample_tokens)
_apply_penalties = jax.jit(apply_penalties)
_record_tokens = jax.jit(record_tokens)
_token_stats = jax.jit(token_stats, static_argnums=2)
_top_logprobs = jax.jit(top_logprobs, static_argnums=2)
_filter_logits = jax.jit(filter_logits)


def _history(seen, counts):
    """A token history whose statistics are (seen, counts) per row: the seen-only tokens as the
    prompt, padded with an out-of-vocabulary id (ignored by the scatter), then each generated
    token `count` times. -> history [b, H], prompt_len [b], H."""
    seen, counts = np.atleast_2d(seen), np.atleast_2d(counts)
    b, v = seen.shape
    prompts = [np.flatnonzero(seen[r] & (counts[r] == 0)) for r in range(b)]
    gens = [np.repeat(np.arange(v), counts[r]) for r in range(b)]
    width = max(len(pr) for pr in prompts) + max(len(g) for g in gens)
    history = np.full((b, width), v, np.int32)
    prompt_len = np.zeros(b, np.int32)
    for r in range(b):
        prompt_len[r] = width - len(gens[r])
        history[r, : len(prompts[r])] = prompts[r]
        history[r, prompt_len[r]:] = gens[r]
    return history, prompt_len, width


def _state(b, v, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
           frequency_penalty=0.0, seed=0, history=None, prompt_len=0, bias=None):
    """A SamplingState of batch b; scalars broadcast to [b]; no history = an empty one; bias:
    per row a list of (token, bias) pairs (SamplingParams.logit_bias)."""
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (b,))  # noqa: E731
    history = np.zeros((b, 1), np.int32) if history is None else np.broadcast_to(history, (b, np.shape(history)[-1]))
    ids, values = np.zeros((b, MAX_LOGIT_BIAS), np.int32), np.zeros((b, MAX_LOGIT_BIAS), np.float32)
    for r, pairs in enumerate(bias or [()] * b):
        for j, (token, value) in enumerate(pairs):
            ids[r, j], values[r, j] = token, value
    return SamplingState(
        temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32), top_p=full(top_p, jnp.float32),
        min_p=full(min_p, jnp.float32), repetition_penalty=full(repetition_penalty, jnp.float32),
        presence_penalty=full(presence_penalty, jnp.float32), frequency_penalty=full(frequency_penalty, jnp.float32),
        seed=full(seed, jnp.uint32), history=jnp.asarray(history, jnp.int32), prompt_len=full(prompt_len, jnp.int32),
        bias_ids=jnp.asarray(ids), bias_values=jnp.asarray(values), logprobs=full(0, jnp.int32))


def sample(logits, temperature, top_k, top_p, seed, positions, seen=None, counts=None, **kw):
    """sample_tokens with per-row temperature / top-k / top-p / seed (and optional extras).
    Token statistics (seen, counts) become a history; positions are shifted past it."""
    b, v = logits.shape
    positions = np.asarray(positions, np.int32)
    if seen is not None:
        history, prompt_len, width = _history(seen, counts)
        kw.update(history=history, prompt_len=prompt_len)
        positions = positions + width
    s = _state(b, v, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **kw)
    return _sample_tokens(jnp.asarray(logits), s, jnp.asarray(positions, jnp.int32))


def _reference_keep(logits, k, p, min_p=0.0):
    """Brute force: the kept set of top-k then nucleus-p (ties at the cut-off kept), intersected
    with min-p (p >= min_p * p_max, computed in float64 from the probabilities)."""
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
    if min_p > 0:
        full = np.exp(logits.astype(np.float64) - logits.max())
        full /= full.sum()
        kept &= full >= min_p * full.max()
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


# ---------------------------------------------------------------- min-p

@pytest.mark.parametrize("k,p,min_p,temperature", [
    (0, 1.0, 0.05, 1.0), (0, 1.0, 0.2, 1.0), (0, 1.0, 0.5, 1.0), (0, 1.0, 0.2, 0.5), (0, 1.0, 0.05, 2.0),
    (5, 1.0, 0.05, 1.0), (12, 1.0, 0.2, 0.7), (0, 0.5, 0.05, 1.0), (0, 0.9, 0.2, 1.5), (7, 0.9, 0.5, 1.0),
    (3, 0.3, 0.05, 1.0), (0, 1.0, 1.0, 1.0), (0, 1.0, 0.0, 1.0)])
def test_filter_min_p_matches_brute_force(k, p, min_p, temperature):
    rng = np.random.default_rng(int(k * 1000 + p * 100 + min_p * 10 + temperature * 7))
    logits = rng.normal(size=(16, 40)).astype(np.float32) * 2
    logits[3, :5] = logits[3, 0] + 1.0  # ties at the maximum
    logits[5, 10:16] = np.sort(logits[5])[-4]  # a tied group in the middle
    logits[7, :] = 0.0  # all tied
    scaled = (logits / np.float32(temperature)).astype(np.float32)
    out = np.asarray(_filter_logits(jnp.asarray(scaled), jnp.full((16,), k, np.int32), jnp.full((16,), p, np.float32),
                                    jnp.full((16,), min_p, np.float32)))
    for i, (row, got) in enumerate(zip(scaled, out)):
        keep = _reference_keep(row, k, p, min_p)
        np.testing.assert_array_equal(np.isfinite(got), keep, err_msg=f"row {i}")
        np.testing.assert_array_equal(got[keep], row[keep])  # kept logits unchanged
        assert np.all(np.isneginf(got[~keep]))
    assert np.isfinite(out[7]).all()  # all tied: all kept


def test_filter_min_p_per_row():
    """Different top-k / top-p / min-p per row in one batch."""
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(16, 40)) * 2).astype(np.float32)
    ks = rng.choice([0, 1, 4, 10, 40], size=16).astype(np.int32)
    ps = rng.choice([1.0, 0.95, 0.6, 0.2], size=16).astype(np.float32)
    mps = rng.choice([0.0, 0.05, 0.2, 0.5, 0.9], size=16).astype(np.float32)
    out = np.asarray(_filter_logits(jnp.asarray(logits), jnp.asarray(ks), jnp.asarray(ps), jnp.asarray(mps)))
    for i in range(16):
        np.testing.assert_array_equal(np.isfinite(out[i]), _reference_keep(logits[i], ks[i], ps[i], mps[i]),
                                      err_msg=f"row {i}: k={ks[i]} p={ps[i]} min_p={mps[i]}")


# ---------------------------------------------------------------- penalties

def _np_penalties(logits, seen, counts, rp, presence, frequency):
    """HF/CTRL repetition penalty on seen tokens, OpenAI presence / frequency on generated counts."""
    logits = logits.astype(np.float64)
    rp, presence, frequency = (np.asarray(x, np.float64)[:, None] for x in (rp, presence, frequency))
    out = np.where(seen, np.where(logits > 0, logits / rp, logits * rp), logits)
    return out - presence * (counts > 0) - frequency * counts


def _random_stats(rng, b, v):
    counts = rng.integers(0, 4, size=(b, v)) * (rng.random((b, v)) < 0.3)
    seen = (counts > 0) | (rng.random((b, v)) < 0.2)  # generated, or in the prompt
    return seen, counts.astype(np.int32)


def test_penalties_closed_form():
    rng = np.random.default_rng(1)
    b, v = 6, 50
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    logits[:, 0] = 0.0  # a seen zero logit stays zero under repetition penalty
    seen, counts = _random_stats(rng, b, v)
    seen[:, 0] = True
    rp = np.array([1.0, 1.2, 0.8, 2.0, 1.5, 1.0], np.float32)
    presence = np.array([0.0, 0.5, -0.5, 2.0, 0.0, 1.0], np.float32)
    frequency = np.array([0.0, 0.3, 0.0, -1.0, 2.0, 0.1], np.float32)
    s = _state(b, v, repetition_penalty=rp, presence_penalty=presence, frequency_penalty=frequency)
    got = np.asarray(_apply_penalties(jnp.asarray(logits), s, jnp.asarray(seen), jnp.asarray(counts)))
    want = _np_penalties(logits, seen, counts, rp, presence, frequency)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], logits[0])  # neutral row: unchanged
    np.testing.assert_array_equal(got[:, 0], -presence * (counts[:, 0] > 0) - frequency * counts[:, 0])
    unseen = ~seen & (counts == 0)
    np.testing.assert_array_equal(got[unseen], logits[unseen])  # untouched tokens: bit-identical
    # each penalty alone, to pin down which term is which
    for kw, sel in [({"repetition_penalty": rp}, (rp, 0 * rp, 0 * rp)),
                    ({"presence_penalty": presence}, (1 + 0 * rp, presence, 0 * rp)),
                    ({"frequency_penalty": frequency}, (1 + 0 * rp, 0 * rp, frequency))]:
        got = np.asarray(_apply_penalties(jnp.asarray(logits), _state(b, v, **kw), jnp.asarray(seen),
                                          jnp.asarray(counts)))
        np.testing.assert_allclose(got, _np_penalties(logits, seen, counts, *sel), rtol=1e-6, atol=1e-6,
                                   err_msg=str(list(kw)))


def test_greedy_uses_penalized_logits():
    rng = np.random.default_rng(2)
    b, v = 6, 50
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    seen, counts = _random_stats(rng, b, v)
    top = logits.argmax(-1)
    seen[np.arange(b), top] = True  # penalize the raw argmax
    counts[np.arange(b), top] = 2
    rp = np.array([1.0, 1.2, 3.0, 2.0, 1.5, 10.0], np.float32)
    presence = np.array([0.0, 0.5, 1.0, 2.0, 0.0, 1.0], np.float32)
    frequency = np.array([0.0, 0.3, 0.0, 1.0, 2.0, 0.1], np.float32)
    tokens = np.asarray(sample(logits, 0.0, 0, 1.0, 3, np.arange(b), min_p=0.5, repetition_penalty=rp,
                               presence_penalty=presence, frequency_penalty=frequency, seen=seen, counts=counts))
    want = _np_penalties(logits, seen, counts, rp, presence, frequency).argmax(-1)
    np.testing.assert_array_equal(tokens, want)
    assert (want != top).any()  # the penalties did change some greedy choice


def test_logit_bias_is_added_before_everything_but_the_mask():
    """Greedy and sampled tokens with logit_bias are those of the logits plus the dense bias
    (the same keys: draws compared token for token), penalties applied after it."""
    rng = np.random.default_rng(7)
    b, v = 6, 50
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    pairs = [[(int(t), float(rng.uniform(-100, 100))) for t in rng.choice(v, size=n, replace=False)]
             for n in (0, 1, 5, 20, 3, 50)]
    pairs[1] = [(int(np.argsort(logits[1])[0]), 100.0)]  # the least likely token forced
    pairs[4] = [(int(logits[4].argmax()), -100.0)]  # the most likely banned
    dense = np.zeros((b, v), np.float32)
    for r, row in enumerate(pairs):
        for t, x in row:
            dense[r, t] = x
    positions = np.arange(b)
    for temperature in (0.0, 0.7):
        got = sample(logits, temperature, 0, 0.9, 5, positions, bias=pairs, presence_penalty=0.5,
                     seen=np.eye(b, v, dtype=bool), counts=np.eye(b, v, dtype=np.int32))
        want = sample(logits + dense, temperature, 0, 0.9, 5, positions, presence_penalty=0.5,
                      seen=np.eye(b, v, dtype=bool), counts=np.eye(b, v, dtype=np.int32))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    greedy = np.asarray(sample(logits, 0.0, 0, 1.0, 5, positions, bias=pairs))
    assert greedy[1] == pairs[1][0][0] and greedy[4] != pairs[4][0][0]


def test_logit_bias_refusals():
    assert SamplingParams(logit_bias={3: 1.5}).logit_bias == ((3, 1.5),)
    for bad, where in (({3: 101}, "logit_bias[0] bias"), ({-1: 1}, "logit_bias[0] token"),
                       ({i: 1 for i in range(MAX_LOGIT_BIAS + 1)}, "at most 300"), ([(1, 1), (1, 2)], "one bias per")):
        with pytest.raises(ValueError, match=re.escape(where)):
            SamplingParams(logit_bias=bad)


# ---------------------------------------------------------------- record_tokens

def test_record_tokens_masked():
    rng = np.random.default_rng(3)
    b, cap = 6, 16
    s = _state(b, 50, history=np.zeros((b, cap), np.int32))
    history = np.zeros((b, cap), np.int32)
    for step in range(12):
        tokens = rng.integers(0, 50, size=b).astype(np.int32)
        positions = rng.integers(0, cap, size=b).astype(np.int32)
        mask = rng.random(b) < 0.6
        if step == 0:
            mask[:] = False
        s = _record_tokens(s, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
        history[np.arange(b)[mask], positions[mask]] = tokens[mask]
        np.testing.assert_array_equal(np.asarray(s.history), history, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(s.repetition_penalty), np.ones(b, np.float32))  # settings untouched


def test_token_stats_closed_form():
    """seen = tokens at positions < position; counts = generated (positions >= prompt_len)."""
    rng = np.random.default_rng(6)
    b, cap, v = 5, 24, 30
    history = rng.integers(0, v, size=(b, cap)).astype(np.int32)
    prompt_len = np.array([0, 3, 10, 24, 7], np.int32)
    positions = np.array([5, 3, 24, 24, 0], np.int32)
    seen, counts = _token_stats(_state(b, v, history=history, prompt_len=prompt_len), jnp.asarray(positions), v)
    for r in range(b):
        want_seen = np.zeros(v, bool)
        want_seen[history[r, : positions[r]]] = True
        gen = history[r, prompt_len[r]: max(positions[r], prompt_len[r])]
        np.testing.assert_array_equal(np.asarray(seen[r]), want_seen, err_msg=str(r))
        np.testing.assert_array_equal(np.asarray(counts[r]), np.bincount(gen, minlength=v), err_msg=str(r))


# ---------------------------------------------------------------- chi-square with min-p and penalties

_CHI_LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
_CHI_SEEN = np.array([1, 0, 1, 0, 1, 0, 1, 0], bool)
_CHI_COUNTS = np.array([3, 0, 0, 0, 1, 0, 2, 0], np.int32)


@pytest.mark.parametrize("temperature,k,p,min_p,rp,presence,frequency", [
    (1.0, 0, 1.0, 0.2, 1.0, 0.0, 0.0),
    (0.7, 0, 1.0, 0.05, 1.0, 0.0, 0.0),
    (1.3, 6, 0.9, 0.25, 1.0, 0.0, 0.0),
    (0.9, 0, 1.0, 0.0, 1.3, 0.5, 0.3),
    (1.2, 0, 1.0, 0.05, 0.8, -0.4, 0.2),
    (0.8, 0, 1.0, 0.07, 1.5, 0.3, 0.5),
    (0.8, 5, 0.95, 0.02, 1.5, 0.3, 0.5),
])
def test_sampled_distribution_chi_square_min_p_penalties(temperature, k, p, min_p, rp, presence, frequency):
    n, v = 40000, len(_CHI_LOGITS)
    penalized = _np_penalties(_CHI_LOGITS[None], _CHI_SEEN[None], _CHI_COUNTS[None], [rp], [presence],
                              [frequency])[0]
    scaled = penalized / temperature
    keep = _reference_keep(scaled, k, p, min_p)
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0)
    probs /= probs.sum()
    rows = jnp.broadcast_to(jnp.asarray(_CHI_LOGITS), (n, v))
    tokens = np.asarray(sample(rows, temperature, k, p, 12345, np.arange(n), min_p=min_p, repetition_penalty=rp,
                               presence_penalty=presence, frequency_penalty=frequency, seen=_CHI_SEEN,
                               counts=_CHI_COUNTS))
    counts = np.bincount(tokens, minlength=v)
    assert counts[~keep].sum() == 0, (counts, keep)
    assert keep.sum() >= 2 and (keep.sum() < v or (k == 0 and p == 1 and min_p == 0))  # the filter bites
    expected = probs[keep] * n
    assert expected.min() >= 5
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    assert chi2 < _chi2_critical(keep.sum() - 1), (chi2, counts, expected)


# ---------------------------------------------------------------- key derivation

def test_token_depends_only_on_seed_and_position():
    rng = np.random.default_rng(4)
    b, v = 200, 50
    uniform = np.zeros((b, v), np.float32)
    seeds = rng.integers(0, 2**32, size=b, dtype=np.uint64).astype(np.uint32)
    seeds[:3] = [0, 2**32 - 1, 2**31]
    positions = rng.integers(0, 100000, size=b).astype(np.int32)
    base = np.asarray(sample(uniform, 1.0, 0, 1.0, seeds, positions))
    assert len(np.unique(base)) > 25  # 200 draws from 50 tokens cover most of them

    # same (logits, seed, position) in every row: the same token at every batch index
    for i in (0, 1, 2, 77):
        same = np.asarray(sample(uniform, 1.0, 0, 1.0, np.full(b, seeds[i]), np.full(b, positions[i])))
        assert (same == base[i]).all(), i

    # any permutation of the batch, with neighbours that have other logits and settings
    logits = (rng.normal(size=(b, v)) * 2).astype(np.float32)
    temps = rng.choice([0.0, 0.5, 1.0, 1.7], size=b).astype(np.float32)
    ks = rng.choice([0, 3, 20], size=b).astype(np.int32)
    mps = rng.choice([0.0, 0.1], size=b).astype(np.float32)
    kw = dict(temperature=temps, top_k=ks, top_p=np.ones(b, np.float32), seed=seeds, positions=positions)
    tokens = np.asarray(sample(logits, min_p=mps, **kw))
    perm = rng.permutation(b)
    permuted = np.asarray(sample(logits[perm], min_p=mps[perm], **{a: x[perm] for a, x in kw.items()}))
    np.testing.assert_array_equal(permuted, tokens[perm])

    # other seed / position: an independent draw (P(same) = 1/50, so ~4 of 200 rows agree)
    for name, s2, p2 in [("seed+1", seeds + np.uint32(1), positions),
                         ("position+1", seeds, positions + 1),
                         ("seed+1, position-1", seeds + np.uint32(1), positions - 1),
                         ("seed<->position", positions.astype(np.uint32), seeds.astype(np.int64).astype(np.int32))]:
        other = np.asarray(sample(uniform, 1.0, 0, 1.0, s2, p2))
        assert (other == base).sum() < 20, name


# ---------------------------------------------------------------- logprobs

@pytest.mark.parametrize("n", [1, 5])
def test_top_logprobs_closed_form(n):
    rng = np.random.default_rng(5)
    b, v = 6, 50
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    logits[1, 20:23] = logits[1].max() + 1.0  # a tie at the top
    tokens = rng.integers(0, v, size=b).astype(np.int32)
    tokens[2] = logits[2].argmax()
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    chosen, values, ids = _top_logprobs(jnp.asarray(logits), jnp.asarray(tokens), n)
    np.testing.assert_allclose(np.asarray(chosen), logp[np.arange(b), tokens], rtol=1e-5, atol=1e-5)
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :n]  # ties: lower id first
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_allclose(np.asarray(values), np.take_along_axis(logp, order, -1), rtol=1e-5, atol=1e-5)
    assert np.asarray(values).shape == (b, n) and np.asarray(ids).dtype == np.int32
