"""Prefill and decode as one jitted function: `extend` feeds a chunk of C tokens per
sequence (C = the prefill chunk, or 1 for decode) through the model against the cache.

Shapes are static per (batch, C, ctx_bucket); `ctx_bucket` bounds how many compressed
entries are read, so a step's cost follows the longest sequence in the batch rather than
the cache capacity, and steady-state decode reuses one compiled function per bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.engine.cache import Cache
from dsjax.layers.attention import attention_extend
from dsjax.model import ModelParams, block_apply, embed_streams, head_logits

MIN_BUCKET = 256


def context_bucket(tokens_needed: int, capacity: int) -> int:
    """Smallest power-of-two multiple of MIN_BUCKET holding `tokens_needed`, capped at capacity."""
    bucket = MIN_BUCKET
    while bucket < tokens_needed:
        bucket *= 2
    return min(bucket, capacity)


def run_layers(params: ModelParams, cache: Cache, tokens: jax.Array, n_valid: jax.Array, cfg: ModelConfig,
               ctx_bucket: int) -> tuple[jax.Array, Cache]:
    """The decoder over a chunk against the cache -> (final streams [B, C, N, D], cache)."""
    start = cache.length
    streams = embed_streams(params, tokens, cfg)
    layers = []
    for layer, block, state in zip(cfg.layers, params.blocks, cache.layers):
        n_entries = ctx_bucket // layer.compress_ratio if layer.compress_ratio else 0

        def attend(p_attn, h, layer=layer, state=state, n_entries=n_entries):
            return attention_extend(p_attn, state, h, start, n_valid, layer, cfg, n_entries)

        streams, new_state = block_apply(block, streams, tokens, attend, cfg)
        layers.append(new_state)
    return streams, Cache(start + n_valid, tuple(layers))


def _extend_rows(params: ModelParams, cache: Cache, tokens: jax.Array, n_valid: jax.Array, cfg: ModelConfig,
                 ctx_bucket: int, all_logits: bool):
    streams, cache = run_layers(params, cache, tokens, n_valid, cfg, ctx_bucket)
    if not all_logits:  # only the last valid position of each row
        last = jnp.maximum(n_valid - 1, 0)
        streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)
    return head_logits(params, streams, cfg), cache


@functools.partial(jax.jit, static_argnames=("cfg", "ctx_bucket", "all_logits", "batch_invariant"),
                   donate_argnames=("cache",))
def extend(params: ModelParams, cache: Cache, tokens: jax.Array, n_valid: jax.Array, *, cfg: ModelConfig,
           ctx_bucket: int, all_logits: bool = False, batch_invariant: bool = False):
    """tokens [B, C] at positions cache.length + i; only i < n_valid [B] are real (rows with
    n_valid = 0 are left untouched). Returns logits [B, C, V] (all_logits) or [B, 1, V] at
    each row's last valid token, and the updated cache (donated).

    batch_invariant: run each row as its own batch-1 computation (`lax.map`), so a row's
    results are bitwise independent of the other rows and of its slot."""
    if not batch_invariant:
        return _extend_rows(params, cache, tokens, n_valid, cfg, ctx_bucket, all_logits)

    def one(row):
        c, t, n = row
        c = jax.tree.map(lambda a: a[None], c)
        logits, c = _extend_rows(params, c, t[None], n[None], cfg, ctx_bucket, all_logits)
        return logits[0], jax.tree.map(lambda a: a[0], c)

    return jax.lax.map(one, (cache, tokens, n_valid))
