"""DeepSeek-V4.1 attention: V4's one-KV-head attention with compressed KV and top-k lists
shared across layers (spec deepseek-v41.md §1.2, §2).

    cq  = Norm_q(W_qa x)                          [r_q]     (also the indexer's input)
    q_h = rope_t(W_qb cq)_h                       [H, hd]   no per-head RMS (Δ V4)
    k_t = fp8(rope_t(Norm_kv(W_kv x)))            [hd]      the window ring's row, K = V
    KV source (own compressor, ratio r in {1, 2}, no overlap, no position bias):
        C_j = Norm_c(sum_{t in group j} softmax_t(W_g x_t) * W_c x_t)    (r = 1: Norm_c(W_c x_t), no gate)
        index keys k^I_j = fp4(rope(Norm_k(W_k C_j)))                    (wk / k_norm: KV sources only)
    index source (own indexer): s_{t,j} = sum_h w_h ReLU(q^I_h . k^I_j), top-k over visible j
        (restricted sources mask s to the candidate source's blocks first)
    consumer: attends its KV source's cache through the top-k list of its index source

A layer's `LayerSpec.sharing` says which of these parts it owns; `shared_attention_specs`
declares exactly those weights (the checkpoint has no others, §8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import LayerSpec, ModelConfig
from dsjax.layers.attention import (AttentionProjections, attention_output, compressed_visible, project_kv, project_q,
                                   projection_specs, window_extend, window_intervals)
from dsjax.layers.candidate_selection import candidate_mask, index_head_weights, index_scores_bf16, topk_entry_list
from dsjax.layers.compressor import state_rows, state_set
from dsjax.layers.indexer import index_scores
from dsjax.layers.linear import linear, linear_f32
from dsjax.layers.norms import rms_norm
from dsjax.layers.qdq import qdq_fp4_e4m3, qdq_fp4_e8m0, qdq_fp8
from dsjax.layers.rope import apply_rope, rope_cos_sin
from dsjax.layers.taps import tap
from dsjax.kernels.index_scores import candidate_scores, candidate_scores_kernel
from dsjax.kernels.sink_attention import sink_attention as attention_kernel
from dsjax.params import ParamSpec
from dsjax.sharding.rules import batch_major, reshape


@struct.dataclass
class LatentCompressor:
    """A KV source's compressor: `attn.compressor.{wkv, wgate, norm}`."""

    kv_proj: jax.Array  # [hd, D]
    norm: jax.Array  # [hd] fp32
    gate_proj: jax.Array | None = None  # [hd, D]; ratio 2 only (ratio 1 has no gate)


@struct.dataclass
class IndexKeys:
    """A KV source's index-key projection of its latents: `attn.indexer.{wk, k_norm}`."""

    k_proj: jax.Array  # [d_I, hd]
    k_norm: jax.Array  # [d_I] fp32


@struct.dataclass
class IndexQueries:
    """An index source's queries and head weights: `attn.indexer.{wq_b, weights_proj}`."""

    q_b_proj: jax.Array  # [H_I * d_I, r_q]
    weights_proj: jax.Array  # [H_I, D]


@struct.dataclass
class SharedAttention(AttentionProjections):
    """V4.1 attention: V4's projections and sinks (`AttentionProjections`) and the parts of the
    sharing scheme this layer owns."""

    compressor: LatentCompressor | None = None  # KV sources
    index_keys: IndexKeys | None = None  # KV sources that are index sources
    index_queries: IndexQueries | None = None  # index sources


def shared_attention_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> SharedAttention:
    hd, d = cfg.head_dim, cfg.hidden_size
    f32 = jnp.float32
    compressor = index_keys = index_queries = None
    if layer.has_compressor:
        compressor = LatentCompressor(
            kv_proj=ParamSpec((hd, d), dtype, ("head_dim", "embed")),
            norm=ParamSpec((hd,), f32, (None,), init="ones"),
            gate_proj=ParamSpec((hd, d), dtype, ("head_dim", "embed")) if layer.compress_ratio > 1 else None)
    if layer.compress_ratio and layer.has_index_keys:
        index_keys = IndexKeys(k_proj=ParamSpec((cfg.index_head_dim, hd), dtype, (None, "head_dim")),
                               k_norm=ParamSpec((cfg.index_head_dim,), f32, (None,), init="ones"))
    if layer.compress_ratio and layer.has_indexer:
        index_queries = IndexQueries(
            q_b_proj=ParamSpec((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), dtype,
                               ("index_heads", "q_lora")),
            weights_proj=ParamSpec((cfg.index_n_heads, d), dtype, ("index_heads_w", "embed")))
    return SharedAttention(**projection_specs(cfg, dtype), compressor=compressor, index_keys=index_keys,
                           index_queries=index_queries)


