"""The decode cache: per layer, a window ring and (CSA / HCA) compressed entries with the
raw projections of the incomplete window; never per-token KV older than the window.

Shapes are static: `capacity` tokens per sequence, `batch` sequences (the engine's slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.config import ModelConfig
from dsjax.layers.attention import AttentionState, attention_state_shapes


@struct.dataclass
class Cache:
    length: jax.Array  # [B] int32: tokens already in the cache per sequence
    layers: tuple[AttentionState, ...]


def cache_shapes(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> Cache:
    """Abstract cache (jax.ShapeDtypeStruct leaves); nothing is allocated."""
    if capacity % max(cfg.compress_rate_csa, cfg.compress_rate_hca):
        raise ValueError(f"cache capacity {capacity} must be a multiple of the compression ratios "
                         f"({cfg.compress_rate_csa}, {cfg.compress_rate_hca})")
    return Cache(
        length=jax.ShapeDtypeStruct((batch,), jnp.int32),
        layers=tuple(attention_state_shapes(cfg, layer, batch, capacity, dtype) for layer in cfg.layers),
    )


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> Cache:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, capacity, dtype))


def cache_bytes(cfg: ModelConfig, capacity: int, dtype=jnp.bfloat16) -> dict:
    """Bytes of one sequence's cache at `capacity` tokens, split into the part that grows
    with context (compressed entries) and the constant part (rings), plus the analytic
    minimum: per layer 512*(1/4 + 1/128) + 128/4 elements per token, as the spec states."""
    shapes = cache_shapes(cfg, 1, capacity, dtype)
    growing = constant = 0
    for layer in shapes.layers:
        for name, leaf in (("window", layer.window),) + tuple(
                (n, getattr(s, n)) for s in (layer.compressor, layer.indexer) if s is not None
                for n in ("entries", "ring_kv", "ring_gate")):
            nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
            if name == "entries":
                growing += nbytes
            else:
                constant += nbytes
    item = jnp.dtype(dtype).itemsize
    minimum = 0.0
    for layer in cfg.layers:
        if layer.compress_ratio:
            minimum += cfg.head_dim / layer.compress_ratio
        if layer.has_indexer:
            minimum += cfg.index_head_dim / layer.compress_ratio
    return {
        "capacity": capacity,
        "bytes_per_sequence": growing + constant,
        "compressed_bytes_per_sequence": growing,
        "constant_bytes_per_sequence": constant,
        "bytes_per_token": (growing + constant) / capacity,
        "compressed_bytes_per_token": growing / capacity,
        "analytic_min_bytes_per_token": minimum * item,
        "full_kv_bytes_per_token": cfg.num_hidden_layers * cfg.head_dim * item,
    }
