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
from dsjax.params import ParamSpec


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
class SharedAttention:
    q_a_proj: jax.Array  # [r_q, D]
    q_a_norm: jax.Array  # [r_q] fp32
    q_b_proj: jax.Array  # [H * hd, r_q]
    kv_proj: jax.Array  # [hd, D]
    kv_norm: jax.Array  # [hd] fp32
    o_a_proj: jax.Array  # [G * r_o, H * hd / G]
    o_b_proj: jax.Array  # [D, G * r_o]
    sinks: jax.Array  # [H] fp32
    compressor: LatentCompressor | None = None  # KV sources
    index_keys: IndexKeys | None = None  # KV sources that are index sources
    index_queries: IndexQueries | None = None  # index sources


def shared_attention_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> SharedAttention:
    h, hd, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
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
    return SharedAttention(
        q_a_proj=ParamSpec((cfg.q_lora_rank, d), dtype, ("q_lora", "embed")),
        q_a_norm=ParamSpec((cfg.q_lora_rank,), f32, (None,), init="ones"),
        q_b_proj=ParamSpec((h * hd, cfg.q_lora_rank), dtype, ("q_heads", "q_lora")),
        kv_proj=ParamSpec((hd, d), dtype, ("head_dim", "embed")),
        kv_norm=ParamSpec((hd,), f32, (None,), init="ones"),
        o_a_proj=ParamSpec((cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), dtype,
                           ("o_groups", "o_group_in")),
        o_b_proj=ParamSpec((d, cfg.o_groups * cfg.o_lora_rank), dtype, ("embed", "o_groups")),
        sinks=ParamSpec((h,), f32, ("heads",), init="zeros"),
        compressor=compressor, index_keys=index_keys, index_queries=index_queries)


# ----------------------------------------------------------------------------- cached state
@struct.dataclass
class SharedAttentionState:
    """One V4.1 layer's cache (spec §2.12): every layer's window ring; a KV source's
    compressed latents (and index keys) that its consumers read, and the fp32 projections
    of its open group (ratio 2: token t in slot t % 2)."""

    window: jax.Array  # [B, W, hd]
    entries: jax.Array | None = None  # [B, capacity // r, hd]   KV sources
    index_keys: jax.Array | None = None  # [B, capacity // r, d_I]   KV sources with index keys
    tail_kv: jax.Array | None = None  # [B, r, hd] fp32   KV sources with r > 1
    tail_gate: jax.Array | None = None  # [B, r, hd] fp32


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
            tail_kv = tail_gate = shape((batch, r, hd), jnp.float32)
    return SharedAttentionState(shape((batch, cfg.sliding_window, hd), dtype), entries, keys, tail_kv, tail_gate)
