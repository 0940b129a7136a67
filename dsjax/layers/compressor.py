"""KV compressors: gated per-channel pooling of m tokens into one compressed entry.

HCA (ratio m, no overlap): entry w pools tokens m*w .. m*w+m-1:

    c = W_kv x,  z = W_g x                                   # [d] each
    C_w = Norm( sum_j softmax_j(z_j + B_j)[d] * c_j[d] )     # softmax over the m slots, per channel
    then RoPE at position m*w.

CSA (overlap): c, z are [2d], split into an a-half and a b-half. Entry w pools 2m slots:
the a-halves of window w-1 and the b-halves of window w (for w = 0 the a-slots have kv 0 and
gate -inf). The Lightning Indexer uses the same CSA form at index_head_dim.

`pool_windows` is the one implementation of the pooling; the full-sequence path
(`compress_kv`) and the engine's incremental caches both call it.
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
    """Per-token raw kv and gate (gate includes nothing yet; the slot bias is added per window)."""
    return linear(x, p.kv_proj), linear(x, p.gate_proj)


def pool_windows(
    p: Compressor,
    kv: jax.Array,  # [B, W, m, c*d]  raw kv of W complete windows
    gate: jax.Array,  # [B, W, m, c*d]  raw gate
    *,
    overlap: bool,
    eps: float,
    prev_a: tuple[jax.Array, jax.Array] | None = None,  # a-halves (kv, gate+bias) [B, m, d] of window -1
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Pooled, normed entries [B, W, d] (before RoPE), and the overlap state for the next call
    (the last window's a-halves), or None without overlap."""
    gate = gate.astype(jnp.float32) + p.position_bias  # slot bias, fp32
    if not overlap:
        weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
        return rms_norm(jnp.sum(kv * weights, axis=2), p.kv_norm, eps), None
    d = kv.shape[-1] // 2
    a_kv, b_kv = kv[..., :d], kv[..., d:]
    a_gate, b_gate = gate[..., :d], gate[..., d:]
    if prev_a is None:
        first_kv = jnp.zeros_like(a_kv[:, :1])
        first_gate = jnp.full_like(a_gate[:, :1], -jnp.inf)
    else:
        first_kv, first_gate = prev_a[0][:, None].astype(kv.dtype), prev_a[1][:, None]
    # slots 0..m-1: a-halves of the previous window; slots m..2m-1: b-halves of this window
    slots_kv = jnp.concatenate([jnp.concatenate([first_kv, a_kv[:, :-1]], axis=1), b_kv], axis=2)
    slots_gate = jnp.concatenate([jnp.concatenate([first_gate, a_gate[:, :-1]], axis=1), b_gate], axis=2)
    weights = jax.nn.softmax(slots_gate, axis=2).astype(kv.dtype)
    pooled = rms_norm(jnp.sum(slots_kv * weights, axis=2), p.kv_norm, eps)
    return pooled, (a_kv[:, -1], a_gate[:, -1])


def rope_entries(entries: jax.Array, first_entry: jax.Array | int, ratio: int, cfg: ModelConfig) -> jax.Array:
    """RoPE ("compress" type) on entries [B, W, d] at positions ratio * (first_entry + w)."""
    w = entries.shape[1]
    positions = (jnp.asarray(first_entry)[..., None] + jnp.arange(w)) * ratio  # [W] or [B, W]
    positions = jnp.broadcast_to(positions, entries.shape[:2])
    cos, sin = rope_cos_sin(positions, cfg.rope("compress"), cfg.qk_rope_head_dim)
    return apply_rope(entries, cos, sin)


def compress_kv(p: Compressor, x: jax.Array, *, ratio: int, overlap: bool, cfg: ModelConfig) -> jax.Array:
    """Full-sequence compression: x [B, S, D] -> entries [B, S // ratio, d] (normed, roped).
    Tokens after the last complete window produce no entry."""
    b, s, _ = x.shape
    n_windows = s // ratio
    if n_windows == 0:
        return jnp.zeros((b, 0, p.kv_norm.shape[0]), x.dtype)
    kv, gate = project(p, x[:, : n_windows * ratio])
    kv = kv.reshape(b, n_windows, ratio, -1)
    gate = gate.reshape(b, n_windows, ratio, -1)
    pooled, _ = pool_windows(p, kv, gate, overlap=overlap, eps=cfg.rms_norm_eps)
    return rope_entries(pooled, 0, ratio, cfg)
