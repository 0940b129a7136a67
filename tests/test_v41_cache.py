"""dsjax's V4.1 cached path (prefill chunks, then one-token decodes) against the float64 numpy
oracle's decode mode and full-sequence forward (tests/v41_oracle.py, written from the spec),
and what the cache stores.

tiny-v41 with the random weights of test_v41_forward.py (unit gain, perturbed norms / hc / sinks /
router biases) and Engram rows, B = 2, 20 positions (window 8, ratio-2 layers 2-9 with sources
2, 5, 8, ratio-1 layers 10-15 with source 10, top-k 4, candidate blocks 2 of 2):
* quirk mode (the reference): an 11-token prefill (an odd token left in the ratio-2 compressors'
  slot 0) and 9 one-token decodes at positions 11..19, so the window slides, even positions use
  the keys layer 10 published (§2.7), and top-k is below the visible count; and a chunk after a
  short prefill, as long as the rule lets it be exact, against the same one-token decodes (§2.11);
* clean mode: chunks of 8 + 8 (one row idle in each second-chunk call) + 4 decodes, against
  the oracle's full sequence over all 20 positions;
* round trips on: the rows a prefill writes are fixed points of their QDQs (§2.12).
Five compiled programs (chunk 11 / 1 quirk, chunk 8 / 1 clean, chunk 8 round trips).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import RuntimeOptions, load_config
from dsjax.layers.qdq import qdq_fp4_e4m3, qdq_fp4_e8m0, qdq_fp8
from dsjax.model import layer_slot
from dsjax.model.cache import take_rows
from dsjax.model.cache_layout import init_cache
from dsjax.model.v41.backbone import v41_logits, v41_streams_cached
from dsjax.model.v41.params import v41_model_specs
from dsjax.params import init_params

import v41_oracle  # tests/ is on sys.path (conftest.py)
from test_v41_forward import HP, RTOL, _engram, _oracle_engram, _oracle_weights, _randomize

B, T = 2, 20  # rows, positions in all (test_v41_forward's _engram draws rows for 20 positions)
P = 11  # quirk-mode prefill: odd, so each ratio-2 source keeps token 10 open in slot 0
CHUNK = 8  # clean mode: prefill and second chunk share one program
CAP = 32  # cache capacity = ctx_bucket, a multiple of both ratios
# Quirk mode against the oracle (RTOL, test_v41_forward's 1e-4): measured <= 1.7e-6 at every
# position, while the oracle's clean reading (index_keys_from_owner) differs from dsjax's quirk
# mode by 0.18-0.82 at t >= 12, and decode slips tried on the oracle (latent or index-key RoPE at
# t instead of j·r, the open group's slot ignored, published keys sliced from the end) by >= 0.36
# (measured with a 7-token prefill).
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
        """Positions s..s+c of every row, or s[b]..s[b]+c of row b (n_valid [B]: how many each row takes)."""
        n_valid = jnp.full((B,), c, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
        if np.ndim(s):
            ids = jnp.asarray(np.stack([tokens[b, sb:sb + c] for b, sb in enumerate(s)]))
            erows = tuple(jnp.stack([r[b, sb:sb + c] for b, sb in enumerate(s)]) for r in rows(0, T))
        else:
            ids, erows = jnp.asarray(tokens[:, s:s + c]), rows(s, c)
        logits, cache = step_jit(params, ids, cache, erows, n_valid, opts=opts)
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
    assert P >= HP["sliding_window"]  # the prefill fills the ring: every decode overwrites a row it wrote
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


def _oracle_row(weights, tokens, b, prefill, end):
    """Row b alone: the oracle's prefill of `prefill` tokens, then one-token decodes up to `end`
    -> (the decode logits [end - prefill, V], the even positions where §2.7 changed a ratio-2
    source's top-k: its own keys would have selected other entries)."""
    w = dict(weights, engram={layer: dict(e, rows=e["rows"][b:b + 1]) for layer, e in weights["engram"].items()})
    trace, logits, changed = {}, [], []
    v41_oracle.forward(w, tokens[b:b + 1, :prefill], HP, trace=trace)
    for t in range(prefill, end):
        step = {}
        logits.append(v41_oracle.decode_step(w, trace["published"], tokens[b:b + 1, t], t, HP, trace=step)[0])
        (call,) = step["calls"]
        if t % 2 == 0 and any(call["topk", layer] != call["own_topk", layer] for layer in RATIO2_SOURCES):
            changed.append(t)
    return np.concatenate(logits), changed


def test_quirk_chunk_matches_one_token_decodes(model):
    """§2.11: a chunk after a prefill reproduces one-token decodes per row, §2.7 included, up to
    position 2 s + 1 for a chunk starting at s (`dsjax.model.interface.reference_key_rule`: past it,
    the layer-10 keys an even position scores are written by the chunk itself, later in the
    layer order; engines keep their chunks within it). Row 0: prefill 5, chunk 5..11; row 1:
    prefill 6, chunk 6..13, both the longest such chunk; at t = 10 and 12 five or six ratio-2
    entries are visible to a top-k of 4, and the oracle's trace must show the published keys
    changing a ratio-2 source's selection at an even position of the chunks (with the rule
    ignored in chunks this test failed at t = 10, 11). Reuses the quirk programs (chunk of P)."""
    step = model["step"]
    starts = (5, 6)
    _, cache = step(model["empty"](), 0, P, QUIRK, n_valid=list(starts))
    got, _ = step(cache, starts, P, QUIRK, n_valid=[s + 2 for s in starts])
    changed = []
    for b, s in enumerate(starts):
        ref, row_changed = _oracle_row(model["weights"], model["tokens"], b, s, 2 * s + 2)
        changed += row_changed
        errs = {s + i: _rel_err(got[b, i], ref[i]) for i in range(s + 2)}
        bad = {t: e for t, e in errs.items() if not e < RTOL}
        assert not bad, f"row {b} (chunk at {s}..{2 * s + 1}): positions differing from one-token decodes: {bad}"
    assert changed, "§2.7 changes no ratio-2 source's top-k in the chunks (their own keys would select the same)"


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
    # the full sequence is the reference's prefill, every index source scoring its owner's keys:
    # the oracle's forward (one fewer dsjax program to compile than dsjax's own full forward)
    ref, _ = v41_oracle.forward(model["weights"], model["tokens"], HP)
    got = np.concatenate([first, np.stack([second0[0], second1[1]]), *decodes], axis=1)
    return dict(got=got, ref=ref, caches=(cache1, cache2, cache3))


def test_clean_chunks_and_decodes_match_full_sequence(clean):
    """index_keys_from_owner=True: chunk + chunk + decodes = the full-sequence forward (the
    oracle's, which test_v41_forward holds dsjax's full forward to)."""
    got, ref = clean["got"], clean["ref"]
    assert got.shape == ref.shape == (B, T, HP["vocab_size"])
    errs = {t: _rel_err(got[:, t], ref[:, t]) for t in range(T)}
    bad = {t: e for t, e in errs.items() if not e < RTOL}
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
