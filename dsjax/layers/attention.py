"""V4 attention: one shared KV head (K = V), partial RoPE, attention sinks, grouped output.

    cq  = Norm_q(W_qa x)                         [q_lora]   (also feeds the indexer)
    q_h = rope_t(RMS(W_qb cq)_h)                 [H, hd]    per-head unweighted RMS
    kv  = rope_t(Norm_kv(W_kv x))                [hd]
    keys(t) = window {t-W < s <= t}  U  visible (CSA: selected) compressed entries
    p   = exp(q.k / sqrt(hd)) / (sum exp(q.k' / sqrt(hd)) + exp(sink_h))
    o_h = inverse_rope_t(sum_s p_s kv_s)
    out = W_ob concat_g(W_oa[g] concat(o_h, h in group g))

`attend` routes both paths through the dispatch of dsjax/kernels/sink_attention.py,
which also holds the reference math (its reference or a kernel, per the `kernels` option).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import LayerSpec, ModelConfig
from dsjax.layers.compressor import (Compressor, CompressorState, compress_extend, compress_kv, compressor_specs,
                                     compressor_state_shapes, state_rows, state_set)
from dsjax.layers.indexer import (Indexer, index_queries, index_scores, index_weights, indexer_specs,
                                  select_topk_indices)
from dsjax.layers.linear import linear, merge_last_two, stored_grouped_product
from dsjax.layers.norms import rms_norm, unweighted_rms_norm
from dsjax.layers.quantized import dense
from dsjax.layers.rope import apply_rope, rope_cos_sin
from dsjax.layers.taps import tap
from dsjax.kernels.sink_attention import sink_attention as attention_kernel
from dsjax.params import ParamSpec
from dsjax.sharding.rules import reshape, spec


@struct.dataclass
class AttentionProjections:
    """The projections and sinks every DeepSeek attention layer has, V4's and V4.1's
    (`dsjax.model.v41.shared_attention.SharedAttention`) alike."""

    q_a_proj: jax.Array  # [q_lora, D]
    q_a_norm: jax.Array  # [q_lora] fp32
    q_b_proj: jax.Array  # [H * hd, q_lora]
    kv_proj: jax.Array  # [hd, D]
    kv_norm: jax.Array  # [hd] fp32
    o_a_proj: jax.Array  # [G * o_lora, H * hd / G]
    o_b_proj: jax.Array  # [D, G * o_lora]
    sinks: jax.Array  # [H] fp32


@struct.dataclass
class Attention(AttentionProjections):
    compressor: Compressor | None = None  # CSA / HCA layers
    indexer: Indexer | None = None  # CSA layers


def projection_specs(cfg: ModelConfig, dtype) -> dict:
    """`AttentionProjections`' specs, as keyword arguments of either generation's attention."""
    h, hd, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    f32 = jnp.float32
    return dict(
        q_a_proj=ParamSpec((cfg.q_lora_rank, d), dtype, ("q_lora", "embed")),
        q_a_norm=ParamSpec((cfg.q_lora_rank,), f32, (None,), init="ones"),
        q_b_proj=ParamSpec((h * hd, cfg.q_lora_rank), dtype, ("q_heads", "q_lora")),
        kv_proj=ParamSpec((hd, d), dtype, ("head_dim", "embed")),
        kv_norm=ParamSpec((hd,), f32, (None,), init="ones"),
        o_a_proj=ParamSpec((cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), dtype,
                           ("o_groups", "o_group_in")),
        o_b_proj=ParamSpec((d, cfg.o_groups * cfg.o_lora_rank), dtype, ("embed", "o_groups")),
        sinks=ParamSpec((h,), f32, ("heads",), init="zeros"))


def attention_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> Attention:
    compressor = indexer = None
    if layer.compress_ratio:
        compressor = compressor_specs(cfg, ratio=layer.compress_ratio, dim=cfg.head_dim, overlap=layer.overlap,
                                      dtype=dtype)
    if layer.has_indexer:
        indexer = indexer_specs(cfg, ratio=layer.compress_ratio, dtype=dtype)
    return Attention(**projection_specs(cfg, dtype), compressor=compressor, indexer=indexer)


# ----------------------------------------------------------------------------- pieces
def project_q(p: AttentionProjections, x: jax.Array, cos, sin, cfg: ModelConfig, *, head_norm: bool = True,
              fp8_act: bool = False) -> tuple[jax.Array, jax.Array]:
    """-> cq [B, S, q_lora], q [B, S, H, hd] (roped). head_norm: V4's per-head unweighted RMS
    (V4.1 has none); fp8_act: V4.1's Lin8 products (deepseek-v41.md §2.10)."""
    cq = rms_norm(linear(x, p.q_a_proj, fp8_act=fp8_act), p.q_a_norm, cfg.rms_norm_eps)
    q = reshape(linear(cq, p.q_b_proj, fp8_act=fp8_act), (*x.shape[:-1], cfg.num_attention_heads, cfg.head_dim))
    if head_norm:
        q = unweighted_rms_norm(q, cfg.rms_norm_eps)
    return cq, apply_rope(q, cos[..., None, :], sin[..., None, :])


