"""DeepSeek-V4.1's parameters (spec deepseek-v41.md §8): the backbone with cross-layer
shared attention, Engram's device-side weights, and the DSpark draft head.

    X_0 = [E[id]] * N,  pi = e_0                       # one-hot collapse weights (no hc_head)
    for layer l: (Engram_l before it) ; (X, pi) = Block_l(X, pi)   # mHC with a one-sublayer lag
    logits = W_head Norm(collapse(X, pi))

The blocks follow the config's layer plan (`cfg.layer_runs`), stacked per period position as
in V4 (dsjax/model/decoder.py); Engram's tables (196.6 G values) stay on the host and are
counted, not declared, here.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import SLIDING, TOPK_MOE, LayerSpec, ModelConfig, RuntimeOptions
from dsjax.layers.engram import BEFORE_START, Engram, dequant_rows, engram_fuse, engram_specs
from dsjax.layers.hyper_connection import collapse, expand, hc_mixes, hyper_connection_specs
from dsjax.layers.linear import linear
from dsjax.layers.moe import moe_forward, moe_specs
from dsjax.layers.norms import rms_norm
from dsjax.layers.shared_attention import (empty_shared, shared_attention_extend, shared_attention_forward,
                                           shared_attention_specs)
from dsjax.model.cache import Cache
from dsjax.model.decoder import (DEFAULT_OPTIONS, Block, embed_streams, last_valid, layer_slot, lm_head_weight,
                                 norm_spec, rows_logits)
from dsjax.params import ParamSpec, stack_specs
from dsjax.sharding.rules import batch_major


@struct.dataclass
class DSparkParams:
    """The DSpark draft head (`mtp.0..2`): stages that are window-only V4.1 blocks with their
    own MoE size, fed the main model's taps; the Markov-corrected head and a confidence head."""

    stages: Block  # leaves [n_stages, ...]
    main_proj: jax.Array  # [D, len(target_layer_ids) * D]   mtp.0.main_proj
    main_norm: jax.Array  # [D] fp32                          mtp.0.main_norm
    norm: jax.Array  # [D] fp32                               mtp.2.norm
    markov_embed: jax.Array  # [V, rank]                      mtp.2.markov_head.embed
    markov_head: jax.Array  # [V, rank]                       mtp.2.markov_head.head
    confidence: jax.Array  # [1, D + rank]                    mtp.2.confidence_head.proj


@struct.dataclass
class ModelParamsV41:
    embed: jax.Array  # [V, D]
    blocks: tuple[tuple[Block, ...], ...]  # per layer run, per period position: leaves [repeats * inner, ...]
    norm: jax.Array  # [D] fp32
    lm_head: jax.Array | None  # [V, D]; None when tied to embed
    engram: tuple[Engram, ...] = ()  # per Engram layer (cfg.v41.engram.layer_ids); tables on the host
    # the host tables themselves (an `EngramStore`, not an array: static to jit, compared by identity): when
    # set, a forward given no engram_rows fetches its rows from them during the step (`engram_fetch`)
    engram_tables: Any = struct.field(pytree_node=False, default=None)


# The weights a V4.1 checkpoint stores in FP8 (E4M3, UE8M0 scales on 32 x 32 tiles, spec §7.3, §8)
# that a resident model keeps so, by the end of their dsjax path; with the MXFP4 routed experts.
# attn.wo_a (o_a_proj) is stored FP8 too, but the reference dequantizes it to bf16 at load (its
# grouped product is a bf16 einsum, §8), and so does dsjax: it is not listed.
V41_FP8_LINEARS = ("attn.q_a_proj", "attn.q_b_proj", "attn.kv_proj", "attn.o_b_proj", "attn.index_queries.q_b_proj",
                   "moe.shared_w1", "moe.shared_w2", "moe.shared_w3", "wkv", "main_proj")  # wkv: engram.K.wkv
V41_FP8_BLOCK = (32, 32)


def v41_block_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> Block:
    return Block(attn_hc=hyper_connection_specs(cfg), attn_norm=norm_spec(cfg),
                 attn=shared_attention_specs(cfg, layer, dtype), ffn_hc=hyper_connection_specs(cfg),
                 ffn_norm=norm_spec(cfg), moe=moe_specs(cfg, layer, dtype))


