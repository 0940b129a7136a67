"""DeepSeek-V4.1's DSpark draft head (`mtp.0..2`, spec deepseek-v41.md §6): five tokens drafted in
one call, in parallel, from the main model's taps, then corrected left to right by a low-rank
Markov head.

    mu_t   = Norm_main(W_main_proj main_hidden_t)                   shared by the stages (§6.1)
    rho_t  = fp8(rope_t(Norm_kv(W_kv mu_t)))   -> ring_s[t mod W]   per stage, theta = rope_main (§6.4)
    block  = [a, noise x 4] at P..P+4 (P = t + 1);  X = [E[id]] x N, pi = e_0          (§6.2)
    stage s: (X, pi) = Block_s(X, pi)   V4.1 block with the mHC lag (§3.2); its attention:
        q_k = rope_{P+k}(W_qb Norm_q(W_qa x_k)),  beta_k = fp8(rope_{P+k}(Norm_kv(W_kv x_k)))
        every q_k attends ring_s at positions max(0, t-W+1)..t and ALL of beta_0..4
        (bidirectional), with the sink; inverse rope at P+k; grouped wo_a, wo_b
    h_k    = collapse(X_k, pi);  l_k = W_head Norm(h_k)   (fp32, the main model's head)   (§6.5)
    o_0 = a;  for k = 0..4:  e_k = markov_embed[o_k];  l_k += markov_head e_k;  o_{k+1} = sample(l_k)
    c_k    = w_conf . [h_k ; e_k]          (un-normed h_k; sigma(c_k) ~ P(o_{k+1} accepted | prefix))

The ring holds main-stream keys only (one row per main position, slot = position mod W);
`dspark_seed` writes them after a prefill and for the positions a verification commits
(§6.6, §6.7 step 3), `dspark_draft` writes position t itself and then drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import SLIDING, TOPK_MOE, LayerSpec, ModelConfig, RuntimeOptions
from dsjax.layers.attention import FOREVER
from dsjax.layers.hyper_connection import collapse
from dsjax.layers.linear import linear, linear_f32
from dsjax.layers.norms import rms_norm
from dsjax.layers.qdq import qdq_fp8
from dsjax.layers.quantized import dense
from dsjax.layers.rope import apply_rope, rope_cos_sin
from dsjax.model.block import DEFAULT_OPTIONS, block_apply, embed_streams
from dsjax.model.cache import Cache
from dsjax.model.v41.backbone import first_pi, stream_tap, v41_forward_rows
from dsjax.model.v41.params import DSparkParams, ModelParamsV41, dspark_config
from dsjax.model.v41.shared_attention import SharedAttention, attend_and_project, project_q_kv, round_trip
from dsjax.sharding.rules import batch_major, lookup


@struct.dataclass
class DSparkRing:
    """The stages' window rings of main-stream keys rho (spec §2.12, last row): stage s's ring
    is keys[s]. All stages write the same positions, so one position table serves them."""

    keys: jax.Array  # [n_stages, B, W, hd]  rho_p at slot p mod W
    positions: jax.Array  # [B, W] int32       the position each slot holds (-1: empty)

    def batch_axes(self) -> "DSparkRing":
        """Per leaf, which axis is the batch (`dsjax.model.cache.batch_axes`)."""
        return DSparkRing(keys=1, positions=0)


def dspark_layer(cfg: ModelConfig) -> LayerSpec:
    """A stage as a layer: window-only attention (rope_main, no YaRN), a top-k MoE."""
    return LayerSpec(cfg.num_hidden_layers, SLIDING, 0, TOPK_MOE)


def dspark_state_shapes(cfg: ModelConfig, batch: int, dtype=jnp.bfloat16) -> DSparkRing:
    shape = jax.ShapeDtypeStruct
    return DSparkRing(keys=shape((cfg.num_nextn_predict_layers, batch, cfg.sliding_window, cfg.head_dim), dtype),
                      positions=shape((batch, cfg.sliding_window), jnp.int32))


def empty_ring(cfg: ModelConfig, batch: int, dtype=jnp.bfloat16) -> DSparkRing:
    """Rings holding no position."""
    s = dspark_state_shapes(cfg, batch, dtype)
    return DSparkRing(keys=jnp.zeros(s.keys.shape, dtype), positions=jnp.full(s.positions.shape, -1, jnp.int32))


# ----------------------------------------------------------------------------- main-stream keys
def main_mu(ds: DSparkParams, main_hidden: jax.Array, cfg: ModelConfig, round_trips: bool) -> jax.Array:
    """mu = Norm_main(W_main_proj main_hidden) (Lin8 with round trips): [..., len(targets) * D] -> [..., D] (§6.1)."""
    return rms_norm(linear(main_hidden, ds.main_proj, fp8_act=round_trips), ds.main_norm, cfg.rms_norm_eps)


def main_keys(p: SharedAttention, mu: jax.Array, positions: jax.Array, cfg: ModelConfig,
              round_trips: bool) -> jax.Array:
    """rho = fp8(rope_p(Norm_kv(W_kv mu))): mu [B, S, D] at positions [B, S] -> [B, S, hd] (§6.4)."""
    cos, sin = rope_cos_sin(positions, cfg.rope(dspark_layer(cfg).rope), cfg.qk_rope_head_dim)
    kv = apply_rope(rms_norm(linear(mu, p.kv_proj, fp8_act=round_trips), p.kv_norm, cfg.rms_norm_eps), cos, sin)
    return round_trip(kv, qdq_fp8, round_trips)


def dspark_seed(ds: DSparkParams, main_hidden: jax.Array, positions: jax.Array, ring: DSparkRing,
                cfg: ModelConfig, valid: jax.Array | None = None, *,
                opts: RuntimeOptions = DEFAULT_OPTIONS) -> DSparkRing:
    """Write rho for main positions [B, S] (distinct per row; rows' entries where `valid` [B, S])
    from main_hidden [B, S, len(targets) * D] into every stage's ring (§6.6 prefill, §6.7 step 3).
    Of a row's positions only the last W can survive in a W-slot ring; only those are written,
    so no two writes of one call meet in a slot."""
    w = cfg.sliding_window
    valid = jnp.ones(positions.shape, bool) if valid is None else valid
    mu = main_mu(ds, main_hidden, cfg, opts.round_trips)
    rho = jax.vmap(lambda p: main_keys(p, mu, positions, cfg, opts.round_trips))(ds.stages.attn)  # [n, B, S, hd]
    last = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
    slot = jnp.where(valid & (positions > last - w), jnp.mod(positions, w), w)  # w: not written
    # row by row (vmap over the batch): each row writes its own ring, also on a mesh's batch shards
    put = lambda a, i, v: a.at[..., i, :].set(v, mode="drop")  # noqa: E731
    keys = jax.vmap(put, in_axes=(1, 0, 1), out_axes=1)(ring.keys, slot, rho.astype(ring.keys.dtype))
    put_positions = jax.vmap(lambda a, i, v: a.at[i].set(v, mode="drop"))
    return DSparkRing(keys=keys, positions=put_positions(ring.positions, slot, positions.astype(jnp.int32)))


# ----------------------------------------------------------------------------- the stages
def draft_intervals(ring_positions: jax.Array, t: jax.Array, window: int, block: int):
    """Visibility for `sink_attention` over keys [ring (W) ; block]: a ring slot is seen by every
    block query iff it holds a position in max(0, t-W+1)..t, a block key always (bidirectional).
    -> (lo, hi) [B, W + block]."""
    seen = (ring_positions >= jnp.maximum(t[:, None] - window + 1, 0)) & (ring_positions <= t[:, None])
    seen = jnp.pad(seen, ((0, 0), (0, block)), constant_values=True)  # keeps a batch-major seen's sharding
    return jnp.where(seen, 0, 1), jnp.where(seen, FOREVER, 0)


def dspark_attention(p: SharedAttention, x: jax.Array, positions: jax.Array, ring_keys: jax.Array, lo, hi,
                     cfg: ModelConfig, opts: RuntimeOptions) -> jax.Array:
    """§6.4: the block x [B, K, D] (normed) at positions [B, K] over the ring [B, W, hd] and its
    own keys beta, with the sink; inverse rope; grouped output -> [B, K, D]."""
    _, q, beta, cos, sin = project_q_kv(p, x, positions, dspark_layer(cfg), cfg, opts.round_trips)
    keys = jnp.concatenate([ring_keys.astype(beta.dtype), beta], axis=1)
    return attend_and_project(p, q, keys, lo, hi, positions, None, cos, sin, cfg, opts.kernels, opts.round_trips)


def dspark_stages(ds: DSparkParams, streams: jax.Array, ids: jax.Array, positions: jax.Array, ring: DSparkRing,
                  t: jax.Array, cfg: ModelConfig, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """The stages in order over the block streams [B, K, N, D] (a scan over the stacked stages),
    pi chaining through them from e_0 (§6.3) -> (streams, pi)."""
    lo, hi = draft_intervals(ring.positions, t, cfg.sliding_window, ids.shape[1])
    stage_cfg = dspark_config(cfg)

    def stage(carry, xs):
        streams, pi = carry
        p, ring_keys = xs
        attend = lambda pa, h: (dspark_attention(pa, h, positions, ring_keys, lo, hi, cfg, opts), None)  # noqa: E731
        streams, pi, _ = block_apply(p, streams, ids, attend, stage_cfg, opts, pi=pi, fp8_acts=opts.round_trips)
        return (streams, pi), None

    (streams, pi), _ = jax.lax.scan(stage, (streams, first_pi(streams)), (ds.stages, ring.keys))
    return streams, pi


# ----------------------------------------------------------------------------- head and sampling
def sample_tokens(logits: jax.Array, temperature, key: jax.Array | None) -> jax.Array:
    """§7.1: argmax (the first maximum) where temperature <= 0 or no key is given, else a draw
    from softmax(logits / max(T, 1e-5)) (Gumbel-max: the spec's exponential race in law, not in
    bits). logits [B, V], temperature scalar or [B] -> [B] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        return greedy
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:-1])
    drawn = jax.random.categorical(key, logits / jnp.maximum(temp, 1e-5)[..., None], axis=-1).astype(jnp.int32)
    return jnp.where(temp > 0, drawn, greedy)


