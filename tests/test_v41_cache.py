"""dsjax's V4.1 cached path (prefill chunks, then one-token decodes) against the float64 numpy
oracle's decode mode (tests/v41_oracle.py, written from the spec), against dsjax's own
full-sequence forward, and what the cache stores.

tiny-v41 with the random weights of test_v41_forward.py (unit gain, perturbed norms / hc / sinks /
router biases) and Engram rows, B = 2, 20 positions (window 8, ratio-2 layers 2-9 with sources
2, 5, 8, ratio-1 layers 10-15 with source 10, top-k 4, candidate blocks 2 of 2):
* quirk mode (the reference): a 7-token prefill (an odd token left in the ratio-2 compressors'
  slot 0) and 13 one-token decodes at positions 7..19, so the window slides, even positions use
  the keys layer 10 published (§2.7), and top-k is below the visible count;
* clean mode: chunks of 8 + 8 (one row idle in each second-chunk call) + 4 decodes, against
  `v41_streams` over all 20 positions;
* round trips on: the rows a prefill writes are fixed points of their QDQs (§2.12).
Six compiled programs (chunk 7 / 1 quirk, chunk 8 / 1 / full sequence clean, chunk 8 round trips).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import RuntimeOptions, load_config
from dsjax.layers.qdq import qdq_fp4_e4m3, qdq_fp4_e8m0, qdq_fp8
from dsjax.model import layer_slot
from dsjax.model.cache import init_cache, take_rows
from dsjax.model.v41 import v41_logits, v41_model_specs, v41_streams, v41_streams_cached
from dsjax.params import init_params

import v41_oracle  # tests/ is on sys.path (conftest.py)
from test_v41_forward import HP, RTOL, _engram, _oracle_engram, _oracle_weights, _randomize

B, T = 2, 20  # rows, positions in all (test_v41_forward's _engram draws rows for 20 positions)
P = 7  # quirk-mode prefill: odd, so each ratio-2 source keeps token 6 open in slot 0
CHUNK = 8  # clean mode: prefill and second chunk share one program
CAP = 32  # cache capacity = ctx_bucket, a multiple of both ratios
# Cached against full-sequence dsjax, both fp32: the same arithmetic in other shapes and orders,
# measured ~1e-7; 1e-5 still catches any mechanism slip (those move logits by >= 0.1).
SELF_RTOL = 1e-5
QUIRK = RuntimeOptions(round_trips=False)  # index_keys_from_owner=False: the reference's §2.7 rule
CLEAN = QUIRK.replace(index_keys_from_owner=True)
ROUND_TRIPS = RuntimeOptions(index_keys_from_owner=True)  # round_trips on (the default)
RATIO2_SOURCES = [layer for layer in HP["index_source_layer_ids"] if HP["compress_ratios"][layer] == 2]


def _rel_err(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def model():
    cfg = load_config("tiny-v41")
    rng = np.random.default_rng(0)
    params = _randomize(init_params(v41_model_specs(cfg, jnp.float32), seed=0), rng)
    tokens = np.asarray(rng.integers(0, cfg.vocab_size, (B, T)), np.int32)
    eweights, erows = _engram(cfg, rng)
    ids = cfg.v41.engram.layer_ids
    params = params.replace(engram=tuple(eweights[layer] for layer in ids))
    weights = _oracle_weights(params, cfg)
    weights["engram"] = _oracle_engram(eweights, erows)

    def rows(s, c):  # the Engram rows of positions s..s+c (they depend only on the tokens)
        return tuple(erows[layer][:, s:s + c] for layer in ids)

    def _step(params, tokens, cache, erows, n_valid, opts):
        streams, pi, cache, _ = v41_streams_cached(params, tokens, cfg, cache, ctx_bucket=CAP, n_valid=n_valid,
                                                   engram_rows=erows, opts=opts)
        return v41_logits(params, streams, pi, cfg), cache

    step_jit = jax.jit(_step, static_argnames="opts")

    def step(cache, s, c, opts, n_valid=None):
        """Positions s..s+c of both rows (n_valid [B]: how many of them each row takes)."""
        n_valid = jnp.full((B,), c, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
        logits, cache = step_jit(params, jnp.asarray(tokens[:, s:s + c]), cache, rows(s, c), n_valid, opts=opts)
        return np.asarray(logits), cache

    return dict(cfg=cfg, params=params, tokens=tokens, rows=rows, weights=weights, step=step,
                empty=lambda: init_cache(cfg, B, CAP, jnp.float32))


# ----------------------------------------------------------------------------- a. quirk mode
@pytest.fixture(scope="module")
def quirk(model):
    step, cache = model["step"], model["empty"]()
    got = []
    logits, cache = step(cache, 0, P, QUIRK)
    got.append(logits)
    for t in range(P, T):
        logits, cache = step(cache, t, 1, QUIRK)
        got.append(logits)
    got = np.concatenate(got, axis=1)  # [B, T, V]

    prefill_trace, calls = {}, {}
    ref, _ = v41_oracle.forward(model["weights"], model["tokens"][:, :P], HP, trace=prefill_trace)
    ref = [ref]
    states = prefill_trace["published"]
    for t in range(P, T):
        trace = {}
        logits, _ = v41_oracle.decode_step(model["weights"], states, model["tokens"][:, t], t, HP, trace=trace)
        ref.append(logits[:, None])
        calls[t] = trace["calls"]
    return got, np.concatenate(ref, axis=1), calls


def test_quirk_decode_matches_oracle(quirk):
    """Prefill + one-token decodes = the reference's decode semantics (§2.3-2.8), Engram included."""
    got, ref, _ = quirk
    assert got.shape == ref.shape == (B, T, HP["vocab_size"])
    errs = {t: _rel_err(got[:, t], ref[:, t]) for t in range(T)}
    bad = {t: e for t, e in errs.items() if not e < RTOL}
    assert not bad, f"positions whose logits differ from the oracle (relative error): {bad}"