def project_kv(p: AttentionProjections, x: jax.Array, cos, sin, cfg: ModelConfig, *,
               fp8_act: bool = False) -> jax.Array:
    """-> kv [B, S, hd] (normed, roped): the window key and value of each token."""
    return apply_rope(rms_norm(linear(x, p.kv_proj, fp8_act=fp8_act), p.kv_norm, cfg.rms_norm_eps), cos, sin)


def grouped_output(p: AttentionProjections, o: jax.Array, cfg: ModelConfig, round_trips: bool = False) -> jax.Array:
    """o [B, S, H, hd] -> [B, S, D]: per-group low-rank W_oa (one batched GEMM, also for a CPU
    decode row: per-group matrix-vector loops were no faster; a 16-bit W_oa at a CPU decode
    step's rows: one library call reading each group's block in place, `stored_grouped_product`),
    then the mixing W_ob.
    round_trips: DeepSeek-V4.1's Lin8 on W_ob (deepseek-v41.md §2.10)."""
    g = cfg.o_groups
    grouped = reshape(o, (*o.shape[:-2], g, -1))  # [B, S, G, H/G * hd]
    z = stored_grouped_product(grouped, p.o_a_proj, g)  # a 16-bit W_oa on XLA:CPU, a decode step's rows
    if z is None:
        w_oa = dense(p.o_a_proj, o.dtype).reshape(g, cfg.o_lora_rank, -1)
        z = jnp.einsum("bsgi,goi->bsgo", grouped, w_oa, preferred_element_type=jnp.float32)
    z = z.astype(o.dtype)
    return linear(merge_last_two(z), p.o_b_proj, out_sharding=spec("batch", None, None),
                  fp8_act=round_trips)


def attention_output(p: AttentionProjections, o: jax.Array, cos, sin, cfg: ModelConfig,
                     round_trips: bool = False) -> jax.Array:
    """The attention's output o [B, S, H, hd] (values roped at their key positions) -> [B, S, D]:
    the inverse RoPE at the query positions, then `grouped_output`."""
    o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
    return grouped_output(p, o, cfg, round_trips)


FOREVER = jnp.iinfo(jnp.int32).max


