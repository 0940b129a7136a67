"""The DeepSeek-V4 decoder as pure functions over a parameter pytree, with and without a
cache; ONE `forward` (dsjax/model/forward_pass.py) serves `Model.logits`, prefill, decode and
speculative verification.

    X      = [E[id]] * N                                   # [B, S, N, D] mHC streams
    block  : X = expand(attn(Norm(collapse(X))), X);  X = expand(moe(Norm(collapse(X))), X)
    logits = W_head Norm(head_collapse(X))                 # `head_logits`, shared with the MTP drafter

The block is `dsjax.model.block.block_apply` without V4.1's lag, around V4's attention
(dsjax/layers/attention.py). The layers run as the config's layer plan (`cfg.layer_runs`):
each run's period of blocks is stored with a leading [repeats] axis and applied under
`lax.scan`, so a compiled program holds one period per run instead of every layer (V4-Flash:
43 layers -> 5 blocks).

Without a cache the tokens are a whole sequence from position 0 (checked against HF
transformers). With a cache (dsjax/model/cache.py) they are a chunk at positions
cache.length + i, only i < n_valid real, and the cache comes back updated (checked against
the full-sequence path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.config import LayerRun, LayerSpec, ModelConfig, RuntimeOptions
from dsjax.layers.attention import attention_extend, attention_forward, attention_specs
from dsjax.layers.hyper_connection import HyperHead, hyper_connection_specs, hyper_head_specs
from dsjax.layers.linear import whole_weights
from dsjax.layers.moe import moe_specs
from dsjax.layers.quantized import Bf16Weight, take
from dsjax.layers import taps
from dsjax.model.block import (DEFAULT_OPTIONS, INVARIANT_ROWS, Block, LayerByLayer, block_apply, embed_streams,
                               norm_spec)
from dsjax.model.cache import Cache
from dsjax.model.head import (fp32_one_row, head_input, head_logits, last_valid, lm_head_weight, one_row_head,
                              rows_logits)
from dsjax.params import ParamSpec, stack_specs


@struct.dataclass
class ModelParams:
    embed: jax.Array  # [V, D]
    blocks: tuple[tuple[Block, ...], ...]  # per layer run, per period position: leaves [repeats, ...]
    hc_head: HyperHead
    norm: jax.Array  # [D] fp32
    lm_head: jax.Array | None  # [V, D]; None when tied to embed


def block_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> Block:
    return Block(
        attn_hc=hyper_connection_specs(cfg), attn_norm=norm_spec(cfg), attn=attention_specs(cfg, layer, dtype),
        ffn_hc=hyper_connection_specs(cfg), ffn_norm=norm_spec(cfg), moe=moe_specs(cfg, layer, dtype))


def model_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> ModelParams:
    v, d = cfg.vocab_size, cfg.hidden_size
    return ModelParams(
        embed=ParamSpec((v, d), dtype, ("vocab", "embed")),
        blocks=tuple(tuple(stack_specs(block_specs(cfg, layer, dtype), run.repeats) for layer in run.layers)
                     for run in cfg.layer_runs),
        hc_head=hyper_head_specs(cfg),
        norm=norm_spec(cfg),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), dtype, ("vocab", "embed")),
    )


def attention_call(layer: LayerSpec, cfg: ModelConfig, opts: RuntimeOptions, *, positions=None, state=None,
                   start=None, n_valid=None, n_entries: int = 0, at=None):
    """`attend` for `block_apply`: full-sequence at `positions` (state None), or cached
    against the layer's `state` for a chunk at start + i, i < n_valid (`at`: the state is
    a layer run's stacked states, this layer is `at` of them)."""
    if state is None:
        attend = lambda p, h: (attention_forward(p, h, positions, layer, cfg, kernels=opts.kernels), None)  # noqa: E731
    else:
        attend = lambda p, h: attention_extend(p, state, h, start, n_valid, layer, cfg, n_entries,  # noqa: E731
                                               kernels=opts.kernels, at=at)
    return jax.named_scope(layer.attention)(attend)  # a profile's op group (benchmarks/decode_trace.py)


def v4_block(p: Block, streams: jax.Array, token_ids: jax.Array, attend, cfg: ModelConfig,
             opts: RuntimeOptions = DEFAULT_OPTIONS, expert_layer: jax.Array | None = None):
    """One V4 block (`block_apply`, each sublayer collapsing with its own pre; batch-invariant
    mode's MoE in fixed row tiles) -> (streams, attend's state)."""
    streams, _, state = block_apply(p, streams, token_ids, attend, cfg, opts, expert_layer,
                                    rows=INVARIANT_ROWS if opts.batch_invariant else None)
    return streams, state


