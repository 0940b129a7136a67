"""Products that read the checkpoint's stored FP8 / MXFP4 bytes (Mosaic GPU, sm90): the
routed experts' grouped FFN (`mgpu_stored_grouped_ffn`, same contract as
grouped_matmul.reference) and a dense FP8 projection (`mgpu_fp8_linear`, x @ W.T).

Their reference is the dequantize path: dsjax/layers/quantized.py's `dense()` (E2M1 or E4M3
values times 2^(e - 127)) then grouped_matmul.reference / an einsum. The dispatch is in the
layers (moe.py `routed_experts`, linear.py `linear`), which see the weight's type.

Stored formats, as the checkpoint ships them ([out, in] = [N, K] per expert):
    MXFP4   packed int8 [E, N, K/2] (element 2j in the low nibble of byte j, 2j+1 in the high),
            E8M0 exponents uint8 [E, N, K/32]
    FP8     float8_e4m3fn [E, N, K], E8M0 exponents uint8 [E, ceil(N/b0), ceil(K/b1)],
            (b0, b1) = (128, 128) for V4, (32, 32) for V4.1

How the kernels read them. A weight tile [block_n, 32] of one 32-group of K (one MXFP4 scale
group) has ONE scale per row: the exponents are passed as "scale rows" [slots, K/32, N] (MXFP4:
the stored exponents transposed; FP8: each block's exponent repeated over its rows and
32-groups), and a group's row [block_n] is broadcast along the tile's columns in registers.
That re-layout is an XLA copy per call, so it is made only for the experts that have rows (at
most min(M, E) "slots": a batch-1 decode step's 6, not 256); the bytes are read in place. A pipeline step
takes `groups` (default 4) such groups: it TMA-copies the activations, each group's stored
bytes (a contiguous tile of its own) and the exponent rows into shared memory, dequantizes each
weight tile in registers (int8 / fp8 -> fp32 -> times 2^(e - 127) -> bf16: exact, since E2M1
and E4M3 values times a power of two fit bf16), writes it to a swizzled bf16 shared-memory tile,
then issues the step's wgmmas (fp32 accumulators) and waits for them once:

* MXFP4 bytes are never interleaved in registers: the K order of a product is free, so the
  activations arrive split into even and odd columns (x[:, 0::2], x[:, 1::2]; an XLA copy of
  the small activation, laid out [K/32, M, 32/parts] so that each group is a whole wgmma
  operand; FP8 takes the same layout in one part) and the product is x_even @ W_low^T + x_odd @ W_high^T. The bytes are
  widened to 16 bits (Mosaic GPU does no arithmetic on 8-bit registers) and a nibble c becomes
  the f16 bits ((c & 8) << 12) | ((c & 7) << 9), whose value is E2M1(c) x 2^-14 (the E2M1
  subnormal 0.5 lands on an f16 subnormal, which f16 -> f32 widens exactly); the 2^14 joins
  the scale.
* FP8: the tile is converted as it is.

The grouped FFN is grouped_matmul's pair of kernels over the same tile table (64-row tiles, one
warpgroup each): (1) gate and up [64, block_n] in two accumulators from W1 / W3, the clamped
SwiGLU, h out; (2) y [64, block_n] = h W2^T. The dense projection is kernel (2) with one
"expert" and every 64-row tile on it. Weights are padded only where N is not a multiple of 64
or (FP8) K not of 32 (tiny test models; V4 / V4.1 widths are not): a pad copies the weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsjax.kernels.grouped_matmul import gather_tiles, scatter_tiles, tile_table
from dsjax.kernels.mgpu import interpret_params, layout, operand_transforms, pad_axis, round_up, store_tile
from dsjax.kernels.mgpu import wgmma_nt

GROUP = 32  # K elements of one MXFP4 scale group: a weight tile's K
SMS = 132  # streaming multiprocessors of an H100 SXM / H200: one wave of programs
ROWS = 64  # rows per tile: one warpgroup's wgmma M
FORMATS = ("mxfp4", "fp8")


def _parts(fmt: str) -> int:
    """How many K-interleaved parts a step's weight tile splits into (MXFP4: low / high nibbles)."""
    return 2 if fmt == "mxfp4" else 1


