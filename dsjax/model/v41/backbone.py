"""DeepSeek-V4.1's backbone forward (spec deepseek-v41.md §1.3): the blocks with cross-layer
shared attention and mHC's one-sublayer lag, Engram before its layers, no head collapse.

    X_0 = [E[id]] * N,  pi = e_0                       # one-hot collapse weights (no hc_head)
    for layer l: (Engram_l before it) ; (X, pi) = Block_l(X, pi)   # mHC with a one-sublayer lag
    logits = W_head Norm(collapse(X, pi))

Each block is `dsjax.model.block.block_apply` with the lag (pi) around the shared-KV
attention (dsjax/model/v41/shared_attention.py). The blocks follow the config's layer plan
(`cfg.layer_runs`), stacked per period position as in V4, with V4.1's runs of alike layers an
inner scan; the state the layers share (`Shared`) rides in the scans' carry.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.kernels import cpu as cpu_kernels
from dsjax.kernels.dispatch import on_batch_shards
from dsjax.layers.engram import BEFORE_START, dequant_rows, engram_fuse
from dsjax.layers.hyper_connection import collapse
from dsjax.layers.linear import linear
from dsjax.layers.norms import rms_norm
from dsjax.layers import taps as inspect_taps  # `taps` here names DSpark's
from dsjax.model.block import DEFAULT_OPTIONS, block_apply, embed_streams, layer_slot
from dsjax.model.cache import Cache
from dsjax.model.head import last_valid, lm_head_weight, rows_logits
from dsjax.model.v41.params import ModelParamsV41
from dsjax.model.v41.shared_attention import empty_shared, shared_attention_extend, shared_attention_forward
from dsjax.sharding.rules import batch_major, current_mesh


# ----------------------------------------------------------------------------- the forward
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
    if engram_rows is None:
        engram_rows = params.engram_rows
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
        with inspect_taps.layer(run.first):  # dsjax.inspect's `layers.{i}.engram.*` (inert otherwise)
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


def stream_tap(streams: jax.Array) -> jax.Array:
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

    bodies = {}  # dsjax.inspect: what each scan body captured (static, read back by `taps.release`)

    def position(j):
        wants = _taps_at(run, j, targets)

        def step(c, xs):
            streams, pi, shared, state = c
            p, at = xs
            tap = stream_tap(streams) if wants else None
            with inspect_taps.collect() as bodies[j], inspect_taps.layer(run.indices[j], at):
                streams, pi, (state, shared) = block_apply(
                    p, streams, tokens, lambda pa, h: attends[j](pa, h, state, at, shared), cfg, opts, pi=pi,
                    fp8_acts=opts.round_trips)
            return (streams, pi, shared, state), (tap, bodies[j].values)
        return step

    def copy(c, xs):
        streams, pi, shared, sts = c
        ps, r = xs
        tapped, new = [], list(sts)
        with inspect_taps.collect() as bodies["copy"]:
            for j, p in enumerate(ps):
                ats = r * run.inner[j] + jnp.arange(run.inner[j])
                (streams, pi, shared, new[j]), (tap, found) = jax.lax.scan(position(j), (streams, pi, shared, new[j]),
                                                                           (p, ats))
                inspect_taps.release(found, bodies[j])
                tapped.append(tap)
        return (streams, pi, shared, tuple(new)), (tuple(tapped), bodies["copy"].values)

    stacked = tuple(jax.tree.map(lambda a, n=n: a.reshape(run.repeats, n, *a.shape[1:]), blocks[j])
                    for j, n in enumerate(run.inner))  # [repeats * inner, ...] -> [repeats, inner, ...]
    states = (None,) * len(run.layers) if states is None else tuple(states)
    (streams, pi, shared, states), (tapped, found) = jax.lax.scan(copy, (*carry, states),
                                                                  (stacked, jnp.arange(run.repeats)))
    inspect_taps.release(found, bodies["copy"])
    out = {run.index_of(r, j, i): tapped[j][r, i] for r in range(run.repeats) for j in range(len(run.layers))
           for i in range(run.inner[j]) if run.index_of(r, j, i) in targets}
    return streams, pi, shared, states, out


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def v41_head_input(params: ModelParamsV41, streams: jax.Array, pi: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Norm(collapse(X, pi)): the vocabulary projection's input [..., D] (no hc_head)."""
    return rms_norm(collapse(streams, pi), params.norm, cfg.rms_norm_eps)


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def v41_logits(params: ModelParamsV41, streams: jax.Array, pi: jax.Array, cfg: ModelConfig) -> jax.Array:
    """logits = W_head Norm(collapse(X, pi)) in fp32 (spec §1.3 step 4; no hc_head)."""
    logits = linear(v41_head_input(params, streams, pi, cfg), lm_head_weight(params), out_dtype=jnp.float32)
    return batch_major(logits)  # vocab-parallel under a mesh: gathered, as the sampler's rows take them


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


