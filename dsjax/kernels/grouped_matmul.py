"""The routed experts' grouped matmul with the clamped SwiGLU fused: the references, the
Pallas kernels and the one dispatch `grouped_ffn` (what dsjax/layers/moe.py calls).

Rows arrive sorted by expert with ragged group sizes (empty groups allowed); each row goes
through its group's expert:

    y = W2[e] (silu(min(W1[e] x, L)) * clip(W3[e] x, -L, L))     [M, D] -> [M, D] fp32

Rows past sum(group_sizes) (padding) are not computed and come out 0.

* `reference`: `jax.lax.ragged_dot_general`, exact on every backend; what impl="reference"
  runs on accelerators.
* `tile_loop`: the same product as a loop over the tile table; what impl="reference" runs
  on CPU, where XLA lowers ragged_dot to roughly a masked dense product (measured 4-30x
  slower than the loop).
* `pallas_grouped_ffn`: the generic Pallas kernel, one program per tile.
* `mgpu_grouped_ffn`: the Hopper (sm90) kernels for Mosaic GPU.

The tile table (`tile_table`, shared by the loop and both kernels): rows are cut into tiles
of `rows` rows that each belong to ONE expert (a group's last tile is partial; at most
ceil(M / rows) + E tiles). A tile computes

    y_tile = W2[e] (silu(min(W1[e] x_tile, L)) * clip(W3[e] x_tile, -L, L))

and the kernels write each tile to its own output block [rows, D], so programs never write
the same memory (tile outputs are scattered back to row order outside the kernel). The
table is the metadata a TPU / GPU grouped-matmul kernel takes too.

`mgpu_grouped_ffn` runs two kernels over the same tile table (64-row tiles, one warpgroup
each; bf16 operands, fp32 accumulation):
  1. grid (tile, I block): gate and up [64, block_n] accumulate in two wgmma accumulators
     while x and the tile's expert's W1 / W3 blocks stream through a TMA pipeline over D;
     the clamped SwiGLU runs on the accumulators and h [64, block_n] goes out in bf16;
  2. grid (tile, D block): y [64, block_n] = h W2[e]^T, pipelined over I, out in fp32.
The expert of a tile is read from the tile table inside the kernel and picks the weight
blocks the pipeline copies; empty tiles (past the last group) return at once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.dispatch import kernel_choice, on_batch_shards, out_struct
from dsjax.kernels.mgpu import interpret_params, operand_transforms, pad_axis, round_up, store_tile, wgmma_nt
from dsjax.kernels.tpu_grouped_matmul import tpu_grouped_ffn


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, L)) * clip(up, -L, L)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of x (sorted by group) times their group's w [G, out, in] -> [M, out], fp32 acc."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    return jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes, dims,
                                      preferred_element_type=jnp.float32)


def exact_products(down) -> bool:
    """Whether the routed experts' products take `expert_product`'s exact form: with
    DeepSeek-V4.1's FP8 activations (`down` given), on XLA:CPU."""
    return down is not None and jax.default_backend() == "cpu"