def markov_correct(ds: DSparkParams, logits: jax.Array, anchor: jax.Array, temperature, key: jax.Array | None,
                   pick=None):
    """The sequential Markov correction (§6.5): logits [B, K, V] fp32, anchor o_0 [B] ->
    (drafts o_1..o_K [B, K], corrected logits [B, K, V], e_0..e_{K-1} [B, K, rank]).
    pick(l_k [B, V], k) -> o_{k+1} [B]: how a draft is drawn from its corrected logits
    (default: `sample_tokens` with temperature and key; the engine draws with its own keys)."""
    head = dense(ds.markov_head, jnp.float32)  # [V, rank]
    keys = None if key is None else jax.random.split(key, logits.shape[1])

    def step(o, xs):
        l, k, j = xs
        e = lookup(ds.markov_embed, o)  # [B, rank]
        l = l + jnp.einsum("br,vr->bv", e.astype(jnp.float32), head)
        nxt = sample_tokens(l, temperature, k) if pick is None else pick(l, j)
        return nxt, (nxt, l, e)

    xs = (jnp.swapaxes(logits, 0, 1), keys, jnp.arange(logits.shape[1]))
    _, (drafts, logits, e) = jax.lax.scan(step, anchor.astype(jnp.int32), xs)
    return jnp.swapaxes(drafts, 0, 1), jnp.swapaxes(logits, 0, 1), jnp.swapaxes(e, 0, 1)


