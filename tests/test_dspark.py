"""DSpark's draft head (dsjax/model/v41/dspark.py) against the float64 numpy oracle in
tests/dspark_oracle.py, written from spec §6: seeding the rings from a prefill's main_hidden,
a greedy draft (drafts, Markov-corrected logits, confidences), the ring after the window
slid, and a second draft after two committed positions were fed.

tiny-v41 (W = 8, block 5, 3 stages, 4 experts top-2, Markov rank 8) with the DSpark weights at
unit gain and the init's constant leaves perturbed (norms, mHC base / scale, sinks, router
biases), so attention, routing and mixes are far from uniform, and a Markov head whose
correction has unit scale: it moves drafts (asserted on the oracle). main_hidden comes from
the V4.1 backbone's full-sequence forward over 14 tokens (causal, so positions 12-13 carry the
hidden states a verification of them would give). B = 2 rows at different t: row 0 prefills
12 tokens, row 1 only 10 (valid mask), so rings and positions differ per row.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.config import RuntimeOptions, load_config
from dsjax.model.v41.dspark import dspark_draft, dspark_seed, dspark_state_shapes, empty_ring, sample_tokens
from dsjax.model.v41.backbone import v41_streams
from dsjax.model.v41.params import dspark_specs, v41_model_specs
from dsjax.params import init_params

import dspark_oracle  # tests/ is on sys.path (conftest.py)

# Max |error| over max |value|, fp32 against float64 through 3 stages (norms, 20 Sinkhorn
# iterations per mix, softmaxes) and a head of 129280 rows: measured 3e-7..5e-7 (logits) and
# 1e-6..2e-6 (confidences). 1e-4 leaves ~50x for accumulation order, while each error tried on
# the oracle moved the logits by far more: ring window W-1 (1.3), positions off by one (1.2),
# no sink (1.2), no inverse RoPE (1.2), a causal mask inside the block (1.1), the YaRN table
# (0.12); dropping the Markov term changes the drafts. Drafts are argmaxes, compared exactly,
# on data whose top-2 margins (>= 1.4e-3 of max |logit|) the test checks are above 10x the
# tolerance.
RTOL = 1e-4
FP32 = RuntimeOptions(round_trips=False)  # the oracle has no quantisation round trips
HP = json.loads((Path(__file__).parents[1] / "configs" / "tiny-v41.json").read_text())["text_config"]
B, S_PREFILL, FEED = 2, 12, 2
LENGTHS = np.array([12, 10])  # row 1 prefills fewer tokens: per-row t


def _randomize(tree, rng):
    """Unit-gain matrices ([..., out, in]: std 1/sqrt(in)); the init's constants perturbed."""

    def leaf(path, a):
        name = str(getattr(path[-1], "name", getattr(path[-1], "key", "")))
        shape = a.shape
        if name in ("base", "sinks") or name.startswith("router_bias"):
            v = rng.normal(0, 0.5 if name.startswith("router_bias") else 1.0, shape)
        elif name == "scale":
            v = 1.0 + 0.3 * rng.normal(size=shape)
        elif name.endswith("norm"):
            v = 1.0 + 0.2 * rng.normal(size=shape)
        elif name in ("embed", "markov_embed"):
            v = rng.normal(size=shape)
        else:
            v = rng.normal(0, shape[-1] ** -0.5, shape)
        return jnp.asarray(v, a.dtype)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def _oracle_weights(ds, main, cfg):
    """dsjax's fields -> the reference names the oracle reads (the only coupling between the two)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    stages = []
    for s in range(cfg.num_nextn_predict_layers):
        blk = jax.tree.map(lambda a: f64(a[s]), ds.stages)
        at, moe = blk.attn, blk.moe
        stages.append(dict(
            attn_norm=blk.attn_norm, ffn_norm=blk.ffn_norm,
            hc_attn=(blk.attn_hc.fn, blk.attn_hc.base, blk.attn_hc.scale),
            hc_ffn=(blk.ffn_hc.fn, blk.ffn_hc.base, blk.ffn_hc.scale),
            attn=dict(wq_a=at.q_a_proj, q_norm=at.q_a_norm, wq_b=at.q_b_proj, wkv=at.kv_proj, kv_norm=at.kv_norm,
                      wo_a=at.o_a_proj, wo_b=at.o_b_proj, attn_sink=at.sinks),
            ffn=dict(gate=moe.router, bias=moe.router_bias, w1=moe.w1, w2=moe.w2, w3=moe.w3,
                     shared_w1=moe.shared_w1, shared_w2=moe.shared_w2, shared_w3=moe.shared_w3)))
    return dict(embed=f64(main.embed), head=f64(main.lm_head), main_proj=f64(ds.main_proj),
                main_norm=f64(ds.main_norm), norm=f64(ds.norm), markov_embed=f64(ds.markov_embed),
                markov_head=f64(ds.markov_head), confidence=f64(ds.confidence[0]), stages=stages)


def _rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def case():
    """The dsjax calls (seed, draft, feed, draft) and the oracle's answers for the same inputs."""
    cfg = load_config("tiny-v41")
    rng = np.random.default_rng(0)
    ds = _randomize(init_params(dspark_specs(cfg, jnp.float32), seed=0), rng)
    main = init_params(v41_model_specs(cfg, jnp.float32), seed=1)
    main = main.replace(embed=jnp.asarray(rng.normal(size=main.embed.shape), jnp.float32),
                        lm_head=jnp.asarray(rng.normal(0, cfg.hidden_size ** -0.5, main.lm_head.shape), jnp.float32))
    n = S_PREFILL + FEED
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, n)), jnp.int32)
    hidden = jax.jit(lambda p, x: v41_streams(p, x, cfg, taps=True, opts=FP32)[2])(main, tokens)  # [B, n, 3D]
    hidden = np.asarray(hidden)

    seed = jax.jit(lambda ds, h, pos, ring, valid: dspark_seed(ds, h, pos, ring, cfg, valid, opts=FP32))
    draft = jax.jit(lambda ds, main, a, h, t, ring, temp, key: dspark_draft(ds, main, a, h, t, ring, cfg,
                                                                            temperature=temp, key=key, opts=FP32))
    rows = np.arange(B)
    out = {}
    # prefill: positions 0..11 (row 1: 0..9 valid)
    pos = np.broadcast_to(np.arange(S_PREFILL), (B, S_PREFILL))
    ring = seed(ds, jnp.asarray(hidden[:, :S_PREFILL]), jnp.asarray(pos), empty_ring(cfg, B, jnp.float32),
                jnp.asarray(pos < LENGTHS[:, None]))
    out["seeded"] = ring
    t1 = LENGTHS - 1
    anchors1 = rng.integers(0, cfg.vocab_size, B)
    greedy = dict(temp=jnp.zeros((B,), jnp.float32), key=jax.random.key(0))  # temperature 0 -> argmax
    ring, *res = draft(ds, main, jnp.asarray(anchors1), jnp.asarray(hidden[rows, t1]), jnp.asarray(t1, jnp.int32),
                       ring, **greedy)
    out["draft1"] = [np.asarray(r) for r in res]
    # a verification committed t1+1, t1+2: feed them, then draft from t2 = t1 + 2
    fpos = t1[:, None] + 1 + np.arange(FEED)
    ring = seed(ds, jnp.asarray(hidden[rows[:, None], fpos]), jnp.asarray(fpos, jnp.int32), ring,
                jnp.ones((B, FEED), bool))
    out["fed"] = ring
    t2 = t1 + FEED
    anchors2 = rng.integers(0, cfg.vocab_size, B)
    ring, *res = draft(ds, main, jnp.asarray(anchors2), jnp.asarray(hidden[rows, t2]), jnp.asarray(t2, jnp.int32),
                       ring, **greedy)
    out["draft2"] = [np.asarray(r) for r in res]
    out["ring2"] = ring
    # the same program with temperature > 0 (sampled drafts)
    _, *res = draft(ds, main, jnp.asarray(anchors2), jnp.asarray(hidden[rows, t2]), jnp.asarray(t2, jnp.int32),
                    out["fed"], temp=jnp.ones((B,), jnp.float32), key=jax.random.key(1))
    out["sampled"] = [np.asarray(r) for r in res]

    weights = _oracle_weights(ds, main, cfg)
    ref = {"draft1": [], "draft2": [], "plain1": [], "keys": []}
    for b in range(B):
        keys = [dict() for _ in weights["stages"]]
        dspark_oracle.seed(weights, keys, hidden[b, :LENGTHS[b]], range(LENGTHS[b]), HP)
        ref["plain1"].append(dspark_oracle.draft(weights, [dict(k) for k in keys], anchors1[b], hidden[b, t1[b]],
                                                 int(t1[b]), HP, markov=False))
        ref["draft1"].append(dspark_oracle.draft(weights, keys, anchors1[b], hidden[b, t1[b]], int(t1[b]), HP))
        dspark_oracle.seed(weights, keys, hidden[b, fpos[b]], fpos[b], HP)
        ref["draft2"].append(dspark_oracle.draft(weights, keys, anchors2[b], hidden[b, t2[b]], int(t2[b]), HP))
        ref["keys"].append(keys)
    return cfg, out, ref, dict(t1=t1, t2=t2, fpos=fpos, anchors1=anchors1, anchors2=anchors2, hidden=hidden,
                               weights=weights, ds=ds)


