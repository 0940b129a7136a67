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

from dsjax.config import ModelConfig
from dsjax.layers.attention import AttentionState, attention_extend, attention_forward, attention_state_shapes
from dsjax.layers.hyper_connection import head_collapse
from dsjax.layers.linear import linear
from dsjax.layers.norms import rms_norm
from dsjax.model import ModelParams, MTPParams, block_apply, mtp_layer


def mtp_inputs(mtp: MTPParams, main: ModelParams, streams: jax.Array, next_tokens: jax.Array,
               cfg: ModelConfig) -> jax.Array:
    """streams [B, S, N, D] (main state at t), next_tokens [B, S] (x_{t+1}) -> [B, S, N, D]."""
    e = linear(rms_norm(main.embed[next_tokens], mtp.enorm, cfg.rms_norm_eps), mtp.e_proj)
    h = linear(rms_norm(streams, mtp.hnorm, cfg.rms_norm_eps), mtp.h_proj)
    return (e[:, :, None, :] + h).astype(streams.dtype)


def mtp_head(mtp: MTPParams, main: ModelParams, out: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The MTP block's output streams -> logits [..., V] (fp32) through the shared head."""
    h = rms_norm(head_collapse(mtp.hc_head, out, cfg), mtp.norm, cfg.rms_norm_eps)
    head = main.embed if main.lm_head is None else main.lm_head
    return linear(h, head, out_dtype=jnp.float32)


def mtp_forward(mtp: MTPParams, main: ModelParams, streams: jax.Array, next_tokens: jax.Array,
                cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Full sequence (training, checks): -> (logits [B, S, V], output streams [B, S, N, D])."""
    b, s = next_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    layer = mtp_layer(cfg)
    x = mtp_inputs(mtp, main, streams, next_tokens, cfg)
    out, _ = block_apply(mtp.block, x, next_tokens,
                         lambda a, h: (attention_forward(a, h, positions, layer, cfg), None), cfg)
    return mtp_head(mtp, main, out, cfg), out


def mtp_state_shapes(cfg: ModelConfig, batch: int, dtype) -> AttentionState:
    """The MTP layer's cache: one window ring."""
    return attention_state_shapes(cfg, mtp_layer(cfg), batch, cfg.sliding_window, dtype)


def mtp_extend(mtp: MTPParams, main: ModelParams, state: AttentionState, streams: jax.Array,
               next_tokens: jax.Array, start: jax.Array, n_valid: jax.Array, cfg: ModelConfig):
    """A chunk through the MTP layer against its ring: streams [B, C, N, D] at positions
    start + i (i < n_valid), next_tokens [B, C] -> (out streams [B, C, N, D], state); the
    caller applies `mtp_head` where it needs logits."""
    layer = mtp_layer(cfg)
    x = mtp_inputs(mtp, main, streams, next_tokens, cfg)
    return block_apply(mtp.block, x, next_tokens,
                       lambda a, h: attention_extend(a, state, h, start, n_valid, layer, cfg, 0), cfg)
