"""Prefill and decode as one jitted function: `extend` feeds a chunk of C tokens per
sequence (C = the prefill chunk, or 1 for decode) through the model's cached forward.

Shapes are static per (batch, C, ctx_bucket); `ctx_bucket` bounds how many compressed
entries are read, so a step's cost follows the longest sequence in the batch rather than
the cache capacity, and steady-state decode reuses one compiled function per bucket.
"""

from __future__ import annotations

import jax

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.model.cache import Cache
from dsjax.model.decoder import DEFAULT_OPTIONS, ModelParams, forward

MIN_BUCKET = 256


def context_bucket(tokens_needed: int, capacity: int) -> int:
    """Smallest power-of-two multiple of MIN_BUCKET holding `tokens_needed`, capped at capacity."""
    bucket = MIN_BUCKET
    while bucket < tokens_needed:
        bucket *= 2
    return min(bucket, capacity)


def extend(params: ModelParams, cache: Cache, tokens: jax.Array, n_valid: jax.Array, *, cfg: ModelConfig,
           ctx_bucket: int, all_logits: bool = False, batch_invariant: bool = False,
           opts: RuntimeOptions = DEFAULT_OPTIONS):
    """tokens [B, C] at positions cache.length + i; only i < n_valid are real. Returns logits
    [B, C, V] (all_logits) or [B, 1, V] at each row's last valid token, and the cache."""
    return forward(params, tokens, cfg, cache, opts=opts.replace(batch_invariant=batch_invariant), n_valid=n_valid,
                   ctx_bucket=ctx_bucket, last_only=not all_logits)