def test_quirk_data_exercises_the_rules(quirk):
    """The decodes reach the rules they are meant to check, so the match above can fail."""
    _, _, calls = quirk
    assert T - 1 >= HP["sliding_window"] + P  # decodes overwrite ring slots the prefill wrote
    changed = [(t, b, layer) for t, rows in calls.items() if t % 2 == 0 for b, call in enumerate(rows)
               for layer in RATIO2_SOURCES if call["topk", layer] != call["own_topk", layer]]
    assert changed, "§2.7 never changes a ratio-2 source's top-k (its own keys would select the same)"
    assert all(call["published_by", layer] == HP["candidate_source_layer_id"] for t, rows in calls.items()
               if t % 2 == 0 for call in rows for layer in RATIO2_SOURCES)
    assert all(call["published_by", layer] == layer for t, rows in calls.items() if t % 2
               for call in rows for layer in RATIO2_SOURCES)
    assert any(not call["candidates"].all() for rows in calls.values() for call in rows), \
        "the candidate mask never excludes an entry in decode"
    assert any(len(call["topk", layer]) < (t + 1) // 2 for t, rows in calls.items() for call in rows
               for layer in RATIO2_SOURCES), "top-k never below the visible ratio-2 entries"


# ----------------------------------------------------------------------------- b. clean mode
@pytest.fixture(scope="module")
def clean(model):
    step, cache0 = model["step"], model["empty"]()
    first, cache1 = step(cache0, 0, CHUNK, CLEAN)
    second0, cache2 = step(cache1, CHUNK, CHUNK, CLEAN, n_valid=[CHUNK, 0])  # row 1 idle
    second1, cache3 = step(cache2, CHUNK, CHUNK, CLEAN, n_valid=[0, CHUNK])  # row 0 idle
    cache, decodes = cache3, []
    for t in range(2 * CHUNK, T):
        logits, cache = step(cache, t, 1, CLEAN)
        decodes.append(logits)
    cfg, params = model["cfg"], model["params"]

    @jax.jit
    def full(params, tokens, erows):
        streams, pi, _ = v41_streams(params, tokens, cfg, engram_rows=erows, opts=CLEAN)
        return v41_logits(params, streams, pi, cfg)

    ref = np.asarray(full(params, jnp.asarray(model["tokens"]), model["rows"](0, T)))
    got = np.concatenate([first, np.stack([second0[0], second1[1]]), *decodes], axis=1)
    return dict(got=got, ref=ref, caches=(cache1, cache2, cache3))


