"""Speculative decoding with the MTP drafter: the MTP layer's cached path against its
full-sequence form, greedy outputs identical to plain decoding, the sampled output
distribution against the target's (chi-square), caches after accept / reject sequences
against plain decoding, and confidence scheduling against its closed form. The same with a
reduced draft vocabulary: drafts against the drafter's logits restricted to it."""

import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.programs import spec_decode_step
from dsjax.engine.policy import CALIBRATION_PRIOR, CALIBRATION_REFRESH, SpeculationPolicy
from dsjax.engine.sampler import SamplingParams, argmax_first
from dsjax.engine.scheduler import StepPlan
from dsjax.engine.slots import init_slots
from dsjax.config.io import to_hf_dict
from dsjax.engine.speculative import (CALIBRATION_BINS, DRAFT, Drafts, Schedule, accept, calibration_centres,
                                      choose_limits, draft_vocab, draw, init_speculation, prefill_chunk,
                                      screened_argmax, verify)
from dsjax.kernels import cpu as cpu_kernels
from dsjax.model.interface import screens
from dsjax.model import decoder_streams, model_specs, mtp_forward, mtp_head, mtp_specs
from dsjax.model.cache_layout import init_cache, min_ring
from dsjax.params import init_params
from dsjax.train.export import most_frequent
from hlo_checks import widened_outside

F32 = jnp.float32
# The full-sequence oracles as one program each (run op by op they were ~700 programs to fetch)
_streams = jax.jit(decoder_streams, static_argnames="cfg")
_mtp = jax.jit(mtp_forward, static_argnames="cfg")
_mtp_head = jax.jit(mtp_head, static_argnames="cfg")


def _model(vocab: int | None = None, seed: int = 0) -> dsjax.Model:
    """tiny (every layer type), with its vocabulary cut to `vocab` so that a random drafter
    agrees with the target often enough to exercise acceptance as well as rejection."""
    cfg = dsjax.load_config("tiny")
    if vocab is not None:
        cfg = cfg.replace(vocab_size=vocab, name=f"tiny-v{vocab}")
    return dsjax.Model(cfg, init_params(model_specs(cfg, F32), seed), F32, None,
                       init_params(mtp_specs(cfg, F32), seed + 1))


@pytest.fixture(scope="module")
def tiny():
    return _model()


@pytest.fixture(scope="module")
def small_vocab():
    return _model(vocab=6, seed=3)


def _prompts(rng, vocab, lengths):
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


# ----------------------------------------------------------------------------- MTP layer
def test_mtp_cached_matches_full_sequence(small_vocab, rng):
    """The MTP layer over its ring, fed in uneven chunks, equals its full-sequence form
    (window attention wrapping the 16-slot ring)."""
    tiny = small_vocab
    cfg, s = tiny.config, 41
    ids = jnp.asarray(rng.integers(2, cfg.vocab_size, (2, s + 1)))
    streams, _ = _streams(tiny.params, ids[:, :s], cfg)
    want_out, _ = _mtp(tiny.mtp, tiny.params, streams, ids[:, 1:], cfg)
    want_logits = _mtp_head(tiny.mtp, tiny.params, want_out, cfg)
    state = init_speculation(cfg, 2, 1, F32).mtp
    start, outs = 0, []
    for c in (8, 1, 16, 16):
        length = jnp.full((2,), start, jnp.int32)
        out, state = _mtp(tiny.mtp, tiny.params, streams[:, start:start + c], ids[:, start + 1:start + c + 1], cfg,
                          state, start=length, n_valid=jnp.full((2,), c, jnp.int32))
        outs.append(out)
        start += c
    out = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(_mtp_head(tiny.mtp, tiny.params, out, cfg), want_logits, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- greedy
def _engine(model, **kw) -> Engine:
    """One engine shape for the whole module (3 slots, 256 tokens, 16-token chunks), so the
    tests share compiled steps, dsjax.generate's included."""
    return Engine(model, max_slots=3, capacity=256, prefill_chunk=16, **kw)


def _generate(model, prompts, params, **kw):
    engine = _engine(model, **kw)
    return engine.generate(prompts, params), engine


@pytest.mark.parametrize("k", [1, 4])  # the extremes; k = 2 and 3 run in the tests below
def test_greedy_speculation_is_token_identical(small_vocab, rng, k):
    """k drafts per step, batch 3 (+ queued requests), prompts and outputs crossing CSA (4)
    and HCA (16) group boundaries: the greedy tokens equal plain decoding's, and the drafter
    both hit and missed (so acceptance, rejection and rollback all ran)."""
    prompts = _prompts(rng, 6, (5, 19, 33, 12))
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 4
    if k == 4:  # a sampled request in the batch: greedy rows then go through the sampling variant
        prompts.append(prompts[0])
        params.append(SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5))
    plain, _ = _generate(small_vocab, prompts, params)
    spec, engine = _generate(small_vocab, prompts, params, num_draft_tokens=k, spec_policy="fixed")
    assert spec[:4] == plain[:4]
    m = engine.spec_metrics()
    assert 0 < m["drafts_accepted"] < m["drafts_proposed"]
    assert m["drafts_proposed"] == k * m["row_steps"]
    assert m["decode_tokens"] == sum(len(t) - 1 for t in spec)
    for rid in engine.requests:
        req = engine.requests[rid]
        assert req.decode_tokens == len(req.tokens) - 1 and req.drafts_accepted <= req.drafts_proposed


