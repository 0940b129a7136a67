"""The decode cache: per layer, a window ring and (CSA / HCA) compressed entries with the
raw projections of the incomplete window; never per-token KV older than the window.

Shapes are static: `capacity` tokens per sequence, `batch` sequences (the engine's slots).
Also here: which cache rows a chunk of positions writes, and saving / restoring exactly
those rows (`save_rows` / `restore_rows`), which speculative rollback needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.config import ModelConfig
from dsjax.layers.attention import AttentionState, attention_state_shapes
from dsjax.layers.compressor import CompressorState


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


# ----------------------------------------------------------------------------- rollback
def written_rows(state: AttentionState, ratio: int, positions: jax.Array) -> AttentionState:
    """Per field of one layer's state, the row index [B, n] that an extend over `positions`
    may write: ring slots (position % ring size) and the compressed entry each position
    would complete (position // ratio). Same structure as `state`."""
    def comp_rows(comp: CompressorState | None):
        if comp is None:
            return None
        ring = positions % comp.ring_kv.shape[1]
        return CompressorState(entries=positions // ratio, ring_kv=ring, ring_gate=ring)

    return AttentionState(window=positions % state.window.shape[1], compressor=comp_rows(state.compressor),
                          indexer=comp_rows(state.indexer))


def save_rows(cache: Cache, positions: jax.Array, cfg: ModelConfig) -> tuple[AttentionState, ...]:
    """What an extend over positions [B, n] will overwrite, per layer (each field [B, n, ...])."""
    rows = jnp.arange(positions.shape[0])[:, None]
    return tuple(jax.tree.map(lambda a, idx: a.at[rows, idx].get(mode="fill", fill_value=0), st,
                              written_rows(st, layer.compress_ratio, positions))
                 for st, layer in zip(cache.layers, cfg.layers))


def restore_rows(cache: Cache, saved: tuple[AttentionState, ...], positions: jax.Array, rejected: jax.Array,
                 cfg: ModelConfig) -> Cache:
    """Put back the rows that the positions marked rejected [B, n] wrote. A rejected
    position's entry index holds its pre-step value: every position of that group at or
    after it was rejected too, so no kept position wrote it."""
    rows = jnp.arange(positions.shape[0])[:, None]

    def put_back(a, idx, old):
        idx = jnp.where(rejected, idx, a.shape[1])  # out of bounds: dropped
        return a.at[rows, idx].set(old, mode="drop")

    layers = tuple(jax.tree.map(put_back, st, written_rows(st, layer.compress_ratio, positions), old)
                   for st, layer, old in zip(cache.layers, cfg.layers, saved))
    return cache.replace(layers=layers)


def min_ring(cfg: ModelConfig) -> int:
    """The smallest ring of the cache: one verify step may write at most this many positions
    (each ring slot at most once, so the saved rows are the pre-step ones)."""
    sizes = [cfg.sliding_window]
    for layer in cfg.layers:
        if layer.compress_ratio:
            sizes.append(layer.compress_ratio * (2 if layer.overlap else 1))
        if layer.has_indexer:
            sizes.append(2 * layer.compress_ratio)
    return min(sizes)