# ----------------------------------------------------------------------------- shared between layers
@struct.dataclass
class Shared:
    """What a layer publishes for the layers after it (spec §1.2): its KV source's roped
    latents and index keys, the last index source's top-k entries, the candidate source's
    mask. Every field is always present (zeros until a source writes it), so a scan over a
    layer run can carry it."""

    entries: jax.Array  # [B, E, hd]  roped compressed latents of the current KV source
    index_keys: jax.Array  # [B, E, d_I]  its published index keys
    top: jax.Array  # [B, S, k] int32  entries chosen by the last index source
    top_valid: jax.Array  # [B, S, k] bool
    candidates: jax.Array  # [B, S, E] bool  the candidate source's blocks


def empty_shared(cfg: ModelConfig, batch: int, seq: int, n_entries: int, dtype) -> Shared:
    k = min(cfg.index_topk, n_entries)
    return jax.tree.map(batch_major, Shared(
        entries=jnp.zeros((batch, n_entries, cfg.head_dim), dtype),
        index_keys=jnp.zeros((batch, n_entries, cfg.index_head_dim), dtype),
        top=jnp.zeros((batch, seq, k), jnp.int32), top_valid=jnp.zeros((batch, seq, k), bool),
        candidates=jnp.zeros((batch, seq, n_entries), bool)))


# ----------------------------------------------------------------------------- pieces
def pool_group(a: jax.Array, z: jax.Array, dtype, round_trips: bool) -> jax.Array:
    """The ratio-2 pooling of §2.4 over fp32 projections a, z [..., r, hd] of a group's tokens:
    sum_t softmax_t(z) a, in bf16 as the reference writes it (`round_trips`; else rounded
    to `dtype` only), then in `dtype` for the norm."""
    pooled = jnp.sum(jax.nn.softmax(z, axis=-2) * a, axis=-2)
    return (pooled.astype(jnp.bfloat16) if round_trips else pooled).astype(dtype)


def compress_latents(p: LatentCompressor, x: jax.Array, ratio: int, eps: float, round_trips: bool = False
                     ) -> jax.Array:
    """x [B, S, D] -> latents C [B, S // ratio, hd] before RoPE (§2.4): ratio 1 is a normed
    projection per token; ratio 2 pools each pair of tokens channel-wise by a softmax of
    their gates (fp32, `pool_group`). Tokens after the last full group give no latent."""
    b, s, _ = x.shape
    n = s // ratio
    if ratio == 1:
        return rms_norm(linear(x, p.kv_proj), p.norm, eps)
    xs = x[:, :n * ratio].astype(jnp.float32)
    a = reshape(linear_f32(xs, p.kv_proj), (b, n, ratio, -1))
    z = reshape(linear_f32(xs, p.gate_proj), (b, n, ratio, -1))
    return rms_norm(pool_group(a, z, x.dtype, round_trips), p.norm, eps)


def rope_at(x: jax.Array, positions: jax.Array, cfg: ModelConfig, kind: str = "compress") -> jax.Array:
    """RoPE on the last qk_rope_head_dim channels of x [B, T, d] at positions [B, T] (or [T])."""
    cos, sin = rope_cos_sin(positions, cfg.rope(kind), cfg.qk_rope_head_dim)
    return apply_rope(x, cos, sin)


def entry_indices(batch: int, n: int) -> jax.Array:
    """[B, n]: entries 0..n-1 (latent j sits at its group's first position, j * ratio)."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))


def round_trip(x: jax.Array, qdq, on: bool) -> jax.Array:
    """x through a quantisation round trip (a dsjax/layers/qdq.py function, bf16 in and out)
    when `on`, back in x's dtype: the reference stores these values only as QDQ outputs."""
    return qdq(x).astype(x.dtype) if on else x


