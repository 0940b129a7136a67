"""Dense projections. Weights are stored [out, in] as in the checkpoints.

On XLA:CPU a decode step's projections have a handful of rows, and how the product is
written decides whether it runs at memory speed (benchmarks/decode_profile.py; issue: CPU
decode speed). `linear` picks by the static row count:

    1 row         x @ w.T          a matrix-vector loop that reads w once, widening a
                                   16-bit or dequantized w as it goes; x @ t for a
                                   `ColumnMajor` w (the engine's one-row head); w @ x for
                                   an fp32 w under `whole_weights` (the library product)
    any rows, a `PackedHead`      the XLA:CPU vocabulary-head kernel (`cpu_kernels`: an
                                   engine's head on one CPU device, fp32 or bf16)
    2..16 rows, a 16-bit layer weight (`Bf16Weight`, or `Bf16Slice`: a scanned layer's,
                  read in its stack) the library's few-row kernel (`cpu_kernels.rows_product`:
                                   each output row of w read once for 8 rows at a time);
                                   the library not built: as below
    2..16 rows, w with more than WIDE_TILE rows (the vocabulary head, a big model's layers):
                  sum(w * x, -1)   a fused multiply-reduce: w read once for all rows (a
                                   plain bf16 w, as `store_weights` keeps the head: read as
                                   it is; `Bf16Weight` bits: widened in tiles the cache
                                   holds, `_tiled`)
    otherwise     einsum           the library GEMM

V4 attention's W_oa (block-diagonal over its groups) at a decode step's rows, 16-bit: one call
of the library's expert kernel, the groups as its experts (`stored_grouped_product`).

The choice is static (it depends on shapes only), so a program computes a row the same way
whatever the other rows hold. Batch-invariant mode takes the GEMM throughout (`gemm_only`), as
a mesh does.
"""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from dsjax.kernels import cpu as cpu_kernels
from dsjax.layers.qdq import qdq_fp8
from dsjax.kernels.cpu import PackedHead
from dsjax.layers.quantized import Bf16Slice, Bf16Weight, ColumnMajor, Fp8Weight, dense
from dsjax.kernels.dispatch import kernel_choice, resolve_kernels
from dsjax.kernels.stored_matmul import mgpu_fp8_linear
from dsjax.sharding.rules import current_mesh, reshape

FEW_ROWS = 16  # up to this many rows a large weight is read once for all of them (multiply-reduce / tiles)
STORED_ROWS = 256  # up to this many rows an FP8 weight is read as stored by the Mosaic GPU kernel (decode)


_GEMM_ONLY = contextvars.ContextVar("dsjax_gemm_only", default=False)
_WHOLE_WEIGHTS = contextvars.ContextVar("dsjax_whole_weights", default=False)
_KERNELS = contextvars.ContextVar("dsjax_kernels", default="reference")


@contextlib.contextmanager
def _tracing_with(flag: contextvars.ContextVar):
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def gemm_only():
    """While tracing inside: every product takes the GEMM. Batch-invariant mode runs under it,
    so a row's logits are bitwise the same on one device and on a mesh (where the GEMM is
    XLA's sharded one)."""
    return _tracing_with(_GEMM_ONLY)


def whole_weights():
    """While tracing inside: the layer weights are whole arrays (program arguments, not slices
    of a stacked layer run; `dsjax.model.block.LayerByLayer`), so a one-row fp32 product is
    written `w @ x`: XLA:CPU calls its library matrix-vector product on the argument in place.
    (On a slice, XLA fuses the slice into an element-by-element loop instead, and `x @ w.T`
    reads that loop faster; see `linear`.)"""
    return _tracing_with(_WHOLE_WEIGHTS)


@contextlib.contextmanager
def kernels_for_stored_weights(kernels: str):
    """While tracing inside: a projection of few rows by an FP8 weight kept as stored runs the
    Mosaic GPU kernel that reads its bytes when `kernels` resolves to it (dispatch.py's rule;
    `_stored_product`). The model's forward enters it with its `kernels` option, so the many
    `linear` calls of the layers need no argument for it."""
    token = _KERNELS.set(resolve_kernels(kernels))
    try:
        yield
    finally:
        _KERNELS.reset(token)


def _stored_product(x: jax.Array, w) -> jax.Array | None:
    """x [..., K] @ w.T in fp32 by the Mosaic GPU kernel reading an `Fp8Weight` [N, K] as stored
    (bf16 operands, fp32 accumulation), or None (dequantize, then the GEMM): another weight, a
    mesh, more than STORED_ROWS rows (prefill reads the weight once for many rows anyway), or
    kernels that do not resolve to Mosaic GPU."""
    if not isinstance(w, Fp8Weight) or w.q.ndim != 2 or current_mesh() is not None:
        return None
    kind, interpret = kernel_choice(_KERNELS.get())
    if kind != "mosaic_gpu" or math.prod(x.shape[:-1]) > STORED_ROWS:
        return None
    return mgpu_fp8_linear(x, w.q, w.scale_exp, block=w.block, interpret=interpret)