@jax.named_scope("engram")
def engram_fetch(fetch, cfg: ModelConfig, tokens: jax.Array, history: jax.Array, n_valid: jax.Array):
    """The Engram rows of a chunk from host tables, inside a jitted program: `fetch(tokens
    [B, C], history [B, h], n_valid [B])` runs on the host and returns, per Engram layer, the stored
    (E4M3 bytes [B, C, n_hash, hd], E8M0 bytes [B, C, n_hash, hd / 32]) of the rows the
    chunk's n-grams hash to, then the history after the n_valid committed tokens
    (`dsjax.checkpoint.engram_tables.EngramStore.fetch`). -> (rows per layer, history).
    A pure host call: the lookup is a function of its operands (the tables do not change), so XLA
    may schedule it beside the layers before the first Engram layer. An `io_callback` (effectful,
    even unordered) serialised the step around it, costing it many times the lookup itself
    (docs/v41.md; benchmarks/engram_transfer.py). On one CPU device a store's own `fetch` is
    called by its store's number (`cpu_kernels.host_call`), which leaves the program one JAX's
    persistent cache keeps; on an explicit mesh of CPU devices each device calls it on its own
    rows (`dispatch.on_batch_shards`: the lookup is row by row). Elsewhere (GPU, TPU, another
    function) it is a `jax.pure_callback`."""
    e = cfg.v41.engram

    def shapes(b, c, history_shape):
        return [*(jax.ShapeDtypeStruct((b, c, e.n_hash, width), jnp.uint8)
                  for _ in e.layer_ids for width in (e.head_dim, e.head_dim // 32)),
                jax.ShapeDtypeStruct(history_shape, jnp.int32)]

    store = getattr(fetch, "__self__", None)  # a store's own fetch has the number its store registered
    own = getattr(store, "key", None) is not None and getattr(fetch, "__func__", None) is getattr(type(store), "fetch", 0)
    mesh = current_mesh()
    if own and cpu_kernels.host_calls() and (mesh is None or AxisType.Explicit in mesh.axis_types):
        def call(t, h, n):  # one device's rows
            return tuple(cpu_kernels.host_call(store.key, shapes(*t.shape, h.shape), t, h, n))

        out = on_batch_shards(call, (tokens.astype(jnp.int32), history.astype(jnp.int32), n_valid.astype(jnp.int32)))
    else:
        out = jax.pure_callback(fetch, tuple(shapes(*tokens.shape, history.shape)), tokens, history, n_valid)
    return _stored_rows(out, cfg), batch_major(out[-1])  # a callback's outputs are replicated: the history batch-major


def _stored_rows(fetched, cfg: ModelConfig) -> tuple:
    """`EngramStore.fetch`'s uint8 outputs -> per Engram layer (E4M3 rows, E8M0 exponents)."""
    return tuple((fetched[2 * k].view(jnp.float8_e4m3fn), fetched[2 * k + 1])  # a bitcast (traced or on the host)
                 for k in range(len(cfg.v41.engram.layer_ids)))


def with_sequence_rows(params: ModelParamsV41, tokens: np.ndarray, cfg: ModelConfig, put=jnp.asarray
                       ) -> ModelParamsV41:
    """params for one whole-sequence forward over tokens [B, S] (host ints, from position 0): the
    Engram rows its n-grams select, fetched from the host tables now (`EngramStore.fetch`, as the
    in-step callback would: the same bytes) and carried as `engram_rows` (each host array placed
    by `put`), so that the forward's program holds no host callback and JAX's persistent cache
    keeps it. params must have tables."""
    b, s = tokens.shape
    start = np.full((b, cfg.v41.engram.max_ngram_size - 1), BEFORE_START, np.int32)
    fetched = params.engram_tables.fetch(np.asarray(tokens), start, np.full((b,), s, np.int32))
    return params.replace(engram_rows=jax.tree.map(put, _stored_rows(fetched, cfg)))


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
    streams = inspect_taps.tap("final.streams", streams)
    inspect_taps.optional_tap("final.hidden", lambda: v41_head_input(params, streams, pi, cfg))
    if last_only:
        n = jnp.full(tokens.shape[:1], tokens.shape[1]) if n_valid is None else n_valid
        streams, pi = last_valid(streams, n), last_valid(pi, n)
    if head_rows:
        return v41_head_input(params, streams, pi, cfg), cache, hidden
    logits = rows_logits(lambda: v41_logits(params, streams, pi, cfg), lm_head_weight(params), n_valid, streams.dtype)
    return logits, cache, hidden
