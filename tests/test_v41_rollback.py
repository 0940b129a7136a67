"""Speculative rollback on DeepSeek-V4.1's cache: a 5-token verification chunk whose last 3
positions are rejected is undone by putting back exactly the rows those positions wrote
(window ring slots, ratio-2 tail slots, the latents and index keys of the groups they
closed), and decoding on from the accepted prefix gives the full sequence's logits (the float64 oracle's
forward; tiny-v41, fp32, no round trips, the owner's index keys)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import RuntimeOptions, load_config
from dsjax.model.cache import restore_rows, save_rows
from dsjax.model.cache_layout import init_cache, min_ring
from dsjax.model.v41.backbone import v41_logits, v41_streams_cached
from dsjax.model.v41.params import v41_model_specs
from dsjax.params import init_params

import v41_oracle  # tests/ is on sys.path (conftest.py)
from test_v41_forward import HP, _oracle_weights

OPTS = RuntimeOptions(round_trips=False, index_keys_from_owner=True)
CAP = 32


def test_rejected_positions_are_put_back():
    cfg = load_config("tiny-v41")
    assert min_ring(cfg) >= 6  # a DSpark verification (anchor + 5 drafts) writes each ring slot once
    params = init_params(v41_model_specs(cfg, jnp.float32), seed=0)
    tokens = np.random.default_rng(0).integers(0, 5000, (2, 16)).astype(np.int32)
    want, _ = v41_oracle.forward(_oracle_weights(params, cfg), tokens, HP)  # the full sequence, no Engram

    @functools.partial(jax.jit, static_argnames="c")
    def step(params, t, cache, c):
        streams, pi, cache, _ = v41_streams_cached(params, t, cfg, cache, ctx_bucket=CAP, opts=OPTS)
        return v41_logits(params, streams, pi, cfg), cache

    cache = init_cache(cfg, 2, CAP, jnp.float32)
    _, cache = step(params, tokens[:, :5], cache, c=5)
    positions = jnp.broadcast_to(jnp.arange(5, 10), (2, 5))
    saved = save_rows(cache, positions, cfg)
    logits, cache = step(params, tokens[:, 5:10], cache, c=5)  # "verify" 5 positions
    np.testing.assert_allclose(np.asarray(logits)[:, :2], want[:, 5:7], atol=1e-5 * np.abs(want).max(), rtol=0)
    rejected = positions >= 7  # accept 5, 6; reject 7, 8, 9 (7 closes a ratio-2 group: its latent goes too)
    cache = restore_rows(cache, saved, positions, rejected, cfg).replace(length=jnp.full((2,), 7, jnp.int32))
    got = []
    for p in range(7, 16):
        logits, cache = step(params, tokens[:, p:p + 1], cache, c=1)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want[:, 7:16], atol=1e-5 * np.abs(want).max(), rtol=0)
