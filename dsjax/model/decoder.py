"""The DeepSeek-V4 decoder as pure functions over a parameter pytree, with and without a
cache; ONE `forward` (dsjax/model/forward_pass.py) serves `Model.logits`, prefill, decode and
speculative verification.

    X      = [E[id]] * N                                   # [B, S, N, D] mHC streams
    block  : X = expand(attn(Norm(collapse(X))), X);  X = expand(moe(Norm(collapse(X))), X)
    logits = W_head Norm(head_collapse(X))                 # `head_logits`, shared with the MTP drafter

The layers run as the config's layer plan (`cfg.layer_runs`): each run's period of blocks
is stored with a leading [repeats] axis and applied under `lax.scan`, so a compiled program
holds one period per run instead of every layer (V4-Flash: 43 layers -> 5 blocks).

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
from dsjax.layers.attention import Attention, attention_extend, attention_forward, attention_specs
from dsjax.layers.hyper_connection import (HyperConnection, HyperHead, collapse, expand, hc_mixes,
                                           head_collapse, hyper_connection_specs, hyper_head_specs)
from dsjax.kernels import cpu as cpu_kernels
from dsjax.layers.linear import few_rows, linear, whole_weights
from dsjax.kernels.cpu import PackedHead
from dsjax.layers.quantized import ColumnMajor
from dsjax.layers.moe import MoE, moe_forward, moe_specs
from dsjax.layers.norms import rms_norm
from dsjax.model.cache import Cache
from dsjax.params import ParamSpec, stack_specs
from dsjax.sharding.rules import current_mesh, lookup, spec

DEFAULT_OPTIONS = RuntimeOptions()


@struct.dataclass
class Block:
    attn_hc: HyperConnection
    attn_norm: jax.Array  # [D] fp32
    attn: Attention
    ffn_hc: HyperConnection
    ffn_norm: jax.Array  # [D] fp32
    moe: MoE


@struct.dataclass
class LayerByLayer:
    """A layer run's blocks as one pytree per layer (leaves without the [repeats] axis),
    applied unrolled (`one_row_params`; benchmarks/layer_layout.py)."""

    layers: tuple  # per repeat: the period's tuple[Block, ...]


@struct.dataclass
class ModelParams:
    embed: jax.Array  # [V, D]
    blocks: tuple[tuple[Block, ...], ...]  # per layer run, per period position: leaves [repeats, ...]
    hc_head: HyperHead
    norm: jax.Array  # [D] fp32
    lm_head: jax.Array | None  # [V, D]; None when tied to embed


def norm_spec(cfg: ModelConfig) -> ParamSpec:
    return ParamSpec((cfg.hidden_size,), jnp.float32, (None,), init="ones")


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


def layer_slot(cfg: ModelConfig, i: int) -> tuple[int, int, int]:
    """Where layer i lives in the stacked layout: (run, period position, index along that
    position's stacked axis)."""
    for k, run in enumerate(cfg.layer_runs):
        found = run.slot(i)
        if found is not None:
            return (k, *found)
    raise IndexError(f"layer {i} outside the {cfg.num_hidden_layers} layers of {cfg.name}")


def layer_block(params: ModelParams, cfg: ModelConfig, i: int) -> Block:
    """Layer i's block (its slice of the stacked weights), for inspection and tests."""
    k, j, r = layer_slot(cfg, i)
    if isinstance(params.blocks[k], LayerByLayer):
        return params.blocks[k].layers[r][j]
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct)
                        else a[r], params.blocks[k][j])


# ----------------------------------------------------------------------------- pieces
@jax.named_scope("embedding")  # a profile's op group (benchmarks/decode_trace.py)
def embed_streams(params: ModelParams, token_ids: jax.Array, cfg: ModelConfig,
                  opts: RuntimeOptions = DEFAULT_OPTIONS) -> jax.Array:
    """token_ids [B, S] -> X [B, S, N, D]: the embedding copied to the N streams, in
    opts.compute_dtype (16-bit weights, fp32 activations) or the embedding's dtype."""
    e = lookup(params.embed, token_ids)
    if opts.compute_dtype is not None:
        e = e.astype(opts.compute_dtype)
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], cfg.hc_mult, e.shape[-1]))