def test_first_tokens_restrict_the_first_token_with_and_without_speculation(small_vocab, rng):
    """Token healing's first_tokens: the first token is the argmax of the full forward's
    last logits among the allowed ids (here the least likely ones, so the restriction
    decides), and the speculative engine, which drafts from that token, makes the same
    greedy tokens as plain decoding. Bad first_tokens are refused by name."""
    prompts = _prompts(rng, 6, (7, 21))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    allowed = [np.argsort(small_vocab.logits(np.array([p]))[0, -1])[:2].tolist() for p in prompts]
    outs = []
    for kw in ({}, {"num_draft_tokens": 3, "spec_policy": "fixed"}):
        engine = _engine(small_vocab, **kw)
        ids = [engine.add_request(p, params, first_tokens=a) for p, a in zip(prompts, allowed)]
        list(engine.run())
        outs.append([engine.requests[i].tokens for i in ids])
    assert outs[0] == outs[1]
    for p, a, out in zip(prompts, allowed, outs[0]):
        logits = small_vocab.logits(np.array([p]))[0, -1]
        assert out[0] == a[int(np.argmax(logits[a]))]
    for bad, what in (([], "non-empty"), ([2, 6], "token id 6 is outside"), ([1.5], "non-empty list of token ids")):
        with pytest.raises(ValueError, match=what):
            engine.add_request(prompts[0], params, first_tokens=bad)


def test_greedy_speculation_stops_inside_a_verified_run(small_vocab, rng):
    """A stop token met among accepted drafts ends the request there, as in plain decoding."""
    prompts = _prompts(rng, 6, (9, 14))
    free = _generate(small_vocab, prompts, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = free[0][6]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    plain = _generate(small_vocab, prompts, params)[0]
    spec = _generate(small_vocab, prompts, params, num_draft_tokens=3, spec_policy="fixed")[0]
    assert spec == plain and plain[0][-1] == stop and len(plain[0]) <= 7


def test_confidence_scheduling_greedy_identical(small_vocab, rng):
    """Confidence scheduling (cost curve pinned): rows verify different numbers of drafts,
    steps different lengths, and the tokens still equal plain decoding's."""
    prompts = _prompts(rng, 6, (7, 21, 30))
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain, _ = _generate(small_vocab, prompts, params)
    spec, engine = _generate(small_vocab, prompts, params, num_draft_tokens=2, verify_costs=[1.0, 1.05, 1.1])
    assert spec == plain
    m = engine.spec_metrics()
    assert 0 < m["drafts_proposed"] < 2 * m["row_steps"]  # not always the maximum
    # the calibration booked every judged draft, each once, and the accepted ones (all but those
    # of stale drafts, verified after a plain step: the draining batch's last steps may be plain)
    assert sum(m["calibration"]["judged"]) == sum(m["judged_by_position"]) > 0
    assert sum(m["calibration"]["accepted"]) == engine.policy.by_position[1].sum() > 0
    measured = _engine(small_vocab, num_draft_tokens=2)  # the same step shapes: no new compiles
    measured.runner.measure_costs(measured.scheduler.bucket(1))
    assert len(measured.verify_costs) == 3 and measured.verify_costs[0] == 1.0
    assert all(c > 0 for c in measured.verify_costs) and measured.costs.shape == (3,)


def test_speculation_reads_a_stored_head_as_stored(tiny, rng):
    """16-bit weights (`store_weights`, the head a plain bf16 array): the drafter's loop over
    its k drafts reads the head, and XLA hoisted its widening out of that loop into an fp32
    copy of the whole head every step (`dsjax.model.head.rows_logits` keeps it in place).
    The compiled verify step holds no such copy, and its greedy tokens equal plain decoding's
    with the same weights. (tiny's full vocabulary: a head of a few rows takes the GEMM,
    which widens it outside the product anyway.)"""
    stored = dsjax.store_weights(tiny)
    vocab, hidden = stored.params.lm_head.shape
    prompts = _prompts(rng, vocab, (5, 19))
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2
    plain, _ = _generate(stored, prompts, params)
    spec, engine = _generate(stored, prompts, params, num_draft_tokens=2, spec_policy="fixed")
    assert spec == plain
    compiled = spec_decode_step.lower(stored.params, stored.mtp, engine.cache, engine.spec, engine.slots,
                                      jnp.zeros(engine.rows, bool), engine.policy.schedule, engine.runner.draft, k=2,
                                      cfg=engine.cfg, opts=engine.opts, ctx_bucket=engine.scheduler.bucket(1),
                                      sampled=False, n_logprobs=0).compile()
    widened = widened_outside(compiled, (vocab, hidden))
    assert not widened, widened


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_greedy_speculation_with_draft_vocab_is_token_identical(small_vocab, rng, policy):
    """A reduced draft vocabulary D without 2 of the 6 tokens (so some drafts are wrong
    whatever the drafter thinks): the greedy tokens equal plain decoding's, every draft is
    in D, and the drafter both hit and missed. Fixed: with a sampled row in the batch (the
    sampling variant, q scattered from D); confidence: rows verifying different counts."""
    d = [0, 2, 3, 5]
    prompts = _prompts(rng, 6, (5, 19, 33, 12))
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 4
    kw = {"spec_policy": "fixed"}
    if policy == "fixed":
        prompts.append(prompts[1])
        params.append(SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5))
    else:
        kw = {"verify_costs": [1.0, 1.05, 1.1, 1.15]}
    plain, _ = _generate(small_vocab, prompts, params)
    spec, engine = _generate(small_vocab, prompts, params, num_draft_tokens=3, draft_vocab=d, **kw)
    assert spec[:4] == plain[:4]
    assert engine.draft_vocab.tolist() == d and np.isin(np.asarray(engine.spec.drafts.tokens), d).all()
    m = engine.spec_metrics()
    assert 0 < m["drafts_accepted"] < m["drafts_proposed"]


