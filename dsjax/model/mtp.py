"""The MTP layer (`mtp.0.*`): DeepSeek-V4's next-token-prediction module, used as the
speculative drafter.

At position t it sees the main model's N-stream state X_t (before the head collapse; the
state that predicted x_{t+1}) and the token x_{t+1}, and predicts x_{t+2}:

    X   = e_proj(enorm(E[x_{t+1}]))  (copied to the N streams)  +  h_proj(hnorm(X_t))
    X'  = one V4 block (window-only attention with its own ring, bias-routed MoE)
    p   = softmax(W_head Norm(hc_head(X')))          # its own hc_head and norm, the shared head

For k > 1 drafts it is reused recurrently: its output streams X' stand in for the main
state at the next position, with the token it just drafted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers.attention import AttentionState, attention_state_shapes
from dsjax.layers.hyper_connection import HyperHead, hyper_head_specs
from dsjax.layers.linear import linear
from dsjax.layers.norms import rms_norm
from dsjax.model.decoder import (DEFAULT_OPTIONS, Block, ModelParams, attention_call, block_apply, block_specs,
                                 head_logits, lm_head_weight, norm_spec)
from dsjax.params import ParamSpec
from dsjax.sharding.rules import lookup


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


def mtp_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> MTPParams:
    d = cfg.hidden_size
    return MTPParams(
        e_proj=ParamSpec((d, d), dtype, ("embed_out", "embed")),
        h_proj=ParamSpec((d, d), dtype, ("embed_out", "embed")),
        enorm=norm_spec(cfg), hnorm=norm_spec(cfg), block=block_specs(cfg, cfg.mtp_layer, dtype),
        hc_head=hyper_head_specs(cfg), norm=norm_spec(cfg))


def mtp_inputs(mtp: MTPParams, main: ModelParams, streams: jax.Array, next_tokens: jax.Array,
               cfg: ModelConfig) -> jax.Array:
    """streams [B, S, N, D] (main state at t), next_tokens [B, S] (x_{t+1}) -> [B, S, N, D]."""
    e = linear(rms_norm(lookup(main.embed, next_tokens), mtp.enorm, cfg.rms_norm_eps), mtp.e_proj)
    h = linear(rms_norm(streams, mtp.hnorm, cfg.rms_norm_eps), mtp.h_proj)
    return (e[:, :, None, :] + h).astype(streams.dtype)


def mtp_head(mtp: MTPParams, main: ModelParams, out: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The MTP block's output streams -> logits [..., V] (fp32): its own collapse and norm,
    the main model's vocabulary projection (`head_logits`, shared)."""
    return head_logits(mtp.hc_head, mtp.norm, lm_head_weight(main), out, cfg)


def mtp_forward(mtp: MTPParams, main: ModelParams, streams: jax.Array, next_tokens: jax.Array, cfg: ModelConfig,
                state: AttentionState | None = None, *, start: jax.Array | None = None,
                n_valid: jax.Array | None = None, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """The MTP block on the main state streams [B, S, N, D] and the tokens after them
    [B, S] -> (output streams [B, S, N, D], ring state); `mtp_head` makes logits of them.
    state None: a whole sequence from position 0 (training, checks). With its window ring
    `state`: a chunk at positions start + i, i < n_valid [B]."""
    layer = cfg.mtp_layer
    x = mtp_inputs(mtp, main, streams, next_tokens, cfg)
    if state is None:
        b, s = next_tokens.shape
        attend = attention_call(layer, cfg, opts, positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
    else:
        attend = attention_call(layer, cfg, opts, state=state, start=start, n_valid=n_valid)
    return block_apply(mtp.block, x, next_tokens, attend, cfg, opts)


def mtp_state_shapes(cfg: ModelConfig, batch: int, dtype) -> AttentionState:
    """The MTP layer's cache: one window ring."""
    return attention_state_shapes(cfg, cfg.mtp_layer, batch, cfg.sliding_window, dtype)