def few_rows(rows: int) -> bool:
    """Whether a product of `rows` rows takes the XLA:CPU decode forms (`linear`)."""
    return rows <= FEW_ROWS and jax.default_backend() == "cpu" and not _GEMM_ONLY.get()


def cpu_library_forms(x: jax.Array) -> bool:
    """Whether products of fp32 activations like x may take the XLA:CPU library's kernels at
    any row count (one CPU device, no mesh, not `gemm_only`: batch-invariant mode keeps XLA's
    GEMM), where `cpu_forms` is a decode step's few rows."""
    return (x.dtype == jnp.float32 and current_mesh() is None and jax.default_backend() == "cpu"
            and not _GEMM_ONLY.get())


def cpu_forms(x: jax.Array, rows: int) -> bool:
    """Whether `rows` products of fp32 activations like x take the XLA:CPU decode forms
    (one device, no mesh, few rows; see `linear`)."""
    return cpu_library_forms(x) and rows <= FEW_ROWS


def _cpu_product(x: jax.Array, w) -> jax.Array | None:
    """x [..., I] fp32 @ w[O, I].T (plain, or stored: quantized / 16-bit) in fp32 on XLA:CPU
    with few rows, or None (use the GEMM). A stored weight is widened inside the product.
    A `PackedHead` (an engine's vocabulary head on one CPU device): the head kernel, any rows."""
    if isinstance(w, PackedHead) and current_mesh() is None and not _GEMM_ONLY.get() and cpu_kernels.available():
        return cpu_kernels.vocab_head(x, w)
    rows = math.prod(x.shape[:-1])
    if not cpu_forms(x, rows):
        return None
    flat = x.reshape(rows, x.shape[-1])
    if rows > 1 and stored_rows(w):  # one row: XLA's matrix-vector loop measured faster (docs/cpu-decode.md)
        y = stored_rows_product(flat, w)
    elif rows == 1:
        if isinstance(w, ColumnMajor):
            y = flat @ w.t
        elif _WHOLE_WEIGHTS.get() and isinstance(w, jax.Array) and w.dtype == jnp.float32:
            y = (w @ flat[0])[None]
        else:
            y = flat @ dense(w, jnp.float32).T
    elif w.shape[0] <= WIDE_TILE:  # a small weight: the GEMM (a multiply-reduce would broadcast x to its shape)
        return None
    elif isinstance(w, jax.Array):
        y = jnp.sum(w.astype(jnp.float32)[:, None, :] * flat[None], axis=-1).T
    elif isinstance(w, Bf16Weight):  # an element per element: cut into row tiles (a block-scaled one is not)
        y = _tiled(flat, w)
    else:
        return None
    return y.reshape(*x.shape[:-1], w.shape[0])


def _stored_16bit(w, rank: int) -> bool:
    """w a 16-bit weight of `rank` dims (`Bf16Weight`, or one of a stack: `Bf16Slice`) that the
    library's kernels read, here and now."""
    return (isinstance(w, (Bf16Weight, Bf16Slice)) and len(w.shape) == rank and not _GEMM_ONLY.get()
            and cpu_kernels.rows_available())


def _in_place(w) -> tuple[jax.Array, jax.Array | None]:
    """(array, index) from which the library's kernels read a 16-bit weight where it lies."""
    return (w.stack, w.at) if isinstance(w, Bf16Slice) else (w.bits, None)


def stored_rows(w) -> bool:
    """Whether a few-row product by w takes the library's few-row kernel (`stored_rows_product`):
    a 16-bit weight [out, in], the library built."""
    return _stored_16bit(w, 2)


def stored_rows_product(flat: jax.Array, w) -> jax.Array:
    """flat [R, I] fp32 @ w.T for a `stored_rows` weight, read where it lies."""
    stack, at = _in_place(w)
    return cpu_kernels.rows_product(flat, stack, at)


def stored_experts(*ws) -> bool:
    """Whether a decode step's assignments take the library's expert kernel for the 16-bit expert
    stacks ws ([E, out, in] each: `stored_experts_product`)."""
    return all(_stored_16bit(w, 3) for w in ws)


def stored_experts_product(rows: jax.Array, w, experts: jax.Array) -> jax.Array:
    """rows [A, I] fp32, each against its expert's w[experts[a]].T -> [A, out] fp32, each expert
    read once where it lies (`stored_experts`)."""
    stack, at = _in_place(w)
    return cpu_kernels.expert_rows_product(rows, stack, experts, at)


