"""The decode cache: per layer, a window ring and (CSA / HCA) compressed entries with the
raw projections of the incomplete window; never per-token KV older than the window.

Shapes are static: `capacity` tokens per sequence, `batch` sequences (the engine's slots).
Layout follows the config's layer plan (`cfg.layer_runs`): per run, per period position,
one AttentionState whose leaves have a leading [repeats] axis, so the batch axis of a
layer state is axis 1 (`batch_axes`; `take_rows` / `put_rows` slice rows by it).
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
from dsjax.layers.engram import BEFORE_START
from dsjax.layers.shared_attention import TAIL_SLOTS, SharedAttentionState, shared_attention_state_shapes


@struct.dataclass
class Cache:
    length: jax.Array  # [B] int32: tokens already in the cache per sequence
    layers: tuple[tuple[AttentionState | SharedAttentionState, ...], ...]  # per run, per period position:
    #                                                      [R, B, ...] leaves (V4.1: [R * inner, B, ...])
    history: jax.Array | None = None  # [B, max_ngram - 1] int32 (V4.1 Engram): the last compressed ids

    def batch_axes(self) -> "Cache":
        """Per leaf, which axis is the batch (same structure as the cache)."""
        return Cache(length=0, layers=jax.tree.map(lambda _: 1, self.layers),
                     history=None if self.history is None else 0)

    def admit(self, length: jax.Array, reset: jax.Array) -> "Cache":
        """The cache with lengths [B] after an admission, in which the rows `reset` [B] start a new
        sequence: their Engram history (V4.1) forgets the request before."""
        history = self.history
        if history is not None:
            history = jnp.where(reset[:, None], jnp.int32(BEFORE_START), history)
        return self.replace(length=length, history=history)


def batch_axes(tree):
    """Per leaf of a batch-major tree (a Cache, slot state, speculation state), its batch axis:
    0, but in a node that says its own (`batch_axes()`: a Cache, DSpark's rings)."""
    own = lambda x: hasattr(type(x), "batch_axes")  # noqa: E731
    return jax.tree.map(lambda x: x.batch_axes() if own(x) else 0, tree, is_leaf=own)


def take_rows(tree, i, n: int = 1):
    """Rows i..i+n of every leaf, along each leaf's batch axis (i may be traced)."""
    return jax.tree.map(lambda a, ax: jax.lax.dynamic_slice_in_dim(a, i, n, axis=ax), tree, batch_axes(tree))


def put_rows(tree, rows, i):
    """`tree` with rows i.. replaced by `rows` (as `take_rows` returned them)."""
    return jax.tree.map(lambda a, r, ax: jax.lax.dynamic_update_slice_in_dim(a, r, i, axis=ax),
                        tree, rows, batch_axes(tree))


def over_tiles(fn, state, inputs, n: int):
    """fn(state rows, input rows) -> (state rows, outputs) over the batch in tiles of n rows:
    a `lax.scan` whose body is fn at one shape, whatever the batch size (so a row's results
    do not depend on it: batch-invariant mode). state: a batch-major tree (`batch_axes`);
    inputs and outputs: trees of arrays with the batch first. Always a scan, one tile too,
    so that every batch size runs the same compiled body."""
    b = jax.tree.leaves(inputs)[0].shape[0]
    if b % n:
        raise ValueError(f"batch_invariant: {b} rows are not a multiple of {n} (INVARIANT_ROWS)")

    def tile(state, i):
        part, out = fn(take_rows(state, i, n), jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i, n), inputs))
        return put_rows(state, part, i), out

    state, out = jax.lax.scan(tile, state, jnp.arange(0, b, n))
    return state, jax.tree.map(lambda a: a.reshape(b, *a.shape[2:]), out)


def _stack_shapes(tree, n: int):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), tree)


def cache_shapes(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> Cache:
    """Abstract cache (jax.ShapeDtypeStruct leaves); nothing is allocated."""
    ratios = sorted({layer.compress_ratio for layer in cfg.layers} - {0})
    if capacity % max(ratios, default=1):
        raise ValueError(f"cache capacity {capacity} must be a multiple of the compression ratios {tuple(ratios)}")
    if cfg.v41 is not None:  # V4.1: stacked over repeats * inner per period position
        e = cfg.v41.engram
        return Cache(length=jax.ShapeDtypeStruct((batch,), jnp.int32), layers=tuple(
            tuple(_stack_shapes(shared_attention_state_shapes(cfg, layer, batch, capacity, dtype), run.repeats * n)
                  for layer, n in zip(run.layers, run.inner)) for run in cfg.layer_runs),
            history=None if e is None else jax.ShapeDtypeStruct((batch, e.max_ngram_size - 1), jnp.int32))
    return Cache(
        length=jax.ShapeDtypeStruct((batch,), jnp.int32),
        layers=tuple(tuple(_stack_shapes(attention_state_shapes(cfg, layer, batch, capacity, dtype), run.repeats)
                           for layer in run.layers) for run in cfg.layer_runs),
    )


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> Cache:
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, capacity, dtype))
    if cache.history is not None:  # no token before the start (Engram's hashing blocks those shifts)
        cache = cache.replace(history=jnp.full(cache.history.shape, BEFORE_START, jnp.int32))
    return cache


