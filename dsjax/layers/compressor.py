"""KV compressors: gated per-channel pooling of m tokens into one compressed entry.

HCA (ratio m, no overlap): entry w pools tokens m*w .. m*w+m-1:

    c = W_kv x,  z = W_g x                                   # [d] each
    C_w = Norm( sum_j softmax_j(z_j + B_j)[d] * c_j[d] )     # softmax over the m slots, per channel
    then RoPE at position m*w.

CSA (overlap): c, z are [2d], split into an a-half and a b-half. Entry w pools 2m slots:
the a-halves of window w-1 and the b-halves of window w (for w = 0 the a-slots have kv 0 and
gate -inf). The Lightning Indexer uses the same CSA form at index_head_dim.

`pool_windows` is the one implementation of the pooling. The full-sequence path
(`compress_kv`) and the cached path (`compress_extend`: a ring buffer of the raw kv / gate
of the incomplete window, plus the previous window for CSA's overlap) both call it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig
from dsjax.layers.linear import linear
from dsjax.layers.norms import rms_norm
from dsjax.layers.rope import apply_rope, rope_cos_sin
from dsjax.params import ParamSpec
from dsjax.sharding.rules import batch_major, reshape, spec


@struct.dataclass
class Compressor:
    kv_proj: jax.Array  # [c*d, D]   c = 2 with overlap (a | b halves), else 1
    gate_proj: jax.Array  # [c*d, D]
    position_bias: jax.Array  # [m, c*d] fp32
    kv_norm: jax.Array  # [d] fp32


def compressor_specs(cfg: ModelConfig, *, ratio: int, dim: int, overlap: bool, dtype) -> Compressor:
    width = (2 if overlap else 1) * dim
    return Compressor(
        kv_proj=ParamSpec((width, cfg.hidden_size), dtype, ("compress_out", "embed")),
        gate_proj=ParamSpec((width, cfg.hidden_size), dtype, ("compress_out", "embed")),
        position_bias=ParamSpec((ratio, width), jnp.float32, (None, "compress_out"), init="zeros"),
        kv_norm=ParamSpec((dim,), jnp.float32, (None,), init="ones"),
    )


def project(p: Compressor, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token raw kv and gate [..., c*d] (the slot bias is added per window, in fp32)."""
    return linear(x, p.kv_proj), linear(x, p.gate_proj)


def pool_windows(p: Compressor, kv: jax.Array, gate: jax.Array, *, overlap: bool, eps: float,
                 lead_valid: jax.Array | None = None) -> jax.Array:
    """Pooled, normed entries (before RoPE).

    kv, gate [B, W, m, c*d]: raw projections of complete windows -> [B, W, d].
    With overlap, the first window is the one *before* the first entry: only its a-halves
    are read, so the result has W - 1 entries; `lead_valid` [B] says whether that leading
    window exists (at position 0 it does not: its slots get kv 0 and gate -inf)."""
    gate = gate.astype(jnp.float32) + p.position_bias  # slot bias, fp32
    if not overlap:
        weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
        return rms_norm(pool(kv, weights), p.kv_norm, eps)
    d = kv.shape[-1] // 2
    lead = lead_valid[:, None, None] if lead_valid is not None else jnp.asarray(True)
    a_kv = kv[:, :-1, :, :d].at[:, 0].set(jnp.where(lead, kv[:, 0, :, :d], 0))
    a_gate = gate[:, :-1, :, :d].at[:, 0].set(jnp.where(lead, gate[:, 0, :, :d], -jnp.inf))
    slots_kv = jnp.concatenate([a_kv, kv[:, 1:, :, d:]], axis=2)  # [B, W-1, 2m, d]
    slots_gate = jnp.concatenate([a_gate, gate[:, 1:, :, d:]], axis=2)
    weights = jax.nn.softmax(slots_gate, axis=2).astype(kv.dtype)
    return rms_norm(pool(slots_kv, weights), p.kv_norm, eps)


