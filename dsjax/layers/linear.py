"""Dense projections. Weights are stored [out, in] as in the checkpoints."""

import jax
import jax.numpy as jnp

from dsjax.layers.quantized import dense


def linear(x: jax.Array, w: jax.Array, out_dtype=None, out_sharding=None) -> jax.Array:
    """`x @ w.T`, fp32 accumulation, result in `out_dtype` (default: x's dtype).
    `out_sharding` (a PartitionSpec under a mesh) is needed when the input dimension is
    sharded: the partial products are then summed across devices."""
    y = jnp.einsum("...i,oi->...o", x, dense(w, x.dtype), preferred_element_type=jnp.float32,
                   out_sharding=out_sharding)
    return y.astype(out_dtype or x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection that runs entirely in fp32 (mHC mixes, router)."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dense(w, jnp.float32))