def block_apply(p: Block, streams: jax.Array, token_ids: jax.Array, attend, cfg: ModelConfig,
                opts: RuntimeOptions = DEFAULT_OPTIONS, expert_layer: jax.Array | None = None):
    """One decoder block around an attention call `attend(p.attn, h) -> (out, state)`
    (full-sequence or cached); returns (streams, state). expert_layer: p.moe's routed-expert
    weights are still stacked over the layer run and this is layer `expert_layer`."""
    pre, post, comb = hc_mixes(p.attn_hc, streams, cfg)
    with jax.named_scope("mhc"):  # the sublayer's input norm counts with its collapse in a profile
        h = rms_norm(collapse(streams, pre), p.attn_norm, cfg.rms_norm_eps)
    out, state = attend(p.attn, h)
    streams = expand(out, streams, post, comb)
    pre, post, comb = hc_mixes(p.ffn_hc, streams, cfg)
    with jax.named_scope("mhc"):
        h = rms_norm(collapse(streams, pre), p.ffn_norm, cfg.rms_norm_eps)
    y = moe_forward(p.moe, h, token_ids, cfg, kernels=opts.kernels, capacity_factor=opts.moe_capacity_factor,
                    layer=expert_layer, rows=INVARIANT_ROWS if opts.batch_invariant else None)
    return expand(y, streams, post, comb), state


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


def lm_head_weight(params: ModelParams) -> jax.Array:
    return params.embed if params.lm_head is None else params.lm_head


COLUMN_HEAD_MAX_IN = 1024  # the hidden sizes measured faster with the head transposed: 128..1024


def one_row_head(params: ModelParams, dtype) -> ModelParams:
    """The params a one-row decode on XLA:CPU (one device, not batch-invariant: the caller
    says so) runs with: a float32 head (its own, or the tied embedding's copy: the lookup
    keeps `embed`) with a short hidden size kept transposed (`ColumnMajor`), which XLA:CPU
    reads faster at one row: a vector-matrix loop streaming whole rows, against each row
    reduced on its own (docs/cpu-decode.md; benchmarks/head_layout.py). A copy of the head, held by the caller (an
    `Engine`); a bf16 or quantized head, a bf16 model, a wider hidden size and other
    backends keep `params` (a bf16 head transposed is widened whole before the product)."""
    w = lm_head_weight(params)
    if (not _fp32_one_row(dtype) or not isinstance(w, jax.Array) or w.dtype != jnp.float32
            or w.shape[1] > COLUMN_HEAD_MAX_IN):
        return params
    return params.replace(lm_head=ColumnMajor(jnp.transpose(w)))


def cpu_head_params(params, dtype, *, screen: bool = False):
    """The params an engine on one XLA:CPU device (not batch-invariant: the caller says so)
    runs with when the vocabulary-head kernel is built (`dsjax.kernels.cpu`): an fp32
    model's plain fp32 or bf16 head (its own, or the tied embedding's copy: the lookup keeps
    `embed`) packed in tiles (`PackedHead`), which the kernel reads for any row count, faster
    than any form of XLA's product from 2 rows up (docs/cpu-decode.md); at one row XLA's
    product on the transposed head measured a little faster, so a one-slot fp32 engine keeps
    that: `one_row_head`). A copy of the head, held by the caller; else
    `params` (a quantized head, a bf16 model, no kernel). V4 and V4.1 params alike. screen: an
    fp32 head also keeps a bf16 copy and its rows' norms (half its bytes again), from which
    the decode step finds greedy tokens reading half the bytes (`cpu_kernels.greedy_tokens`;
    a bf16 head is its own screen where that saves multiply-adds: `cpu_kernels.pack_head`)."""
    w = lm_head_weight(params)
    if (jnp.dtype(dtype) != jnp.float32 or not isinstance(w, jax.Array)
            or w.dtype not in (jnp.float32, jnp.bfloat16) or not cpu_kernels.available()):
        return params
    return params.replace(lm_head=cpu_kernels.pack_head(w, screen=screen))


def head_dtype(params):
    """The vocabulary head's stored dtype (None for a quantized or other stored head)."""
    w = lm_head_weight(params)
    return w.dtype if isinstance(w, jax.Array) else None


def screens(params) -> bool:
    """Whether `params`' vocabulary head carries a greedy screen (`cpu_kernels.greedy_tokens`)."""
    return isinstance(params.lm_head, PackedHead) and params.lm_head.screen is not None


def step_head_params(params, dtype, *, one_row: bool, screen: bool = False):
    """The head an engine on one XLA:CPU device (not batch-invariant: the caller says so) runs
    its steps with. screen (an engine whose decode steps report no logprobs and verify no
    drafts): an fp32 or bf16 head packed with its greedy screen where it gets one
    (`cpu_head_params`).
    Else at one row the transposed head where `one_row_head` keeps one (XLA's product there
    measured a little faster than the kernel), else the packed head, else `params`."""
    packed = cpu_head_params(params, dtype, screen=True) if screen else None
    if packed is not None and screens(packed):
        return packed
    if one_row:
        transposed = one_row_head(params, dtype)
        if transposed is not params:
            return transposed
    return packed if packed is not None else cpu_head_params(params, dtype)  # (packed without a screen)