def test_clean_chunks_and_decodes_match_full_sequence(clean):
    """index_keys_from_owner=True: chunk + chunk + decodes = dsjax's full-sequence forward."""
    got, ref = clean["got"], clean["ref"]
    assert got.shape == ref.shape == (B, T, HP["vocab_size"])
    errs = {t: _rel_err(got[:, t], ref[:, t]) for t in range(T)}
    bad = {t: e for t, e in errs.items() if not e < SELF_RTOL}
    assert not bad, f"positions whose cached logits differ from the full sequence: {bad}"


def test_idle_rows_leave_their_cache_unchanged(clean):
    """n_valid = 0: the row's cache (rings, latents, keys, compressor slots, length) is untouched."""
    cache1, cache2, cache3 = clean["caches"]
    for before, after, idle in ((cache1, cache2, 1), (cache2, cache3, 0)):
        same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), take_rows(before, idle), take_rows(after, idle))
        assert all(jax.tree.leaves(same)), f"row {idle} changed while idle"
        busy = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                            take_rows(before, 1 - idle), take_rows(after, 1 - idle))
        assert not all(jax.tree.leaves(busy))  # the other row did write


# ----------------------------------------------------------------------------- c. round trips
def _stored_rows(cfg, cache, n):
    """Per KV-source / every layer: (layer, what, rows [B, k, ·] written by a prefill of n, its QDQ)."""
    out = []
    for i, layer in enumerate(cfg.layers):
        k, j, at = layer_slot(cfg, i)
        st = jax.tree.map(lambda a: a[at], cache.layers[k][j])
        out.append((i, "window", st.window[:, :n], qdq_fp8))  # n <= W: slots 0..n-1 hold positions 0..n-1
        if st.entries is not None:
            out.append((i, "latents", st.entries[:, :n // layer.compress_ratio], qdq_fp4_e4m3))
        if st.index_keys is not None:
            out.append((i, "index keys", st.index_keys[:, :n // layer.compress_ratio], qdq_fp4_e8m0))
    return out


def test_round_trip_cache_stores_qdq_values(model, clean):
    """round_trips=True: window rows, latents and index keys are stored as their QDQ outputs
    (§2.12), i.e. fixed points of QDQ_fp8 / QDQ_fp4,e4m3 / QDQ_fp4,e8m0; without round trips
    the same rows are not (so the check can fail)."""
    cfg = model["cfg"]
    assert CHUNK <= HP["sliding_window"]
    _, cache = model["step"](model["empty"](), 0, CHUNK, ROUND_TRIPS)
    kinds = set()
    for layer, what, rows, qdq in _stored_rows(cfg, cache, CHUNK):
        rows = np.asarray(rows)
        assert np.abs(rows).max() > 0, f"layer {layer} {what}: nothing written"
        back = np.asarray(qdq(jnp.asarray(rows, jnp.bfloat16)).astype(jnp.float32))
        assert np.array_equal(back, rows), f"layer {layer} {what}: stored rows are not QDQ fixed points"
        kinds.add(what)
    assert kinds == {"window", "latents", "index keys"}
    plain = clean["caches"][0]
    moved = {what for layer, what, rows, qdq in _stored_rows(cfg, plain, CHUNK)
             if not np.array_equal(np.asarray(qdq(jnp.asarray(rows, jnp.bfloat16)).astype(jnp.float32)),
                                   np.asarray(rows))}
    assert moved == kinds