def test_choose_limits_closed_form(rng):
    """argmax_{k >= 1} (1 + sum_{j<=k} prod_{i<=j} c_i) / cost[k], by enumeration (k = 0, no
    verify, is the scheduler's plain step)."""
    conf = rng.uniform(0, 1, (64, 5)).astype(np.float32)
    costs = np.array([1.0, 1.15, 1.4, 1.5, 2.0, 2.1], np.float32)
    got = np.asarray(choose_limits(jnp.asarray(conf), jnp.asarray(costs)))
    for row, c in enumerate(conf):
        value = [(1 + sum(np.prod(c[: j + 1]) for j in range(k))) / costs[k] for k in range(6)]
        assert got[row] == int(np.argmax(value[1:])) + 1
    assert (np.asarray(choose_limits(jnp.asarray(conf), None)) == 5).all()
    table = np.sort(rng.uniform(0, 1, CALIBRATION_BINS)).astype(np.float32)  # calibrated: c -> interp(c, table)
    got = np.asarray(choose_limits(jnp.asarray(conf), jnp.asarray(costs), jnp.asarray(table)))
    for row, c in enumerate(np.interp(conf, calibration_centres(), table)):
        value = [(1 + sum(np.prod(c[: j + 1]) for j in range(k))) / costs[k] for k in range(6)]
        assert got[row] == int(np.argmax(value[1:])) + 1


def test_calibration_books_each_judged_draft():
    """The confidence policy's calibration: a draft is judged iff the drafts before it were
    accepted; each judged draft's confidence bin counts it, and the accepted ones; the
    acceptance per bin is (accepted + prior x centre) / (judged + prior), the centre itself
    before anything is judged; the programs' schedule takes it every CALIBRATION_REFRESH
    verify steps that booked drafts."""
    policy = SpeculationPolicy(3, "confidence", verify_costs=[1.0, 1.1, 1.2, 1.3], max_slots=2)
    np.testing.assert_allclose(np.asarray(policy.schedule.acceptance), calibration_centres(), rtol=1e-6)
    host = types.SimpleNamespace(drafts_checked=np.array([3, 2]), drafts_accepted=np.array([1, 2]),
                                 emitted=np.ones((4, 2), bool), next_limit=np.array([3, 1]),
                                 draft_confidence=np.array([[0.05, 0.55, 0.95], [0.31, 0.39, 0.0]], np.float32))
    req = lambda: types.SimpleNamespace(done=False, target_steps=0, drafts_proposed=0, drafts_accepted=0,  # noqa: E731
                                        decode_tokens=0)
    policy.count(host, {0: req(), 1: req()})
    judged, accepted = np.zeros(CALIBRATION_BINS), np.zeros(CALIBRATION_BINS)
    judged[[0, 3, 5]], accepted[[0, 3]] = [1, 2, 1], [1, 2]  # row 0: 0.05 yes, 0.55 no; row 1: 0.31, 0.39 yes
    assert policy.calibration.tolist() == [judged.tolist(), accepted.tolist()]
    def want(n):  # after n such steps
        return (n * accepted + CALIBRATION_PRIOR * calibration_centres()) / (n * judged + CALIBRATION_PRIOR)
    np.testing.assert_allclose(policy.acceptance(), want(1), rtol=1e-6)
    assert policy.next_k == [3, 1]
    np.testing.assert_allclose(np.asarray(policy.schedule.acceptance), calibration_centres(), rtol=1e-6)
    for _ in range(CALIBRATION_REFRESH - 1):
        policy.count(host, {0: req(), 1: req()})
    np.testing.assert_allclose(np.asarray(policy.schedule.acceptance), want(CALIBRATION_REFRESH), rtol=1e-6)


# ----------------------------------------------------------------------------- sampled
def _sampling_state(n, capacity, temperature, top_k=0, top_p=1.0):
    s = init_slots(n, capacity).sampling
    return s.replace(temperature=jnp.full((n,), temperature, F32), top_k=jnp.full((n,), top_k, jnp.int32),
                     top_p=jnp.full((n,), top_p, F32), seed=jnp.arange(n, dtype=jnp.uint32))