def v41_model_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> ModelParamsV41:
    v, d, e = cfg.vocab_size, cfg.hidden_size, cfg.v41.engram
    return ModelParamsV41(
        embed=ParamSpec((v, d), dtype, ("vocab", "embed")),
        blocks=tuple(tuple(stack_specs(v41_block_specs(cfg, layer, dtype), run.repeats * n)
                           for layer, n in zip(run.layers, run.inner)) for run in cfg.layer_runs),
        norm=norm_spec(cfg),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), dtype, ("vocab", "embed")),
        engram=tuple(engram_specs(cfg.hc_mult, d, e.n_hash, e.head_dim, dtype) for _ in e.layer_ids) if e else ())


def dspark_config(cfg: ModelConfig) -> ModelConfig:
    """The config a DSpark stage is a block of: the backbone's sizes with DSpark's MoE."""
    ds = cfg.v41.dspark
    return cfg.replace(n_routed_experts=ds.n_routed_experts, num_experts_per_tok=ds.n_activated_experts)


def dspark_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> DSparkParams | None:
    ds = cfg.v41.dspark if cfg.v41 is not None else None
    if ds is None or not cfg.num_nextn_predict_layers:
        return None
    v, d, rank = cfg.vocab_size, cfg.hidden_size, ds.markov_rank
    stage = LayerSpec(cfg.num_hidden_layers, SLIDING, 0, TOPK_MOE)
    return DSparkParams(
        stages=stack_specs(v41_block_specs(dspark_config(cfg), stage, dtype), cfg.num_nextn_predict_layers),
        main_proj=ParamSpec((d, len(ds.target_layer_ids) * d), dtype, ("embed_out", None)),
        main_norm=norm_spec(cfg), norm=norm_spec(cfg),
        markov_embed=ParamSpec((v, rank), dtype, ("vocab", None)),
        markov_head=ParamSpec((v, rank), dtype, ("vocab", None)),
        confidence=ParamSpec((1, d + rank), jnp.float32, (None, None)))


def engram_table_values(cfg: ModelConfig) -> int:
    """Values in the Engram tables (host memory): rows x head_dim per Engram layer."""
    e = cfg.v41.engram if cfg.v41 is not None else None
    return 0 if e is None else sum(e.num_embeddings) * e.head_dim


# ----------------------------------------------------------------------------- the forward
def block_apply_lag(p: Block, streams: jax.Array, pi: jax.Array, token_ids: jax.Array, attend, cfg: ModelConfig,
                    opts: RuntimeOptions = DEFAULT_OPTIONS, expert_layer: jax.Array | None = None):
    """One V4.1 block with the one-sublayer lag (spec §3.2): each sublayer collapses the
    streams with the `pre` the previous sublayer computed on its own input.
    streams [B, S, N, D], pi [B, S, N] fp32 -> (streams, pi_out, attend's state)."""
    a_pre, a_post, a_comb = hc_mixes(p.attn_hc, streams, cfg)
    with jax.named_scope("mhc"):  # the sublayer's input norm counts with its collapse in a profile
        h = rms_norm(collapse(streams, pi), p.attn_norm, cfg.rms_norm_eps)
    out, state = attend(p.attn, h)
    streams = expand(out, streams, a_post, a_comb)
    f_pre, f_post, f_comb = hc_mixes(p.ffn_hc, streams, cfg)
    with jax.named_scope("mhc"):
        h = rms_norm(collapse(streams, a_pre), p.ffn_norm, cfg.rms_norm_eps)
    y = moe_forward(p.moe, h, token_ids, cfg, kernels=opts.kernels, capacity_factor=opts.moe_capacity_factor,
                    layer=expert_layer, fp8_acts=opts.round_trips)
    return expand(y, streams, f_post, f_comb), f_pre, state


@jax.named_scope("engram")  # a profile's op group (benchmarks/decode_trace.py)
def engram_before(params: ModelParamsV41, run, streams: jax.Array, engram_rows, cfg: ModelConfig,
                  round_trips: bool) -> jax.Array:
    """The Engram update before a run that starts at an Engram layer (§1.3 step 3). A layer's
    rows are dense [B, S, n_hash, hd] or the stored (E4M3, E8M0 exponents) pair, dequantized here.
    round_trips: its wkv product is Lin8 (§5.6)."""
    if not run.layers[0].engram or engram_rows is None:
        return streams
    k = cfg.v41.engram.layer_ids.index(run.first)
    rows = engram_rows[k]
    rows = dequant_rows(*rows) if isinstance(rows, (tuple, list)) else rows
    return engram_fuse(params.engram[k], streams, rows, project=functools.partial(linear, fp8_act=round_trips))


def first_pi(streams: jax.Array) -> jax.Array:
    """pi = e_0: layer 0's attention collapses to stream 0 (all streams are the embedding)."""
    return batch_major(jnp.zeros(streams.shape[:-1], jnp.float32).at[..., 0].set(1.0))


