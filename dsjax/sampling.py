"""Token sampling as one jitted function over per-request arrays.

Randomness for a request comes from a counter-based key derived from (request seed,
position) only, so its tokens never depend on batch neighbours or slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def request_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    """The PRNG key of one request at one position (seed, position: int scalars)."""
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position.astype(jnp.uint32))


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) everything outside top-k (0: off) and outside the top-p nucleus.

    logits [B, V] (already temperature-scaled), top_k [B] int, top_p [B] float in (0, 1].
    The nucleus is the smallest set of highest-probability tokens whose mass reaches top_p
    (the most likely token is always kept); ties at the cut-off are kept."""
    v = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_logits = jnp.where(jnp.arange(v) < k[:, None], sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.maximum(jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1), kth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


@jax.jit
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """logits [B, V] -> token ids [B]. temperature 0 means greedy (first maximum)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    t = jnp.where(temperature > 0, temperature, 1.0)
    filtered = filter_logits(logits / t[:, None], top_k, top_p)
    keys = jax.vmap(request_key)(seeds, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