def _chi_square_p(samples, probs):
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    counts = np.bincount(samples, minlength=len(probs))
    keep = probs * len(samples) >= 5  # pool the rare cells
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep], probs[~keep].sum()) * len(samples)
    if expected[-1] == 0:
        assert observed[-1] == 0
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


@jax.jit  # one trace and program for every case below (op by op it was ~100 programs)
def _draw_and_accept(p, q, limit, s):
    """k drafts per row drawn from q [k, V], then accept() against p [k + 1, V] with `limit`."""
    (k, v), n = q.shape, s.seed.shape[0]
    start = jnp.zeros((n,), jnp.int32)
    drafts = jnp.stack([draw(jnp.broadcast_to(q[j], (n, v)), s.seed, start + 2 + j, DRAFT) for j in range(k)], 1)
    a, nxt = accept(jnp.broadcast_to(p, (n, k + 1, v)), jnp.broadcast_to(q, (n, k, v)), drafts,
                    jnp.full((n,), limit, jnp.int32), s, start)
    return a, nxt, drafts


@pytest.mark.parametrize("limit, support", [(3, None), (1, None), (0, None), (3, (0, 2, 3, 5))])
def test_acceptance_rule_keeps_the_target_distribution(rng, limit, support):
    """accept() over 20000 seeds: the first emitted token follows p_0 and the second (given
    the first draft was accepted) p_1, for drafts drawn from a different q; also when the
    row verifies fewer drafts than it has (limit), and when q is zero outside a draft
    vocabulary (`support`: the mass p puts there comes from the residual alone)."""
    n, k, v = 20000, 3, 7
    p = rng.dirichlet(np.ones(v) * 0.7, k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v) * 0.7, k).astype(np.float32)
    if support is not None:
        q[:, np.setdiff1d(np.arange(v), support)] = 0.0
        q /= q.sum(-1, keepdims=True)
    a, nxt, drafts = map(np.asarray, _draw_and_accept(p, q, limit, _sampling_state(n, 16, 1.0)))
    assert (a <= limit).all()
    first = np.where(a > 0, drafts[:, 0], nxt)
    assert _chi_square_p(first, p[0]) > 1e-3
    if limit >= 1:
        second = np.where(a > 1, drafts[:, 1], nxt)[a >= 1]
        assert _chi_square_p(second, p[1]) > 1e-3
    # the test has power: q's distribution is rejected
    assert _chi_square_p(drafts[:, 0], p[0]) < 1e-6


@pytest.mark.parametrize("ids", [None, (0, 2, 3, 5)])
def test_sampled_speculation_matches_target_distribution(small_vocab, rng, ids):
    """The whole verify path on the model (top-k 4, temperature 0.8): 2048 requests with the
    same prompt and different seeds, two speculative steps; the first two generated tokens'
    joint distribution equals the target's p(x1) p(x2 | x1) from full forwards. Also with
    a draft vocabulary `ids` (drafts only among them, q zero elsewhere)."""
    model, n, k = small_vocab, 2048, 2
    vocab = None if ids is None else draft_vocab(model.params, ids)
    cfg = model.config
    prompt = _prompts(rng, 6, (11,))[0]
    temperature, top_k = 0.8, 4

    def target(ids):
        logits = np.asarray(model.logits(np.asarray(ids)))[:, -1] / temperature
        logits[logits < np.sort(logits, axis=-1)[:, -top_k][:, None]] = -np.inf
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p_last = target([prompt])[0]  # the pending token x0 is fixed below: condition on it
    x0 = int(np.argmax(p_last))
    p1 = target([prompt + [x0]])[0]
    p2 = target([prompt + [x0, t] for t in range(cfg.vocab_size)])
    joint = (p1[:, None] * p2).ravel()

    # n copies of the prompt, each with its own seed, the pending token x0, drafts of their own
    slots = init_slots(n, 64)
    slots = slots.replace(sampling=_sampling_state(n, 64, temperature, top_k=top_k), last_token=jnp.full((n,), x0),
                          active=jnp.ones((n,), bool), n_generated=jnp.ones((n,), jnp.int32),
                          max_tokens=jnp.full((n,), 8, jnp.int32))
    chunk = np.zeros((n, 16), np.int32)
    chunk[:, : len(prompt)] = prompt
    following = np.zeros((n, 16), np.int32)
    following[:, : len(prompt) - 1] = prompt[1:]

    @jax.jit
    def prefill(cache, spec, chunk, following, sampling, vocab):
        emit = lambda logits, length, last: (jnp.full((n,), x0, jnp.int32), sampling, None)  # noqa: E731
        return prefill_chunk(model.params, model.mtp, cache, spec, chunk, following,
                             jnp.full((n,), len(prompt), jnp.int32), jnp.ones((n,), bool), emit, cfg=cfg,
                             ctx_bucket=64, schedule=None, vocab=vocab)[:2]

    cache, spec = prefill(init_cache(cfg, n, 64, F32), init_speculation(cfg, n, k, F32), chunk, following,
                          slots.sampling, vocab)
    step = jax.jit(functools.partial(verify, k=k, cfg=cfg, ctx_bucket=64, schedule=None))
    tokens = [[] for _ in range(n)]
    for _ in range(2):
        if ids is not None:  # drafts from D, q a distribution over the full vocabulary, zero outside D
            q = np.asarray(spec.drafts.q)
            assert np.isin(np.asarray(spec.drafts.tokens), ids).all()
            np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
            assert not q[..., np.setdiff1d(np.arange(cfg.vocab_size), ids)].any()
        cache, spec, slots, v = step(model.params, model.mtp, cache, spec, slots, vocab=vocab)
        produced, count = np.asarray(v.tokens), np.asarray(v.count)
        for i in range(n):
            tokens[i] += produced[i, : count[i]].tolist()
    assert all(len(t) >= 2 for t in tokens)
    cells = np.array([t[0] * cfg.vocab_size + t[1] for t in tokens])
    assert _chi_square_p(cells, joint) > 1e-3
    assert _chi_square_p(cells, np.full_like(joint, 1 / len(joint))) < 1e-6  # the test has power


