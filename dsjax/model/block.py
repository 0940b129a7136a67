"""The decoder block both generations stack, and where a layer lives in the stacked layout.

    X = [E[id]] * N                                               # [B, S, N, D] mHC streams
    block: X = expand(attn(Norm(collapse(X, a))), X);  X = expand(moe(Norm(collapse(X, f))), X)

Each sublayer's mHC mixes (pre, post, comb) come from its own input. DeepSeek-V4 collapses
a sublayer's input with its own `pre` (a = pre_attn, f = pre_ffn); V4.1 lags the collapse
by one sublayer (spec deepseek-v41.md §3.2: a = the previous FFN's pre, f = pre_attn).
`block_apply` is that block for both, the lag a parameter; the attention inside is a call
the generation passes (V4's `layers/attention.py`, V4.1's shared-KV attention).

The layers run as the config's layer plan (`cfg.layer_runs`): each run's period of blocks is
stored with a leading [repeats] axis ([repeats * inner] for V4.1's runs of alike layers),
so a compiled program holds one period per run instead of every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers.attention import AttentionProjections
from dsjax.layers.hyper_connection import HyperConnection, expand, sublayer_input
from dsjax.layers.moe import MoE, moe_forward
from dsjax.layers.taps import tap
from dsjax.params import ParamSpec
from dsjax.sharding.rules import lookup

DEFAULT_OPTIONS = RuntimeOptions()
INVARIANT_ROWS = 8  # rows per batch-invariant tile (see `dsjax.model.forward`)


@struct.dataclass
class Block:
    attn_hc: HyperConnection
    attn_norm: jax.Array  # [D] fp32
    attn: AttentionProjections  # the generation's attention (V4: `Attention`; V4.1: `SharedAttention`)
    ffn_hc: HyperConnection
    ffn_norm: jax.Array  # [D] fp32
    moe: MoE


@struct.dataclass
class LayerByLayer:
    """A layer run's blocks as one pytree per layer (leaves without the [repeats] axis),
    applied unrolled (`dsjax.model.v4.decoder.one_row_params`; benchmarks/layer_layout.py)."""

    layers: tuple  # per repeat: the period's tuple[Block, ...]


def norm_spec(cfg: ModelConfig) -> ParamSpec:
    return ParamSpec((cfg.hidden_size,), jnp.float32, (None,), init="ones")


def layer_slot(cfg: ModelConfig, i: int) -> tuple[int, int, int]:
    """Where layer i lives in the stacked layout: (run, period position, index along that
    position's stacked axis)."""
    for k, run in enumerate(cfg.layer_runs):
        found = run.slot(i)
        if found is not None:
            return (k, *found)
    raise IndexError(f"layer {i} outside the {cfg.num_hidden_layers} layers of {cfg.name}")


def layer_block(params, cfg: ModelConfig, i: int) -> Block:
    """Layer i's block (its slice of the stacked weights), for inspection and tests."""
    k, j, r = layer_slot(cfg, i)
    if isinstance(params.blocks[k], LayerByLayer):
        return params.blocks[k].layers[r][j]
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct)
                        else a[r], params.blocks[k][j])


@jax.named_scope("embedding")  # a profile's op group (benchmarks/decode_trace.py)
def embed_streams(params, token_ids: jax.Array, cfg: ModelConfig, opts: RuntimeOptions = DEFAULT_OPTIONS) -> jax.Array:
    """token_ids [B, S] -> X [B, S, N, D]: the embedding (`params.embed`) copied to the N
    streams, in opts.compute_dtype (16-bit weights, fp32 activations) or the embedding's dtype."""
    e = lookup(params.embed, token_ids)
    if opts.compute_dtype is not None:
        e = e.astype(opts.compute_dtype)
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], cfg.hc_mult, e.shape[-1]))


def block_apply(p: Block, streams: jax.Array, token_ids: jax.Array, attend, cfg: ModelConfig,
                opts: RuntimeOptions = DEFAULT_OPTIONS, expert_layer: jax.Array | None = None, *,
                pi: jax.Array | None = None, rows: int | None = None, fp8_acts: bool = False):
    """One block around an attention call `attend(p.attn, h) -> (out, state)` (full-sequence or
    cached) over streams [B, S, N, D] -> (streams, the FFN's pre [B, S, N] fp32, state).
    pi None: each sublayer collapses with its own pre (V4). pi [B, S, N]: V4.1's lag, the
    attention collapses with pi and the FFN with the attention's pre; the FFN's pre returned
    is the next block's pi.
    expert_layer: p.moe's routed-expert weights and p's mHC mixes (attn_hc, ffn_hc) are still
    stacked over the layer run and this is layer `expert_layer`. rows, fp8_acts: `moe_forward`'s
    (batch-invariant tiles; V4.1's FP8 activations)."""
    streams = tap("mhc.streams_in", streams)  # `tap`: a named point for dsjax.inspect (inert otherwise)
    # each sublayer's mixes, collapse and norm (one library call in a decode step on XLA:CPU)
    h, a_pre, a_post, a_comb = sublayer_input(p.attn_hc, p.attn_norm, streams, cfg, pi, expert_layer, "attn_hc")
    out, state = attend(p.attn, h)
    streams = tap("mhc.streams_mid", expand(tap("attn.out", out), streams, a_post, a_comb))
    h, f_pre, f_post, f_comb = sublayer_input(p.ffn_hc, p.ffn_norm, streams, cfg, None if pi is None else a_pre,
                                              expert_layer, "ffn_hc")
    h = tap("moe.in", h)
    y = moe_forward(p.moe, h, token_ids, cfg, kernels=opts.kernels, capacity_factor=opts.moe_capacity_factor,
                    layer=expert_layer, rows=rows, fp8_acts=fp8_acts, ep_dispatch=opts.ep_dispatch)
    return tap("mhc.streams_out", expand(tap("moe.out", y), streams, f_post, f_comb)), f_pre, state