def v41_streams(params: ModelParamsV41, tokens: jax.Array, cfg: ModelConfig, *, engram_rows=None,
                opts: RuntimeOptions = DEFAULT_OPTIONS, taps: bool = False):
    """The full-sequence V4.1 backbone over tokens [B, S] from position 0 -> (final streams
    [B, S, N, D], final pi [B, S, N], main_hidden [B, S, len(targets) * D] or None).

    engram_rows: per Engram layer, the dequantized table rows its n-gram ids select
    [B, S, n_hash, head_dim] (gathered on the host, dsjax/checkpoint/engram_tables.py);
    None: fetched from `params.engram_tables` during the step if set, else the Engram update is
    left out (a model without its tables). taps: also return DSpark's main_hidden, the stream
    means of the block inputs of its target layers."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if engram_rows is None and params.engram_tables is not None:
        start = jnp.full((b, cfg.v41.engram.max_ngram_size - 1), BEFORE_START, jnp.int32)
        engram_rows, _ = engram_fetch(params.engram_tables.fetch, cfg, tokens, start, jnp.full((b,), s, jnp.int32))

    def attend_of(layer, n_entries):
        def attend(pa, h, state, at, shared):
            out, shared = shared_attention_forward(pa, h, positions, layer, cfg, shared, kernels=opts.kernels,
                                                   round_trips=opts.round_trips)
            return out, (state, shared)
        return jax.named_scope(layer.attention)(attend)  # a profile's op group (benchmarks/decode_trace.py)

    streams, pi, _, main_hidden = _backbone(params, tokens, cfg, None, lambda ratio: s // ratio, attend_of,
                                            engram_rows, opts, taps)
    return streams, pi, main_hidden


def _backbone(params, tokens, cfg, states, n_entries_of, attend_of, engram_rows, opts, taps):
    """The layer runs in order, shared by the full-sequence and cached forwards: the Engram
    update before a run that starts at an Engram layer, each run scanned (`_run`) with the
    shared state of its ratio carried in and out. n_entries_of(ratio): the latents a layer of
    that ratio reads; attend_of(layer, n_entries) -> attend(p, h, state, at, shared) ->
    (out, (state, shared)); states: the cache's per-run stacked states, or None.
    -> (streams, pi, the new states or None, main_hidden or None)."""
    b, c = tokens.shape
    streams = embed_streams(params, tokens, cfg, opts)
    pi = first_pi(streams)
    targets = cfg.v41.dspark.target_layer_ids if (taps and cfg.v41.dspark) else ()
    tapped, shared, new_states = {}, None, []
    for k, (run, blocks) in enumerate(zip(cfg.layer_runs, params.blocks)):
        streams = engram_before(params, run, streams, engram_rows, cfg, opts.round_trips)
        ratio = max(layer.compress_ratio for layer in run.layers)
        n_entries = n_entries_of(ratio) if ratio else 0
        if ratio and (shared is None or shared.entries.shape[1] != n_entries):
            shared = empty_shared(cfg, b, c, n_entries, streams.dtype)
        run_states = None if states is None else states[k]
        streams, pi, run_shared, run_states, run_taps = _run(
            run, blocks, (streams, pi, shared if ratio else None), run_states, tokens,
            [attend_of(layer, n_entries) for layer in run.layers], targets, cfg, opts)
        shared = run_shared if ratio else shared
        new_states.append(run_states)
        tapped.update(run_taps)
    main_hidden = jnp.concatenate([tapped[i] for i in targets], axis=-1) if targets else None
    return streams, pi, None if states is None else tuple(new_states), main_hidden


def _tap(streams: jax.Array) -> jax.Array:
    """DSpark's tap of a block input: the mean over the N streams, in their dtype (§1.3)."""
    return jnp.mean(streams.astype(jnp.float32), axis=-2).astype(streams.dtype)


def _taps_at(run, j: int, targets) -> bool:
    """Whether any layer stacked at period position j is a DSpark target (else no tap is kept)."""
    return any(i in targets for i in run.indices[j])