def test_draft_vocab_drafts_are_the_drafter_restricted_to_it(small_vocab, rng):
    """The first draft after a prompt against the MTP layer's full-sequence logits z,
    restricted to D (all ids but z's argmax, so the restriction matters): a greedy row drafts
    D[argmax z_D] with confidence softmax(z_D) there; a sampled row's q is softmax(z_D / T)
    scattered into the full vocabulary. D = every id drafts exactly as the full head does."""
    model, k, t = small_vocab, 2, 0.7
    cfg = model.config
    prompt, first = _prompts(rng, 6, (11,))[0], 3
    seq = jnp.asarray([prompt + [first]])
    streams, _ = _streams(model.params, seq[:, :-1], cfg)
    out, _ = _mtp(model.mtp, model.params, streams, seq[:, 1:], cfg)
    z = np.asarray(_mtp_head(model.mtp, model.params, out, cfg))[0, -1]  # [V]: predicts the token after `first`
    d = np.setdiff1d(np.arange(cfg.vocab_size), [np.argmax(z)])

    sampling = _sampling_state(2, 64, t).replace(temperature=jnp.asarray([0.0, t], F32))  # row 0 greedy
    chunk = np.zeros((2, 16), np.int32)
    chunk[:, : len(prompt)] = prompt
    following = np.zeros((2, 16), np.int32)
    following[:, : len(prompt)] = prompt[1:] + [first]

    @jax.jit
    def drafts(vocab):
        emit = lambda logits, length, last: (jnp.full((2,), first, jnp.int32), sampling, None)  # noqa: E731
        spec = prefill_chunk(model.params, model.mtp, init_cache(cfg, 2, 64, F32), init_speculation(cfg, 2, k, F32),
                             jnp.asarray(chunk), jnp.asarray(following), jnp.full((2,), len(prompt), jnp.int32),
                             jnp.ones((2,), bool), emit,
                             cfg=cfg, ctx_bucket=64, vocab=vocab,
                             schedule=Schedule(jnp.ones((k + 1,), F32), jnp.asarray(calibration_centres(), F32)))[1]
        return spec.drafts

    got = drafts(draft_vocab(model.params, d))
    z_d = z[d] - z[d].max()
    soft = np.exp(z_d) / np.exp(z_d).sum()
    want_q = np.zeros(cfg.vocab_size)
    want_q[d] = np.exp(z_d / t) / np.exp(z_d / t).sum()
    greedy = d[np.argmax(z_d)]
    assert int(got.tokens[0, 0]) == greedy
    np.testing.assert_allclose(got.confidence[0, 0], soft.max(), rtol=1e-4)
    np.testing.assert_allclose(got.q[0, 0], np.eye(cfg.vocab_size)[greedy])
    np.testing.assert_allclose(got.q[1, 0], want_q, atol=1e-5)
    sampled = int(got.tokens[1, 0])
    assert sampled in d and np.isclose(got.confidence[1, 0], want_q[sampled], rtol=1e-4)
    assert np.isin(np.asarray(got.tokens), d).all()

    full, every = drafts(None), drafts(draft_vocab(model.params, np.arange(cfg.vocab_size)))
    assert np.array_equal(np.asarray(full.tokens), np.asarray(every.tokens))
    np.testing.assert_allclose(every.q, full.q, atol=1e-6)
    np.testing.assert_allclose(every.confidence, full.confidence, rtol=1e-5)


# ----------------------------------------------------------------------------- caches
def _forced(tokens_ahead: list[int], n_right: int, k: int, v: int, rows: int) -> Drafts:
    """k drafts for row 0: the first n_right are the true continuation, then wrong ones."""
    d = [t if i < n_right else (t + 1) % v for i, t in enumerate(tokens_ahead[:k])]
    tokens = jnp.zeros((rows, k), jnp.int32).at[0].set(jnp.asarray(d + [0] * (k - len(d))))
    return Drafts(tokens, jax.nn.one_hot(tokens, v, dtype=F32), jnp.ones((rows, k), F32))


