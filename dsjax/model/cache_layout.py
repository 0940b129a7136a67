"""The cache a config lays out (its generation's layer states, `family_of(cfg).cache_shapes`):
abstract shapes, zeros, bytes per sequence, the smallest ring, and how a prefix block cuts it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.layers.engram import BEFORE_START
from dsjax.model.cache import DEAD, Cache
from dsjax.model.family import family_of
from dsjax.params import spec_leaves, weight_group


def cache_shapes(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> Cache:
    """Abstract cache (jax.ShapeDtypeStruct leaves); nothing is allocated."""
    ratios = sorted({layer.compress_ratio for layer in cfg.layers} - {0})
    if capacity % max(ratios, default=1):
        raise ValueError(f"cache capacity {capacity} must be a multiple of the compression ratios {tuple(ratios)}")
    return family_of(cfg).cache_shapes(cfg, batch, capacity, dtype)


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> Cache:
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, capacity, dtype))
    if cache.history is not None:  # no token before the start (Engram's hashing blocks those shifts)
        cache = cache.replace(history=jnp.full(cache.history.shape, BEFORE_START, jnp.int32))
    return cache


GROWING = ("entries", "index_keys")  # the leaves that grow with the context; the rest are rings and tails


def cache_bytes(cfg: ModelConfig, capacity: int, dtype=jnp.bfloat16) -> dict:
    """Bytes of one sequence's cache at `capacity` tokens, split into the part that grows
    with context (compressed entries, index keys) and the constant part (rings, tails), plus
    the analytic minimum (`ModelFamily.cache_minimum`; V4: per layer 512*(1/4 + 1/128) + 128/4
    elements per token, as the spec states)."""
    shapes = cache_shapes(cfg, 1, capacity, dtype)
    growing = constant = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes.layers)[0]:
        nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        if getattr(path[-1], "name", None) in GROWING:
            growing += nbytes
        else:
            constant += nbytes
    item = jnp.dtype(dtype).itemsize
    minimum, compact = family_of(cfg).cache_minimum(cfg)
    return {
        "capacity": capacity,
        "bytes_per_sequence": growing + constant,
        "compressed_bytes_per_sequence": growing,
        "constant_bytes_per_sequence": constant,
        "bytes_per_token": (growing + constant) / capacity,
        "compressed_bytes_per_token": growing / capacity,
        "analytic_min_bytes_per_token": minimum * item,
        "full_kv_bytes_per_token": cfg.num_hidden_layers * cfg.head_dim * item,
        **({"compact_bytes_per_token": compact} if compact is not None else {}),
    }


def min_ring(cfg: ModelConfig) -> int:
    """The smallest ring of the cache: one verify step may write at most this many positions
    (each ring slot at most once, so the saved rows are the pre-step ones)."""
    return family_of(cfg).min_ring(cfg)


def block_layout(cfg: ModelConfig, capacity: int, dtype=jnp.bfloat16) -> tuple[int, ...]:
    """Per leaf of `Cache.layers`: tokens per row of its axis 2 where it grows with the
    capacity (compressed entries, index keys); 0 for fixed-size state a block's end must keep
    (windows, overlapping compressor rings, V4.1's tails); DEAD for the raw kv / gate ring of
    a non-overlapping compressor (V4's HCA), whose group the block completed: nothing reads
    it before the next group's tokens overwrite it, so a block neither stores nor restores it
    (for V4-Flash that is 5.2 of a 128-token block's 12 MB)."""
    small, large = cache_shapes(cfg, 1, capacity, dtype), cache_shapes(cfg, 1, 2 * capacity, dtype)
    codes = []
    for run, run_small, run_large in zip(cfg.layer_runs, small.layers, large.layers):
        for layer, st, st_large in zip(run.layers, run_small, run_large):
            comp = getattr(st, "compressor", None)
            dead = set() if comp is None or layer.overlap else {id(comp.ring_kv), id(comp.ring_gate)}
            for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(st_large)):
                if a.shape == b.shape:
                    codes.append(DEAD if id(a) in dead else 0)
                elif b.shape[2] == 2 * a.shape[2] and capacity % a.shape[2] == 0:
                    codes.append(capacity // a.shape[2])
                else:
                    raise ValueError(f"cache leaf of shape {a.shape} grows unevenly with the capacity")
    return tuple(codes)


def decode_step_bytes(cfg: ModelConfig, *, batch: int, context: int, dtype=jnp.float32, specs=None) -> dict:
    """Bytes one decode step reads at `batch` rows of `context` cached tokens, by group.
    specs: the weights as held (default: model_specs at `dtype`; a resident spec tree counts
    the stored bytes, FP8 / MXFP4 codes and their exponents); the cache is at `dtype`."""
    groups: dict[str, float] = {}
    for path, spec in spec_leaves(family_of(cfg).param_specs(cfg, dtype) if specs is None else specs):
        group = weight_group(path)
        groups[group] = groups.get(group, 0.0) + float(spec.nbytes)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    groups["routed_experts"] = groups.get("routed_experts", 0.0) * (1 - (1 - k / e) ** batch)  # distinct experts hit
    groups["embed"] = groups.get("embed", 0.0) / cfg.vocab_size * batch  # one row per token
    if cfg.tie_word_embeddings:  # the head reads the whole matrix
        groups["lm_head"] = cfg.vocab_size * cfg.hidden_size * jnp.dtype(dtype).itemsize
    ratio = max(cfg.compress_rate_csa, cfg.compress_rate_hca)
    capacity = -(-context // ratio) * ratio
    groups["cache"] = sum(float(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
                          for s in jax.tree.leaves(cache_shapes(cfg, batch, capacity, dtype)))
    return {"total": sum(groups.values()), "by_group": groups}