def index_scores_of(p: IndexQueries, cq: jax.Array, x: jax.Array, keys: jax.Array, cos, sin, cfg: ModelConfig,
                    kernels: str = "reference", round_trips: bool = False, visible: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array | None]:
    """s_{t,j} = sum_h w_h ReLU(q^I_h . k^I_j) with w = W_wp x / sqrt(H_I d_I) (§2.6) -> ([B, S, E]
    (fp32; with round trips the reference's FP4 queries and bf16 score pipeline), the candidate
    blocks' maxima of the `visible` (a prefix per row) scores [B, S, E / b_c] where a kernel
    gives them with the scores (V4.1's Mosaic TPU kernel, under round trips), else None)."""
    q = linear(cq, p.q_b_proj, fp8_act=round_trips)
    q = reshape(q, (*cq.shape[:-1], cfg.index_n_heads, cfg.index_head_dim))
    q = apply_rope(q, cos[..., None, :], sin[..., None, :])
    if round_trips:
        w = index_head_weights(linear(x, p.weights_proj).astype(jnp.bfloat16), head_dim=cfg.index_head_dim)
        q = round_trip(q, qdq_fp4_e8m0, True)
        if visible is not None and keys.shape[1] and candidate_scores_kernel(kernels):
            return candidate_scores(q, keys, w, jnp.sum(visible, axis=-1, dtype=jnp.int32),
                                    block=cfg.v41.candidate_block_size, impl=kernels)
        return index_scores_bf16(q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16), w).astype(jnp.float32), None
    w = linear(x, p.weights_proj).astype(jnp.float32) * cfg.index_n_heads ** -0.5
    return index_scores(q, keys, w, cfg, kernels=kernels), None


def project_q_kv(p: SharedAttention, x: jax.Array, positions: jax.Array, layer: LayerSpec, cfg: ModelConfig,
                 round_trips: bool):
    """-> (cq [B, S, r_q], q [B, S, H, hd], kv [B, S, hd] (the window row; FP8 round trip over all
    hd channels, RoPE tail included, §2.3), cos, sin). No per-head q RMS (Δ V4)."""
    cos, sin = rope_cos_sin(positions, cfg.rope(layer.rope), cfg.qk_rope_head_dim)
    cq, q = project_q(p, x, cos, sin, cfg, head_norm=False, fp8_act=round_trips)
    kv = project_kv(p, x, cos, sin, cfg, fp8_act=round_trips)
    return cq, q, round_trip(kv, qdq_fp8, round_trips), cos, sin


def latent_rows(p: SharedAttention, latents: jax.Array, entry: jax.Array, ratio: int, cfg: ModelConfig,
                round_trips: bool) -> tuple[jax.Array, jax.Array | None]:
    """A KV source's new latents C [B, G, hd] (before RoPE) at entry indices [B, G] -> the rows
    its cache stores: roped latents (FP4 with E4M3 scales per 16 when round-tripping, §2.4) and
    index keys Norm_k(W_k C), roped (FP4 / E8M0 per 32, §2.6), or None without wk."""
    stored = round_trip(rope_at(latents, entry * ratio, cfg), qdq_fp4_e4m3, round_trips)
    if p.index_keys is None:
        return stored, None
    keys = rms_norm(linear(latents, p.index_keys.k_proj), p.index_keys.k_norm, cfg.rms_norm_eps)
    return stored, round_trip(rope_at(keys, entry * ratio, cfg), qdq_fp4_e8m0, round_trips)


def index_select(p: SharedAttention, layer: LayerSpec, cq, x, shared: Shared, visible, cos, sin, cfg: ModelConfig,
                 kernels: str, round_trips: bool, alt_keys: jax.Array | None = None,
                 use_alt: jax.Array | None = None) -> Shared:
    """An index source's top-k over the published keys (rows where `use_alt` [B, S] score
    `alt_keys` instead: the reference's published-key rule); the candidate source also
    publishes its blocks, a restricted source masks its scores by them (§2.6-2.8)."""
    scores, beta = index_scores_of(p.index_queries, cq, x, shared.index_keys, cos, sin, cfg, kernels, round_trips,
                                   visible)
    if alt_keys is not None:
        alt, alt_beta = index_scores_of(p.index_queries, cq, x, alt_keys, cos, sin, cfg, kernels, round_trips, visible)
        scores = jnp.where(use_alt[..., None], alt, scores)
        beta = None if beta is None else jnp.where(use_alt[..., None], alt_beta, beta)  # blocks follow scores
    if layer.sharing.publishes_candidates:
        shared = shared.replace(candidates=candidate_mask(
            scores, visible, k_blocks=cfg.v41.candidate_topk_blocks, block=cfg.v41.candidate_block_size, beta=beta))
    restrict = shared.candidates if layer.sharing.candidates_from is not None else None
    top, valid = select_entries(tap("indexer.scores", scores), tap("indexer.visible", visible), shared.top.shape[-1],
                                restrict)
    return shared.replace(top=tap("indexer.selected", top), top_valid=valid)


