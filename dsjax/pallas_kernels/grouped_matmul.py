"""The routed experts' grouped matmul with the clamped SwiGLU fused: the Pallas kernel, its
reference, and the dispatch.

Rows arrive sorted by expert with ragged group sizes (empty groups allowed). They are cut
into tiles of `rows` rows that each belong to ONE expert (a group's last tile is partial;
at most ceil(M / rows) + E tiles). Each kernel program takes one tile:

    y_tile = W2[e] (silu(min(W1[e] x, L)) * clip(W3[e] x, -L, L))

and writes its own output block [rows, D], so programs never write the same memory (tile
outputs are scattered back to row order outside the kernel). The tile table is the
metadata a TPU / GPU grouped-matmul kernel takes too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.layers.moe import expert_ffn, pl2, swiglu


def tile_table(group_sizes: jax.Array, m: int, rows: int):
    """-> (expert per tile, first row per tile, rows used per tile) for ceil(m/rows) + E tiles."""
    n_experts = group_sizes.shape[0]
    n_tiles = -(-m // rows) + n_experts
    tiles = -(-group_sizes // rows)
    tile_end = jnp.cumsum(tiles)
    j = jnp.arange(n_tiles)
    expert = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), n_experts - 1)
    local = j - tile_end[expert] + tiles[expert]
    first = (jnp.cumsum(group_sizes) - group_sizes)[expert] + local * rows
    used = jnp.where(j < tile_end[-1], jnp.clip(group_sizes[expert] - local * rows, 0, rows), 0)
    return expert.astype(jnp.int32), first.astype(jnp.int32), used.astype(jnp.int32)


def _kernel(expert_ref, x_ref, w1_ref, w3_ref, w2_ref, o_ref, *, limit: float):
    i = pl.program_id(0)
    e = expert_ref[i]
    x = x_ref[0]  # [rows, D]
    gate = jnp.einsum("rd,id->ri", x, w1_ref[e], preferred_element_type=jnp.float32)
    up = jnp.einsum("rd,id->ri", x, w3_ref[e], preferred_element_type=jnp.float32)
    h = swiglu(gate, up, limit).astype(x.dtype)
    o_ref[0] = jnp.einsum("ri,di->rd", h, w2_ref[e], preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("limit", "rows", "interpret"))
def pallas_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, limit: float, rows: int = 32, interpret: bool = False):
    """Same contract as `reference`: [M, D] rows sorted by expert -> [M, D] fp32; rows past
    sum(group_sizes) come out 0."""
    m, d = x_sorted.shape
    expert, first, used = tile_table(group_sizes, m, rows)
    n_tiles = expert.shape[0]
    r = jnp.arange(rows)
    src = jnp.clip(first[:, None] + r, 0, m - 1)  # [tiles, rows]
    x_tiles = jnp.where((r < used[:, None])[..., None], x_sorted[src], 0).astype(x_sorted.dtype)
    w1, w3, w2 = (w.astype(x_sorted.dtype) for w in (w1, w3, w2))
    out = pl.pallas_call(
        functools.partial(_kernel, limit=limit), grid=(n_tiles,),
        in_specs=[pl.BlockSpec((n_tiles,), lambda i: (0,)),
                  pl.BlockSpec((1, rows, d), lambda i: (i, 0, 0)),
                  pl.BlockSpec(w1.shape, lambda i: (0, 0, 0)),
                  pl.BlockSpec(w3.shape, lambda i: (0, 0, 0)),
                  pl.BlockSpec(w2.shape, lambda i: (0, 0, 0))],
        out_specs=pl.BlockSpec((1, rows, d), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((n_tiles, rows, d), jnp.float32), interpret=interpret,
    )(expert, x_tiles, w1, w3, w2)
    # back to row order: each valid tile row lands on its sorted row
    dest = jnp.where(r < used[:, None], first[:, None] + r, m)
    return jnp.zeros((m, d), jnp.float32).at[dest.reshape(-1)].set(out.reshape(-1, d), mode="drop")


def reference(x_sorted, group_sizes, w1, w3, w2, *, limit: float):
    return expert_ffn(x_sorted, group_sizes, w1, w3, w2, limit)


def grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, limit: float, impl: str = "reference"):
    """Dispatch: "reference" (ragged_dot, or the tile loop on CPU), "pallas" (the kernel;
    interpreted on CPU)."""
    from dsjax.layers.moe import grouped_ffn as model_grouped_ffn

    return model_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, limit, impl=impl)