def expert_product(x: jax.Array, w: jax.Array, exact: bool = False) -> jax.Array:
    """x [..., R, K] times w [..., O, K] -> [..., R, O] fp32 (fp32 accumulation).

    exact (`exact_products`): fp32 operands (bf16 and FP8 values widen exactly) and at least two
    rows. XLA:CPU then gives a row the same bits whatever R is and however the product is
    batched, where a bf16 GEMM's rows change with R and a matrix-vector product sums in another
    order (tests/test_moe_paths.py): the gather, tile-loop and Pallas paths then decide every
    rounding after the product (a bf16 gate / up, W2's FP8 input) alike, so a row's output does
    not depend on the path its batch takes. Accelerators keep bf16 operands: their GEMMs sum in
    the library's order, and only batch-invariant mode fixes a row's bits there."""
    if not exact:
        return jnp.einsum("...rk,...ok->...ro", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    rows = x.shape[-2]
    if rows == 1:
        x = jnp.concatenate([x, jnp.zeros_like(x)], axis=-2)
    return jnp.einsum("...rk,...ok->...ro", x.astype(jnp.float32), w.astype(jnp.float32))[..., :rows, :]


def hidden(gate: jax.Array, up: jax.Array, limit: float, dtype, scale: jax.Array | None = None, down=None
           ) -> jax.Array:
    """W2's input from the fp32 products gate, up [..., I]: the SwiGLU, rounded to dtype. With
    `down` (DeepSeek-V4.1's Lin4, dsjax/layers/moe.py) gate and up are rounded to dtype first, as
    the reference's Lin4 outputs are, and W2's input is down(h, scale) (scale [...] per row: the
    routing weight, applied with W2's FP8 activation round trip)."""
    if down is None:
        return swiglu(gate, up, limit).astype(dtype)
    as_out = lambda a: a.astype(dtype).astype(jnp.float32)
    return down(swiglu(as_out(gate), as_out(up), limit), scale).astype(dtype)


def reference(x_sorted, group_sizes, w1, w3, w2, *, limit: float, scale=None, down=None):
    """x_sorted [M, D] rows sorted by expert, group_sizes [E], w1 / w3 [E, I, D], w2 [E, D, I]
    -> [M, D] fp32 (h rounded to x's dtype between the two products, as in the kernels).
    scale [M] / down: see `hidden`."""
    h = hidden(_ragged(x_sorted, w1, group_sizes), _ragged(x_sorted, w3, group_sizes), limit, x_sorted.dtype,
               scale, down)
    return _ragged(h, w2, group_sizes)


def row_tile(m: int, n_experts: int) -> int:
    """Rows per tile for the loop and the generic kernel: the mean group size rounded up to
    a power of two, within [8, 128]."""
    rows = 8
    while rows < min(128, m / n_experts):
        rows *= 2
    return rows


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


def gather_tiles(x_sorted: jax.Array, first: jax.Array, used: jax.Array, rows: int) -> jax.Array:
    """The tile table's rows of x: [tiles, rows, D], rows past a tile's `used` zero."""
    r = jnp.arange(rows)
    src = jnp.clip(first[:, None] + r, 0, x_sorted.shape[0] - 1)
    return jnp.where((r < used[:, None])[..., None], x_sorted[src], 0).astype(x_sorted.dtype)


def scatter_tiles(y_tiles: jax.Array, first: jax.Array, used: jax.Array, m: int) -> jax.Array:
    """Tile outputs [tiles, rows, D] back to sorted row order [m, D] fp32 (unused rows dropped;
    rows no tile covers stay 0)."""
    rows, d = y_tiles.shape[1:]
    r = jnp.arange(rows)
    dest = jnp.where(r < used[:, None], first[:, None] + r, m)
    return jnp.zeros((m, d), jnp.float32).at[dest.reshape(-1)].set(y_tiles.reshape(-1, d), mode="drop")


def tile_loop(x_sorted, group_sizes, w1, w3, w2, *, limit: float, rows: int, layer=None, scale=None, down=None):
    """Same contract as `reference`: a fori_loop over the tile table, one expert's dense
    [rows, D] products per tile. A partial tile's rows past its group are zeroed and then
    overwritten by the next group's tiles (the loop runs in row order).
    layer: the weights are stacked over a layer run ([R, E, ...]); each tile reads its
    expert of layer `layer` straight from the stack (no copy of the layer's experts)."""
    m, d = x_sorted.shape
    exact = exact_products(down)
    expert, first, used = tile_table(group_sizes, m, rows)
    x_padded = jnp.concatenate([x_sorted, jnp.zeros((rows, d), x_sorted.dtype)])
    s_padded = None if scale is None else jnp.concatenate([scale, jnp.zeros((rows,), scale.dtype)])

    def tile(i, out):
        def compute(out):
            xt = jax.lax.dynamic_slice_in_dim(x_padded, first[i], rows)
            e = expert[i] if layer is None else (layer, expert[i])
            gate, up = expert_product(xt, w1[e], exact), expert_product(xt, w3[e], exact)
            st = None if scale is None else jax.lax.dynamic_slice_in_dim(s_padded, first[i], rows)
            y = expert_product(hidden(gate, up, limit, xt.dtype, st, down), w2[e], exact)
            y = jnp.where(jnp.arange(rows)[:, None] < used[i], y, 0.0)
            return jax.lax.dynamic_update_slice_in_dim(out, y, first[i], 0)

        return jax.lax.cond(used[i] > 0, compute, lambda o: o, out)

    # zeros_like(x_padded): inside shard_map the carry must vary over the same mesh axes as x
    return jax.lax.fori_loop(0, expert.shape[0], tile, jnp.zeros_like(x_padded, dtype=jnp.float32))[:m]


def _kernel(expert_ref, x_ref, w1_ref, w3_ref, w2_ref, *refs, limit: float, down=None):
    *s_ref, o_ref = refs  # s_ref: the rows' scales [1, rows] when `down` is given
    i = pl.program_id(0)
    e = expert_ref[i]
    x = x_ref[0]  # [rows, D]
    exact = exact_products(down)
    gate, up = expert_product(x, w1_ref[e], exact), expert_product(x, w3_ref[e], exact)
    h = hidden(gate, up, limit, x.dtype, s_ref[0][0] if s_ref else None, down)
    o_ref[0] = expert_product(h, w2_ref[e], exact)


@functools.partial(jax.jit, static_argnames=("limit", "rows", "interpret", "down"))
def pallas_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, limit: float, rows: int = 32, interpret: bool = False,
                       scale=None, down=None):
    """Same contract as `reference`: [M, D] rows sorted by expert -> [M, D] fp32; rows past
    sum(group_sizes) come out 0."""
    m, d = x_sorted.shape
    expert, first, used = tile_table(group_sizes, m, rows)
    n_tiles = expert.shape[0]
    x_tiles = gather_tiles(x_sorted, first, used, rows)
    w1, w3, w2 = (w.astype(x_sorted.dtype) for w in (w1, w3, w2))
    scales = [] if down is None else [gather_tiles(scale[:, None], first, used, rows)[..., 0]]  # [n_tiles, rows]
    out = pl.pallas_call(
        functools.partial(_kernel, limit=limit, down=down), grid=(n_tiles,),
        in_specs=[pl.BlockSpec((n_tiles,), lambda i: (0,)),
                  pl.BlockSpec((1, rows, d), lambda i: (i, 0, 0)),
                  pl.BlockSpec(w1.shape, lambda i: (0, 0, 0)),
                  pl.BlockSpec(w3.shape, lambda i: (0, 0, 0)),
                  pl.BlockSpec(w2.shape, lambda i: (0, 0, 0))]
        + [pl.BlockSpec((1, rows), lambda i: (i, 0))] * len(scales),
        out_specs=pl.BlockSpec((1, rows, d), lambda i: (i, 0, 0)),
        out_shape=out_struct((n_tiles, rows, d), jnp.float32, x_tiles), interpret=interpret,
    )(expert, x_tiles, w1, w3, w2, *scales)
    return scatter_tiles(out, first, used, m)


