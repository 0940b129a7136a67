"""The decode cache: per layer, a window ring and (CSA / HCA, V4.1's KV sources) compressed
entries with what the incomplete group still needs; never per-token KV older than the window.

Shapes are static: `capacity` tokens per sequence, `batch` sequences (the engine's slots).
Layout follows the config's layer plan (`cfg.layer_runs`): per run, per period position,
one layer state of the generation (V4's `AttentionState`, V4.1's `SharedAttentionState`;
which, and their shapes: `ModelFamily.cache_shapes`, dsjax/model/cache_layout.py) whose
leaves have a leading [repeats] axis, so the batch axis of a layer state is axis 1
(`batch_axes`; `take_rows` / `put_rows` slice rows by it). Also here: saving / restoring
exactly the rows a chunk of positions writes (`save_rows` / `restore_rows`, from each
state's `written_rows`), which speculative rollback needs, and prefix blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig
from dsjax.layers.engram import BEFORE_START


@struct.dataclass
class Cache:
    length: jax.Array  # [B] int32: tokens already in the cache per sequence
    layers: tuple[tuple[Any, ...], ...]  # per run, per period position, the generation's layer state:
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


def stack_shapes(tree, n: int):
    """Abstract leaves with a leading [n] axis (a layer run's stacked states)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), tree)


# ----------------------------------------------------------------------------- rollback
def save_rows(cache: Cache, positions: jax.Array, cfg: ModelConfig) -> tuple[tuple[Any, ...], ...]:
    """What an extend over positions [B, n] will overwrite, per layer (each field [R, B, n, ...]):
    the rows each layer state's `written_rows(ratio, positions)` names (ring slots, the
    compressed entries the positions complete)."""
    # row by row (vmap over the batch): a gather of each row's own entries, also on a mesh's batch shards
    take = jax.vmap(lambda a, idx: a.at[idx].get(mode="fill", fill_value=0))

    def one(st, ratio):
        return jax.tree.map(take, st, st.written_rows(ratio, positions))

    return tuple(tuple(jax.vmap(lambda st, r=layer.compress_ratio: one(st, r))(st)
                       for st, layer in zip(period, run.layers))
                 for period, run in zip(cache.layers, cfg.layer_runs))


def restore_rows(cache: Cache, saved: tuple[tuple[Any, ...], ...], positions: jax.Array,
                 rejected: jax.Array, cfg: ModelConfig) -> Cache:
    """Put back the rows that the positions marked rejected [B, n] wrote. A rejected
    position's entry index holds its pre-step value: every position of that group at or
    after it was rejected too, so no kept position wrote it."""
    put = jax.vmap(lambda a, idx, old: a.at[idx].set(old, mode="drop"))  # row by row, as save_rows

    def put_back(a, idx, old):
        return put(a, jnp.where(rejected, idx, a.shape[1]), old)  # out of bounds: dropped

    def one(st, old, ratio):
        return jax.tree.map(put_back, st, st.written_rows(ratio, positions), old)

    layers = tuple(tuple(jax.vmap(lambda st, o, r=layer.compress_ratio: one(st, o, r))(st, old)
                         for st, layer, old in zip(period, run.layers, saved_period))
                   for period, run, saved_period in zip(cache.layers, cfg.layer_runs, saved))
    return cache.replace(layers=layers)


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
