"""The DeepSeek-V4 decoder as pure functions over a parameter pytree.

    X      = [E[id]] * N                                   # [B, S, N, D] mHC streams
    block  : X = expand(attn(Norm(collapse(X))), X);  X = expand(moe(Norm(collapse(X))), X)
    logits = W_head Norm(head_collapse(X))

`forward` is the full-sequence path (no cache). The engine's incremental path is checked
against it, and it is checked against HF transformers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import SLIDING, TOPK_MOE, LayerSpec, ModelConfig
from dsjax.layers.attention import Attention, attention_forward, attention_specs
from dsjax.layers.hyper_connection import (HyperConnection, HyperHead, collapse, expand, hc_mixes,
                                           head_collapse, hyper_connection_specs, hyper_head_specs)
from dsjax.layers.linear import linear
from dsjax.layers.moe import MoE, moe_forward, moe_specs
from dsjax.layers.norms import rms_norm
from dsjax.params import ParamSpec
from dsjax.sharding.rules import spec


@struct.dataclass
class Block:
    attn_hc: HyperConnection
    attn_norm: jax.Array  # [D] fp32
    attn: Attention
    ffn_hc: HyperConnection
    ffn_norm: jax.Array  # [D] fp32
    moe: MoE


@struct.dataclass
class ModelParams:
    embed: jax.Array  # [V, D]
    blocks: tuple[Block, ...]
    hc_head: HyperHead
    norm: jax.Array  # [D] fp32
    lm_head: jax.Array | None  # [V, D]; None when tied to embed


@struct.dataclass
class MTPParams:
    """The next-token-prediction layer (`mtp.0.*`): the speculative drafter."""

    e_proj: jax.Array  # [D, D]
    h_proj: jax.Array  # [D, D]
    enorm: jax.Array  # [D] fp32
    hnorm: jax.Array  # [D] fp32
    block: Block  # window-only attention, top-k MoE
    hc_head: HyperHead
    norm: jax.Array  # [D] fp32


def _norm_spec(cfg: ModelConfig) -> ParamSpec:
    return ParamSpec((cfg.hidden_size,), jnp.float32, (None,), init="ones")


def block_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> Block:
    return Block(
        attn_hc=hyper_connection_specs(cfg), attn_norm=_norm_spec(cfg), attn=attention_specs(cfg, layer, dtype),
        ffn_hc=hyper_connection_specs(cfg), ffn_norm=_norm_spec(cfg), moe=moe_specs(cfg, layer, dtype))


def model_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> ModelParams:
    v, d = cfg.vocab_size, cfg.hidden_size
    return ModelParams(
        embed=ParamSpec((v, d), dtype, ("vocab", "embed")),
        blocks=tuple(block_specs(cfg, layer, dtype) for layer in cfg.layers),
        hc_head=hyper_head_specs(cfg),
        norm=_norm_spec(cfg),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), dtype, ("vocab", "embed")),
    )


def mtp_layer(cfg: ModelConfig) -> LayerSpec:
    """The MTP block: window-only attention, bias-routed (top-k) MoE."""
    return LayerSpec(cfg.num_hidden_layers, SLIDING, 0, TOPK_MOE)


def mtp_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> MTPParams:
    d = cfg.hidden_size
    layer = mtp_layer(cfg)
    return MTPParams(
        e_proj=ParamSpec((d, d), dtype, ("embed_out", "embed")),
        h_proj=ParamSpec((d, d), dtype, ("embed_out", "embed")),
        enorm=_norm_spec(cfg), hnorm=_norm_spec(cfg), block=block_specs(cfg, layer, dtype),
        hc_head=hyper_head_specs(cfg), norm=_norm_spec(cfg))


# ----------------------------------------------------------------------------- forward
def embed_streams(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """token_ids [B, S] -> X [B, S, N, D]: the embedding copied to the N streams."""
    rows = spec("batch", None, None)
    e = params.embed[token_ids] if rows is None else params.embed.at[token_ids].get(out_sharding=rows)
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], cfg.hc_mult, e.shape[-1]))


def block_apply(p: Block, streams: jax.Array, token_ids: jax.Array, attend, cfg: ModelConfig):
    """One decoder block around any attention implementation `attend(p.attn, h) -> (out, aux)`
    (full-sequence or cached); returns (streams, aux)."""
    pre, post, comb = hc_mixes(p.attn_hc, streams, cfg)
    h = rms_norm(collapse(streams, pre), p.attn_norm, cfg.rms_norm_eps)
    out, aux = attend(p.attn, h)
    streams = expand(out, streams, post, comb)
    pre, post, comb = hc_mixes(p.ffn_hc, streams, cfg)
    h = rms_norm(collapse(streams, pre), p.ffn_norm, cfg.rms_norm_eps)
    return expand(moe_forward(p.moe, h, token_ids, cfg, kernels=cfg.kernels,
                              capacity_factor=cfg.moe_capacity_factor), streams, post, comb), aux


def block_forward(p: Block, streams: jax.Array, token_ids: jax.Array, positions: jax.Array,
                  layer: LayerSpec, cfg: ModelConfig) -> jax.Array:
    """Full-sequence block (no cache)."""
    return block_apply(p, streams, token_ids,
                       lambda a, h: (attention_forward(a, h, positions, layer, cfg), None), cfg)[0]


def head_logits(params: ModelParams, streams: jax.Array, cfg: ModelConfig) -> jax.Array:
    """N streams [..., N, D] -> logits [..., V] in fp32."""
    h = rms_norm(head_collapse(params.hc_head, streams, cfg), params.norm, cfg.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    logits = linear(h, head, out_dtype=jnp.float32)  # vocab-parallel under a mesh
    out = spec("batch", *([None] * (logits.ndim - 1)))
    return logits if out is None else jax.sharding.reshard(logits, out)  # gather the vocabulary


def forward_streams(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Full-sequence forward to the final N-stream state [B, S, N, D] (before the head)."""
    b, s = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    streams = embed_streams(params, token_ids, cfg)
    for layer, block in zip(cfg.layers, params.blocks):
        streams = block_forward(block, streams, token_ids, positions, layer, cfg)
    return streams


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """token_ids [B, S] int32 -> logits [B, S, V] fp32 (full causal forward, no cache)."""
    return head_logits(params, forward_streams(params, token_ids, cfg), cfg)