def cache_bytes(cfg: ModelConfig, capacity: int, dtype=jnp.bfloat16) -> dict:
    """Bytes of one sequence's cache at `capacity` tokens, split into the part that grows
    with context (compressed entries) and the constant part (rings), plus the analytic
    minimum: per layer 512*(1/4 + 1/128) + 128/4 elements per token, as the spec states."""
    shapes = cache_shapes(cfg, 1, capacity, dtype)
    growing = constant = 0
    for state in (st for period in shapes.layers for st in period):
        if isinstance(state, SharedAttentionState):
            parts = {"entries": state.entries, "index_keys": state.index_keys, "window": state.window,
                     "tail_kv": state.tail_kv, "tail_gate": state.tail_gate}
        else:
            parts = {"window": state.window, **{
                f"{n}.{i}": getattr(s, n) for i, s in enumerate((state.compressor, state.indexer)) if s is not None
                for n in ("entries", "ring_kv", "ring_gate")}}
        for name, leaf in parts.items():
            if leaf is None:
                continue
            nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
            if name.startswith(("entries", "index_keys")):
                growing += nbytes
            else:
                constant += nbytes
    item = jnp.dtype(dtype).itemsize
    minimum = compact = 0.0
    for layer in cfg.layers:
        if cfg.v41 is not None:  # only KV sources store latents (and index keys); spec §2.12's compact formats
            if layer.has_compressor:
                minimum += (cfg.head_dim + cfg.index_head_dim * layer.has_index_keys) / layer.compress_ratio
                compact += (cfg.head_dim * 9 / 16 + cfg.index_head_dim * 17 / 32 * layer.has_index_keys
                            ) / layer.compress_ratio  # fp4 + e4m3 / 16; fp4 + e8m0 / 32
            continue
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
        **({"compact_bytes_per_token": compact} if cfg.v41 is not None else {}),
    }


