"""Lossless greedy speculation with DSpark on DeepSeek-V4.1 (spec §6.7), at the model level:
DSpark drafts 5 tokens after the anchor, the main model verifies [anchor, drafts] in one
6-position chunk, each row keeps the drafts that equal its argmax (and the correction /
bonus), the cache rows of rejected positions are put back, the drafter's rings are fed the
committed positions' taps. The tokens equal plain greedy decoding's. tiny-v41 cut to an
8-token vocabulary (no Engram tables, so the Markov head can be the identity): the drafts
repeat the anchor, right inside the target's runs of a token and wrong where a run ends."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dsjax.config import RuntimeOptions, load_config
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.model.cache import init_cache, restore_rows, save_rows
from dsjax.model.dspark import dspark_draft, dspark_seed, empty_ring
from dsjax.model.v41 import dspark_specs, v41_logits, v41_model_specs, v41_streams_cached
from dsjax.params import init_params

OPTS = RuntimeOptions(round_trips=False)
CAP, B, PROMPT, NEW = 64, 2, 6, 24


def _config():
    cfg = load_config("tiny-v41")
    v41 = dataclasses.replace(cfg.v41, dspark=dataclasses.replace(cfg.v41.dspark, noise_token_id=7), engram=None)
    return cfg.replace(vocab_size=8, v41=v41, eos_token_ids=(1,), pad_token_id=2)


def test_greedy_dspark_speculation_equals_plain_decoding():
    cfg = _config()
    params = init_params(v41_model_specs(cfg, jnp.float32), seed=0)
    ds = init_params(dspark_specs(cfg, jnp.float32), seed=1)
    # a Markov head that repeats the previous token: the target's greedy output runs in
    # repeats here, so drafts are right inside a run and wrong where it changes
    ds = ds.replace(markov_embed=4 * jnp.eye(8), markov_head=4 * jnp.eye(8))
    prompts = np.random.default_rng(0).integers(0, 8, (B, PROMPT)).astype(np.int32)

    @functools.partial(jax.jit, static_argnames="c", donate_argnames="cache")
    def main_step(params, tokens, cache, c):
        streams, pi, cache, hidden = v41_streams_cached(params, tokens, cfg, cache, ctx_bucket=CAP, opts=OPTS,
                                                        taps=True)
        return v41_logits(params, streams, pi, cfg), hidden, cache

    # plain greedy decoding
    logits, _, cache = main_step(params, prompts, init_cache(cfg, B, CAP, jnp.float32), c=PROMPT)
    plain = [np.asarray(logits[:, -1].argmax(-1))]
    for _ in range(NEW - 1):
        logits, _, cache = main_step(params, plain[-1][:, None].astype(np.int32), cache, c=1)
        plain.append(np.asarray(logits[:, -1].argmax(-1)))
    plain = np.stack(plain, axis=1)

    # speculative: prefill, seed the rings, then draft / verify / roll back / feed
    draft = jax.jit(lambda ds, p, a, h, t, ring: dspark_draft(ds, p, a, h, t, ring, cfg, opts=OPTS))
    seed = jax.jit(lambda ds, h, pos, ring, valid: dspark_seed(ds, h, pos, ring, cfg, valid, opts=OPTS))
    logits, hidden, cache = main_step(params, prompts, init_cache(cfg, B, CAP, jnp.float32), c=PROMPT)
    ring = seed(ds, hidden, jnp.broadcast_to(jnp.arange(PROMPT), (B, PROMPT)), empty_ring(cfg, B, jnp.float32),
                jnp.ones((B, PROMPT), bool))
    anchor = np.asarray(logits[:, -1].argmax(-1)).astype(np.int32)
    last_hidden, t = hidden[:, -1], np.full(B, PROMPT - 1, np.int32)
    out = [[int(a)] for a in anchor]
    accepted_total = proposed = 0
    while min(len(o) for o in out) < NEW:
        ring, drafts, _, _ = draft(ds, params, anchor, last_hidden, t, ring)
        chunk = np.concatenate([anchor[:, None], np.asarray(drafts)], axis=1).astype(np.int32)  # [B, 6]
        positions = jnp.asarray(t[:, None] + 1 + np.arange(chunk.shape[1]), jnp.int32)
        saved = save_rows(cache, positions, cfg)
        logits, hidden, cache = main_step(params, chunk, cache, c=chunk.shape[1])
        target = np.asarray(logits.argmax(-1))  # [B, 6]: the argmax after each position
        ok = np.cumprod(chunk[:, 1:] == target[:, :-1], axis=1)
        n_acc = ok.sum(axis=1)  # accepted drafts per row
        accepted_total += int(n_acc.sum())
        proposed += chunk.shape[1] - 1
        for r in range(B):
            out[r] += chunk[r, 1:1 + n_acc[r]].tolist() + [int(target[r, n_acc[r]])]
        keep = np.arange(chunk.shape[1])[None] <= n_acc[:, None]  # anchor + accepted drafts
        cache = restore_rows(cache, saved, positions, jnp.asarray(~keep), cfg).replace(
            length=jnp.asarray(t + 1 + n_acc + 1, jnp.int32))
        ring = seed(ds, hidden, positions, ring, jnp.asarray(keep))
        anchor = target[np.arange(B), n_acc].astype(np.int32)
        last_hidden = hidden[np.arange(B), n_acc]
        t = t + 1 + n_acc
    spec = np.stack([np.asarray(o[:NEW]) for o in out])
    np.testing.assert_array_equal(spec, plain)
    assert 0 < accepted_total < proposed * B  # drafts were both accepted and rejected



@pytest.fixture(scope="module")
def tiny8():
    """tiny-v41 cut to 8 tokens with seeded Engram tables and the repeating Markov head, as a
    `dsjax.Model` with its DSpark head (default options: round trips, the reference's keys)."""
    from dsjax.api import Model
    from dsjax.checkpoint.engram_tables import EngramStore

    cfg = load_config("tiny-v41")
    cfg = cfg.replace(vocab_size=8, eos_token_ids=(1,), pad_token_id=2,
                      v41=dataclasses.replace(cfg.v41, dspark=dataclasses.replace(cfg.v41.dspark, noise_token_id=7)))
    params = init_params(v41_model_specs(cfg, jnp.float32), seed=0).replace(engram_tables=EngramStore.seeded(cfg, 1))
    ds = init_params(dspark_specs(cfg, jnp.float32), seed=1).replace(markov_embed=4 * jnp.eye(8),
                                                                     markov_head=4 * jnp.eye(8))
    return Model(cfg, params, jnp.float32, mtp=ds)


def test_engine_dspark_speculation_equals_the_plain_engine(tiny8):
    """The same at the engine: greedy requests through `Engine(num_draft_tokens=5)` with the
    DSpark head (prefill seeding its rings, verify steps rolling back the caches and the
    Engram id history, drafts committed and redrawn; 3 requests over 2 slots, one prompt of 2
    tokens) give the plain engine's tokens, under the default options (quantisation round
    trips, the reference's index keys) and with seeded Engram tables; drafts are both
    accepted and rejected."""
    prompts = np.random.default_rng(2).integers(0, 8, (3, 7)).tolist()
    prompts[2] = prompts[2][:2]  # from start 2 a 6-position chunk is past the key rule's exact range: fewer drafts
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = Engine(tiny8, max_slots=2, capacity=CAP, prefill_chunk=8).generate(prompts, sampling)
    engine = Engine(tiny8, max_slots=2, capacity=CAP, prefill_chunk=8, num_draft_tokens=5, spec_policy="fixed")
    assert engine.generate(prompts, sampling) == plain
    m = engine.spec_metrics()
    assert 0 < m["drafts_accepted"] < m["drafts_proposed"]


def test_engine_sampled_dspark_speculation_keeps_the_distribution(tiny8):
    """Sampled requests (temperature 0.1, where this model's p is far from uniform; a seed each):
    the first token comes from the prefill,
    the second from a verify step over DSpark's drafts drawn from the drafter's processed
    distribution. Its frequencies over 320 requests fit the target's marginal
    sum_a p(a | prompt) p(b | prompt, a), from the model's full-sequence logits (chi-square)."""
    prompt = [3, 5, 2, 6, 1, 0, 4]
    n, temp = 320, 0.1
    engine = Engine(tiny8, max_slots=8, capacity=CAP, prefill_chunk=8, num_draft_tokens=3, spec_policy="fixed")
    out = np.array(engine.generate([prompt] * n, [SamplingParams(max_tokens=2, ignore_eos=True, temperature=temp,
                                                                 seed=i) for i in range(n)]))
    assert engine.spec_metrics()["drafts_accepted"] > 0
    seqs = np.array([prompt + [a] for a in range(8)])
    logits = tiny8.logits(seqs)  # [8, 8, 8]
    probs = np.asarray(jax.nn.softmax(logits.astype(np.float64) / temp, axis=-1), np.float64)
    first = probs[0, len(prompt) - 1]
    second = first @ probs[:, len(prompt)]  # the marginal of b
    for got, want in ((out[:, 0], first), (out[:, 1], second)):
        assert stats.chisquare(np.bincount(got, minlength=8), n * want / want.sum()).pvalue > 1e-3
