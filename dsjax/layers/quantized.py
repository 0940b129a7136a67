"""Weights kept on device as stored (FP8 / MXFP4) and dequantized inside the jitted
function that uses them: about half the bytes of bf16 for FP8, about a quarter for FP4.
Formats: see dsjax/checkpoint/quant.py."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.kernels.cpu import PackedHead
from dsjax.params import LAYERS, ParamSpec, is_spec, name_key, path_str

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

    def seeded(self, seed: int, name: str, shardings=None) -> "Fp8Weight":
        """Seeded stored bytes for a spec container (`dsjax.params.init_params`): see `seeded_stored`."""
        q, e = seeded_stored("fp8", self.q, self.scale_exp, self.block, seed, name, shardings)
        return Fp8Weight(q, e, self.block)


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

    def seeded(self, seed: int, name: str, shardings=None) -> "Fp4Weight":
        """Seeded stored bytes for a spec container (`dsjax.params.init_params`): see `seeded_stored`."""
        return Fp4Weight(*seeded_stored("mxfp4", self.packed, self.scale_exp, (1, MXFP4_GROUP), seed, name,
                                        shardings))


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
class Bf16Slice:
    """One weight of a `Bf16Weight` stack kept whole: stack[at] (a scanned layer's weight inside
    its layer loop, a layer's expert), so that XLA:CPU's few-row kernel reads it where it lies
    (`dsjax.kernels.cpu.rows_product`; a custom call would get a copy of a slice). Anything else
    reads `bits`, the slice itself, as it reads a `Bf16Weight`'s (`take` makes one)."""

    stack: jax.Array  # [*lead, out, in] uint16
    at: jax.Array  # [len(lead)] int32

    @property
    def shape(self):
        return self.stack.shape[self.at.shape[0]:]

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    @property
    def bits(self) -> jax.Array:
        return self.stack[tuple(self.at[j] for j in range(self.at.shape[0]))]

    def dense(self, dtype) -> jax.Array:
        return Bf16Weight(self.bits).dense(dtype)


@struct.dataclass
class ColumnMajor:
    """A plain [out, in] weight kept as its transpose `t` [in, out]: the layout in which
    XLA:CPU reads a one-row product x @ w.T fastest when `in` is short (a vector-matrix loop
    streaming whole rows of t, where the row form reduces each short row of w on its own).
    The engine keeps its vocabulary head so for a one-row CPU decode
    (`dsjax.model.head.one_row_head`); `dense()` is the transpose back, which XLA folds
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


def dense(w, dtype) -> jax.Array:
    """A weight as a plain array of `dtype`: dequantized if stored quantized."""
    return (w.dense(dtype) if isinstance(w, (Fp8Weight, Fp4Weight, Bf16Weight, Bf16Slice, ColumnMajor, PackedHead))
            else w.astype(dtype))


def stored_form(w):
    """A weight kept as the checkpoint stores it -> (format, FP8 block, (bytes, E8M0 exponents)),
    what the Mosaic GPU kernels that read stored bytes take (dsjax/kernels/stored_matmul.py);
    None for any other weight."""
    if isinstance(w, Fp4Weight):
        return "mxfp4", None, (w.packed, w.scale_exp)
    if isinstance(w, Fp8Weight):
        return "fp8", w.block, (w.q, w.scale_exp)
    return None


def take(w, index):
    """w[index] for a plain or a stored (quantized, 16-bit) weight. A 16-bit stack and one index
    (a scalar) on XLA:CPU: a `Bf16Slice`, the stack kept whole."""
    if isinstance(w, (Bf16Weight, Bf16Slice)) and jnp.ndim(index) == 0 and jax.default_backend() == "cpu":
        stack, at = (w.bits, jnp.zeros((0,), jnp.int32)) if isinstance(w, Bf16Weight) else (w.stack, w.at)
        return Bf16Slice(stack, jnp.concatenate([at, jnp.asarray(index, jnp.int32).reshape(1)]))
    if isinstance(w, Bf16Slice):
        w = Bf16Weight(w.bits)
    return jax.tree.map(lambda a: a[index], w)


# The weights DeepSeek-V4's checkpoints store in FP8 and keep so (routed experts: MXFP4, or
# FP8 per expert), by the end of their dsjax path. A model generation names its own list (V4.1:
# dsjax.model.v41.params.V41_FP8_LINEARS); a weight stored FP8 but not listed is dequantized at load.
FP8_LINEARS = ("attn.q_a_proj", "attn.q_b_proj", "attn.kv_proj", "attn.o_a_proj", "attn.o_b_proj",
               "attn.indexer.q_b_proj", "moe.shared_w1", "moe.shared_w2", "moe.shared_w3", "e_proj", "h_proj")
ROUTED_EXPERTS = ("moe.w1", "moe.w2", "moe.w3")


@dataclasses.dataclass(frozen=True)
class StoredFormat:
    """How a model generation's release stores its weights (each generation's `ModelFamily`
    names its own; `resident_specs` keeps them so)."""

    fp8_block: tuple[int, int]  # E8M0 scale tiles of the FP8 projections
    fp8_linears: tuple[str, ...]  # the projections kept FP8 on device (dsjax path endings)
    experts_fp4: bool = True  # routed experts: MXFP4 (E2M1 pairs + E8M0 per 32)


def resident_specs(specs, block: tuple[int, int], experts_fp4: bool, fp8_linears: tuple[str, ...] = FP8_LINEARS):
    """Replace the spec of every weight kept as stored (`fp8_linears`, and the routed experts)
    by its stored form (an Fp8Weight / Fp4Weight of ParamSpecs), so it is loaded and kept so.
    The rest stay in the model's dtype (a stored-FP8 one is dequantized at load). The value
    spec keeps the weight's init std: `init_params` draws stored bytes of that magnitude."""
    import ml_dtypes

    def one(path, s):
        name = "." + path_str(path)
        experts = name.endswith(tuple("." + n for n in ROUTED_EXPERTS))
        if not (experts or name.endswith(tuple("." + n for n in fp8_linears))):
            return s
        if experts and experts_fp4:
            lead = s.shape[:-1]
            return Fp4Weight(
                packed=ParamSpec((*lead, s.shape[-1] // 2), np.int8, s.axes, init="zeros", std=s.std),
                scale_exp=ParamSpec((*lead, s.shape[-1] // MXFP4_GROUP), np.uint8, s.axes, init="zeros"))
        *lead, out, inn = s.shape
        return Fp8Weight(
            q=ParamSpec(s.shape, ml_dtypes.float8_e4m3fn, s.axes, init="zeros", std=s.std),
            scale_exp=ParamSpec((*lead, -(-out // block[0]), -(-inn // block[1])), np.uint8, s.axes, init="zeros"),
            block=block)

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)


# ----------------------------------------------------------------------------- seeded stored bytes
E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2  # |t| above the i-th midpoint rounds to E2M1[i + 1] or higher


def seeded_stored(kind: str, values: ParamSpec, scales: ParamSpec, block: tuple[int, int], seed: int, name: str,
                  shardings=None) -> tuple[jax.Array, jax.Array]:
    """Random FP8 (E4M3 + E8M0 per `block`) or MXFP4 (E2M1 codes, two a byte + E8M0 per 32)
    bytes of one weight, drawn with jax.random on the device in the weight's sharding: no bf16
    copy of it is ever made, on the host or the device.

    The rule, for a weight whose bf16 init is N(0, std) (`values.std`): each scale block gets
    an exponent e = e0 + u with u uniform in {-1, 0, 1} (FP8) or {0, 1} (MXFP4) and
    2^(e0 - 127) = 2^floor(log2 std) (FP8: round), and codes = round(z * std / 2^(e - 127)),
    z ~ N(0, 1), to E4M3 / to the nearest E2M1 value. Dequantized, a block is z * std up to the
    format's rounding (E4M3: ~3 % relative; E2M1 codes of std 0.5-2: the std within ~5 %),
    so the model sees the bf16 init's magnitudes; the random exponents make every block's
    scale matter, as a checkpoint's do. Each [out, in] slice of a stacked weight is drawn from
    its own key (`_lead_modes`). shardings: the container's shardings (`.q` / `.packed`,
    `.scale_exp`) or None."""
    sh = None if shardings is None else tuple(jax.tree.leaves(shardings))
    make = _stored_program(kind, values.shape, scales.shape, tuple(block), float(values.std),
                           _lead_modes(values, sh[0] if sh else None), sh)
    return make(name_key(seed, name))


def _lead_modes(spec: ParamSpec, sharding) -> tuple[str, ...]:
    """Per leading axis (all but the last two: stacked layers, experts): drawn one slice at a
    time ("map": the fp32 draws hold one slice) where it is stacked layers or unsharded, all
    at once where it is sharded ("vmap": each device its own slices). Each slice has its own
    key, so the values are the same either way: they do not depend on the sharding."""
    lead = len(spec.shape) - 2
    split = tuple(sharding.spec) + (None,) * lead if sharding is not None else (None,) * lead
    return tuple("map" if spec.axes[i] == LAYERS or split[i] is None else "vmap" for i in range(lead))


@functools.lru_cache(maxsize=None)
def _stored_program(kind, shape, scale_shape, block, std, modes, shardings):
    """One jitted draw per (format, shape, std, sharding): the key is an argument."""
    e0 = 127 + (round(math.log2(std)) if kind == "fp8" else math.floor(math.log2(std)))
    lo, hi = (-1, 2) if kind == "fp8" else (0, 2)
    lead = len(modes)
    inner, inner_scales = shape[lead:], scale_shape[lead:]
    dense_inner = (*inner[:-1], 2 * inner[-1]) if kind == "mxfp4" else inner

    def one(key):  # one [out, in] slice
        k_exp, k_val = jax.random.split(key)
        exp = (e0 + jax.random.randint(k_exp, inner_scales, lo, hi)).astype(jnp.uint8)
        step = jnp.exp2(exp.astype(jnp.float32) - 127.0)
        step = jnp.repeat(jnp.repeat(step, block[0], axis=-2), block[1], axis=-1)
        step = step[..., :dense_inner[-2], :dense_inner[-1]]
        t = jax.random.normal(k_val, dense_inner, jnp.float32) * (std / step)
        if kind == "fp8":
            return t.astype(values_dtype(kind)), exp
        code = jnp.sum(jnp.abs(t)[..., None] > jnp.asarray(E2M1_MIDPOINTS), axis=-1).astype(jnp.uint8)
        code = code | jnp.where(t < 0, jnp.uint8(8), jnp.uint8(0))  # bit 3: the sign (E2M1_SIGNED)
        pairs = code.reshape(*code.shape[:-1], -1, 2)
        return jax.lax.bitcast_convert_type(pairs[..., 0] | (pairs[..., 1] << 4), jnp.int8), exp

    def over(keys, modes):
        if not modes:
            return one(keys)
        inner_fn = functools.partial(over, modes=modes[1:])
        return jax.lax.map(inner_fn, keys) if modes[0] == "map" else jax.vmap(inner_fn)(keys)

    def draw(key):
        n = math.prod(shape[:lead])
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n)).reshape(shape[:lead])
        return over(keys, modes)

    return jax.jit(draw, out_shardings=shardings)


def values_dtype(kind: str):
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn if kind == "fp8" else np.int8