def test_caches_after_accept_reject_equal_plain_decoding(small_vocab, rng):
    """Forced accept / reject patterns (0..3 of 3 drafts, through CSA and HCA group ends):
    after each step every cache leaf — window ring, compressor and indexer entries and
    rings — and the MTP ring equal those of plain decoding of the same tokens."""
    model, k = small_vocab, 3
    cfg = model.config
    prompt = _prompts(rng, cfg.vocab_size, (13,))[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    truth = _generate(model, [prompt], params)[0][0]

    spec_engine = _engine(model, num_draft_tokens=k, spec_policy="fixed")
    plain = _engine(model)
    dispatched = []  # the speculative engine's outputs, in order
    for e in (spec_engine, plain):  # admission and the prompt's one chunk, no decode step yet
        e.add_request(prompt, params)
        out = e.runner.execute(StepPlan(e.scheduler.admit(), e.scheduler.prefill_calls()))
        dispatched += out.dispatches if e is spec_engine else []
    emitted = 1  # the prefill's first token
    for n_right in (2, 0, 3, 1, 3, 0, 2, 3, 1):
        spec_engine.spec = spec_engine.spec.replace(drafts=_forced(truth[emitted:], n_right, k, cfg.vocab_size, 3))
        dispatched += spec_engine.runner.execute(StepPlan(decode=spec_engine.scheduler.decode())).dispatches
        emitted += n_right + 1
        while int(plain.cache.length[0]) < len(prompt) + emitted - 1:
            plain.runner.execute(StepPlan(decode=plain.scheduler.decode()))
        assert int(spec_engine.cache.length[0]) == int(plain.cache.length[0])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5),
                     spec_engine.cache, plain.cache)
    got = [t for d in dispatched for t in np.asarray(d.out.tokens)[:, 0][np.asarray(d.out.emitted)[:, 0]]]
    assert got == truth[: emitted]
    # the MTP ring equals one built from the plain sequence in a single pass
    seq = jnp.asarray([prompt + truth[: emitted]])
    length = len(prompt) + emitted - 1
    streams, _ = _streams(model.params, seq[:, :length], cfg)
    _, want = _mtp(model.mtp, model.params, streams, seq[:, 1:length + 1], cfg,
                   init_speculation(cfg, 1, k, F32).mtp, start=jnp.zeros((1,), jnp.int32),
                   n_valid=jnp.full((1,), length, jnp.int32))
    np.testing.assert_allclose(spec_engine.spec.mtp.window[:1], want.window, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- batch invariance
def test_batch_invariant_speculation_and_its_logprobs(small_vocab, rng):
    """Batch-invariant mode with speculation (2 drafts, the fixed policy), sampled requests:
    at 1, 4 and 16 slots (one and two 8-row tiles) and in shuffled order, every request's
    tokens and logprobs (chosen and top-2) are bitwise the same, while drafts were both
    accepted and rejected; and the logprobs are the target's: a full-sequence forward over
    prompt + output gives them to float rounding."""
    prompts = _prompts(rng, 6, (16, 32, 16, 48, 32, 16, 16))  # whole 16-token chunks: one prefill width
    params = [SamplingParams(max_tokens=14, ignore_eos=True, logprobs=2, seed=i, temperature=0.9)
              for i in range(len(prompts))]

    def run(order, slots):
        engine = Engine(small_vocab, max_slots=slots, capacity=128, prefill_chunk=16, max_logprobs=2,
                        batch_invariant=True, num_draft_tokens=2)
        ids = {engine.add_request(prompts[i], params[i]): i for i in order}
        out = {i: [] for i in order}
        for e in engine.run():
            out[ids[e.request_id]].append((e.token, e.logprob, e.top_logprobs))
        return out, engine.spec_metrics()

    order = list(range(len(prompts)))
    want, spec = run(order, 4)
    assert 0 < spec["drafts_accepted"] < spec["drafts_proposed"]
    shuffled = list(np.random.default_rng(7).permutation(order))
    for slots, o in ((1, order), (16, shuffled), (4, shuffled)):
        assert run(o, slots)[0] == want, slots

    seqs = [prompts[i] + [t for t, _, _ in want[i]] for i in order]
    width = max(map(len, seqs))
    logp = jax.nn.log_softmax(small_vocab.logits([s + [0] * (width - len(s)) for s in seqs]), axis=-1)
    for i, seq in zip(order, seqs):
        n = len(prompts[i])
        at = np.asarray(logp[i, n - 1: len(seq) - 1])  # the distribution each output token came from
        got = [(lp, top) for _, lp, top in want[i]]
        np.testing.assert_allclose([lp for lp, _ in got], at[np.arange(len(got)), seq[n:]], atol=1e-5)
        for (_, top), row in zip(got, at):
            assert [t for t, _ in top] == np.argsort(-row, kind="stable")[:2].tolist()
            np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:2], atol=1e-5)


