"""Dense projections. Weights are stored [out, in] as in the checkpoints."""

import jax
import jax.numpy as jnp

from dsjax.layers.qdq import qdq_fp8
from dsjax.layers.quantized import dense


def linear(x: jax.Array, w: jax.Array, out_dtype=None, out_sharding=None, fp8_act: bool = False) -> jax.Array:
    """`x @ w.T`, fp32 accumulation, result in `out_dtype` (default: x's dtype).
    `out_sharding` (a PartitionSpec under a mesh) is needed when the input dimension is
    sharded: the partial products are then summed across devices.
    fp8_act: DeepSeek-V4.1's Lin8 / Lin4 (spec deepseek-v41.md §0, §7.3): the activation first
    makes the FP8 round trip per 32 along K (its dequantized values are exact in bf16 and fp32,
    so the product is the reference's up to the order of the fp32 sums)."""
    if fp8_act:
        x = qdq_fp8(x).astype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, dense(w, x.dtype), preferred_element_type=jnp.float32,
                   out_sharding=out_sharding)
    return y.astype(out_dtype or x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection that runs entirely in fp32 (mHC mixes, router)."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dense(w, jnp.float32))
