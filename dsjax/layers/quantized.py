"""Weights kept on device as stored (FP8 / MXFP4) and dequantized inside the jitted
function that uses them: about half the bytes of bf16 for FP8, about a quarter for FP4.
Formats: see dsjax/checkpoint/quant.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.params import ParamSpec, is_spec, path_str

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
E2M1_SIGNED = np.concatenate([E2M1, -E2M1])  # index = code (bit 3 = sign)
MXFP4_GROUP = 32


@struct.dataclass
class Fp8Weight:
    """An FP8 block-scaled [..., out, in] weight kept as stored; `dense()` inside jit."""

    q: jax.Array  # [..., out, in] float8_e4m3fn
    scale_exp: jax.Array  # [..., ceil(out/b0), ceil(in/b1)] uint8 (E8M0 exponent)
    block: tuple[int, int] = struct.field(pytree_node=False, default=(128, 128))

    @property
    def shape(self):
        return self.q.shape

    def dense(self, dtype) -> jax.Array:
        b0, b1 = self.block
        out, inn = self.q.shape[-2:]
        s = jnp.exp2(self.scale_exp.astype(jnp.float32) - 127.0)
        s = jnp.repeat(jnp.repeat(s, b0, axis=-2), b1, axis=-1)[..., :out, :inn]
        return (self.q.astype(jnp.float32) * s).astype(dtype)


@struct.dataclass
class Fp4Weight:
    """MXFP4 routed-expert weights [E, out, in] kept as stored (packed [E, out, in/2] bytes,
    E8M0 exponents [E, out, in/32]); `dense()` inside jit."""

    packed: jax.Array  # int8
    scale_exp: jax.Array  # uint8

    @property
    def shape(self):
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def dense(self, dtype) -> jax.Array:
        b = self.packed.astype(jnp.uint8)
        codes = jnp.stack([b & 0x0F, b >> 4], axis=-1).reshape(self.shape)
        vals = jnp.asarray(E2M1_SIGNED)[codes.astype(jnp.int32)]
        s = jnp.exp2(self.scale_exp.astype(jnp.float32) - 127.0)
        return (vals * jnp.repeat(s, MXFP4_GROUP, axis=-1)).astype(dtype)


@struct.dataclass
class Bf16Weight:
    """A weight stored as bf16 under fp32 activations (`dsjax.store_weights`), kept as its
    uint16 bit patterns: XLA:CPU widens a bf16 array it slices or gathers (a scanned layer's
    weights, the experts a token picks) in a new fp32 buffer of the whole stack, hoisted out
    of the layer loop; integer slices stay integer, and `dense()` shifts the bits into place
    inside the fusion that reads them (exact)."""

    bits: jax.Array  # [..., out, in] uint16

    @property
    def shape(self):
        return self.bits.shape

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    @staticmethod
    def of(w: jax.Array) -> "Bf16Weight":
        return Bf16Weight(jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16))

    def dense(self, dtype) -> jax.Array:
        wide = jax.lax.bitcast_convert_type(self.bits.astype(jnp.uint32) << 16, jnp.float32)
        return wide.astype(dtype)


@struct.dataclass
class ColumnMajor:
    """A plain [out, in] weight kept as its transpose `t` [in, out]: the layout in which
    XLA:CPU reads a one-row product x @ w.T fastest when `in` is short (a vector-matrix loop
    streaming whole rows of t, where the row form reduces each short row of w on its own).
    The engine keeps its vocabulary head so for a one-row CPU decode
    (`dsjax.model.decoder.one_row_head`); `dense()` is the transpose back, which XLA folds
    into the product that reads it."""

    t: jax.Array  # [in, out]

    @property
    def shape(self):
        return self.t.shape[::-1]

    @property
    def dtype(self):
        return self.t.dtype

    def dense(self, dtype) -> jax.Array:
        return self.t.T.astype(dtype)


@struct.dataclass
class PackedHead:
    """A vocabulary head [V, D] (fp32 or bf16) kept in tiles [ceil(V / 32), D, 32] of 32
    vocabulary rows, each k's 32 weights contiguous: the layout the XLA:CPU vocabulary-head
    kernel reads in one sequential stream (`dsjax.layers.cpu_kernels`; an engine on one CPU
    device keeps its head so, `dsjax.model.decoder.cpu_head_params`). Rows past V are zeros.
    `dense()` is the [V, D] head back. An fp32 head may also carry a bf16 copy of its tiles
    and its rows' norms (`screen`, `norms`), from which the kernel finds greedy tokens
    reading half the bytes (`cpu_kernels.greedy_tokens`)."""

    tiles: jax.Array  # [ceil(V / 32), D, 32]
    vocab: int = struct.field(pytree_node=False)
    screen: jax.Array | None = None  # [ceil(V / 32), D, 32] bf16: the tiles rounded to nearest
    norms: jax.Array | None = None  # [ceil(V / 32) * 32] fp32: ||w_j||_2 rounded up (0 past V)

    @property
    def shape(self):
        return (self.vocab, self.tiles.shape[1])

    @property
    def dtype(self):
        return self.tiles.dtype

    def dense(self, dtype) -> jax.Array:
        w = jnp.transpose(self.tiles, (0, 2, 1)).reshape(-1, self.tiles.shape[1])
        return w[:self.vocab].astype(dtype)


def dense(w, dtype) -> jax.Array:
    """A weight as a plain array of `dtype`: dequantized if stored quantized."""
    return (w.dense(dtype) if isinstance(w, (Fp8Weight, Fp4Weight, Bf16Weight, ColumnMajor, PackedHead))
            else w.astype(dtype))


def stored_form(w):
    """A weight kept as the checkpoint stores it -> (format, FP8 block, (bytes, E8M0 exponents)),
    what the Mosaic GPU kernels that read stored bytes take (dsjax/pallas_kernels/stored_matmul.py);
    None for any other weight."""
    if isinstance(w, Fp4Weight):
        return "mxfp4", None, (w.packed, w.scale_exp)
    if isinstance(w, Fp8Weight):
        return "fp8", w.block, (w.q, w.scale_exp)
    return None


def take(w, index):
    """w[index] for a plain or a stored (quantized, 16-bit) weight."""
    return jax.tree.map(lambda a: a[index], w)


# The weights DeepSeek-V4's checkpoints store in FP8 and keep so (routed experts: MXFP4, or
# FP8 per expert), by the end of their dsjax path. A model generation names its own list (V4.1:
# dsjax.model.v41.V41_FP8_LINEARS); a weight stored FP8 but not listed is dequantized at load.
FP8_LINEARS = ("attn.q_a_proj", "attn.q_b_proj", "attn.kv_proj", "attn.o_a_proj", "attn.o_b_proj",
               "attn.indexer.q_b_proj", "moe.shared_w1", "moe.shared_w2", "moe.shared_w3", "e_proj", "h_proj")
ROUTED_EXPERTS = ("moe.w1", "moe.w2", "moe.w3")


def resident_specs(specs, block: tuple[int, int], experts_fp4: bool, fp8_linears: tuple[str, ...] = FP8_LINEARS):
    """Replace the spec of every weight kept as stored (`fp8_linears`, and the routed experts)
    by its stored form (an Fp8Weight / Fp4Weight of ParamSpecs), so it is loaded and kept so.
    The rest stay in the model's dtype (a stored-FP8 one is dequantized at load)."""
    import ml_dtypes

    def one(path, s):
        name = "." + path_str(path)
        experts = name.endswith(tuple("." + n for n in ROUTED_EXPERTS))
        if not (experts or name.endswith(tuple("." + n for n in fp8_linears))):
            return s
        if experts and experts_fp4:
            lead = s.shape[:-1]
            return Fp4Weight(
                packed=ParamSpec((*lead, s.shape[-1] // 2), np.int8, s.axes, init="zeros"),
                scale_exp=ParamSpec((*lead, s.shape[-1] // MXFP4_GROUP), np.uint8, s.axes, init="zeros"))
        *lead, out, inn = s.shape
        return Fp8Weight(
            q=ParamSpec(s.shape, ml_dtypes.float8_e4m3fn, s.axes, init="zeros"),
            scale_exp=ParamSpec((*lead, -(-out // block[0]), -(-inn // block[1])), np.uint8, s.axes, init="zeros"),
            block=block)

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)
