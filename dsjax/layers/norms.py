"""RMS norms, computed in fp32 and cast back to the activation dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """`w * x * rsqrt(mean(x^2) + eps)`; the weight (fp32 in V4 checkpoints) multiplies in fp32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = weight.astype(jnp.float32) * y
    return y.astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """Per-head query norm. As in the reference, the fp32 rsqrt is cast to the activation
    dtype before the multiply (this only matters in bf16)."""
    xf = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps).astype(x.dtype)