# ----------------------------------------------------------------------------- rollback
def written_rows(state: AttentionState | SharedAttentionState, ratio: int, positions: jax.Array):
    """Per field of one layer's state, the row index [B, n] that an extend over `positions`
    may write: ring slots (position % ring size) and the compressed entry each position
    would complete (position // ratio). Same structure as `state`."""
    if isinstance(state, SharedAttentionState):  # V4.1: window, a KV source's latents / keys / tails
        def rows(leaf, idx):
            return None if leaf is None else idx
        entry = positions // max(ratio, 1)
        tail = None if state.tail_kv is None else positions % state.tail_kv.shape[-2]
        return SharedAttentionState(window=positions % state.window.shape[-2], entries=rows(state.entries, entry),
                                    index_keys=rows(state.index_keys, entry), tail_kv=tail, tail_gate=tail)
    def comp_rows(comp: CompressorState | None):
        if comp is None:
            return None
        ring = positions % comp.ring_kv.shape[1]
        return CompressorState(entries=positions // ratio, ring_kv=ring, ring_gate=ring)

    return AttentionState(window=positions % state.window.shape[1], compressor=comp_rows(state.compressor),
                          indexer=comp_rows(state.indexer))


def save_rows(cache: Cache, positions: jax.Array, cfg: ModelConfig) -> tuple[tuple[AttentionState, ...], ...]:
    """What an extend over positions [B, n] will overwrite, per layer (each field [R, B, n, ...])."""
    # row by row (vmap over the batch): a gather of each row's own entries, also on a mesh's batch shards
    take = jax.vmap(lambda a, idx: a.at[idx].get(mode="fill", fill_value=0))

    def one(st, ratio):
        return jax.tree.map(take, st, written_rows(st, ratio, positions))

    return tuple(tuple(jax.vmap(lambda st, r=layer.compress_ratio: one(st, r))(st)
                       for st, layer in zip(period, run.layers))
                 for period, run in zip(cache.layers, cfg.layer_runs))


def restore_rows(cache: Cache, saved: tuple[tuple[AttentionState, ...], ...], positions: jax.Array,
                 rejected: jax.Array, cfg: ModelConfig) -> Cache:
    """Put back the rows that the positions marked rejected [B, n] wrote. A rejected
    position's entry index holds its pre-step value: every position of that group at or
    after it was rejected too, so no kept position wrote it."""
    put = jax.vmap(lambda a, idx, old: a.at[idx].set(old, mode="drop"))  # row by row, as save_rows

    def put_back(a, idx, old):
        return put(a, jnp.where(rejected, idx, a.shape[1]), old)  # out of bounds: dropped

    def one(st, old, ratio):
        return jax.tree.map(put_back, st, written_rows(st, ratio, positions), old)

    layers = tuple(tuple(jax.vmap(lambda st, o, r=layer.compress_ratio: one(st, o, r))(st, old)
                         for st, layer, old in zip(period, run.layers, saved_period))
                   for period, run, saved_period in zip(cache.layers, cfg.layer_runs, saved))
    return cache.replace(layers=layers)


def min_ring(cfg: ModelConfig) -> int:
    """The smallest ring of the cache: one verify step may write at most this many positions
    (each ring slot at most once, so the saved rows are the pre-step ones)."""
    sizes = [cfg.sliding_window]
    if cfg.v41 is not None:  # windows, and the fp32 tails of ratio-2 KV sources
        tails = any(layer.has_compressor and layer.compress_ratio > 1 for layer in cfg.layers)
        return min(sizes + [TAIL_SLOTS] * tails)
    for layer in cfg.layers:
        if layer.compress_ratio:
            sizes.append(layer.compress_ratio * (2 if layer.overlap else 1))
        if layer.has_indexer:
            sizes.append(2 * layer.compress_ratio)
    return min(sizes)


# ----------------------------------------------------------------------------- prefix blocks
@struct.dataclass
class Block:
    """One sequence's cache over `block` aligned tokens (`dsjax.engine.prefix_cache`): the
    compressed entries and index keys those tokens completed, per layer ([R, 1, block / ratio,
    ...] each), and the fixed-size state at the block's end: windows, compressor rings and
    tails ([R, 1, ...]), the Engram history (V4.1) and the drafter's ring (speculative
    engines). With `block` a multiple of every compression ratio no group straddles two blocks,
    so a prefix's blocks put back in order give the cache its prompt made, bit for bit."""

    entries: tuple[jax.Array, ...]
    rings: tuple[jax.Array, ...]
    history: jax.Array | None
    drafter: object = None


DEAD = -1  # `block_layout`: a ring that holds nothing live at a block's end


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


def _at(leaf, row, start: int | jax.Array = 0, axis: int = 2):
    """The start index of a [R, B, n, ...] leaf's row `row` at `start` along `axis`."""
    zero = jnp.int32(0)
    idx = [zero] * leaf.ndim
    idx[1] = jnp.asarray(row, jnp.int32)
    if axis < leaf.ndim:
        idx[axis] = jnp.asarray(start, jnp.int32)
    return idx


def take_block(cache: Cache, drafter, row, j, *, block: int, layout: tuple[int, ...]) -> Block:
    """Block j (tokens j*block .. (j+1)*block) of cache row `row`, read at the block's end
    (`block_layout` says what each leaf gives)."""
    entries, rings = [], []
    for leaf, r in zip(jax.tree.leaves(cache.layers), layout):
        if r == DEAD:
            continue
        n = block // r if r else leaf.shape[2]
        part = jax.lax.dynamic_slice(leaf, _at(leaf, row, j * (block // r) if r else 0),
                                     (leaf.shape[0], 1, n, *leaf.shape[3:]))
        (entries if r else rings).append(part)
    history = None if cache.history is None else take_rows(cache.history, row)
    return Block(tuple(entries), tuple(rings), history, None if drafter is None else take_rows(drafter, row))


def put_block(cache: Cache, drafter, blk: Block, row, j, *, block: int, layout: tuple[int, ...]):
    """Cache row `row` (and the drafter's) with block j put back: its entries at their place,
    its rings as the row's (a DEAD ring keeps what the row had). -> (cache, drafter)."""
    leaves, tree = jax.tree.flatten(cache.layers)
    entries, rings = iter(blk.entries), iter(blk.rings)
    new = [leaf if r == DEAD else jax.lax.dynamic_update_slice(leaf, next(entries) if r else next(rings),
                                                               _at(leaf, row, j * (block // r) if r else 0))
           for leaf, r in zip(leaves, layout)]
    history = cache.history if blk.history is None else put_rows(cache.history, blk.history, row)
    drafter = drafter if blk.drafter is None else put_rows(drafter, blk.drafter, row)
    return cache.replace(layers=jax.tree.unflatten(tree, new), history=history), drafter
