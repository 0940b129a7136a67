"""Dense projections. Weights are stored [out, in] as in the checkpoints."""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """`x @ w.T`, fp32 accumulation, result in `out_dtype` (default: x's dtype)."""
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection that runs entirely in fp32 (mHC mixes, router)."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32))