def pool(kv: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over slots of kv * weights ([B, W, m, d] each) -> [B, W, d], as a product over m:
    XLA:CPU runs the multiply-reduce over a middle axis far slower (it was most of a batch-8
    decode step's attention time: docs/cpu-decode.md)."""
    return jnp.einsum("bwmd,bwmd->bwd", kv, weights, preferred_element_type=jnp.float32).astype(kv.dtype)


def rope_entries(entries: jax.Array, first_entry: jax.Array | int, ratio: int, cfg: ModelConfig) -> jax.Array:
    """RoPE ("compress" type) on entries [B, W, d] at positions ratio * (first_entry + w);
    first_entry is an int or per row [B]."""
    w = entries.shape[1]
    positions = (jnp.asarray(first_entry)[..., None] + jnp.arange(w)) * ratio
    positions = jnp.broadcast_to(positions, entries.shape[:2])
    cos, sin = rope_cos_sin(positions, cfg.rope("compress"), cfg.qk_rope_head_dim)
    return apply_rope(entries, cos, sin)


def compress_kv(p: Compressor, x: jax.Array, *, ratio: int, overlap: bool, cfg: ModelConfig) -> jax.Array:
    """Full-sequence compression: x [B, S, D] -> entries [B, S // ratio, d] (normed, roped).
    Tokens after the last complete window produce no entry."""
    b, s, _ = x.shape
    n_windows = s // ratio
    if n_windows == 0:  # no entry; projected from x's empty slice so it keeps x's (batch) sharding
        return project(p, x[:, :0])[0][..., : p.kv_norm.shape[0]].astype(x.dtype)  # [B, 0, c*d] -> [B, 0, d]
    kv, gate = project(p, x[:, : n_windows * ratio])
    kv = reshape(kv, (b, n_windows, ratio, -1))
    gate = reshape(gate, (b, n_windows, ratio, -1))
    if overlap:  # a leading window that does not exist
        kv = jnp.concatenate([jnp.zeros_like(kv[:, :1]), kv], axis=1)
        gate = jnp.concatenate([jnp.zeros_like(gate[:, :1]), gate], axis=1)
    pooled = pool_windows(p, kv, gate, overlap=overlap, eps=cfg.rms_norm_eps,
                          lead_valid=jnp.zeros((b,), bool) if overlap else None)
    return rope_entries(pooled, 0, ratio, cfg)


# ----------------------------------------------------------------------------- cached path
@struct.dataclass
class CompressorState:
    """Per sequence: the compressed entries so far and the raw projections of the recent
    tokens. The ring holds positions p at slot p % R with R = m (HCA) or 2m (CSA: the
    incomplete window and the complete one before it, whose a-halves the next entry reads)."""

    entries: jax.Array  # [B, capacity // m, d]  (normed, roped)
    ring_kv: jax.Array  # [B, R, c*d] raw
    ring_gate: jax.Array  # [B, R, c*d] raw


def compressor_state_shapes(batch: int, capacity: int, *, ratio: int, dim: int, overlap: bool, dtype):
    width = (2 if overlap else 1) * dim
    ring = (2 if overlap else 1) * ratio
    return CompressorState(
        entries=jax.ShapeDtypeStruct((batch, capacity // ratio, dim), dtype),
        ring_kv=jax.ShapeDtypeStruct((batch, ring, width), dtype),
        ring_gate=jax.ShapeDtypeStruct((batch, ring, width), dtype),
    )


def state_rows(a: jax.Array, at: jax.Array | None) -> jax.Array:
    """A cache leaf [B, ...], or layer `at` of a stacked one [R, B, ...] (a scanned layer run)."""
    return a if at is None else a[at]


def state_set(a: jax.Array, at: jax.Array | None, rows: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """a[rows, idx] = values (out of range: dropped), on layer `at` of a stacked leaf when
    given: written straight into the stacked buffer, so a scanned layer updates its cache in
    place instead of copying its whole state out and back."""
    trail = (None,) * (a.ndim - (1 if at is None else 2))
    if at is None:
        return a.at[rows, idx].set(values.astype(a.dtype), mode="drop", out_sharding=spec("batch", *trail))
    return a.at[at, rows, idx].set(values.astype(a.dtype), mode="drop", out_sharding=spec(None, "batch", *trail))


def compress_extend(p: Compressor, state: CompressorState, x: jax.Array, start: jax.Array, n_valid: jax.Array,
                    *, ratio: int, overlap: bool, cfg: ModelConfig, at: jax.Array | None = None) -> CompressorState:
    """Feed a chunk x [B, C, D] at positions start + i (i < n_valid, per row) and emit the
    entries of every window the chunk completes. Rows with n_valid = 0 are unchanged.
    at: the state is stacked over a layer run ([R, B, ...] leaves); this layer is `at`."""
    b, c, _ = x.shape
    m = ratio
    ring = state.ring_kv.shape[-2]
    kv_new, gate_new = project(p, x)
    end = start + n_valid
    # An aligned stream from the start of the first window that can still be open (for CSA,
    # one window earlier, whose a-halves the first new entry reads).
    g0 = (start // m) * m - (m if overlap else 0)  # [B]
    n_win = -(-(m - 1 + c) // m) + (1 if overlap else 0)
    pos = g0[:, None] + jnp.arange(n_win * m)  # [B, A]
    from_chunk = pos >= start[:, None]
    chunk_idx = jnp.clip(pos - start[:, None], 0, c - 1)
    ring_idx = jnp.mod(pos, ring)

    def aligned(ring_vals, chunk_vals=None):
        got = jnp.take_along_axis(state_rows(ring_vals, at), ring_idx[..., None], axis=1)
        if chunk_vals is not None:
            got = jnp.where(from_chunk[..., None], jnp.take_along_axis(chunk_vals, chunk_idx[..., None], axis=1), got)
        return reshape(got, (b, n_win, m, -1))

    # Ring: every valid chunk token goes to slot p % R (a chunk longer than the ring keeps
    # only its last R tokens, which are all a later entry can need).
    tok_pos = start[:, None] + jnp.arange(c)
    keep = (jnp.arange(c) < n_valid[:, None]) & (tok_pos >= end[:, None] - ring)
    slot = jnp.where(keep, jnp.mod(tok_pos, ring), ring)
    rows = jnp.arange(b)[:, None]
    write = lambda ring_vals, new: state_set(ring_vals, at, rows, slot, new)  # noqa: E731
    first_entry = (start // m)  # entry index of the first pooled window
    n_entries = n_win - (1 if overlap else 0)  # windows pooled (with overlap the first only lends its a-halves)
    entry_idx = first_entry[:, None] + jnp.arange(n_entries)
    complete = (entry_idx + 1) * m <= end[:, None]

    def emit(kv_al, gate_al):  # the pooled, roped entries of the stream's windows [B, W, d]
        pooled = pool_windows(p, kv_al, gate_al, overlap=overlap, eps=cfg.rms_norm_eps,
                              lead_valid=g0 >= 0 if overlap else None)
        return rope_entries(pooled, first_entry, m, cfg)

    if c == 1:  # one token: written first, the stream read from the ring alone (in place; see window_extend)
        ring_kv, ring_gate = write(state.ring_kv, kv_new), write(state.ring_gate, gate_new)
        # It completes a window once in m steps: pooled only when some row's does (an HCA
        # window's softmax pool is most of its layer's decode time otherwise).
        dtype = state.entries.dtype
        pooled = jax.lax.cond(jnp.any(complete), lambda: emit(aligned(ring_kv), aligned(ring_gate)).astype(dtype),
                              lambda: batch_major(jnp.zeros((b, n_entries, p.kv_norm.shape[0]), dtype)))
    else:
        pooled = emit(aligned(state.ring_kv, kv_new), aligned(state.ring_gate, gate_new))
        ring_kv, ring_gate = write(state.ring_kv, kv_new), write(state.ring_gate, gate_new)
    capacity = state.entries.shape[-2]
    entries = state_set(state.entries, at, jnp.arange(b)[:, None], jnp.where(complete, entry_idx, capacity), pooled)
    return CompressorState(entries=entries, ring_kv=ring_kv, ring_gate=ring_gate)