def _run(run, blocks, carry, states, tokens, attends, targets, cfg, opts):
    """One layer run: a scan over its period copies, in each an inner scan over a position's
    alike layers, carrying (streams, pi, shared) and, with a cache, the run's stacked states
    (each layer writes its rows in place at its index `at` along the stacked axis).
    -> (streams, pi, shared, states, {target layer: tap})."""

    def position(j):
        wants = _taps_at(run, j, targets)

        def step(c, xs):
            streams, pi, shared, state = c
            p, at = xs
            tap = _tap(streams) if wants else None
            streams, pi, (state, shared) = block_apply_lag(
                p, streams, pi, tokens, lambda pa, h: attends[j](pa, h, state, at, shared), cfg, opts)
            return (streams, pi, shared, state), tap
        return step

    def copy(c, xs):
        streams, pi, shared, sts = c
        ps, r = xs
        taps, new = [], list(sts)
        for j, p in enumerate(ps):
            ats = r * run.inner[j] + jnp.arange(run.inner[j])
            (streams, pi, shared, new[j]), tap = jax.lax.scan(position(j), (streams, pi, shared, new[j]), (p, ats))
            taps.append(tap)
        return (streams, pi, shared, tuple(new)), tuple(taps)

    stacked = tuple(jax.tree.map(lambda a, n=n: a.reshape(run.repeats, n, *a.shape[1:]), blocks[j])
                    for j, n in enumerate(run.inner))  # [repeats * inner, ...] -> [repeats, inner, ...]
    states = (None,) * len(run.layers) if states is None else tuple(states)
    (streams, pi, shared, states), taps = jax.lax.scan(copy, (*carry, states), (stacked, jnp.arange(run.repeats)))
    out = {run.index_of(r, j, i): taps[j][r, i] for r in range(run.repeats) for j in range(len(run.layers))
           for i in range(run.inner[j]) if run.index_of(r, j, i) in targets}
    return streams, pi, shared, states, out


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def v41_head_input(params: ModelParamsV41, streams: jax.Array, pi: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Norm(collapse(X, pi)): the vocabulary projection's input [..., D] (no hc_head)."""
    return rms_norm(collapse(streams, pi), params.norm, cfg.rms_norm_eps)


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def v41_logits(params: ModelParamsV41, streams: jax.Array, pi: jax.Array, cfg: ModelConfig) -> jax.Array:
    """logits = W_head Norm(collapse(X, pi)) in fp32 (spec §1.3 step 4; no hc_head)."""
    return linear(v41_head_input(params, streams, pi, cfg), lm_head_weight(params), out_dtype=jnp.float32)


# ----------------------------------------------------------------------------- with a cache
def quirk_source(cfg: ModelConfig) -> int | None:
    """The KV source whose index keys the reference has published last when a one-token decode
    reaches a ratio-2 index source at an even position (V4.1: layer 20), if any layer needs them."""
    if not any(layer.has_indexer and layer.compress_ratio > 1 for layer in cfg.layers):
        return None
    owners = [layer for layer in cfg.layers if layer.has_compressor and layer.has_index_keys]
    if owners[-1].compress_ratio != 1:
        raise NotImplementedError(f"{cfg.name}: the last KV source (layer {owners[-1].index}) has ratio "
                                  f"{owners[-1].compress_ratio}; the published-key rule is written for ratio 1")
    return owners[-1].index


def reference_key_rule(cfg: ModelConfig, opts: RuntimeOptions) -> bool:
    """Whether cached chunks follow the reference's published-key rule (spec deepseek-v41.md §2.7:
    a one-token decode at an even position scores the last KV source's keys at ratio-2 index
    sources). A chunk starting at position s > 0 then equals one-token decodes only at positions
    t <= 2 s + 1: beyond, the keys it needs (the last KV source's, of positions s..t/2 - 1) are
    written by the chunk itself, later in the layer order, and the ratio-2 sources score their
    own instead (`shared_attention_extend`). So an engine keeps every chunk after position 0
    within that bound (prompt chunks on the prefill_chunk grid, at most s + 1 drafts)."""
    return cfg.v41 is not None and not opts.index_keys_from_owner and quirk_source(cfg) is not None


def decodes_equal_prefill(cfg: ModelConfig, opts: RuntimeOptions, length: int) -> bool:
    """Whether one-token decodes of positions below `length` leave what a prefill from position 0
    leaves: always, but under `reference_key_rule` when a ratio-2 source could select fewer than
    its visible entries there (length > 2 index_topk + 1; below, it selects them all either way)."""
    return not reference_key_rule(cfg, opts) or length <= 2 * cfg.index_topk + 1


@jax.named_scope("engram")
def engram_fetch(fetch, cfg: ModelConfig, tokens: jax.Array, history: jax.Array, n_valid: jax.Array):
    """The Engram rows of a chunk from host tables, inside a jitted program: `fetch(tokens
    [B, C], history [B, h], n_valid [B])` runs on the host and returns, per Engram layer, the stored
    (E4M3 bytes [B, C, n_hash, hd], E8M0 bytes [B, C, n_hash, hd / 32]) of the rows the
    chunk's n-grams hash to, then the history after the n_valid committed tokens
    (`dsjax.checkpoint.engram_tables.EngramStore.fetch`). -> (rows per layer, history).
    A `pure_callback`: the lookup is a function of its operands (the tables do not change), so XLA
    may schedule it beside the layers before the first Engram layer. An `io_callback` (effectful,
    even unordered) serialised the step around it, costing it many times the lookup itself
    (docs/v41.md; benchmarks/engram_transfer.py)."""
    e = cfg.v41.engram
    b, c = tokens.shape
    shapes = [jax.ShapeDtypeStruct((b, c, e.n_hash, width), jnp.uint8)
              for _ in e.layer_ids for width in (e.head_dim, e.head_dim // 32)]
    out = jax.pure_callback(fetch, (*shapes, jax.ShapeDtypeStruct(history.shape, jnp.int32)), tokens, history,
                            n_valid)
    rows = tuple((jax.lax.bitcast_convert_type(out[2 * k], jnp.float8_e4m3fn), out[2 * k + 1])
                 for k in range(len(e.layer_ids)))
    return rows, batch_major(out[-1])  # the callback's outputs are replicated; the cache's history is batch-major


def v41_streams_cached(params: ModelParamsV41, tokens: jax.Array, cfg: ModelConfig, cache: Cache, *,
                       ctx_bucket: int, n_valid: jax.Array | None = None, engram_rows=None,
                       opts: RuntimeOptions = DEFAULT_OPTIONS, taps: bool = False):
    """The V4.1 backbone over a chunk tokens [B, C] at positions cache.length + i, i < n_valid
    (rows with n_valid 0 untouched) -> (streams, pi, cache, main_hidden). ctx_bucket (static)
    bounds the latents read: every one a query can see lies below ctx_bucket / ratio.
    engram_rows: as `v41_streams`, or a host fetch function (`engram_fetch`): the rows then
    come from host tables during the step and the cache's Engram history moves on; None:
    `params.engram_tables.fetch` if set. taps: as `v41_streams`."""
    b, c = tokens.shape
    start = cache.length
    n_valid = jnp.full((b,), c, jnp.int32) if n_valid is None else n_valid
    history = cache.history
    if engram_rows is None and params.engram_tables is not None:
        engram_rows = params.engram_tables.fetch
    if callable(engram_rows):
        engram_rows, history = engram_fetch(engram_rows, cfg, tokens, cache.history, n_valid)
    quirk_keys = None
    src = None if opts.index_keys_from_owner else quirk_source(cfg)
    if src is not None:
        k, j, at = layer_slot(cfg, src)
        quirk_keys = cache.layers[k][j].index_keys[at]

    def attend_of(layer, n_entries):
        def attend(pa, h, state, at, shared):
            out, state, shared = shared_attention_extend(
                pa, state, h, start, n_valid, layer, cfg, shared, n_entries, kernels=opts.kernels, at=at,
                quirk_keys=quirk_keys, round_trips=opts.round_trips)
            return out, (state, shared)
        return jax.named_scope(layer.attention)(attend)

    streams, pi, states, main_hidden = _backbone(params, tokens, cfg, cache.layers, lambda ratio: ctx_bucket // ratio,
                                                 attend_of, engram_rows, opts, taps)
    return streams, pi, Cache(start + n_valid, states, history), main_hidden


def v41_forward_rows(params: ModelParamsV41, tokens: jax.Array, cfg: ModelConfig, cache: Cache | None,
                     opts: RuntimeOptions, n_valid: jax.Array | None, ctx_bucket: int | None, last_only: bool,
                     taps: bool = False, head_rows: bool = False):
    """`dsjax.model.forward` for a V4.1 config, the Engram rows from the params' host tables if
    they have them -> (logits fp32, cache, DSpark's taps [B, S, T * D] with taps=True, else None);
    head_rows: the head's input rows instead of the logits."""
    if cache is None:
        streams, pi, hidden = v41_streams(params, tokens, cfg, opts=opts, taps=taps)
    else:
        streams, pi, cache, hidden = v41_streams_cached(params, tokens, cfg, cache, ctx_bucket=ctx_bucket,
                                                        n_valid=n_valid, opts=opts, taps=taps)
    if last_only:
        n = jnp.full(tokens.shape[:1], tokens.shape[1]) if n_valid is None else n_valid
        streams, pi = last_valid(streams, n), last_valid(pi, n)
    if head_rows:
        return v41_head_input(params, streams, pi, cfg), cache, hidden
    logits = rows_logits(lambda: v41_logits(params, streams, pi, cfg), lm_head_weight(params), n_valid, streams.dtype)
    return logits, cache, hidden
