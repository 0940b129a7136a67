"""What the Mosaic TPU kernels (`tpu_*.py`) share: block sizes per TPU generation, each
generation's VMEM limits, a kernel's VMEM budget from its block shapes, and the switch
between compiling for a TPU and Pallas' TPU interpret mode.

VMEM per TensorCore (physical: jax/_src/pallas/mosaic/tpu_info.py in jax 0.10.2,
`vmem_capacity_bytes`: v5e 128 MiB, v6e 128 MiB, v7x 64 MiB). A Mosaic kernel gets the
*scoped* limit unless it raises it (`pltpu.CompilerParams(vmem_limit_bytes=...)` together
with XLA's `--xla_tpu_scoped_vmem_limit_kib`, as XLA's docs/errors/error_1001.md describes):
16 MiB on v5e and 32 MiB on v6e and v7x, the limits the compiler reports when a kernel
overflows them ("Scoped allocation with size ... and limit 16.00M / 32.00M exceeded scoped
vmem limit"). The kernels here stay inside the scoped default, so they need no flag.

`BLOCKS` is one table per generation, as tpu-inference keeps its tuned block sizes. These are
NOT tuned on hardware (the project has no TPU): they are MXU-shaped starting points (v5e's
MXU is 128 x 128, v6e's and v7x's 256 x 256) sized so every kernel's budget fits the scoped
limit at V4-Flash, V4-Pro and V4.1-Flash shapes (tests/test_mosaic_tpu.py, docs/kernels.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MiB = 1 << 20
SCOPED_VMEM = {"v5e": 16 * MiB, "v6e": 32 * MiB, "v7x": 32 * MiB}
PHYSICAL_VMEM = {"v5e": 128 * MiB, "v6e": 128 * MiB, "v7x": 64 * MiB}

# attention: query positions per program (decode has one), shared keys per block, a query's own
#   (CSA top-k) keys per block; grouped_ffn: (tm, tk, tn) megablox tiles; index_scores: query
#   positions per program, keys per block.
BLOCKS = {
    "v5e": dict(attention=dict(block_q=4, block_k=512, block_own=128),
                grouped_ffn=dict(tm=128, tk=512, tn=512),
                index_scores=dict(block_q=4, block_t=512)),
    "v6e": dict(attention=dict(block_q=8, block_k=512, block_own=128),
                grouped_ffn=dict(tm=256, tk=512, tn=1024),
                index_scores=dict(block_q=8, block_t=1024)),
    "v7x": dict(attention=dict(block_q=8, block_k=512, block_own=128),
                grouped_ffn=dict(tm=256, tk=512, tn=1024),
                index_scores=dict(block_q=8, block_t=1024)),
}
GENERATIONS = tuple(BLOCKS)
DEFAULT_GENERATION = "v6e"  # off a TPU (interpret mode, export)


def generation() -> str:
    """This machine's TPU generation from the device kind ("TPU v5 lite", "TPU v6 lite",
    "TPU7x", ...); another TPU (v4, v5p) takes v5e's blocks, which fit the smallest scoped
    limit; DEFAULT_GENERATION off a TPU."""
    device = jax.devices()[0]
    if device.platform != "tpu":
        return DEFAULT_GENERATION
    kind = device.device_kind.lower().replace(" ", "")
    if "v6" in kind:
        return "v6e"
    if "tpu7" in kind or "v7" in kind:
        return "v7x"
    return "v5e"


def blocks(kernel: str, gen: str | None = None) -> dict:
    return dict(BLOCKS[gen or generation()][kernel])


def tpu_available() -> bool:
    return jax.devices()[0].platform == "tpu"


def interpret_params(interpret):
    """`interpret=` for pl.pallas_call: False / None (compile for the TPU), True (TPU interpret
    mode), or an InterpretParams as given (tests turn the race detector on)."""
    from jax.experimental.pallas import tpu as pltpu

    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def compiler_params(*semantics: str):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)


def _tile_bytes(shape, dtype) -> int:
    """Bytes of one VMEM buffer of `shape`: the last dim padded to 128 lanes, the second-last
    to a sublane tile (8 rows of 32 bits, i.e. 16 of bf16, 32 of int8/fp8)."""
    itemsize = jnp.dtype(dtype).itemsize
    shape = (1, 1, *shape)
    rows = math.ceil(shape[-2] / (8 * 4 // itemsize)) * (8 * 4 // itemsize)
    return math.prod(shape[:-2]) * rows * math.ceil(shape[-1] / 128) * 128 * itemsize


def vmem_budget(blocks_: list, scratch: list, values: list = ()) -> int:
    """A kernel's VMEM bytes: each pipelined input / output block twice (double-buffered),
    each scratch buffer once, plus the largest intermediate values the body holds at once
    (`values`: what Mosaic keeps in its internal scratch when they exceed the vregs).
    Every entry is (shape, dtype)."""
    return (2 * sum(_tile_bytes(s, d) for s, d in blocks_) + sum(_tile_bytes(s, d) for s, d in scratch)
            + sum(_tile_bytes(s, d) for s, d in values))
