"""Per-slot decode state on the device, and the ONE place tokens are booked into it.

Every program that produces tokens — a prompt's last chunk (one sampled token), a plain
decode step (one), a speculative verify step (1..k+1) — ends in `emit_tokens`, which
applies the stop ids and max_tokens, writes the token history the penalties read, and
moves `last_token` / `n_generated` / `active` on. Stop conditions are evaluated here, on
the device, so a host that reads outputs a step late never feeds a finished slot.

Prompt tokens are booked by `take_prompt_chunk`, at the start of every prefill chunk; a
prompt's first chunk also admits its request (`Admission`), so admitting is no program
of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.engine.sampler import MAX_LOGIT_BIAS, SamplingState, record_tokens

MAX_STOP_IDS = 16


@struct.dataclass
class Slots:
    sampling: SamplingState
    last_token: jax.Array  # [B] i32: the next decode input
    active: jax.Array  # [B] bool: decoding
    n_generated: jax.Array  # [B] i32
    max_tokens: jax.Array  # [B] i32
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] i32, -1 padded


def init_slots(batch: int, capacity: int) -> Slots:
    f32, i32 = jnp.float32, jnp.int32
    z = lambda dt: jnp.zeros((batch,), dt)  # noqa: E731
    return Slots(
        sampling=SamplingState(z(f32), z(i32), jnp.ones((batch,), f32), z(f32), jnp.ones((batch,), f32), z(f32),
                               z(f32), z(jnp.uint32), jnp.zeros((batch, capacity), i32), z(i32),
                               jnp.zeros((batch, MAX_LOGIT_BIAS), i32), jnp.zeros((batch, MAX_LOGIT_BIAS), f32),
                               z(i32)),
        last_token=z(i32), active=z(bool), n_generated=z(i32), max_tokens=z(i32),
        stop_ids=jnp.full((batch, MAX_STOP_IDS), -1, i32))


@struct.dataclass
class Admission:
    """The settings a prompt's first chunk writes into its slot, rows [R]. Rows where
    `reset` is False (a later chunk, or a row not prefilled) keep their state."""

    reset: jax.Array  # [R] bool: the chunk is a prompt's first; the slot takes a new request
    sampling: dict[str, jax.Array]  # SamplingState fields but `history`: [R] each ([R, MAX_LOGIT_BIAS] the bias)
    max_tokens: jax.Array  # [R] i32
    stop_ids: jax.Array  # [R, MAX_STOP_IDS] i32, -1 padded


def take_prompt_chunk(slots: Slots, length: jax.Array, tokens: jax.Array, n_valid: jax.Array, admission: Admission):
    """Before a prompt chunk tokens [R, C] (n_valid [R] real) runs: rows starting a prompt
    are emptied (cache length 0, not decoding) and take their request's settings; every
    row books its chunk into the token history at positions length + i.
    -> (slots, cache length [R])."""
    reset = admission.reset

    def pick(new, old):
        return jnp.where(reset.reshape(reset.shape + (1,) * (old.ndim - 1)), new, old)

    length = jnp.where(reset, 0, length)
    sampling = slots.sampling.replace(**{k: pick(v, getattr(slots.sampling, k)) for k, v in admission.sampling.items()})
    i = jnp.arange(tokens.shape[1])
    sampling = record_tokens(sampling, tokens, length[:, None] + i, i < n_valid[:, None])
    slots = slots.replace(sampling=sampling, active=slots.active & ~reset, n_generated=pick(0, slots.n_generated),
                          max_tokens=pick(admission.max_tokens, slots.max_tokens),
                          stop_ids=pick(admission.stop_ids, slots.stop_ids))
    return slots, length


def emit_tokens(slots: Slots, tokens: jax.Array, n_new: jax.Array, start: jax.Array,
                emitting: jax.Array | None = None):
    """Book tokens [B, n] for the rows in `emitting` [B] (default: the decoding ones): the
    first n_new [B] of a row are new, at positions start + 1 + j (start: the position of
    the row's last booked token). The first stop id or max_tokens cuts a run short; other
    rows are left as they are. -> (slots, count [B] booked, finished [B])."""
    emitting = slots.active if emitting is None else emitting
    n = tokens.shape[1]
    i = jnp.arange(n)
    stop = jnp.any(tokens[..., None] == slots.stop_ids[:, None, :], axis=-1) & (i < n_new[:, None])
    first_stop = jnp.min(jnp.where(stop, i, n), axis=1)
    count = jnp.minimum(jnp.minimum(n_new, first_stop + 1), slots.max_tokens - slots.n_generated)
    count = jnp.where(emitting, count, 0)
    finished = emitting & ((first_stop < count) | (slots.n_generated + count >= slots.max_tokens))
    sampling = slots.sampling
    for j in range(n):  # n <= k + 1, a handful
        sampling = record_tokens(sampling, tokens[:, j], start + 1 + j, j < count)
    last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    slots = slots.replace(sampling=sampling, n_generated=slots.n_generated + count,
                          last_token=jnp.where(count > 0, last, slots.last_token),
                          active=jnp.where(emitting, ~finished, slots.active))
    return slots, count, finished