def attend_and_project(p: SharedAttention, q, keys, lo, hi, positions, shared: Shared | None, cos, sin,
                       cfg: ModelConfig, kernels: str, round_trips: bool) -> jax.Array:
    """Sink attention over the window keys and (compressed layers) the top-k latents, then the
    inverse RoPE and the grouped output (§2.9-2.10). round_trips: p rounded to bf16 against
    the max before PV, as the vendor kernel does (dsjax/kernels/sink_attention.py)."""
    kv_pq = mask_pq = None
    if shared is not None:
        kv_pq = jnp.take_along_axis(shared.entries[:, None], shared.top[..., None], axis=2)  # [B, S, k, hd]
        mask_pq = shared.top_valid
    o = attention_kernel(q, keys, lo, hi, positions, p.sinks, kv_pq, mask_pq, impl=kernels, round_p=round_trips)
    return attention_output(p, o, cos, sin, cfg, round_trips)


def select_entries(scores: jax.Array, visible: jax.Array, k: int, candidates: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """Top-k visible entries per query (dsjax/layers/candidate_selection.py's rule), sorted
    ascending -> (idx [B, S, k] (0 where invalid), valid [B, S, k])."""
    top = topk_entry_list(scores, visible, k, 0, candidates)
    return jnp.maximum(top, 0), top >= 0


# ----------------------------------------------------------------------------- full sequence
def shared_attention_forward(p: SharedAttention, x: jax.Array, positions: jax.Array, layer: LayerSpec,
                             cfg: ModelConfig, shared: Shared | None, *, kernels: str = "reference",
                             round_trips: bool = False) -> tuple[jax.Array, Shared | None]:
    """Full-sequence V4.1 attention (no cache) over x [B, S, D] (normed) at positions [B, S]
    from 0: the window, plus (compressed layers) the top-k latents of its KV source. A KV
    source compresses and publishes its latents and index keys, an index source its top-k
    (a candidate source also its blocks; a restricted one masks its scores by them), in
    `shared`, which consumers read. round_trips: the reference's FP8 / FP4 round trips of the
    window rows, latents, index keys and queries and its bf16 index scores (§2.3-2.6).
    -> (out [B, S, D], shared)."""
    cq, q, kv, cos, sin = project_q_kv(p, x, positions, layer, cfg, round_trips)
    lo, hi = window_intervals(positions, jnp.ones(positions.shape, bool), cfg.sliding_window)
    r = layer.compress_ratio
    reads = r and shared is not None and shared.entries.shape[1] > 0
    if reads:
        b, n = x.shape[0], shared.entries.shape[1]
        if layer.has_compressor:
            latents = compress_latents(p.compressor, x, r, cfg.rms_norm_eps, round_trips)
            entries, keys = latent_rows(p, latents, entry_indices(b, n), r, cfg, round_trips)
            shared = shared.replace(entries=entries, **({} if keys is None else {"index_keys": keys}))
        if layer.has_indexer:
            shared = index_select(p, layer, cq, x, shared, compressed_visible(positions, n, r), cos, sin, cfg,
                                  kernels, round_trips)
    out = attend_and_project(p, q, kv, lo, hi, positions, shared if reads else None, cos, sin, cfg, kernels,
                             round_trips)
    return out, shared


# ----------------------------------------------------------------------------- cached state
@struct.dataclass
class SharedAttentionState:
    """One V4.1 layer's cache (spec §2.12): every layer's window ring; a KV source's
    compressed latents (and index keys) that its consumers read, and the fp32 projections
    of its recent tokens (ratio 2; token t in slot t % TAIL_SLOTS). The reference keeps r
    slots; TAIL_SLOTS >= a verification's width keeps every slot written at most once per
    step, so speculative rollback can put back the rows a rejected position wrote."""

    window: jax.Array  # [B, W, hd]
    entries: jax.Array | None = None  # [B, capacity // r, hd]   KV sources
    index_keys: jax.Array | None = None  # [B, capacity // r, d_I]   KV sources with index keys
    tail_kv: jax.Array | None = None  # [B, TAIL_SLOTS, hd] fp32   KV sources with r > 1
    tail_gate: jax.Array | None = None  # [B, TAIL_SLOTS, hd] fp32

    def written_rows(self, ratio: int, positions: jax.Array) -> "SharedAttentionState":
        """Per field, the row index [B, n] an extend over `positions` may write: window and tail
        slots, a KV source's latent / index-key entry (position // ratio). Speculative rollback
        saves and restores these rows."""
        def rows(leaf, idx):
            return None if leaf is None else idx
        entry = positions // max(ratio, 1)
        tail = None if self.tail_kv is None else positions % self.tail_kv.shape[-2]
        return SharedAttentionState(window=positions % self.window.shape[-2], entries=rows(self.entries, entry),
                                    index_keys=rows(self.index_keys, entry), tail_kv=tail, tail_gate=tail)


TAIL_SLOTS = 8  # a multiple of every ratio > 1 (2) and >= DSpark's verification width (block + 1 = 6)


def shared_attention_state_shapes(cfg: ModelConfig, layer: LayerSpec, batch: int, capacity: int,
                                  dtype) -> SharedAttentionState:
    hd, r = cfg.head_dim, layer.compress_ratio
    shape = jax.ShapeDtypeStruct
    entries = keys = tail_kv = tail_gate = None
    if layer.has_compressor:
        entries = shape((batch, capacity // r, hd), dtype)
        if layer.has_index_keys:
            keys = shape((batch, capacity // r, cfg.index_head_dim), dtype)
        if r > 1:
            if TAIL_SLOTS % r:
                raise ValueError(f"layer {layer.index}: ratio {r} does not divide the {TAIL_SLOTS} tail slots")
            tail_kv = tail_gate = shape((batch, TAIL_SLOTS, hd), jnp.float32)
    return SharedAttentionState(shape((batch, cfg.sliding_window, hd), dtype), entries, keys, tail_kv, tail_gate)


# ----------------------------------------------------------------------------- cached path
def latents_extend(p: LatentCompressor, state: SharedAttentionState, x: jax.Array, start: jax.Array,
                   n_valid: jax.Array, ratio: int, eps: float, at: jax.Array | None = None, round_trips: bool = False):
    """A KV source's compressor over a chunk x [B, C, D] at positions start + i, i < n_valid:
    -> (latents [B, G, hd] before RoPE, their entry indices [B, G], complete [B, G], new
    tail_kv, new tail_gate). Ratio 2 pools the groups the chunk closes, reading the open
    group's first token from the fp32 tail (slot p % TAIL_SLOTS) (§2.4)."""
    b, c, _ = x.shape
    positions = start[:, None] + jnp.arange(c)
    valid = jnp.arange(c) < n_valid[:, None]
    if ratio == 1:
        return rms_norm(linear(x, p.kv_proj), p.norm, eps), positions, valid, None, None
    a_new, z_new = linear_f32(x, p.kv_proj), linear_f32(x, p.gate_proj)  # [B, C, hd] fp32
    g0 = (start // ratio) * ratio  # the first group the chunk can close
    n_groups = -(-(ratio - 1 + c) // ratio)
    pos = g0[:, None] + jnp.arange(n_groups * ratio)
    from_chunk = pos >= start[:, None]
    chunk_idx = jnp.clip(pos - start[:, None], 0, c - 1)[..., None]
    tail_kv, tail_gate = state_rows(state.tail_kv, at), state_rows(state.tail_gate, at)
    slots = tail_kv.shape[-2]
    tail_idx = jnp.mod(pos, slots)[..., None]

    def aligned(new, tail):
        got = jnp.where(from_chunk[..., None], jnp.take_along_axis(new, chunk_idx, axis=1),
                        jnp.take_along_axis(tail, tail_idx, axis=1))
        return reshape(got, (b, n_groups, ratio, -1))
    a, z = aligned(a_new, tail_kv), aligned(z_new, tail_gate)
    latents = rms_norm(pool_group(a, z, x.dtype, round_trips), p.norm, eps)
    entry = (start // ratio)[:, None] + jnp.arange(n_groups)
    complete = (entry + 1) * ratio <= (start + n_valid)[:, None]
    keep = valid & (positions >= (start + n_valid)[:, None] - slots)  # a chunk's last `slots` tokens
    slot = jnp.where(keep, jnp.mod(positions, slots), slots)
    rows = jnp.arange(b)[:, None]
    return (latents, entry, complete, state_set(state.tail_kv, at, rows, slot, a_new),
            state_set(state.tail_gate, at, rows, slot, z_new))


def shared_attention_extend(p: SharedAttention, state: SharedAttentionState, x: jax.Array, start: jax.Array,
                            n_valid: jax.Array, layer: LayerSpec, cfg: ModelConfig, shared: Shared | None,
                            n_entries: int, *, quirk_keys: jax.Array | None = None, kernels: str = "reference",
                            round_trips: bool = False, at: jax.Array | None = None
                            ) -> tuple[jax.Array, SharedAttentionState, Shared | None]:
    """V4.1 attention for a chunk x [B, C, D] at positions start + i, i < n_valid (per row),
    against the cache: the window ring and chunk, plus (compressed layers) the top-k of its
    KV source's first n_entries (static) latents. A KV source first appends the latents
    (and index keys) of the groups the chunk closes to its own state and publishes them in
    `shared`, as the full-sequence path does.

    quirk_keys [B, >= n_entries, d_I] (ratio-2 index sources, the reference's behaviour,
    §2.7): the index keys the last KV source published before this chunk. A row at an even
    position whose source closes no group scores against them instead of its own, as a
    one-token decode of the reference does; rows of a chunk starting at 0 (the reference's
    prefill) and rows whose keys are not cached yet (t / 2 > start) use their own: a chunk
    starting at s > 0 equals one-token decodes up to position 2 s + 1 only
    (`dsjax.model.v41.family.reference_key_rule`; the engine keeps its chunks within that).
    -> (out [B, C, D], state, shared)."""
    b, c, _ = x.shape
    w, r = cfg.sliding_window, layer.compress_ratio
    positions = start[:, None] + jnp.arange(c)
    valid = jnp.arange(c) < n_valid[:, None]
    cq, q, kv, cos, sin = project_q_kv(p, x, positions, layer, cfg, round_trips)
    keys, lo, hi, window = window_extend(state.window, kv, start, n_valid, at, w)
    state = state.replace(window=window)
    rows = jnp.arange(b)[:, None]
    if r and layer.has_compressor:
        latents, entry, complete, tail_kv, tail_gate = latents_extend(p.compressor, state, x, start, n_valid, r,
                                                                      cfg.rms_norm_eps, at, round_trips)
        entries, index_keys = latent_rows(p, latents, entry, r, cfg, round_trips)
        where = jnp.where(complete, entry, state.entries.shape[-2])
        state = state.replace(tail_kv=tail_kv, tail_gate=tail_gate,
                              entries=state_set(state.entries, at, rows, where, entries))
        shared = shared.replace(entries=state_rows(state.entries, at)[:, :n_entries])
        if index_keys is not None:
            state = state.replace(index_keys=state_set(state.index_keys, at, rows, where, index_keys))
            shared = shared.replace(index_keys=state_rows(state.index_keys, at)[:, :n_entries])
    if r and layer.has_indexer:
        visible = compressed_visible(positions, n_entries, r) & valid[..., None]
        alt = use_alt = None
        if quirk_keys is not None and r > 1:
            alt = quirk_keys[:, :n_entries]
            use_alt = (positions % r != r - 1) & (start[:, None] > 0) & (positions // r <= start[:, None])
        shared = index_select(p, layer, cq, x, shared, visible, cos, sin, cfg, kernels, round_trips, alt, use_alt)
    out = attend_and_project(p, q, keys, lo, hi, positions, shared if r else None, cos, sin, cfg, kernels,
                             round_trips)
    return out, state, shared