def _check_draft(got, refs):
    drafts, logits, conf = got
    assert drafts.shape == (B, HP["dspark_block_size"]) and logits.shape == (B, HP["dspark_block_size"],
                                                                             HP["vocab_size"])
    for b, (r_drafts, r_logits, r_conf, _) in enumerate(refs):
        top2 = np.sort(r_logits, axis=-1)[:, -2:]
        assert np.min(top2[:, 1] - top2[:, 0]) > 10 * RTOL * np.max(np.abs(r_logits)), "argmax within noise of a tie"
        np.testing.assert_array_equal(drafts[b], r_drafts)
        assert _rel_err(logits[b], r_logits) < RTOL
        assert _rel_err(conf[b], r_conf) < RTOL


def _ring_positions(ring, b):
    return sorted(int(p) for p in np.asarray(ring.positions[b]) if p >= 0)


def test_seed_holds_the_last_window(case):
    """After a prefill longer than W the ring holds exactly positions S-W..S-1, each slot p mod W,
    with the oracle's rho (every stage)."""
    cfg, out, ref, _ = case
    w = cfg.sliding_window
    ring = out["seeded"]
    assert ring.keys.shape == dspark_state_shapes(cfg, B, jnp.float32).keys.shape
    for b in range(B):
        want = list(range(LENGTHS[b] - w, LENGTHS[b]))
        assert _ring_positions(ring, b) == want
        for p in want:
            assert int(ring.positions[b, p % w]) == p
            for s in range(cfg.num_nextn_predict_layers):
                assert _rel_err(ring.keys[s, b, p % w], ref["keys"][b][s][p]) < RTOL