ONE_ROW_COPY_MAX_BYTES = 1 << 30  # the layer weights a one-row engine copies layer by layer


def one_row_params(params: ModelParams, cfg: ModelConfig, dtype) -> ModelParams:
    """`one_row_head`, and for an fp32 V4 model whose layer weights are plain fp32 (not stored
    16-bit or quantized, at most ONE_ROW_COPY_MAX_BYTES), its scanned layer runs (repeats > 1)
    layer by layer (`LayerByLayer`): each layer's weights are then whole program arguments,
    which a one-row product reads in place through the library matrix-vector product
    (`linear.whole_weights`), where XLA:CPU reads a scanned run's slices in an element-by-element
    loop well below the memory rate (docs/cpu-decode.md, "Layer by layer"). A
    copy of those layers' weights, held by the caller; its programs unroll those runs. A run
    of one layer keeps its [1, ...] leaves (read in place already). Not what an `Engine` runs
    with since the one-row products read a vector of their own (`linear.merge_last_two`):
    the scanned runs then measured faster; benchmarks/layer_layout.py compares the two layouts
    on a machine, since the balance has moved with the machine before."""
    params = one_row_head(params, dtype)
    leaves = jax.tree.leaves(params.blocks)
    if (not fp32_one_row(dtype) or not any(run.repeats > 1 for run in cfg.layer_runs)
            or not all(isinstance(a, jax.Array) and a.dtype in (jnp.float32, jnp.int32) for a in leaves)
            or sum(a.nbytes for a in leaves) > ONE_ROW_COPY_MAX_BYTES):
        return params
    # cut on the host (XLA:CPU arrays): eager `a[r]` would compile a slice program per leaf shape,
    # most of the first engine's set-up time
    layer = lambda tree, r: jax.tree.map(lambda a: jnp.asarray(np.asarray(a)[r]), tree)
    return params.replace(blocks=tuple(
        LayerByLayer(tuple(tuple(layer(block, r) for block in period) for r in range(run.repeats)))
        if run.repeats > 1 else period
        for run, period in zip(cfg.layer_runs, params.blocks)))