def dspark_draft(ds: DSparkParams, main: ModelParamsV41, anchor: jax.Array, main_hidden_t: jax.Array, t: jax.Array,
                 ring: DSparkRing, cfg: ModelConfig, *, temperature=0.0, key: jax.Array | None = None,
                 pick=None, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """One DSpark call (§6.2-6.6 decode): write rho_t from main_hidden_t [B, len(targets) * D]
    at t [B] (the last position the main model processed), then draft the block after the
    anchor a [B] (sampled at P = t + 1). temperature (scalar or [B]; <= 0: greedy) and key
    (None: greedy) pick the draws, or `pick` as `markov_correct` takes it. -> (ring, drafts
    o_1..o_K [B, K] int32, Markov-corrected logits before temperature [B, K, V] fp32,
    confidence logits c_k [B, K] fp32)."""
    ds_cfg = cfg.v41.dspark
    k = ds_cfg.block_size
    ring = dspark_seed(ds, main_hidden_t[:, None], t[:, None], ring, cfg, opts=opts)
    ids = jnp.where(jnp.arange(k) == 0, anchor[:, None], ds_cfg.noise_token_id).astype(jnp.int32)  # [B, K]
    positions = t[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)
    streams, pi = dspark_stages(ds, embed_streams(main, ids, cfg, opts), ids, positions, ring, t, cfg, opts)
    h = collapse(streams, pi)  # [B, K, D], un-normed
    head = main.embed if main.lm_head is None else main.lm_head
    logits = batch_major(linear(rms_norm(h, ds.norm, cfg.rms_norm_eps), head, out_dtype=jnp.float32))  # vocab gathered
    drafts, logits, e = markov_correct(ds, logits, anchor, temperature, key, pick)
    confidence = linear_f32(jnp.concatenate([h, e.astype(h.dtype)], axis=-1), ds.confidence)[..., 0]
    return ring, drafts, logits, confidence


def _at(x: jax.Array, i: jax.Array) -> jax.Array:
    """x [B, C, ...] at position i [B] of each row -> [B, ...] (take_along_axis: row-local on a
    mesh, where indexing by an arange of rows would gather across the batch shards)."""
    return jnp.take_along_axis(x, i.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


class DSparkDrafter:
    """DeepSeek-V4.1's DSpark head as the engine's drafter (`dsjax.model.interface.Drafter`):
    its state is the stages' key rings, the target hands it its taps [B, C, T * D]. `commit`
    writes the main-stream keys of true positions only (a prompt chunk, a verify step's kept
    positions), so the rings need no rollback; `draft` drafts the block after the next token
    in one call."""

    screens_verify = False  # a V4.1 verify step reads the model's own head (logits)

    def init_state(self, cfg: ModelConfig, batch: int, dtype) -> DSparkRing:
        return empty_ring(cfg, batch, dtype)

    def target_chunk(self, params: ModelParamsV41, tokens: jax.Array, cfg: ModelConfig, cache: Cache, *,
                     opts: RuntimeOptions, n_valid: jax.Array, ctx_bucket: int, last_only: bool = False,
                     hidden: bool = False):
        """-> (logits fp32 [B, C, V] (last_only: [B, 1, V]), DSpark's taps [B, C, T * D], cache).
        hidden is never asked (`screens_verify` False)."""
        if hidden:
            raise ValueError("DSpark's target_chunk gives logits only: a V4.1 verify step does not read the screen")
        logits, cache, hidden = v41_forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only,
                                                 taps=True)
        return logits, hidden, cache

    def feature_points(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The block inputs of the target layers, whose stream means the taps are (§1.3)."""
        return tuple(f"layers.{i}.mhc.streams_in" for i in cfg.v41.dspark.target_layer_ids)

    def features_from(self, found: dict[str, jax.Array], cfg: ModelConfig) -> jax.Array:
        return jnp.concatenate([stream_tap(found[n]) for n in self.feature_points(cfg)], axis=-1)

    def commit(self, ds: DSparkParams, params: ModelParamsV41, ring: DSparkRing, hidden: jax.Array,
               next_tokens: jax.Array, start: jax.Array, n_valid: jax.Array, cfg: ModelConfig,
               opts: RuntimeOptions = DEFAULT_OPTIONS):
        """The keys of positions start .. start+n_valid-1 (taps hidden [B, C, T * D]) into the
        rings -> (rings, what `draft` starts from: the last position's next token and taps)."""
        i = jnp.arange(hidden.shape[1])
        ring = dspark_seed(ds, hidden, start[:, None] + i, ring, cfg, i[None] < n_valid[:, None], opts=opts)
        last = jnp.maximum(n_valid - 1, 0)
        return ring, (next_tokens, hidden, last, start + last)  # t = start + last: the drafts are for t + 2 ..

    def draft(self, ds: DSparkParams, params: ModelParamsV41, ring: DSparkRing, context, cfg: ModelConfig,
              opts: RuntimeOptions = DEFAULT_OPTIONS, *, k: int, sampler, vocab=None):
        """The first k of one DSpark block -> (tokens [B, k], q [B, k, V] or None, confidence [B, k]
        or None): each draft corrected by the one before and drawn by `sampler.pick`; q the
        sampler's distributions of the corrected logits, the confidence sigma(c_k) of the
        confidence head. vocab must be None (DSpark scores the full vocabulary)."""
        del vocab
        next_tokens, hidden, last, t = context
        pick = lambda logits, j: sampler.pick(logits, t + 2 + j)  # noqa: E731
        # the ring dspark_draft returns is `ring` again (rho_t is written by `commit`), unless n_valid is 0
        _, tokens, logits, conf = dspark_draft(ds, params, _at(next_tokens, last), _at(hidden, last), t, ring, cfg,
                                               pick=pick, opts=opts)
        return (tokens[:, :k], sampler.probs(logits[:, :k]) if sampler.sampled else None,
                jax.nn.sigmoid(conf[:, :k]) if sampler.confidence else None)