def _mgpu_swiglu_kernel(expert_gmem, used_gmem, x_gmem, w1_gmem, w3_gmem, h_gmem, *, rows: int, block_n: int,
                        block_k: int, steps: int, limit: float, interpret: bool, round_products: bool = False):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t, n = jax.lax.axis_index("tile"), jax.lax.axis_index("n")
    e = expert_gmem[t]
    tf = operand_transforms(x_gmem.dtype, block_k)

    @pl.when(used_gmem[t] > 0)
    def _():
        def accumulate(gate_ref, up_ref):
            def step(_, x_smem, w1_smem, w3_smem):
                wgmma_nt(gate_ref, x_smem, w1_smem, interpret)
                wgmma_nt(up_ref, x_smem, w3_smem, interpret)
                plgpu.wgmma_wait(0)  # the pipeline refills these buffers once the step returns

            plgpu.emit_pipeline(
                step, grid=(x_gmem.shape[1] // block_k,), max_concurrent_steps=steps,
                in_specs=[plgpu.BlockSpec((rows, block_k), lambda k: (t, k), transforms=tf),
                          plgpu.BlockSpec((block_n, block_k), lambda k: (n, k), transforms=tf),
                          plgpu.BlockSpec((block_n, block_k), lambda k: (n, k), transforms=tf)],
            )(x_gmem, w1_gmem.at[e], w3_gmem.at[e])
            return gate_ref[...], up_ref[...]

        gate, up = pl.run_scoped(accumulate, plgpu.ACC((rows, block_n), jnp.float32),
                                 plgpu.ACC((rows, block_n), jnp.float32))
        if round_products:  # DeepSeek-V4.1: the products are Lin4 outputs, bf16 (`hidden`)
            gate, up = (a.astype(jnp.bfloat16).astype(jnp.float32) for a in (gate, up))
        gate = jnp.minimum(gate, limit)
        h = gate / (1.0 + jnp.exp(-gate)) * jnp.minimum(jnp.maximum(up, -limit), limit)
        # V4.1: h stays fp32 (h_gmem), for `down` to round it once, after the routing weight, as `hidden` does
        store_tile(h.astype(h_gmem.dtype), h_gmem.at[pl.ds(t * rows, rows), pl.ds(n * block_n, block_n)])


def _mgpu_down_kernel(expert_gmem, used_gmem, h_gmem, w2_gmem, y_gmem, *, rows: int, block_n: int, block_k: int,
                      steps: int, interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t, n = jax.lax.axis_index("tile"), jax.lax.axis_index("n")
    e = expert_gmem[t]
    tf = operand_transforms(h_gmem.dtype, block_k)

    @pl.when(used_gmem[t] > 0)
    def _():
        def accumulate(acc_ref):
            def step(_, h_smem, w2_smem):
                wgmma_nt(acc_ref, h_smem, w2_smem, interpret)
                plgpu.wgmma_wait(0)  # as in the first kernel

            plgpu.emit_pipeline(
                step,
                grid=(h_gmem.shape[1] // block_k,), max_concurrent_steps=steps,
                in_specs=[plgpu.BlockSpec((rows, block_k), lambda k: (t, k), transforms=tf),
                          plgpu.BlockSpec((block_n, block_k), lambda k: (n, k), transforms=tf)],
            )(h_gmem, w2_gmem.at[e])
            return acc_ref[...]

        y = pl.run_scoped(accumulate, plgpu.ACC((rows, block_n), jnp.float32))
        store_tile(y, y_gmem.at[pl.ds(t * rows, rows), pl.ds(n * block_n, block_n)])


@functools.partial(jax.jit, static_argnames=("limit", "block_n", "block_k", "steps", "interpret", "down"))
def mgpu_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, limit: float, block_n: int = 128, block_k: int = 64,
                     steps: int = 3, interpret: bool = False, scale=None, down=None):
    """Same contract as `reference`, on Mosaic GPU (bf16 operands, fp32 accumulation). D and
    I are padded to the block sizes with zeros (which add nothing). With `down` (`hidden`) the
    first kernel rounds gate and up to bf16 and writes h in fp32, and `down` applies to it
    between the two kernels: the roundings of `hidden`, in its order (padding columns stay
    whole zero groups of the FP8 round trip)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = 64  # one warpgroup's wgmma M
    m, d = x_sorted.shape
    n_experts, inter, _ = w1.shape
    dt = jnp.bfloat16
    dp, ip = round_up(d, math.lcm(block_n, block_k)), round_up(inter, math.lcm(block_n, block_k))
    expert, first, used = tile_table(group_sizes, m, rows)
    n_tiles = expert.shape[0]
    x_tiles = pad_axis(gather_tiles(x_sorted.astype(dt), first, used, rows).reshape(n_tiles * rows, d), 1, dp)
    w1p, w3p = (pad_axis(pad_axis(w.astype(dt), 1, ip), 2, dp) for w in (w1, w3))
    w2p = pad_axis(pad_axis(w2.astype(dt), 1, dp), 2, ip)
    common = dict(rows=rows, block_n=block_n, block_k=block_k, steps=steps, interpret=interpret)
    h = plgpu.kernel(
        functools.partial(_mgpu_swiglu_kernel, limit=limit, round_products=down is not None, **common),
        out_type=jax.ShapeDtypeStruct((n_tiles * rows, ip), dt if down is None else jnp.float32),
        grid=(n_tiles, ip // block_n),
        grid_names=("tile", "n"), interpret=interpret_params(interpret),
    )(expert, used, x_tiles, w1p, w3p)
    if down is not None:
        s_tiles = gather_tiles(scale[:, None], first, used, rows).reshape(n_tiles * rows)
        h = down(h, s_tiles).astype(dt)
    y = plgpu.kernel(
        functools.partial(_mgpu_down_kernel, **common),
        out_type=jax.ShapeDtypeStruct((n_tiles * rows, dp), jnp.float32), grid=(n_tiles, dp // block_n),
        grid_names=("tile", "n"), interpret=interpret_params(interpret),
    )(expert, used, h, w2p)
    return scatter_tiles(y[:, :d].reshape(n_tiles, rows, d), first, used, m)


def grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, limit: float, impl: str = "reference", layer=None,
                rows: int | None = None, scale=None, down=None, block=None):
    """THE dispatch (dispatch.py's rule), same contract as `reference`: "reference" runs
    ragged_dot, or the tile loop on CPU; "pallas": the Mosaic GPU kernels on Hopper+, the
    Mosaic TPU kernels on a TPU, else the generic kernel (interpreted on CPU); "mosaic_gpu" /
    "mosaic_tpu": those kernels (interpret mode off their hardware; the TPU ones are
    tpu_grouped_matmul.py). layer: w1 / w3 / w2 are stacked over a layer run
    ([R, E, ...]) and this is layer `layer` of them. rows: the tile loop's / generic
    kernel's rows per tile (default `row_tile`; batch-invariant mode fixes it, so a row's
    products do not change with how many rows run). scale [M] / down: W2's input is
    `down(h, scale)` (`hidden`; DeepSeek-V4.1's Lin4). block: the FP8 block of weights given
    as stored (the Mosaic TPU kernels only; dsjax/layers/moe.py hands them so)."""
    rows = rows or row_tile(x_sorted.shape[0], group_sizes.shape[0])
    kind, interpret = kernel_choice(impl)
    down_args = {} if down is None else dict(scale=scale, down=down)
    if layer is not None and not (kind == "reference" and jax.default_backend() == "cpu"):
        w1, w3, w2, layer = w1[layer], w3[layer], w2[layer], None
    if layer is not None:
        return tile_loop(x_sorted, group_sizes, w1, w3, w2, limit=limit, rows=rows, layer=layer, **down_args)
    if kind == "mosaic_gpu":
        return mgpu_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, limit=limit, interpret=interpret, **down_args)
    if kind in ("mosaic_tpu", "pallas"):  # on a mesh outside the expert-parallel step: every device all rows
        fn = (functools.partial(tpu_grouped_ffn, block=block) if kind == "mosaic_tpu"
              else functools.partial(pallas_grouped_ffn, rows=rows))
        kernel = lambda x, sizes, w1, w3, w2, scale: fn(  # noqa: E731
            x, sizes, w1, w3, w2, limit=limit, interpret=interpret, scale=scale, down=down)
        return on_batch_shards(kernel, (), (x_sorted, group_sizes, w1, w3, w2, scale))
    if jax.default_backend() == "cpu":
        return tile_loop(x_sorted, group_sizes, w1, w3, w2, limit=limit, rows=rows, **down_args)
    return reference(x_sorted, group_sizes, w1, w3, w2, limit=limit, **down_args)
