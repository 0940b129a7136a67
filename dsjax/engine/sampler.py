"""Token sampling as one jitted function over a pytree of per-request arrays.

Order (as vLLM): repetition / presence / frequency penalties -> temperature -> top-k,
top-p, min-p -> draw. Randomness for a request comes from a counter-based key derived from
(request seed, position) only, so its tokens never depend on batch neighbours or slot.
Reported logprobs are those of the model's raw distribution (log_softmax of the logits,
before penalties and temperature).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. temperature 0 = greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt + generated tokens (HF / CTRL form)
    presence_penalty: float = 0.0  # on generated tokens (OpenAI form)
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per generated token
    seed: int = 0

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.logprobs >= 0, "logprobs must be >= 0"),
            (0 <= self.seed < 2**32, "seed must be in [0, 2**32)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {msg}")


@struct.dataclass
class SamplingState:
    """Per-slot sampling settings and token statistics (device arrays, batch B)."""

    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] i32
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    seed: jax.Array  # [B] u32
    seen: jax.Array  # [B, V] bool: in prompt or generated
    counts: jax.Array  # [B, V] i32: generated counts


def request_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    """The PRNG key of one request at one position (scalars)."""
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position.astype(jnp.uint32))


def apply_penalties(logits: jax.Array, s: SamplingState) -> jax.Array:
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(s.seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    counts = s.counts.astype(jnp.float32)
    return (logits - s.presence_penalty[:, None] * (counts > 0)
            - s.frequency_penalty[:, None] * counts)


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """Mask (to -inf) everything outside top-k (0: off), the top-p nucleus and min-p.

    logits [B, V] (already temperature-scaled). The nucleus is the smallest set of most
    likely tokens whose mass reaches top_p (the most likely token is always kept); min-p
    keeps tokens with p >= min_p * p_max. Ties at a cut-off are kept."""
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
    if min_p is not None:  # log p >= log(min_p) + log p_max  <=>  logit >= max + log(min_p)
        threshold = jnp.maximum(threshold, sorted_logits[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None])
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_tokens(logits: jax.Array, s: SamplingState, positions: jax.Array) -> jax.Array:
    """logits [B, V] -> token ids [B] (int32). temperature 0: greedy (first maximum)."""
    logits = apply_penalties(logits.astype(jnp.float32), s)
    greedy = jnp.argmax(logits, axis=-1)
    t = jnp.where(s.temperature > 0, s.temperature, 1.0)
    filtered = filter_logits(logits / t[:, None], s.top_k, s.top_p, s.min_p)
    keys = jax.vmap(request_key)(s.seed, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    return jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)


def record_tokens(s: SamplingState, tokens: jax.Array, mask: jax.Array) -> SamplingState:
    """Count generated tokens [B] (rows where mask)."""
    rows = jnp.arange(tokens.shape[0])
    return s.replace(seen=s.seen.at[rows, tokens].max(mask), counts=s.counts.at[rows, tokens].add(mask.astype(jnp.int32)))


def top_logprobs(logits: jax.Array, tokens: jax.Array, n: int):
    """Raw-distribution logprob of each chosen token [B] and the top-n [B, n] (values, ids)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if n == 0:
        return chosen, None, None
    values, ids = jax.lax.top_k(logp, n)
    return chosen, values, ids