def _fp32_one_row(dtype) -> bool:
    """An fp32 model's one-row products on XLA:CPU (`linear`'s decode forms)."""
    return jnp.dtype(dtype) == jnp.float32 and few_rows(1)


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
    if (cfg.v41 is not None or not _fp32_one_row(dtype) or not any(run.repeats > 1 for run in cfg.layer_runs)
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


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def head_input(hc_head: HyperHead, norm: jax.Array, streams: jax.Array, cfg: ModelConfig) -> jax.Array:
    """N streams [..., N, D] -> the vocabulary projection's input [..., D]: collapse, norm."""
    return rms_norm(head_collapse(hc_head, streams, cfg), norm, cfg.rms_norm_eps)


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def head_logits(hc_head: HyperHead, norm: jax.Array, weight: jax.Array, streams: jax.Array,
                cfg: ModelConfig) -> jax.Array:
    """N streams [..., N, D] -> logits [..., V] fp32: head collapse, norm, vocabulary
    projection. The main model and the MTP drafter each have their own collapse and norm
    and share the projection `weight` ([V, D])."""
    h = head_input(hc_head, norm, streams, cfg)
    logits = linear(h, weight, out_dtype=jnp.float32)  # vocab-parallel under a mesh
    out = spec("batch", *([None] * (logits.ndim - 1)))
    return logits if out is None else jax.sharding.reshard(logits, out)  # gather the vocabulary


def logits_of(params: ModelParams, streams: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The main model's head on final streams [..., N, D] -> [..., V]."""
    return head_logits(params.hc_head, params.norm, lm_head_weight(params), streams, cfg)


def last_valid(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """x [B, C, ...] -> [B, 1, ...] at each row's last valid position (n_valid [B])."""
    last = jnp.maximum(n_valid - 1, 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, last, axis=1)


def rows_logits(compute, weight, n_valid: jax.Array | None, dtype) -> jax.Array:
    """compute() -> the logits of a step's rows, read from the vocabulary projection `weight`,
    or zeros of their shape when no row has a token (n_valid [B] all 0: a step of a
    multi-step decode whose slots have all finished), where `weight` is stored narrower than
    the activations' `dtype` (a bf16 head under fp32, `dsjax.store_weights`; a quantized one).
    Such a product widens the head in an op of its own, which XLA hoists out of an enclosing
    loop as loop-invariant: the engine's multi-step decode (`decode_steps` > 1) then widened
    the whole head into a new fp32 buffer per dispatch and read that each step (several times
    slower than one step a dispatch: docs/cpu-decode.md), and so did a speculative step for
    its MTP drafter's loop. XLA
    leaves a conditional's branch in place, so inside the `lax.cond` the product reads the
    head as a single step does. Only for XLA:CPU's few-row decode forms, which read the
    stored head inside the product (`linear`): plain heads, the GEMM (more rows,
    batch-invariant mode, other backends: it widens the head outside the product whatever
    the loop, and once a dispatch beats once a loop step) and any head on a mesh (whose
    branches would have to agree on the logits' sharding) are read as they are."""
    plain = (isinstance(weight, PackedHead)  # the kernel reads its tiles as stored
             or isinstance(weight, (jax.Array, ColumnMajor)) and jnp.dtype(weight.dtype) == jnp.dtype(dtype))
    if n_valid is None or plain or current_mesh() is not None:
        return compute()
    out = jax.eval_shape(compute)
    if not few_rows(int(np.prod(out.shape[:-1]))):
        return compute()
    return jax.lax.cond(jnp.any(n_valid > 0), compute, lambda: jnp.zeros(out.shape, out.dtype))


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
            if at is None or whole:  # whole: this repeat's own weights (`LayerByLayer`)
                streams, state = block_apply(block, streams, tokens, attend, cfg, opts)
            else:  # this repeat's slice of the weights; the routed experts are read from the stack
                moe = block.moe
                with jax.named_scope("layer_weights"):  # a profile's op group (benchmarks/decode_trace.py)
                    own = jax.tree.map(lambda a: a[at], block.replace(moe=moe.replace(w1=None, w3=None, w2=None)))
                own = own.replace(moe=own.moe.replace(w1=moe.w1, w3=moe.w3, w2=moe.w2))
                streams, state = block_apply(own, streams, tokens, attend, cfg, opts, expert_layer=at)
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

    def step(carry, _):  # stacked states ride in the carry; each layer writes its rows in place
        x, sts, r = carry
        x, new = period(x, blocks, sts, at=r)
        if sts is None:  # full sequence: what the attend calls returned besides their output (probes)
            return (x, None, r + 1), new
        return (x, new, r + 1), None

    (streams, states, _), found = jax.lax.scan(step, (streams, states, jnp.int32(0)), None, length=run.repeats)
    return streams, found if states is None else states


INVARIANT_ROWS = 8  # rows per batch-invariant tile (see `forward`)