def logits_of(params: ModelParams, streams: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The main model's head on final streams [..., N, D] -> [..., V]."""
    return head_logits(params.hc_head, params.norm, lm_head_weight(params), streams, cfg)


# ----------------------------------------------------------------------------- the decoder
def decoder_streams(params: ModelParams, tokens: jax.Array, cfg: ModelConfig, cache: Cache | None = None, *,
                    opts: RuntimeOptions = DEFAULT_OPTIONS, n_valid: jax.Array | None = None,
                    ctx_bucket: int | None = None) -> tuple[jax.Array, Cache | None]:
    """The blocks over tokens [B, S] -> (final streams [B, S, N, D], cache). See `forward`."""
    if cache is None:
        return decoder_streams_probed(params, tokens, cfg, None, opts=opts)[0], None
    b, s = tokens.shape
    streams = embed_streams(params, tokens, cfg, opts)
    start = cache.length
    n_valid = jnp.full((b,), s, jnp.int32) if n_valid is None else n_valid
    states = []
    for run, blocks, period_states in zip(cfg.layer_runs, params.blocks, cache.layers):
        attends = tuple(
            lambda state, at, layer=layer: attention_call(
                layer, cfg, opts, state=state, start=start, n_valid=n_valid, at=at,
                n_entries=ctx_bucket // layer.compress_ratio if layer.compress_ratio else 0)
            for layer in run.layers)
        streams, period_states = _run_apply(run, blocks, period_states, streams, tokens, attends, cfg, opts)
        states.append(period_states)
    return streams, Cache(start + n_valid, tuple(states))


def decoder_streams_probed(params: ModelParams, tokens: jax.Array, cfg: ModelConfig, probe, *,
                           opts: RuntimeOptions = DEFAULT_OPTIONS) -> tuple[jax.Array, tuple]:
    """The full-sequence decoder (no cache) over tokens [B, S] -> (final streams [B, S, N, D],
    probes): `probe(layer, attn_params, h, positions)` is called on every layer's attention
    input h [B, S, D] (normed) and its results come back per layer run and period position,
    stacked over the run's repeats ([R, ...] leaves; None when probe is None). Training reads
    what the forward does not return this way (the Lightning Indexer's distillation loss,
    dsjax/train/objective.py) instead of running a second forward."""
    b, s = tokens.shape
    streams = embed_streams(params, tokens, cfg, opts)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    probes = []
    for run, blocks in zip(cfg.layer_runs, params.blocks):
        attends = tuple(_probed(attention_call(layer, cfg, opts, positions=positions), probe, layer, positions)
                        for layer in run.layers)
        streams, found = _run_apply(run, blocks, None, streams, tokens, attends, cfg, opts)
        probes.append(found)
    return streams, tuple(probes)


def _probed(attend, probe, layer: LayerSpec, positions):
    if probe is None:
        return attend
    return lambda p, h: (attend(p, h)[0], probe(layer, p, h, positions))


def _run_apply(run: LayerRun, blocks: tuple[Block, ...], states, streams, tokens, attends, cfg, opts):
    """One layer run: its period of blocks (leaves [R, ...]) applied R times, under
    `lax.scan` when R > 1. states None: full-sequence (`attends[j]` is the attend call);
    else the period's stacked states ([R, B, ...] leaves), and `attends[j](states, at)`
    gives the attend call of repeat `at` (None: states of one layer). Returns (streams,
    the updated states), or without states what the attend calls returned beside their
    output, per period position stacked [R, ...] (probes; None for a plain forward)."""
    def period(streams, blocks, states, at=None, whole=False):
        new = []
        for j, block in enumerate(blocks):
            attend = attends[j] if states is None else attends[j](states[j], at)
            with taps.layer(run.indices[j], at):  # which layer dsjax.inspect's taps name (inert otherwise)
                if at is None or whole:  # whole: this repeat's own weights (`LayerByLayer`)
                    streams, state = v4_block(block, streams, tokens, attend, cfg, opts)
                else:  # this repeat's slice of the weights; the routed experts are read from the stack
                    moe = block.moe
                    with jax.named_scope("layer_weights"):  # a profile's op group (benchmarks/decode_trace.py)
                        # (a 16-bit weight stays its stack and this index, `take`: the few-row kernel reads it there)
                        per_repeat = block.replace(moe=moe.replace(w1=None, w3=None, w2=None), attn_hc=None, ffn_hc=None)
                        own = jax.tree.map(lambda a: take(a, at), per_repeat, is_leaf=lambda a: isinstance(a, Bf16Weight))
                    # the routed experts and the mHC mixes stay stacked: read at `at` where they lie
                    own = own.replace(moe=own.moe.replace(w1=moe.w1, w3=moe.w3, w2=moe.w2), attn_hc=block.attn_hc,
                                      ffn_hc=block.ffn_hc)
                    streams, state = v4_block(own, streams, tokens, attend, cfg, opts, expert_layer=at)
            new.append(state)
        return streams, tuple(new)

    if isinstance(blocks, LayerByLayer):  # whole weights per layer (`one_row_params`), unrolled
        if states is None:
            raise ValueError("layer-by-layer params (an engine's one-slot step_params) run the cached path only: "
                             "give the full-sequence forward the model's params")
        with whole_weights():
            for r, period_blocks in enumerate(blocks.layers):
                streams, states = period(streams, period_blocks, states, at=r, whole=True)
        return streams, states

    if run.repeats == 1:
        first = lambda tree: jax.tree.map(lambda a: a[0], tree)
        streams, new = period(streams, first(blocks), None if states is None else first(states))
        return streams, jax.tree.map(lambda a: a[None], new)

    body = None

    def step(carry, _):  # stacked states ride in the carry; each layer writes its rows in place
        nonlocal body
        x, sts, r = carry
        with taps.collect() as body:  # dsjax.inspect's captures leave the scan as stacked outputs
            x, new = period(x, blocks, sts, at=r)
        if sts is None:  # full sequence: what the attend calls returned besides their output (probes)
            return (x, None, r + 1), (new, body.values)
        return (x, new, r + 1), (None, body.values)

    (streams, states, _), (found, tapped) = jax.lax.scan(step, (streams, states, jnp.int32(0)), None,
                                                         length=run.repeats)
    taps.release(tapped, body)
    return streams, found if states is None else states


def forward_rows(params: ModelParams, tokens: jax.Array, cfg: ModelConfig, cache: Cache | None, opts: RuntimeOptions,
                 n_valid: jax.Array | None, ctx_bucket: int | None, last_only: bool, hidden: bool):
    """`dsjax.model.forward` for a V4 config over one tile of rows -> (logits fp32, cache);
    hidden: the head's input rows instead of the logits."""
    streams, cache = decoder_streams(params, tokens, cfg, cache, opts=opts, n_valid=n_valid, ctx_bucket=ctx_bucket)
    streams = taps.tap("final.streams", streams)
    taps.optional_tap("final.hidden", lambda: head_input(params.hc_head, params.norm, streams, cfg))
    if last_only:
        streams = last_valid(streams, jnp.full(tokens.shape[:1], tokens.shape[1]) if n_valid is None else n_valid)
    if hidden:
        return head_input(params.hc_head, params.norm, streams, cfg), cache
    return rows_logits(lambda: logits_of(params, streams, cfg), lm_head_weight(params), n_valid, streams.dtype), cache