def stored_grouped_product(x: jax.Array, w, groups: int) -> jax.Array | None:
    """x [..., G, I] fp32, group g against its block w[g O:(g + 1) O] of a [G O, I] weight ->
    [..., G, O] fp32 (a block-diagonal product: V4 attention's W_oa), or None where the
    library's kernel does not take it: a decode step's few fp32 rows (`cpu_forms`) and a 16-bit
    w (`stored_rows`), each block read once where it lies (`cpu_kernels.expert_rows_product`,
    the groups as its experts) instead of widened into a buffer for a batched product."""
    rows = math.prod(x.shape[:-2])
    if not (cpu_forms(x, rows) and stored_rows(w) and cpu_kernels.layer_calls_available()):
        return None
    stack, at = _in_place(w)
    blocks = stack.reshape(*stack.shape[:-2], groups, stack.shape[-2] // groups, stack.shape[-1])
    which = jnp.tile(jnp.arange(groups, dtype=jnp.int32), rows)
    y = cpu_kernels.expert_rows_product(x.reshape(rows * groups, x.shape[-1]), blocks, which, at)
    return y.reshape(*x.shape[:-1], -1)


def stored_moe_product(x: jax.Array, weights: jax.Array, idx: jax.Array, experts, shared, limit: float) -> jax.Array:
    """A step's MoE FFN (routed experts weighted, plus the shared expert) in one call of the
    library (`cpu_kernels.moe_rows`), every weight read where it lies: 16-bit, experts (w1, w3,
    w2) `stored_experts` and shared (w1, w3, w2) `stored_rows`; or fp32 arrays, each given as
    itself or as (stack, at)."""
    def place(w):
        return w if isinstance(w, tuple) else (w, None) if isinstance(w, jax.Array) else _in_place(w)
    return cpu_kernels.moe_rows(x, weights, idx, [place(w) for w in experts], [place(w) for w in shared], limit)


WIDE_TILE = 4096  # rows of a large stored weight widened at a time (a few MB: stays in cache)


def _tiled(flat: jax.Array, w) -> jax.Array:
    """flat [R, I] @ w[O, I].T for a large `Bf16Weight` (a big model's layer weight; the head is
    plain bf16, see `store_weights`) and R > 1: XLA:CPU widens the bits outside the product,
    so they are widened WIDE_TILE rows at a time in a loop, into a buffer the cache holds (a
    130 MB head at once: fresh pages each step, ten times slower)."""
    out = w.shape[0]
    n = -(-out // WIDE_TILE)
    tile = out // n
    rows_of = lambda start, size: dense(jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), w),
                                        jnp.float32)
    body = lambda i: jnp.einsum("ri,oi->ro", flat, rows_of(i * tile, tile))  # [R, tile]
    y = jnp.moveaxis(jax.lax.map(body, jnp.arange(n)), 0, 1).reshape(flat.shape[0], n * tile)
    if n * tile < out:  # the rows left over
        y = jnp.concatenate([y, jnp.einsum("ri,oi->ro", flat, rows_of(n * tile, out - n * tile))], axis=-1)
    return y


def merge_last_two(x: jax.Array) -> jax.Array:
    """x [..., A, B] -> [..., A * B], as the vector of a one-row product (`linear`) reads it
    best. On XLA:CPU a one-row product fuses its vector's producers into its matrix-vector
    loop, and a vector that is a reshape of a multi-dim buffer (mHC's N streams, W_oa's
    groups) is read there through per-element index arithmetic, several times slower than a
    buffer of its own (docs/cpu-decode.md). There the A pieces are concatenated
    instead, into a buffer of its own; elsewhere it is the reshape."""
    if x.shape[-2] > 1 and math.prod(x.shape[:-2]) == 1 and cpu_forms(x, 1):
        return jnp.concatenate([x[..., i, :] for i in range(x.shape[-2])], axis=-1)
    return reshape(x, (*x.shape[:-2], -1))


def linear(x: jax.Array, w: jax.Array, out_dtype=None, out_sharding=None, fp8_act: bool = False) -> jax.Array:
    """`x @ w.T`, fp32 accumulation, result in `out_dtype` (default: x's dtype).
    `out_sharding` (a PartitionSpec under a mesh) is needed when the input dimension is
    sharded: the partial products are then summed across devices.
    fp8_act: DeepSeek-V4.1's Lin8 / Lin4 (spec deepseek-v41.md §0, §7.3): the activation first
    makes the FP8 round trip per 32 along K (its dequantized values are exact in bf16 and fp32,
    so the product is the reference's up to the order of the fp32 sums)."""
    if fp8_act:
        x = qdq_fp8(x).astype(x.dtype)
    y = None if out_sharding is not None else _stored_product(x, w)  # a mesh: XLA's sharded GEMM
    if y is None and out_sharding is None:
        y = _cpu_product(x, w)
    if y is None:
        y = jnp.einsum("...i,oi->...o", x, dense(w, x.dtype), preferred_element_type=jnp.float32,
                       out_sharding=out_sharding)
    return y.astype(out_dtype or x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection that runs entirely in fp32 (mHC mixes, router); the XLA:CPU decode forms
    as in `linear`."""
    x = x.astype(jnp.float32)
    y = _cpu_product(x, w)
    return jnp.einsum("...i,oi->...o", x, dense(w, jnp.float32)) if y is None else y
