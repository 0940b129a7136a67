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

from dsjax.config import RuntimeOptions, load_config
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
