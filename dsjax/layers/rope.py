"""Partial, interleaved RoPE on the trailing `qk_rope_head_dim` channels; YaRN for CSA/HCA.

Pairs are adjacent channels `(x[2i], x[2i+1])` of the rope slice (the last `rd` channels of a
head); the leading `head_dim - rd` channels carry no position. Window-only layers use
`rope_theta` with no scaling; compressed layers use `compress_rope_theta` with YaRN and no
mscale (attention_factor 1).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import RopeConfig
from dsjax.sharding.rules import reshape


def inv_freq(rope: RopeConfig, rope_dim: int) -> np.ndarray:
    """Inverse frequencies [rope_dim // 2] (float32), YaRN-blended when configured."""
    exponent = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    pos_freqs = np.float32(rope.theta) ** exponent
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    if rope.scaling != "yarn":
        return extrapolation
    interpolation = (1.0 / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return (rope_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: keep the original frequency (high-frequency pairs)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_cos_sin(positions: jax.Array, rope: RopeConfig, rope_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., rope_dim // 2] in fp32 for integer positions [...]."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq(rope, rope_dim))
    return jnp.cos(angles) * rope.attention_factor, jnp.sin(angles) * rope.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate the last `2 * cos.shape[-1]` channels of x; cos/sin broadcast against x[..., :rd/2].

    `inverse=True` applies the conjugate rotation (used on the attention output, since K = V
    carried the rotation into the values)."""
    half = cos.shape[-1]
    rd = 2 * half
    nope, rot = x[..., :-rd], x[..., -rd:]
    pairs = reshape(rot.astype(jnp.float32), (*rot.shape[:-1], half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    rotated = reshape(rotated, rot.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