def window_intervals(k_pos: jax.Array, valid: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """Window key at position p is seen by queries t with p <= t <= p + W - 1 (t - W < p <= t).
    -> (lo, hi) [..., T]; an invalid key gets an empty interval."""
    return jnp.where(valid, k_pos, 1), jnp.where(valid, k_pos + window - 1, 0)


def entry_intervals(like: jax.Array, n_entries: int, ratio: int) -> tuple[jax.Array, jax.Array]:
    """Compressed entry w is seen once its window closed: w < (t + 1) // m <=> t >= (w + 1) m - 1.
    -> (lo, hi) [B, n_entries], batch-laid-out like `like` [B, ...] (int32)."""
    rows = jnp.zeros_like(like[:, :1], dtype=jnp.int32)  # [B, 1], carrying like's batch sharding
    lo = rows + (jnp.arange(n_entries, dtype=jnp.int32) + 1) * ratio - 1
    return lo, jnp.full_like(lo, FOREVER)


def compressed_visible(q_pos: jax.Array, n_entries: int, ratio: int) -> jax.Array:
    """[..., S, T]: entry w is visible to query t iff w < (t + 1) // ratio (its window closed)."""
    return jnp.arange(n_entries) < ((q_pos + 1) // ratio)[..., None]


def attend(p: Attention, q, cq, x, cos, sin, positions, keys, lo, hi, entries, index_keys, layer: LayerSpec,
           cfg: ModelConfig, kernels: str = "reference") -> jax.Array:
    """The attention core shared by the full-sequence and cached paths.

    keys [B, T, hd] with visibility intervals lo / hi (window keys); entries [B, E, hd] the
    compressed entries (None on window-only layers); index_keys the indexer's keys (CSA).
    CSA selects each query's top-k entries by index when fewer than all visible entries are
    kept; otherwise (and on HCA) all entries join the shared keys. -> o [B, S, H, hd]."""
    kv_pq = mask_pq = None
    if entries is not None:
        n = entries.shape[1]
        e_lo, e_hi = entry_intervals(lo, n, layer.compress_ratio)
        if layer.has_indexer and cfg.index_topk < n:
            scores = tap("indexer.scores", index_scores(index_queries(p.indexer, cq, cos, sin, cfg), index_keys,
                                                        index_weights(p.indexer, x, cfg), cfg, kernels=kernels))
            visible = tap("indexer.visible", compressed_visible(positions, n, layer.compress_ratio))
            top, mask_pq = select_topk_indices(scores, visible, cfg.index_topk)
            top = tap("indexer.selected", top)
            kv_pq = jnp.take_along_axis(entries[:, None], top[..., None], axis=2)  # [B, S, k, hd]
        else:
            keys = jnp.concatenate([keys, entries], axis=1)
            lo, hi = jnp.concatenate([lo, e_lo], axis=1), jnp.concatenate([hi, e_hi], axis=1)
    return attention_kernel(q, keys, lo, hi, positions, p.sinks, kv_pq, mask_pq, impl=kernels)


# ----------------------------------------------------------------------------- full sequence
def attention_forward(p: Attention, x: jax.Array, positions: jax.Array, layer: LayerSpec,
                      cfg: ModelConfig, *, kernels: str = "reference") -> jax.Array:
    """Full-sequence attention (no cache): x [B, S, D] normed input, positions [B, S]."""
    cos, sin = rope_cos_sin(positions, cfg.rope(layer.rope), cfg.qk_rope_head_dim)
    cq, q = project_q(p, x, cos, sin, cfg)
    kv = project_kv(p, x, cos, sin, cfg)
    lo, hi = window_intervals(positions, jnp.ones(positions.shape, bool), cfg.sliding_window)
    entries = index_keys = None
    if layer.compress_ratio:
        entries = compress_kv(p.compressor, x, ratio=layer.compress_ratio, overlap=layer.overlap, cfg=cfg)
        if layer.has_indexer:
            index_keys = compress_kv(p.indexer.compressor, x, ratio=layer.compress_ratio, overlap=True, cfg=cfg)
    o = attend(p, q, cq, x, cos, sin, positions, kv, lo, hi, entries, index_keys, layer, cfg, kernels)
    return attention_output(p, o, cos, sin, cfg)


# ----------------------------------------------------------------------------- cached path
@struct.dataclass
class AttentionState:
    """One layer's cache: the window ring (slot = position % W) and, on CSA / HCA layers,
    the compressor state (and the indexer's own, on CSA layers)."""

    window: jax.Array  # [B, W, hd]  normed, roped kv
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def written_rows(self, ratio: int, positions: jax.Array) -> "AttentionState":
        """Per field, the row index [B, n] an extend over `positions` may write: ring slots
        (position % ring size) and the compressed entry each position would complete
        (position // ratio). Speculative rollback saves and restores these rows."""
        def comp_rows(comp: CompressorState | None):
            if comp is None:
                return None
            ring = positions % comp.ring_kv.shape[1]
            return CompressorState(entries=positions // ratio, ring_kv=ring, ring_gate=ring)

        return AttentionState(window=positions % self.window.shape[1], compressor=comp_rows(self.compressor),
                              indexer=comp_rows(self.indexer))


def attention_state_shapes(cfg: ModelConfig, layer: LayerSpec, batch: int, capacity: int, dtype) -> AttentionState:
    comp = idx = None
    if layer.compress_ratio:
        comp = compressor_state_shapes(batch, capacity, ratio=layer.compress_ratio, dim=cfg.head_dim,
                                       overlap=layer.overlap, dtype=dtype)
    if layer.has_indexer:
        idx = compressor_state_shapes(batch, capacity, ratio=layer.compress_ratio, dim=cfg.index_head_dim,
                                      overlap=True, dtype=dtype)
    return AttentionState(jax.ShapeDtypeStruct((batch, cfg.sliding_window, cfg.head_dim), dtype), comp, idx)


def ring_positions(start: jax.Array, ring: int) -> jax.Array:
    """[B, R]: the position held by each ring slot before a chunk starting at `start`
    (the latest p < start with p % R == slot; negative = empty)."""
    return start[:, None] - 1 - jnp.mod(start[:, None] - 1 - jnp.arange(ring), ring)


def window_extend(ring: jax.Array, kv: jax.Array, start: jax.Array, n_valid: jax.Array, at: jax.Array | None,
                  w: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A chunk's window keys kv [B, C, hd] (positions start + i, i < n_valid) against the
    window ring (slot = position % W; stacked when `at` is given): -> (keys [B, T, hd], their
    visibility lo / hi [B, T], the ring with the chunk's last W valid tokens written).

    One token (decode) is written first and the ring alone is read (its slot held position
    start - W, out of the window): read-then-write with no data dependency between the two
    makes XLA copy the whole loop-carried stacked ring to keep the read safe, while
    write-then-read updates it in place (docs/cpu-decode.md). The token's
    own key is then read back in the ring's dtype, which is kv's (the engine's cache takes the
    model's dtype). A longer chunk overwrites slots its own earlier queries see: the old ring,
    then the chunk."""
    b, c = kv.shape[:2]
    positions = start[:, None] + jnp.arange(c)
    valid = jnp.arange(c) < n_valid[:, None]
    keep = valid & (positions >= (start + n_valid)[:, None] - w)
    new = state_set(ring, at, jnp.arange(b)[:, None], jnp.where(keep, jnp.mod(positions, w), w), kv)
    if c == 1:
        held = ring_positions(start + n_valid, w)
        return (state_rows(new, at), *window_intervals(held, held >= 0, w), new)
    held = ring_positions(start, w)
    keys = jnp.concatenate([state_rows(ring, at), kv], axis=1)  # [B, W + C, hd]
    lo, hi = window_intervals(jnp.concatenate([held, positions], axis=1),
                              jnp.concatenate([held >= 0, valid], axis=1), w)
    return keys, lo, hi, new


def attention_extend(p: Attention, state: AttentionState, x: jax.Array, start: jax.Array, n_valid: jax.Array,
                     layer: LayerSpec, cfg: ModelConfig, n_entries: int, *,
                     kernels: str = "reference", at: jax.Array | None = None) -> tuple[jax.Array, AttentionState]:
    """Attention for a chunk x [B, C, D] at positions start + i, i < n_valid (per row),
    against the cache; returns the output and the updated cache.
    at: the state is stacked over a layer run ([R, B, ...] leaves, updated in place); this
    layer is `at` of it.

    n_entries (static) bounds how many compressed entries are read: every entry a query
    can see must lie below it (the engine picks it from the longest sequence)."""
    positions = start[:, None] + jnp.arange(x.shape[1])
    cos, sin = rope_cos_sin(positions, cfg.rope(layer.rope), cfg.qk_rope_head_dim)
    cq, q = project_q(p, x, cos, sin, cfg)
    kv = project_kv(p, x, cos, sin, cfg)
    keys, lo, hi, window = window_extend(state.window, kv, start, n_valid, at, cfg.sliding_window)
    entries = index_keys = comp = idx_state = None
    if layer.compress_ratio:
        m = layer.compress_ratio
        comp = compress_extend(p.compressor, state.compressor, x, start, n_valid, ratio=m,
                               overlap=layer.overlap, cfg=cfg, at=at)
        entries = state_rows(comp.entries, at)[:, :n_entries]
        if layer.has_indexer:
            idx_state = compress_extend(p.indexer.compressor, state.indexer, x, start, n_valid, ratio=m,
                                        overlap=True, cfg=cfg, at=at)
            index_keys = state_rows(idx_state.entries, at)[:, :n_entries]
    o = attend(p, q, cq, x, cos, sin, positions, keys, lo, hi, entries, index_keys, layer, cfg, kernels)
    return attention_output(p, o, cos, sin, cfg), AttentionState(window, comp, idx_state)
