"""Shared bits of the Mosaic GPU (Hopper, sm90) kernels: operand layouts, padding, and the
switch between compiling for the GPU and running in Pallas' GPU interpret mode. (Which
kernel runs where is dispatch.py's rule.)

The Mosaic GPU kernels (`mgpu_*` in each kernel file) are written against
`jax.experimental.pallas.mosaic_gpu`: one warpgroup per program, TMA copies
(`copy_gmem_to_smem` / `emit_pipeline`) into swizzled shared memory, `wgmma` with fp32
accumulators in registers. On a machine without a GPU they run in GPU interpret mode
(shared memory, barriers, TMA and wgmma simulated on the CPU), and they can be lowered for
CUDA from any machine (`lower_for_cuda`), which runs Mosaic GPU's own checks of shapes,
layouts and operand transforms; only the final PTX compile needs the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def operand_transforms(dtype, minor: int) -> tuple:
    """smem layout wgmma reads for a tile whose last dim is `minor`: (8, swizzle / itemsize)
    tiles with the widest swizzle (128, 64 or 32 bytes) that divides a row."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next((s for s in (128, 64, 32) if (minor * itemsize) % s == 0), None)
    if swizzle is None:
        raise ValueError(f"a wgmma operand row of {minor} x {itemsize} bytes is not a multiple of 32 bytes")
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def interpret_params(interpret: bool):
    """`interpret=` argument for plgpu.kernel: GPU interpret mode, or None (compile)."""
    if not interpret:
        return None
    try:  # not exported by jax.experimental.pallas.mosaic_gpu (jax 0.10)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise RuntimeError(f"the Mosaic GPU kernels need a Hopper+ GPU or Pallas' GPU interpret mode, which this "
                           f"jax ({jax.__version__}) does not provide where dsjax looks for it; use "
                           f"kernels='reference' or 'pallas'") from e
    return InterpretGPUParams()


def layout(x: jax.Array, name: str, interpret: bool) -> jax.Array:
    """plgpu.layout_cast(x, WGMMA layout `name`): "tile" (the accumulator's), "rows" (one
    value per tile row), "cols" (one per column). A value-level identity, skipped in GPU
    interpret mode, which has no rule for it."""
    if interpret:
        return x
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wgmma = plgpu.Layout.WGMMA
    return plgpu.layout_cast(x, {"tile": wgmma, "rows": wgmma.reduce(1), "cols": wgmma.reduce(0)}[name])


def wgmma_nt(acc_ref, a_smem, b_smem, interpret: bool) -> None:
    """acc_ref += a @ b.T, both operands in shared memory (b read through a transposed view).
    GPU interpret mode cannot read transposed views, so there b is first transposed through
    registers into a scratch buffer (same product)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not interpret:
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
        return

    def transposed(bt_smem):
        bt_smem[...] = b_smem[...].T
        plgpu.wgmma(acc_ref, a_smem, bt_smem)

    pl.run_scoped(transposed, plgpu.SMEM(b_smem.shape[::-1], b_smem.dtype))


def matmul_nt(pairs, interpret: bool) -> jax.Array:
    """sum_i a_i @ b_i.T -> fp32 registers (one wgmma per pair into one accumulator)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(acc_ref):
        for a_smem, b_smem in pairs:
            wgmma_nt(acc_ref, a_smem, b_smem, interpret)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC((pairs[0][0].shape[0], pairs[0][1].shape[0]), jnp.float32))


def accumulate(acc: jax.Array, a_smem, b_smem, interpret: bool) -> jax.Array:
    """acc + a @ b with wgmma, acc an fp32 register tile. Compiled: acc seeds the wgmma
    accumulator (pl.run_state), the FA3 idiom. GPU interpret mode has no run_state yet, so
    there the product goes to a fresh accumulator and is added in registers (same sum)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not interpret:
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a_smem, b_smem))(plgpu.ACC.init(acc))

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]

    return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))


def store_tile(value: jax.Array, dst_gmem) -> None:
    """Registers -> shared memory -> (TMA) global memory, waiting for the copy."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def store(smem):
        smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, dst_gmem)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM(value.shape, value.dtype))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """StableHLO text of `fn(*args)` lowered for CUDA (works without a GPU): the Mosaic GPU
    kernels inside are lowered and serialized as custom calls on the way."""
    return jax.jit(fn, **kwargs).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