def test_first_draft_matches_oracle(case):
    """§6.2-6.5 greedy: drafts o_1..o_5, Markov-corrected logits, confidences."""
    _, out, ref, _ = case
    _check_draft(out["draft1"], ref["draft1"])


def test_markov_correction_moves_a_draft(case):
    """On this data the correction changes at least one greedy draft (else the test proves little),
    and the confidences are not trivially zero."""
    _, _, ref, _ = case
    assert any((with_m[0] != without[0]).any() for with_m, without in zip(ref["draft1"], ref["plain1"]))
    assert min(np.min(np.abs(r[2])) for r in ref["draft1"]) > 1e-3


def test_second_draft_after_feeding(case):
    """Two committed positions fed (§6.7 step 3), then a draft from t+2: the ring slid to
    t2-W+1..t2 and the draft matches the oracle, which reads its keys by position."""
    cfg, out, ref, ts = case
    for key in ("fed", "ring2"):
        for b in range(B):
            assert _ring_positions(out[key], b) == list(range(ts["t2"][b] - cfg.sliding_window + 1, ts["t2"][b] + 1))
    _check_draft(out["draft2"], ref["draft2"])


def test_sampled_draft(case):
    """temperature > 0: ℓ_0 depends only on the anchor, so it equals the greedy call's; the
    drafts are sampled ids and the later logits follow them (o_1 feeds ℓ_1's correction)."""
    _, out, _, _ = case
    drafts, logits, _ = out["sampled"]
    g_drafts, g_logits, _ = out["draft2"]
    assert _rel_err(logits[:, 0], g_logits[:, 0]) < 1e-6
    assert ((drafts >= 0) & (drafts < HP["vocab_size"])).all()
    assert (drafts != g_drafts).any()  # at T = 1 over 129280 ids, a draw equal to every argmax is vanishingly rare


def test_sample_tokens_rule():
    """Greedy where T <= 0 (per row), the first maximum; with no key, greedy everywhere."""
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [0.0, 2.0, 2.0, 1.0]])
    np.testing.assert_array_equal(sample_tokens(logits, 0.0, None), [1, 1])
    got = sample_tokens(logits * 50, jnp.asarray([0.0, 1.0]), jax.random.key(3))
    assert int(got[0]) == 1 and int(got[1]) in (1, 2)


def test_round_trip_ring_rows(case):
    """round_trips on (the default): the ring stores rho through the FP8 round trip of §2.3 / §6.4
    (groups of 32 over all hd channels, RoPE tail included): values on the FP8 grid, within
    E4M3's half-ulp (2^-4 relative to the group max) of the fp32 rows."""
    cfg, out, _, ts = case
    from dsjax.layers.qdq import qdq_fp8
    pos = np.broadcast_to(np.arange(S_PREFILL), (B, S_PREFILL))
    ring = jax.jit(lambda ds, h, p, r, v: dspark_seed(ds, h, p, r, cfg, v, opts=RuntimeOptions(round_trips=True)))(
        ts["ds"], jnp.asarray(ts["hidden"][:, :S_PREFILL]), jnp.asarray(pos), empty_ring(cfg, B, jnp.float32),
        jnp.asarray(pos < LENGTHS[:, None]))
    got, fp32 = np.asarray(ring.keys), np.asarray(out["seeded"].keys)
    np.testing.assert_array_equal(np.asarray(qdq_fp8(jnp.asarray(got))), got)
    assert np.max(np.abs(got - fp32)) <= 2 ** -4 * np.max(np.abs(fp32)) and not np.array_equal(got, fp32)
