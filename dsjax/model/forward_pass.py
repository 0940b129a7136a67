"""The model's one jitted forward, `forward`: a whole sequence or a cached chunk through the
config's generation (`family_of(cfg).forward_rows`: V4's decoder, dsjax/model/v4/decoder.py,
or V4.1's backbone, dsjax/model/v41/backbone.py), optionally in batch-invariant tiles.
`Model.logits`, the engine's prefill and decode programs and the training export all call it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers.linear import gemm_only, kernels_for_stored_weights
from dsjax.model.block import DEFAULT_OPTIONS, INVARIANT_ROWS
from dsjax.model.cache import Cache, over_tiles
from dsjax.model.family import family_of
from dsjax.sharding.rules import axis_size, current_mesh


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "ctx_bucket", "last_only", "hidden"),
                   donate_argnames=("cache",))
def forward(params, tokens: jax.Array, cfg: ModelConfig, cache: Cache | None = None, *,
            opts: RuntimeOptions = DEFAULT_OPTIONS, n_valid: jax.Array | None = None, ctx_bucket: int | None = None,
            last_only: bool = False, hidden: bool = False) -> tuple[jax.Array, Cache | None]:
    """tokens [B, S] int32 -> (logits fp32, cache).

    cache None: a whole causal sequence at positions 0..S-1; returns (logits [B, S, V], None).
    cache: a chunk at positions cache.length + i, only i < n_valid [B] real (default all;
    rows with n_valid = 0 are left untouched); returns the updated cache (donated at top
    level). ctx_bucket (static, required with a cache) bounds the compressed entries read:
    every entry a query can see must lie below ctx_bucket / ratio.
    last_only: logits [B, 1, V] at each row's last valid position only.
    hidden: the vocabulary head's input rows (collapsed and normed; [..., D] fp32) instead of
    the logits, for a caller that applies the head itself (the engine's greedy screen).
    opts.batch_invariant (cached path): B rows (a multiple of INVARIANT_ROWS) run as tiles of
    INVARIANT_ROWS, each its own forward of the same shape; on a mesh each device holds
    exactly one tile (B = INVARIANT_ROWS x batch shards), whose per-device program is the
    same; the MoE takes its grouped path in fixed row tiles.
    XLA:CPU picks how a reduction or product sums by the operand shapes, so a fixed shape
    makes a row's results depend on its own tokens only, not on the batch size, its slot
    or its neighbours (see docs/batch-invariance.md)."""
    return forward_traced(params, tokens, cfg, cache, opts=opts, n_valid=n_valid, ctx_bucket=ctx_bucket,
                          last_only=last_only, hidden=hidden)


def forward_traced(params, tokens: jax.Array, cfg: ModelConfig, cache: Cache | None = None, *,
                   opts: RuntimeOptions = DEFAULT_OPTIONS, n_valid: jax.Array | None = None,
                   ctx_bucket: int | None = None, last_only: bool = False, hidden: bool = False):
    """`forward`'s body, not jitted: for a caller that traces it inside a program of its own
    (dsjax/inspect.py opens its taps around it; a nested jit would trace it apart from them)."""
    if cache is not None and ctx_bucket is None:
        raise ValueError("forward with a cache needs ctx_bucket (how many cached tokens a query may read)")
    with kernels_for_stored_weights(opts.kernels):  # FP8 projections: the kernel reading stored bytes, if chosen
        if opts.batch_invariant and cache is not None:  # the same products on one device as on a mesh
            with gemm_only():
                return _forward(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden)
        return _forward(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden)


def _forward(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden):
    b = tokens.shape[0]
    if cache is not None and opts.batch_invariant and current_mesh() is not None:  # each device: one tile
        if b != INVARIANT_ROWS * axis_size("batch"):
            raise ValueError(f"batch_invariant on a mesh: {b} rows, not {INVARIANT_ROWS} on each of the "
                             f"{axis_size('batch')} batch shards")
        return _forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden)
    if cache is None or not opts.batch_invariant:
        return _forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden)
    n_valid = jnp.full((b,), tokens.shape[1], jnp.int32) if n_valid is None else n_valid

    def tile(cache, x):
        logits, cache = _forward_rows(params, x[0], cfg, cache, opts, x[1], ctx_bucket, last_only, hidden)
        return cache, logits

    cache, logits = over_tiles(tile, cache, (tokens, n_valid), INVARIANT_ROWS)
    return logits, cache


def _forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden):
    return family_of(cfg).forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden)