# ----------------------------------------------------------------------------- errors
def test_speculation_refuses_what_it_cannot_do(tiny, small_vocab):
    no_mtp = dsjax.Model(tiny.config, tiny.params, F32, None, None)
    with pytest.raises(ValueError, match="MTP layer"):
        Engine(no_mtp, num_draft_tokens=2, capacity=128)
    with pytest.raises(ValueError, match="smallest cache ring"):
        Engine(tiny, num_draft_tokens=min_ring(tiny.config), capacity=128)
    with pytest.raises(ValueError, match=r"spec_policy='confidence' in batch-invariant mode \(use 'fixed'\)"):
        Engine(tiny, num_draft_tokens=2, capacity=128, batch_invariant=True, spec_policy="confidence")
    with pytest.raises(ValueError, match="spec_policy"):
        Engine(tiny, num_draft_tokens=2, capacity=128, spec_policy="sometimes")
    with pytest.raises(ValueError, match="verify_costs"):
        Engine(tiny, num_draft_tokens=2, capacity=128, verify_costs=[1.0, 2.0])
    engine = Engine(small_vocab, num_draft_tokens=2, capacity=64, spec_policy="fixed")
    with pytest.raises(ValueError, match="penalties"):
        engine.add_request([2, 3], SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        engine.add_request([2, 3], SamplingParams(max_tokens=61))


def test_draft_vocab_is_checked(small_vocab, tmp_path):
    """Engine(draft_vocab=) and a checkpoint's draft_vocab.json: ids in range, unique,
    non-empty, integers; None takes the model's, False the full vocabulary."""
    kw = dict(num_draft_tokens=2, capacity=64, spec_policy="fixed")
    for bad, match in (([], "empty"), ([0, 6], r"token id 6 is outside .*\[0, 6\)"), ([-1, 2], "token id -1"),
                       ([1, 2, 1], "token id 1 appears more than once"), ([[1, 2]], "1-D"), ([1.5], "integer"),
                       (True, "got True")):
        with pytest.raises(ValueError, match=match):
            Engine(small_vocab, draft_vocab=bad, **kw)
    with_ids = small_vocab.replace(draft_vocab=np.asarray([5, 0, 2]))
    assert Engine(with_ids, **kw).draft_vocab.tolist() == [0, 2, 5]  # sorted: argmax ties as over the full vocabulary
    assert Engine(with_ids, draft_vocab=False, **kw).draft_vocab is None
    assert Engine(with_ids, draft_vocab=[1, 4], **kw).draft_vocab.tolist() == [1, 4]
    with pytest.raises(ValueError, match="model.draft_vocab: token id 9"):
        Engine(small_vocab.replace(draft_vocab=np.asarray([9])), **kw)

    # a checkpoint directory's draft_vocab.json, checked before any weight is read
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(small_vocab.config)))
    for record, match in (({"ids": [0, 2, 2]}, "appears more than once"), ({"ids": [0, 99]}, "outside"),
                          ({"ids": ["a"]}, "integer token ids"), ([1, 2], "list \"ids\""), ({"ids": []}, "empty")):
        (tmp_path / "draft_vocab.json").write_text(json.dumps(record))
        with pytest.raises(ValueError, match="draft_vocab.json") as e:
            dsjax.load_model(tmp_path, dtype="float32")
        assert e.match(match)
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [4, 1], "source": "test"}))
    assert dsjax.api.read_draft_vocab(tmp_path, small_vocab.config).tolist() == [1, 4]


def test_most_frequent_tokens():
    """The export's draft vocabulary: the n most frequent ids (ties to the smaller id), sorted,
    never an id that does not occur; and the share of tokens they cover."""
    docs = [np.asarray([0, 5, 5, 7, 3, 3]), np.asarray([0, 9, 9, 9, 5, 2])]
    ids, coverage = most_frequent(docs, 12, 3)
    assert ids.tolist() == [0, 5, 9] and coverage == 8 / 12  # 5 and 9 three times, then 0 and 3 tie: 0
    assert most_frequent(docs, 12, 100)[0].tolist() == [0, 2, 3, 5, 7, 9]


def test_generate_with_drafts(small_vocab, rng):
    prompts = _prompts(rng, 6, (3, 8, 15))
    plain = _generate(small_vocab, prompts, SamplingParams(max_tokens=12))[0]
    assert dsjax.generate(small_vocab, prompts, 12, num_draft_tokens=3, spec_policy="fixed") == plain
    with pytest.raises(ValueError, match="num_draft_tokens"):
        dsjax.generate(small_vocab, prompts, 12, num_draft_tokens=-1)