def scale_rows(scale_exp: jax.Array, fmt: str, block, n: int, k: int) -> jax.Array:
    """Stored E8M0 exponents -> [..., K/32, N] uint8: the exponent of each 32-group of K for each
    output row (the layout a step reads as one row)."""
    if fmt == "mxfp4":
        return jnp.swapaxes(scale_exp, -1, -2)
    b0, b1 = block
    s = jnp.repeat(scale_exp, b0, axis=-2)[..., :n, :]
    return jnp.swapaxes(jnp.repeat(s, b1 // GROUP, axis=-1)[..., :k // GROUP], -1, -2)


def check_stored(name: str, data, scale_exp, fmt: str, block=None) -> None:
    """Refuse a stored weight these kernels cannot read, naming it."""
    if fmt not in FORMATS:
        raise ValueError(f"{name}: stored format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "fp8" and (len(block) != 2 or block[1] % GROUP):
        raise ValueError(f"{name}: FP8 block {tuple(block)} is not readable by the Mosaic GPU kernels, whose steps "
                         f"cover {GROUP} elements of K (the block's K size must be a multiple of {GROUP})")
    if fmt == "fp8" and scale_exp.shape[-2:] != tuple(-(-d // b) for d, b in zip(data.shape[-2:], block)):
        raise ValueError(f"{name}: FP8 scales {scale_exp.shape} do not tile the weight {data.shape} in {tuple(block)} "
                         f"blocks")
    if fmt == "mxfp4" and scale_exp.shape[-1] * GROUP != 2 * data.shape[-1]:
        raise ValueError(f"{name}: MXFP4 scales {scale_exp.shape} do not cover packed bytes {data.shape} "
                         f"(one exponent per {GROUP} elements)")


def _operand(w, fmt: str, block, n_pad: int, k_pad: int, experts=None):
    """(stored bytes, stored exponents) [E, N, .] -> (bytes [E, Np, Kp / parts], scale rows
    [slots, Kp / 32, Np]), zero-padded to Np rows and Kp elements of K. experts [slots]: whose
    scale rows (default all E): the exponents are re-laid out per call, so only for the experts
    that have rows (a decode step's few; the bytes stay where they are)."""
    data, scale_exp = w
    scale_exp = scale_exp if experts is None else scale_exp[experts]
    n = data.shape[-2]
    if fmt == "fp8":
        data = pad_axis(data, 2, k_pad)
    s = scale_rows(scale_exp, fmt, block, n, k_pad)
    return pad_axis(data, 1, n_pad), pad_axis(s, 2, n_pad)


def _split(x: jax.Array, fmt: str) -> list[jax.Array]:
    """Activations [M, K] -> the parts the weight tiles pair with (MXFP4: even / odd columns),
    each [K / 32, M, 32 / parts]: a step's groups are then whole [M, 32 / parts] wgmma operands."""
    parts = [x[:, 0::2], x[:, 1::2]] if fmt == "mxfp4" else [x]
    return [jnp.swapaxes(a.reshape(a.shape[0], -1, GROUP // len(parts)), 0, 1) for a in parts]


def _block_n(n: int) -> int:
    return 128 if n % 128 == 0 else 64


def _groups_per_step(n_groups: int, groups: int) -> int:
    """The most 32-groups of K a pipeline step takes, up to `groups`, that divides K's groups."""
    return max(g for g in range(1, groups + 1) if n_groups % g == 0)


# ----------------------------------------------------------------------------- in the kernel
def _dequantize(data_ref, s_ref, fmt: str, interpret: bool) -> list[jax.Array]:
    """One 32-group: the stored tile [block_n, 32 / parts] and its exponents [block_n] -> the bf16
    weight tile(s) [block_n, 32 / parts] (MXFP4: the low-nibble and the high-nibble elements)."""
    offset = 14 if fmt == "mxfp4" else 0  # E2M1 codes read as f16 are 2^-14 of their value
    s = layout(s_ref[...], "rows", interpret).astype(jnp.int32)
    factor = jax.lax.bitcast_convert_type((s + offset) << 23, jnp.float32)  # 2^(e - 127 + offset)
    raw = layout(data_ref[...], "tile", interpret)
    if fmt == "fp8":
        values = [raw.astype(jnp.float32)]
    else:  # Mosaic GPU does no arithmetic on 8-bit registers: the nibbles are taken apart in 16 bits
        b = raw.astype(jnp.int16)
        f16 = lambda c: jax.lax.bitcast_convert_type(((c & 8) << 12) | ((c & 7) << 9), jnp.float16)  # noqa: E731
        values = [f16(b & 15).astype(jnp.float32), f16((b >> 4) & 15).astype(jnp.float32)]
    return [(v * jax.lax.broadcast_in_dim(factor, v.shape, (0,))).astype(jnp.bfloat16) for v in values]


def _step_products(accs, x_smems, weights, scratch, fmt: str, interpret: bool) -> None:
    """accs[i] += x @ W_i^T over one step's groups: every (group, weight) dequantized into its
    scratch tiles, then one wgmma per (group, accumulator, part), then one wait. weights[i]: (the
    step's byte tiles [block_n, 32 / parts], one per group, its exponents [groups, block_n])."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p, n_w, g_step = _parts(fmt), len(weights), x_smems[0].shape[0]
    slot = lambda g, i, j: scratch.at[(g * n_w + i) * p + j]  # noqa: E731
    for g in range(g_step):
        for i, (data_smems, s_smem) in enumerate(weights):
            for j, tile in enumerate(_dequantize(data_smems[g], s_smem.at[g], fmt, interpret)):
                slot(g, i, j)[...] = tile
    plgpu.commit_smem()  # the register stores, visible to wgmma (the async proxy)
    for g in range(g_step):
        for i, acc_ref in enumerate(accs):
            for j, x_smem in enumerate(x_smems):
                wgmma_nt(acc_ref, x_smem.at[g], slot(g, i, j), interpret)
    plgpu.wgmma_wait(0)  # the pipeline refills the operands, and the next step the scratch, after this


def _accumulate(t, n, e, slot, x_gmems, weight_gmems, *, fmt: str, block_n: int, steps: int, groups: int,
                interpret: bool, split=0, splits: int = 1):
    """The fp32 products [ROWS, block_n] of tile t's rows with block n of each weight in
    `weight_gmems` ((bytes [E, N, .] of expert e, scale rows [slots, K/32, N] of slot `slot`)),
    pipelined over K,
    `groups` 32-groups a step (the bytes of each group a copy of its own: a contiguous tile, which
    registers load without bank conflicts, where one [block_n, groups x 16] copy is not). With
    `splits` > 1 only the steps of K-split `split` (of `splits` equal ones)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p, dt = _parts(fmt), jnp.bfloat16
    kp = GROUP // p  # K elements of each part per group
    tf = operand_transforms(dt, kp)
    n_w = len(weight_gmems)
    g_step = _groups_per_step(x_gmems[0].shape[0], groups)
    k_steps = x_gmems[0].shape[0] // g_step // splits
    k0 = split * k_steps

    def run(scratch):
        def products(*accs):
            def step(_, *smems):
                per_w = g_step + 1
                weights = [(smems[p + per_w * i:p + per_w * i + g_step], smems[p + per_w * i + g_step])
                           for i in range(n_w)]
                _step_products(accs, smems[:p], weights, scratch, fmt, interpret)

            group_spec = lambda g: plgpu.BlockSpec((block_n, kp), lambda k: (n, (k0 + k) * g_step + g))  # noqa: E731
            w_specs = [group_spec(g) for g in range(g_step)]
            w_specs.append(plgpu.BlockSpec((g_step, block_n), lambda k: (k0 + k, n)))
            plgpu.emit_pipeline(
                step, grid=(k_steps,), max_concurrent_steps=steps,
                in_specs=[plgpu.BlockSpec((g_step, ROWS, kp), lambda k: (k0 + k, t, 0), transforms=tf)] * p
                + w_specs * n_w,
            )(*x_gmems, *[a for data, sr in weight_gmems for a in [data.at[e]] * g_step + [sr.at[slot]]])
            return tuple(acc[...] for acc in accs)

        # the accumulators (registers) in a scope of their own: GPU interpret mode cannot mix them with smem
        return pl.run_scoped(products, *[plgpu.ACC((ROWS, block_n), jnp.float32)] * n_w)

    return pl.run_scoped(run, plgpu.SMEM((g_step * p * n_w, block_n, kp), dt, transforms=tf))


def _swiglu_kernel(expert_gmem, slot_gmem, used_gmem, *refs, fmt: str, block_n: int, steps: int, groups: int, limit: float,
                   interpret: bool, round_products: bool):
    p = _parts(fmt)
    x_gmems, (d1, s1, d3, s3), h_gmem = refs[:p], refs[p:p + 4], refs[p + 4]
    t, n = jax.lax.axis_index("tile"), jax.lax.axis_index("n")

    @pl.when(used_gmem[t] > 0)
    def _():
        gate, up = _accumulate(t, n, expert_gmem[t], slot_gmem[t], x_gmems, [(d1, s1), (d3, s3)], fmt=fmt, block_n=block_n,
                               steps=steps, groups=groups, interpret=interpret)
        if round_products:  # DeepSeek-V4.1: the products are Lin4 outputs, bf16 (grouped_matmul.hidden)
            gate, up = (a.astype(jnp.bfloat16).astype(jnp.float32) for a in (gate, up))
        gate = jnp.minimum(gate, limit)
        h = gate / (1.0 + jnp.exp(-gate)) * jnp.minimum(jnp.maximum(up, -limit), limit)
        store_tile(h.astype(h_gmem.dtype), h_gmem.at[pl.ds(t * ROWS, ROWS), pl.ds(n * block_n, block_n)])


def _linear_kernel(expert_gmem, slot_gmem, used_gmem, *refs, fmt: str, block_n: int, steps: int, groups: int,
                   interpret: bool):
    p = _parts(fmt)
    x_gmems, (d, s), y_gmem = refs[:p], refs[p:p + 2], refs[p + 2]  # y_gmem [splits, tiles * 64, N]
    t, n, split = jax.lax.axis_index("tile"), jax.lax.axis_index("n"), jax.lax.axis_index("split")

    @pl.when(used_gmem[t] > 0)
    def _():
        (y,) = _accumulate(t, n, expert_gmem[t], slot_gmem[t], x_gmems, [(d, s)], fmt=fmt, block_n=block_n, steps=steps,
                           groups=groups, interpret=interpret, split=split, splits=y_gmem.shape[0])
        store_tile(y, y_gmem.at[split, pl.ds(t * ROWS, ROWS), pl.ds(n * block_n, block_n)])


# ----------------------------------------------------------------------------- the calls
def k_splits(programs: int, k_steps: int, sms: int = SMS) -> int:
    """How many K-splits a projection of `programs` (row tile, column block) programs takes: the
    most that divides its `k_steps` pipeline steps and keeps the grid within one wave of `sms`
    programs. A decode projection (one row tile) of N = 1024 has 8 column blocks: 8 of 132 SMs."""
    return max(d for d in range(1, k_steps + 1) if k_steps % d == 0 and programs * d <= max(sms, programs))


def _linear_call(x_tiles, expert, slot, used, w, *, fmt: str, steps: int, groups: int, interpret: bool,
                 splits: int | None = 1):
    """x_tiles [tiles * 64, Kp] bf16 @ w[expert of the tile]^T -> [tiles * 64, Np] fp32. splits:
    K cut into this many parts, each its own program writing an fp32 partial, summed here (None:
    `k_splits`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_pad = w[0].shape[1]
    block_n = _block_n(n_pad)
    x_parts = _split(x_tiles, fmt)
    k_steps = x_parts[0].shape[0] // _groups_per_step(x_parts[0].shape[0], groups)
    programs = expert.shape[0] * (n_pad // block_n)
    splits = k_splits(programs, k_steps) if splits is None else splits
    y = plgpu.kernel(
        functools.partial(_linear_kernel, fmt=fmt, block_n=block_n, steps=steps, groups=groups, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((splits, x_tiles.shape[0], n_pad), jnp.float32),
        grid=(expert.shape[0], n_pad // block_n, splits), grid_names=("tile", "n", "split"),
        interpret=interpret_params(interpret),
    )(expert, slot, used, *x_parts, *w)
    return y[0] if splits == 1 else jnp.sum(y, axis=0)


@functools.partial(jax.jit, static_argnames=("fmt", "block", "limit", "steps", "groups", "interpret", "down"))
def mgpu_stored_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, *, fmt: str, limit: float, block=None, steps: int = 2,
                            groups: int = 4, interpret: bool = False, scale=None, down=None):
    """Same contract as grouped_matmul.reference with w1 / w3 [E, I, D] and w2 [E, D, I] given
    as stored: (bytes, E8M0 exponents) pairs in `fmt` ("mxfp4" | "fp8", `block` the FP8
    block). scale / down: DeepSeek-V4.1's Lin4, as in grouped_matmul.mgpu_grouped_ffn (the first
    kernel rounds gate and up to bf16 and writes h in fp32; `down` runs between the kernels)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        check_stored(name, *w, fmt, block)
    m, d = x_sorted.shape
    inter = w1[0].shape[1]
    dp, ip, ik = round_up(d, GROUP), round_up(inter, 64), round_up(inter, GROUP)  # K of W1 / W3, N of W1 / W3, K of W2
    # the experts with rows, in order, at most min(M, E) ("slots"); a tile's slot indexes their scale rows
    n_slots = min(m, group_sizes.shape[0])
    active = jnp.nonzero(group_sizes > 0, size=n_slots, fill_value=0)[0]
    slot_of = jnp.clip(jnp.cumsum(group_sizes > 0) - 1, 0, n_slots - 1).astype(jnp.int32)
    w1, w3 = (_operand(w, fmt, block, ip, dp, active) for w in (w1, w3))
    w2 = _operand(w2, fmt, block, round_up(d, 64), ik, active)
    # the used tiles come first and number at most M (each holds a row): a decode step's grid is its
    # few tiles, not ceil(M / 64) + E mostly empty ones (256 programs per column block at V4-Flash)
    expert, first, used = (a[:m] for a in tile_table(group_sizes, m, ROWS))
    slot = slot_of[expert]
    n_tiles = expert.shape[0]
    dt = jnp.bfloat16
    x_tiles = pad_axis(gather_tiles(x_sorted.astype(dt), first, used, ROWS).reshape(n_tiles * ROWS, d), 1, dp)
    block_n = _block_n(ip)
    h = plgpu.kernel(
        functools.partial(_swiglu_kernel, fmt=fmt, block_n=block_n, steps=steps, groups=groups, limit=limit,
                          interpret=interpret,
                          round_products=down is not None),
        out_type=jax.ShapeDtypeStruct((n_tiles * ROWS, ip), dt if down is None else jnp.float32),
        grid=(n_tiles, ip // block_n), grid_names=("tile", "n"), interpret=interpret_params(interpret),
    )(expert, slot, used, *_split(x_tiles, fmt), *w1, *w3)
    if down is not None:
        s_tiles = gather_tiles(scale[:, None], first, used, ROWS).reshape(n_tiles * ROWS)
        h = down(h, s_tiles).astype(dt)
    y = _linear_call(h[:, :ik], expert, slot, used, w2, fmt=fmt, steps=steps, groups=groups, interpret=interpret)
    return scatter_tiles(y[:, :d].reshape(n_tiles, ROWS, d), first, used, m)


@functools.partial(jax.jit, static_argnames=("block", "steps", "groups", "splits", "interpret"))
def mgpu_fp8_linear(x, q, scale_exp, *, block, steps: int = 2, groups: int = 4, splits: int | None = None,
                    interpret: bool = False) -> jax.Array:
    """x [..., K] @ W^T -> [..., N] fp32 for an FP8 block-scaled W (q [N, K] float8_e4m3fn,
    scale_exp [ceil(N/b0), ceil(K/b1)] uint8), read as stored; x in bf16 (fp32 accumulation).
    splits: K-splits (default `k_splits`: few rows get few programs otherwise)."""
    check_stored("weight", q, scale_exp, "fp8", block)
    *lead, k = x.shape
    n = q.shape[0]
    flat = x.reshape(-1, k).astype(jnp.bfloat16)
    m = flat.shape[0]
    tiles = -(-m // ROWS)
    kp = round_up(k, GROUP)
    w = _operand((q[None], scale_exp[None]), "fp8", block, round_up(n, 64), kp)
    x_tiles = pad_axis(pad_axis(flat, 0, tiles * ROWS), 1, kp)
    used = jnp.clip(m - ROWS * jnp.arange(tiles, dtype=jnp.int32), 0, ROWS)
    zeros = jnp.zeros((tiles,), jnp.int32)
    y = _linear_call(x_tiles, zeros, zeros, used, w, fmt="fp8", steps=steps, groups=groups,
                     interpret=interpret, splits=splits)
    return y[:m, :n].reshape(*lead, n)
