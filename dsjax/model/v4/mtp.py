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
from dsjax.model.block import DEFAULT_OPTIONS, Block, norm_spec
from dsjax.model.cache import Cache
from dsjax.model.head import head_input, head_logits, last_valid, lm_head_weight, rows_logits
from dsjax.model.v4.decoder import ModelParams, attention_call, block_specs, decoder_streams, logits_of, v4_block
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
    return v4_block(mtp.block, x, next_tokens, attend, cfg, opts)


def mtp_state_shapes(cfg: ModelConfig, batch: int, dtype) -> AttentionState:
    """The MTP layer's cache: one window ring."""
    return attention_state_shapes(cfg, cfg.mtp_layer, batch, cfg.sliding_window, dtype)


class MTPDrafter:
    """The MTP layer as the engine's drafter (`dsjax.model.interface.Drafter`). Its state is the
    layer's window ring; the target hands it the final streams of the positions it ran. It
    commits true positions only (the streams of a prompt chunk or of a verify step's kept
    positions), and drafts k tokens by running the layer recurrently on its own output streams
    over a scratch copy of the ring, so nothing it holds needs rolling back."""

    screens_verify = True  # the target's streams collapse to the head's input (`head_input`)

    def init_state(self, cfg: ModelConfig, batch: int, dtype) -> AttentionState:
        return jax.tree.map(lambda sh: jnp.zeros(sh.shape, sh.dtype), mtp_state_shapes(cfg, batch, dtype))

    def target_chunk(self, params: ModelParams, tokens: jax.Array, cfg: ModelConfig, cache: Cache, *,
                     opts: RuntimeOptions, n_valid: jax.Array, ctx_bucket: int, last_only: bool = False,
                     hidden: bool = False):
        """-> (logits fp32 [B, C, V] (last_only: [B, 1, V]; hidden: the head's input [B, C, D]
        instead), the final streams [B, C, N, D], cache)."""
        streams, cache = decoder_streams(params, tokens, cfg, cache, opts=opts, n_valid=n_valid, ctx_bucket=ctx_bucket)
        out = last_valid(streams, n_valid) if last_only else streams
        if hidden:
            return head_input(params.hc_head, params.norm, out, cfg), streams, cache
        return logits_of(params, out, cfg), streams, cache

    def feature_points(self, cfg: ModelConfig) -> tuple[str, ...]:
        return ("final.streams",)

    def features_from(self, found: dict[str, jax.Array], cfg: ModelConfig) -> jax.Array:
        return found["final.streams"]

    def commit(self, mtp: MTPParams, params: ModelParams, state: AttentionState, streams: jax.Array,
               next_tokens: jax.Array, start: jax.Array, n_valid: jax.Array, cfg: ModelConfig,
               opts: RuntimeOptions = DEFAULT_OPTIONS):
        """Positions start .. start+n_valid-1 (streams [B, C, N, D], the tokens after them [B, C])
        into the ring -> (ring, what `draft` starts from: the last output streams and position)."""
        out, state = mtp_forward(mtp, params, streams, next_tokens, cfg, state, start=start, n_valid=n_valid,
                                 opts=opts)
        h = last_valid(out, n_valid)  # [B, 1, N, D]
        pos = start + jnp.maximum(n_valid - 1, 0)  # the position the MTP step just ran at; it predicts pos + 2
        return state, (h, pos, n_valid)

    def draft(self, mtp: MTPParams, params: ModelParams, state: AttentionState, context, cfg: ModelConfig,
              opts: RuntimeOptions = DEFAULT_OPTIONS, *, k: int, sampler, vocab=None):
        """k drafts from `commit`'s context -> (tokens [B, k], q [B, k, V] or None, confidence
        [B, k] or None), each drawn by `sampler.choose`. vocab (ids [|D|], head rows [|D|, D]):
        score only those ids; q leaves scattered into the full vocabulary."""
        h, pos, n_valid = context

        def draft_one(h, pos):
            if vocab is None:
                head, weight = lambda: mtp_head(mtp, params, h, cfg)[:, 0], lm_head_weight(params)  # [B, V]
                full_id = lambda j: j  # noqa: E731
            else:
                head, weight = lambda: head_logits(mtp.hc_head, mtp.norm, vocab.head, h, cfg)[:, 0], vocab.head
                full_id = lambda j: vocab.ids[j]  # noqa: E731
            logits = rows_logits(head, weight, n_valid, h.dtype)  # a 16-bit head read in place in the draft loop too
            j, q, conf = sampler.choose(logits, pos + 2)
            out = {}
            if q is not None:  # with a draft vocabulary, scattered into the full one
                out["q"] = q if vocab is None else \
                    jnp.zeros((q.shape[0], cfg.vocab_size), q.dtype).at[:, vocab.ids].set(q)
            if conf is not None:
                out["confidence"] = conf
            return full_id(j), out

        def one(carry, _):  # the layer again, on its own output streams and the draft it just made
            h, scratch, pos, d = carry
            h, scratch = mtp_forward(mtp, params, h, d[:, None], cfg, scratch, start=pos + 1,
                                     n_valid=jnp.ones_like(pos), opts=opts)
            d, out = draft_one(h, pos + 1)
            return (h, scratch, pos + 1, d), (d, out)

        first, first_out = draft_one(h, pos)
        _, (rest, rest_out) = jax.lax.scan(one, (h, state, pos, first), None, length=k - 1)
        stack = lambda a, b: jnp.concatenate([a[:, None], jnp.moveaxis(b, 0, 1)], axis=1)  # noqa: E731  [B, K, ...]
        return (stack(first, rest), stack(first_out["q"], rest_out["q"]) if "q" in first_out else None,
                stack(first_out["confidence"], rest_out["confidence"]) if "confidence" in first_out else None)