# ----------------------------------------------------------------------------- cost of a step
@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU head kernel: {cpu_kernels.status()}")
def test_greedy_verify_through_the_screen_is_the_fp32_argmax():
    """A greedy verify step reads its k+1 positions' tokens through the head's bf16 screen
    (`screened_argmax`): each needed row's token equals the first maximum of the fp32 logits
    over the same rows, with an exact tie (the first id wins), a near tie (rows 2^-12 apart,
    equal in bf16), rows at many scales; a needed row the screen cannot decide (zero, NaN)
    sends the batch to the fp32 logits (same tokens); such a row that is not needed (an idle
    slot, a position past a row's limit) does not."""
    rng = np.random.default_rng(5)
    vocab, d = 2011, 64
    w = rng.normal(size=(vocab, d)).astype(np.float32)
    w[1500] = w[30]
    w[900] = np.asarray(jnp.asarray(w[900]).astype(jnp.bfloat16).astype(F32))
    w[901] = w[900] * np.float32(1 + 2**-12)
    head = cpu_kernels.pack_head(jnp.asarray(w), screen=True)
    assert head.screen is not None
    x = rng.normal(size=(12, d)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4, (12, 1))
    x[1], x[4] = w[30] * np.float32(2), w[900] + rng.normal(size=d).astype(np.float32) * np.float32(1e-3)
    exact = lambda x: np.asarray(jax.jit(  # noqa: E731
        lambda x: argmax_first(cpu_kernels.vocab_head(x, head)))(jnp.asarray(x)))
    run = jax.jit(screened_argmax)
    needed = np.ones(12, bool)
    got = np.asarray(run(jnp.asarray(x), head, jnp.asarray(needed)))
    np.testing.assert_array_equal(got, exact(x))
    assert got[1] == 30 and got[4] == 901
    undecided = x.copy()
    undecided[7], undecided[9, 3] = 0, np.nan
    got = np.asarray(run(jnp.asarray(undecided), head, jnp.asarray(needed)))  # the fp32 logits' argmax
    np.testing.assert_array_equal(got, exact(undecided))
    needed[[7, 9]] = False  # not needed: the screen's tokens stand for the others
    got = np.asarray(run(jnp.asarray(undecided), head, jnp.asarray(needed)))
    np.testing.assert_array_equal(got[needed], exact(x)[needed])


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU head kernel: {cpu_kernels.status()}")
def test_greedy_verify_through_the_screen_equals_the_fp32_logits_verify(small_vocab, rng):
    """One verify step from the same state, twice: through the screen (the runner's
    `verify_params`, screened) and through the fp32 logits (screen=False, as with logprobs):
    the same tokens, counts and accepted drafts, and the same cache; the screened program
    holds the screen's custom call and the logits one does not."""
    prompts = _prompts(rng, 6, (9, 17, 25))
    engine = _engine(small_vocab, num_draft_tokens=3, spec_policy="fixed")
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(3):
        engine.step()
    runner = engine.runner
    assert screens(runner.verify_params)
    state = lambda: jax.tree.map(jnp.copy, (runner.cache, runner.spec, runner.slots))  # noqa: E731
    step = functools.partial(verify, runner.verify_params, small_vocab.mtp, k=3, cfg=small_vocab.config,
                             ctx_bucket=engine.scheduler.bucket(64), schedule=None, sampled=False, vocab=runner.draft)
    run = jax.jit(lambda c, sp, sl, screen: step(c, sp, sl, screen=screen), static_argnames="screen")
    c1, _, _, screened = run(*state(), screen=True)
    c2, _, _, logits = run(*state(), screen=False)
    assert screened.logits is None and logits.logits is not None
    for f in ("tokens", "count", "accepted", "checked"):
        np.testing.assert_array_equal(getattr(screened, f), getattr(logits, f))
    jax.tree.map(np.testing.assert_array_equal, c1, c2)
    assert int(np.asarray(screened.checked).sum()) > 0
    hlo = lambda screen: run.lower(*state(), screen=screen).as_text()  # noqa: E731
    assert cpu_kernels.GREEDY in hlo(True) and cpu_kernels.GREEDY not in hlo(False)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU head kernel: {cpu_kernels.status()}")
def test_speculative_engine_verifies_through_the_screen(small_vocab, rng):
    """A speculative engine on one CPU device keeps the plain engine's screened head: greedy
    verify steps read it through the screen, and the tokens equal plain decoding's, for both
    policies."""
    prompts = _prompts(rng, 6, (9, 17, 25))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = _generate(small_vocab, prompts, params)
    for policy in ("fixed", "confidence"):
        spec, engine = _generate(small_vocab, prompts, params, num_draft_tokens=3, spec_policy=policy,
                                 verify_costs=None if policy == "fixed" else [1.0, 1.05, 1.1, 1.15])
        assert spec == plain and screens(engine.step_params) and screens(engine.runner.verify_params)


def test_confidence_policy_steps_plain_and_stays_identical(small_vocab, rng):
    """Verify steps pinned twice a plain step, paid for only by drafts accepted more often than
    this untrained drafter's are: the confidence policy tries them first, then decodes mostly
    by plain steps (the plain decode program: warm-up compiles it and verify programs for
    k = 1..K only), probing with verify steps now and then, and the greedy tokens equal plain
    decoding's (some prompts prefilled by the plain program, their rows cold when verify steps
    resume); pinned cheap, it verifies."""
    prompts = _prompts(rng, 6, (7, 21, 30, 9, 14))  # (3 slots)
    # a short request frees its slot early, so that a prompt is admitted during a plain run
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 18, 40, 40, 40)]
    plain, _ = _generate(small_vocab, prompts, params)
    dear, engine = _generate(small_vocab, prompts, params, num_draft_tokens=2, verify_costs=[1.0, 1.9, 2.0])
    assert dear == plain
    m = engine.spec_metrics()
    assert m["plain_steps"] > m["target_steps"] // 2 and m["drafts_proposed"] > 0 and m["plain_prefills"] > 0
    assert engine.policy.verify_lengths() == [1, 2] and engine.policy.plain_steps
    # pinned at half a plain step, a verify step wins whatever the acceptance, draining or not
    cheap, engine = _generate(small_vocab, prompts, params, num_draft_tokens=2, verify_costs=[1.0, 0.5, 0.5])
    assert cheap == plain and engine.spec_metrics()["plain_steps"] == 0
