"""Speculative decoding with the MTP drafter (DeepSeek-V4.1: the DSpark head): k drafts per
request verified in ONE jitted target forward over k+1 positions, lossless acceptance, and
rollback of every cache row the rejected positions wrote.

Per step, for each slot at cache length L with pending token x_L (not yet in the cache):

    feed [x_L, d_1..d_k] at positions L..L+k         -> target distributions p_0..p_k
    greedy : a = #leading i with d_{i+1} == argmax p_i;  next = argmax p_a
    sampled: accept d_{i+1} iff u < p_i(d_{i+1}) / q_i(d_{i+1}) (u from (seed, position));
             at the first rejection next ~ normalise(max(p_i - q_i, 0)); if the row's
             drafts ran out (a = its limit) next ~ p_a (the bonus token)
    keep positions L..L+a (length L + a + 1).

Rollback: before the forward, the rows the k+1 positions will overwrite are saved — per
layer the window-ring slots, the compressor / indexer ring slots, and the compressed entry
each position would complete (k+1 rows each, never a whole cache); afterwards the rows of
rejected positions are put back. So after any accept / reject sequence the cache equals
the one plain decoding of the kept tokens builds. The MTP ring only ever receives true
positions (the target's streams of the kept positions), and drafting k tokens runs the
MTP layer recurrently on a scratch copy of its ring, so it needs no rollback.

p and q are the request's *processed* distributions (temperature, top-k, top-p, min-p),
so the output distribution is exactly the target's. Penalties, whose statistics would
change inside the draft chain, are refused with speculation. Randomness comes from
(seed, position, salt) keys, so a request's draws never depend on its batch neighbours.

Reduced draft vocabulary (`DraftVocab`): the drafter may score only a set D of token ids
(the most frequent ones), through head rows gathered once, W_head[D] [|D|, D_model]. A draft
is then the argmax / a draw within D mapped back to its full id, and q is that distribution
scattered into the full vocabulary (zero outside D): still the distribution the draft was
drawn from, so the acceptance test above stays exact. The target verifies with its full
head as before; only the drafts change (greedy outputs are plain decoding's whatever D is).

DeepSeek-V4.1 (`dspark_commit_and_draft`): the committed positions' taps feed the DSpark
stages' key rings, and one DSpark call drafts the block after the next token, each draft
drawn (as above, with the request's keys) from the processed Markov-corrected logits given
the drafts before it; its confidence head gives the confidence policy sigma(c_k). The
rollback also puts back the Engram id history (`kept_history`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.engine.sampler import SamplingState, argmax_first, categorical, processed_logits, request_key
from dsjax.engine.slots import emit_tokens
from dsjax.layers.attention import AttentionState
from dsjax.model.cache import Cache, batch_axes, restore_rows, save_rows
from dsjax.model.decoder import (DEFAULT_OPTIONS, ModelParams, decoder_streams, head_logits, last_valid, lm_head_weight,
                                 logits_of, rows_logits)
from dsjax.layers.engram import kept_history
from dsjax.model.dspark import DSparkRing, dspark_draft, dspark_seed, empty_ring
from dsjax.model.mtp import MTPParams, mtp_forward, mtp_head, mtp_state_shapes
from dsjax.model.v41 import DSparkParams, reference_key_rule, v41_forward_rows
from dsjax.sharding.rules import per_row

ACCEPT, DRAFT, TOKEN = 1, 2, 3  # salts: acceptance uniforms, draft draws, emitted-token draws


@struct.dataclass
class Drafts:
    """Per slot: the pending drafts and the drafter's distributions over them."""

    tokens: jax.Array  # [B, K] int32
    q: jax.Array  # [B, K, V] fp32: the processed draft distribution each was drawn from
    confidence: jax.Array  # [B, K] fp32: q(d_j) (greedy rows: the drafter's softmax at d_j), for scheduling


CALIBRATION_BINS = 10  # the drafter's confidence [0, 1] in equal bins, calibrated at their centres


def calibration_centres() -> np.ndarray:
    return (np.arange(CALIBRATION_BINS) + 0.5) / CALIBRATION_BINS


@struct.dataclass
class Schedule:
    """What the confidence policy schedules by, a program argument (`SpeculationPolicy`
    keeps it): the verify cost curve, and the drafts' acceptance observed so far at each
    confidence bin's centre (`calibration_centres`; the centres themselves before any
    draft is judged, i.e. the drafter's confidence taken at its word)."""

    costs: jax.Array  # [K + 1] relative cost of a verify step over k = 0..K drafts
    acceptance: jax.Array  # [CALIBRATION_BINS]


@struct.dataclass
class DraftVocab:
    """The drafter's reduced vocabulary D: token ids and their output-head rows, gathered
    once (`draft_vocab`) and passed to the programs as an argument."""

    ids: jax.Array  # [|D|] int32, sorted (argmax ties fall on the smallest id, as over the full vocabulary)
    head: jax.Array  # [|D|, D_model]: lm_head_weight rows of ids


def draft_vocab(params: ModelParams, ids) -> DraftVocab:
    """The head rows of token ids [|D|] (checked ones, `dsjax.engine.policy.check_draft_vocab`)."""
    ids = jnp.asarray(ids, jnp.int32)
    return DraftVocab(ids, jnp.take(lm_head_weight(params), ids, axis=0))


def processed_probs(logits: jax.Array, s: SamplingState) -> jax.Array:
    """The distribution a request samples from: softmax(filter(logits / T)); greedy rows get
    a one-hot on the first maximum. logits [B, ..., V] -> probs (same shape, fp32). The
    softmax and the top-k / top-p / min-p threshold search run only when some row needs them
    (on a mesh: on each batch shard's own rows, `per_row`, like all sampling here)."""
    return per_row(_processed_probs)(logits, s)


def _processed_probs(logits: jax.Array, s: SamplingState) -> jax.Array:
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1]).astype(jnp.float32)
    rows = jnp.repeat(jnp.arange(shape[0]), flat.shape[1])
    flat = flat.reshape(-1, shape[-1])
    t, top_k, top_p, min_p = s.temperature[rows], s.top_k[rows], s.top_p[rows], s.min_p[rows]
    sampled = t > 0
    greedy = jax.nn.one_hot(argmax_first(flat), shape[-1], dtype=jnp.float32)

    def sampled_probs(z):
        probs = jax.nn.softmax(processed_logits(z, t, top_k, top_p, min_p), axis=-1)
        return jnp.where(sampled[:, None], probs, greedy)

    return jax.lax.cond(jnp.any(sampled), sampled_probs, lambda _: greedy, flat).reshape(shape)


def _salted(seed, position, salt):
    return jax.random.fold_in(request_key(seed, position), salt)


def draw(probs: jax.Array, seeds: jax.Array, positions: jax.Array, salt: int) -> jax.Array:
    """One draw per row from probs [B, V] with the key of (seed, position, salt)."""
    return per_row(functools.partial(_draw, salt=salt))(probs, seeds, positions)


def _draw(probs: jax.Array, seeds: jax.Array, positions: jax.Array, salt: int) -> jax.Array:
    keys = jax.vmap(lambda s, p: _salted(s, p, salt))(seeds, positions)
    return categorical(keys, jnp.log(jnp.maximum(probs, 0.0)))


def accept(p: jax.Array, q: jax.Array, drafts: jax.Array, limit: jax.Array, s: SamplingState, start: jax.Array):
    """`_accept` on each batch shard's own rows (`per_row`)."""
    return per_row(_accept)(p, q, drafts, limit, s, start)


def _accept(p: jax.Array, q: jax.Array, drafts: jax.Array, limit: jax.Array, s: SamplingState, start: jax.Array):
    """Lossless acceptance of the first `limit` [B] of k drafts. p [B, k+1, V] target, q
    [B, k, V] draft distributions, drafts [B, k]; start [B] = position of the pending token.
    -> (accepted count a [B], next token [B]): a drafts accepted, then `next`: drawn from the
    residual max(p - q, 0) at a rejection, from p itself when the drafts ran out (a = limit).
    The stopping point `limit` depends only on the drafter, so every choice is lossless."""
    k = drafts.shape[1]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    draft_pos = start[:, None] + 1 + jnp.arange(k)
    u = jax.vmap(jax.vmap(lambda sd, ps: jax.random.uniform(_salted(sd, ps, ACCEPT)), (None, 0)))(s.seed, draft_pos)
    greedy = s.temperature <= 0
    ok = jnp.where(greedy[:, None], p_d > 0.5, u * q_d < p_d)  # u < p/q without dividing by q = 0
    ok &= jnp.arange(k) < limit[:, None]
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # leading accepted drafts
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [B, V]
    q_a = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), a[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - jnp.where((a < limit)[:, None], q_a, 0.0), 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 1e-8, residual / jnp.maximum(mass, 1e-30), p_a)
    nxt = _draw(residual, s.seed, start + 1 + a, TOKEN)  # in per_row already
    return a, jnp.where(greedy, argmax_first(p_a), nxt)


def accept_greedy(logits: jax.Array, drafts: jax.Array, limit: jax.Array):
    """accept() for batches of greedy rows only, on the raw logits [B, k+1, V]: no
    distributions are formed. -> (a [B], next token [B])."""
    b, k1, v = logits.shape
    target = argmax_first(logits.reshape(b * k1, v)).reshape(b, k1)
    ok = (drafts == target[:, :-1]) & (jnp.arange(k1 - 1) < limit[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    return a, jnp.take_along_axis(target, a[:, None], axis=1)[:, 0]


# ----------------------------------------------------------------------------- drafting
@struct.dataclass
class Speculation:
    """Per slot: the MTP layer's window ring, the pending drafts and how many of them the
    next verify step checks."""

    mtp: AttentionState | DSparkRing  # V4.1: the DSpark stages' rings
    drafts: Drafts
    limit: jax.Array  # [B] int32


def init_speculation(cfg: ModelConfig, batch: int, n_drafts: int, dtype) -> Speculation:
    f32 = jnp.float32
    drafts = Drafts(jnp.zeros((batch, n_drafts), jnp.int32), jnp.zeros((batch, n_drafts, cfg.vocab_size), f32),
                    jnp.zeros((batch, n_drafts), f32))
    if cfg.v41 is not None:
        ring = empty_ring(cfg, batch, dtype)
    else:
        ring = jax.tree.map(lambda sh: jnp.zeros(sh.shape, sh.dtype), mtp_state_shapes(cfg, batch, dtype))
    return Speculation(ring, drafts, jnp.zeros((batch,), jnp.int32))


def calibrated(confidence: jax.Array, acceptance: jax.Array) -> jax.Array:
    """np.interp(confidence, calibration_centres(), acceptance), clamped at the end centres,
    as a sum of hat functions over the equally spaced centres: elementwise, so batch-major
    confidences stay on their batch shards (jnp.interp's table lookup is a gather)."""
    u = jnp.clip(confidence * CALIBRATION_BINS - 0.5, 0, CALIBRATION_BINS - 1)[..., None]
    hats = jnp.maximum(1.0 - jnp.abs(u - jnp.arange(CALIBRATION_BINS, dtype=u.dtype)), 0.0)
    return jnp.sum(hats * acceptance, axis=-1)


def choose_limits(confidence: jax.Array, costs: jax.Array | None, acceptance: jax.Array | None = None) -> jax.Array:
    """How many drafts to verify per row. Fixed (costs None): all of them. Otherwise the k
    maximising expected tokens per unit cost, (1 + sum_{j<=k} prod_{i<=j} c_i) / cost[k]:
    the prefix-survival estimate from the drafts' acceptance chances c [B, K] against the
    measured cost curve cost [K+1] of a verify step over k+1 positions. c is the drafter's
    own confidence, calibrated when `acceptance` (observed acceptance at the bin centres)
    is given: interpolated between the centres."""
    b, k = confidence.shape
    if costs is None:
        return jnp.zeros_like(confidence[:, 0], jnp.int32) + k  # batch-major like confidence (a mesh)
    if acceptance is not None:
        confidence = calibrated(confidence, acceptance)
    survival = jnp.cumprod(confidence, axis=1)
    expected = 1.0 + jnp.concatenate([jnp.zeros_like(survival[:, :1]), jnp.cumsum(survival, axis=1)],
                                     axis=1)  # [B, K+1]
    return jnp.argmax(expected / costs[None, :], axis=1).astype(jnp.int32)


def commit_and_draft(params: ModelParams, mtp: MTPParams, mtp_state: AttentionState, streams: jax.Array,
                     next_tokens: jax.Array, start: jax.Array, n_valid: jax.Array, s: SamplingState,
                     old: Drafts, cfg: ModelConfig, *, sampled: bool, confidence: bool, draft=True,
                     vocab: DraftVocab | None = None, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """Commit true positions start .. start+n_valid-1 to the MTP ring (target streams
    [B, C, N, D] and the tokens after them [B, C]), then draft as many tokens as `old` holds
    from the last one by reusing the MTP layer on its own output streams (on a scratch copy
    of the ring, so the ring only ever holds true positions and needs no rollback).
    sampled=False (every row greedy): draft by argmax and leave old.q untouched;
    confidence=False (fixed policy): no confidences (old's kept). draft: a traced bool to
    draft only when it holds (prefill: on a prompt's last chunk), else `old` is returned.
    vocab: draft only among its ids (None: the full vocabulary)."""
    out, mtp_state = mtp_forward(mtp, params, streams, next_tokens, cfg, mtp_state, start=start, n_valid=n_valid,
                                 opts=opts)
    h = last_valid(out, n_valid)  # [B, 1, N, D]
    pos = start + jnp.maximum(n_valid - 1, 0)  # the position the MTP step just ran at; it predicts pos + 2
    row_sampled = s.temperature > 0

    def draft_one(h, pos):
        """One draft from the MTP output streams h at pos (predicting pos + 2). With a draft
        vocabulary, logits / q / the draw are over D (index j) and d = D[j]; q leaves here
        scattered into the full vocabulary."""
        if vocab is None:
            head, weight = lambda: mtp_head(mtp, params, h, cfg)[:, 0], lm_head_weight(params)  # [B, V]
            full_id = lambda j: j  # noqa: E731
        else:
            head, weight = lambda: head_logits(mtp.hc_head, mtp.norm, vocab.head, h, cfg)[:, 0], vocab.head  # [B, |D|]
            full_id = lambda j: vocab.ids[j]  # noqa: E731
        logits = rows_logits(head, weight, n_valid, h.dtype)  # a 16-bit head read in place in the draft loop too
        out = {}
        if sampled:
            q = processed_probs(logits, s)
            j = jnp.where(row_sampled, draw(q, s.seed, pos + 2, DRAFT), argmax_first(logits))
            out["q"] = q if vocab is None else jnp.zeros((q.shape[0], cfg.vocab_size), q.dtype).at[:, vocab.ids].set(q)
        else:
            j = argmax_first(logits)
        if confidence:  # q(d); for greedy rows (q one-hot) the drafter's softmax (over D) at d
            at_j = jnp.take_along_axis(logits, j[:, None], axis=1)[:, 0]
            conf = jnp.exp(at_j - jax.nn.logsumexp(logits, axis=-1))
            if sampled:
                conf = jnp.where(row_sampled, jnp.take_along_axis(q, j[:, None], axis=1)[:, 0], conf)
            out["confidence"] = conf
        return full_id(j), out

    def one(carry, _):  # the layer again, on its own output streams and the draft it just made
        h, scratch, pos, d = carry
        h, scratch = mtp_forward(mtp, params, h, d[:, None], cfg, scratch, start=pos + 1, n_valid=jnp.ones_like(pos),
                                 opts=opts)
        d, out = draft_one(h, pos + 1)
        return (h, scratch, pos + 1, d), (d, out)

    def chain() -> Drafts:
        first, first_out = draft_one(h, pos)
        _, (rest, rest_out) = jax.lax.scan(one, (h, mtp_state, pos, first), None, length=old.tokens.shape[1] - 1)
        stack = lambda a, b: jnp.concatenate([a[:, None], jnp.moveaxis(b, 0, 1)], axis=1)  # noqa: E731  [B, K, ...]
        return Drafts(stack(first, rest), stack(first_out["q"], rest_out["q"]) if sampled else old.q,
                      stack(first_out["confidence"], rest_out["confidence"]) if confidence else old.confidence)

    return mtp_state, chain() if draft is True else jax.lax.cond(jnp.any(draft), chain, lambda: old)


def at(x: jax.Array, i: jax.Array) -> jax.Array:
    """x [B, C, ...] at position i [B] of each row -> [B, ...] (take_along_axis: row-local on a
    mesh, where indexing by an arange of rows would gather across the batch shards)."""
    return jnp.take_along_axis(x, i.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def dspark_commit_and_draft(params, ds: DSparkParams, ring: DSparkRing, hidden: jax.Array, next_tokens: jax.Array,
                            start: jax.Array, n_valid: jax.Array, s: SamplingState, old: Drafts, cfg: ModelConfig, *,
                            sampled: bool, confidence: bool, draft=True, vocab: DraftVocab | None = None,
                            opts: RuntimeOptions = DEFAULT_OPTIONS):
    """`commit_and_draft` for DeepSeek-V4.1's DSpark head: write the main-stream keys of the
    true positions start .. start+n_valid-1 (their taps hidden [B, C, T * D]) into the stages'
    rings, then draft from the last one the block after its next token. Each draft is corrected
    by the one before; greedy rows take the argmax, sampled ones (sampled=True) draw from the
    request's processed distribution of the corrected logits, which is then q. confidence:
    sigma of the confidence head. vocab must be None (DSpark scores the full vocabulary)."""
    del vocab
    c = hidden.shape[1]
    i = jnp.arange(c)
    ring = dspark_seed(ds, hidden, start[:, None] + i, ring, cfg, i[None] < n_valid[:, None], opts=opts)
    last = jnp.maximum(n_valid - 1, 0)
    t = start + last  # the last committed position: the drafts are for t + 2 ..
    row_sampled = s.temperature > 0

    def pick(logits, j):
        if not sampled:
            return argmax_first(logits)
        return jnp.where(row_sampled, draw(processed_probs(logits, s), s.seed, t + 2 + j, DRAFT), argmax_first(logits))

    def chain() -> Drafts:  # the ring it returns is `ring` again (rho_t is written above), unless n_valid is 0
        _, tokens, logits, conf = dspark_draft(ds, params, at(next_tokens, last), at(hidden, last), t, ring, cfg,
                                               pick=pick, opts=opts)
        k = old.tokens.shape[1]
        return Drafts(tokens[:, :k], processed_probs(logits[:, :k], s) if sampled else old.q,
                      jax.nn.sigmoid(conf[:, :k]) if confidence else old.confidence)

    return ring, chain() if draft is True else jax.lax.cond(jnp.any(draft), chain, lambda: old)


def target_chunk(params, tokens: jax.Array, cfg: ModelConfig, cache: Cache, *, opts: RuntimeOptions,
                 n_valid: jax.Array, ctx_bucket: int, last_only: bool = False):
    """The target over a chunk tokens [B, C] -> (logits fp32 [B, C, V] (last_only: [B, 1, V]
    at each row's last valid position), what its drafter reads (V4: the streams [B, C, N, D];
    V4.1: DSpark's taps [B, C, T * D]), cache)."""
    if cfg.v41 is None:
        streams, cache = decoder_streams(params, tokens, cfg, cache, opts=opts, n_valid=n_valid, ctx_bucket=ctx_bucket)
        return logits_of(params, last_valid(streams, n_valid) if last_only else streams, cfg), streams, cache
    logits, cache, hidden = v41_forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, taps=True)
    return logits, hidden, cache


def _drafter(cfg: ModelConfig):
    return commit_and_draft if cfg.v41 is None else dspark_commit_and_draft


def update_speculation(spec: Speculation, mtp_state: AttentionState, drafts: Drafts, rows: jax.Array,
                       schedule: Schedule | None) -> Speculation:
    """The new ring and drafts for `rows` [B] (bool); the other rows keep theirs."""
    def keep(new, old, axis=0):
        if new is old:  # not recomputed (greedy-only q, fixed-policy confidence)
            return old
        return jnp.where(jnp.expand_dims(rows, [d for d in range(new.ndim) if d != axis]), new, old)

    drafts = Drafts(*(keep(n, o) for n, o in zip((drafts.tokens, drafts.q, drafts.confidence),
                                                 (spec.drafts.tokens, spec.drafts.q, spec.drafts.confidence))))
    limits = choose_limits(drafts.confidence, None) if schedule is None else \
        choose_limits(drafts.confidence, schedule.costs, schedule.acceptance)
    ring = jax.tree.map(keep, mtp_state, spec.mtp, batch_axes(spec.mtp))
    return Speculation(ring, drafts, keep(limits, spec.limit))


# ----------------------------------------------------------------------------- steps
@struct.dataclass
class Verified:
    """What a verify step produced, per row: the tokens it emits (the first `count`) and
    the target's logits at each position they were chosen from."""

    tokens: jax.Array  # [B, k+1] int32: a accepted drafts, then the next token
    count: jax.Array  # [B] tokens emitted (a + 1 for active rows, fewer at a stop)
    finished: jax.Array  # [B] bool
    checked: jax.Array  # [B] drafts verified (the row's limit)
    accepted: jax.Array  # [B] drafts accepted (a)
    logits: jax.Array  # [B, k+1, V] fp32: the target's, tokens[:, i] was chosen from logits[:, i]


def verify(params: ModelParams, mtp: MTPParams, cache: Cache, spec: Speculation, slots, *, k: int,
           cfg: ModelConfig, ctx_bucket: int, schedule: Schedule | None, sampled: bool = True,
           vocab: DraftVocab | None = None, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """One speculative step for every active slot: feed [pending token, first k drafts] in
    one target forward, accept (at most each row's limit), roll the caches back to the
    kept positions, commit them to the MTP ring and draft anew. sampled=False: a batch of
    greedy rows only (no distributions formed: argmax on the logits). vocab: the drafter's
    reduced vocabulary for the next drafts (None: full); verification always uses the full head.
    -> (cache, spec, slots, Verified)."""
    start, active = cache.length, slots.active
    drafts = spec.drafts
    tokens = jnp.concatenate([slots.last_token[:, None], drafts.tokens[:, :k]], axis=1)  # [B, k+1]
    positions = start[:, None] + jnp.arange(k + 1)
    saved, history = save_rows(cache, positions, cfg), cache.history
    logits, streams, cache = target_chunk(params, tokens, cfg, cache, opts=opts, n_valid=jnp.where(active, k + 1, 0),
                                          ctx_bucket=ctx_bucket)
    limit = jnp.where(active, jnp.minimum(spec.limit, k), 0)
    if reference_key_rule(cfg, opts):  # exact at positions t <= 2 start + 1 only: a row keeps at most
        limit = jnp.minimum(limit, start + 1)  # start + 1 drafts (a short prompt's first steps)
    if sampled:
        p = processed_probs(logits, slots.sampling)
        a, nxt = accept(p, drafts.q[:, :k], drafts.tokens[:, :k], limit, slots.sampling, start)
    else:
        a, nxt = accept_greedy(logits, drafts.tokens[:, :k], limit)
    i = jnp.arange(k + 1)
    produced = jnp.where(i < a[:, None], jnp.pad(drafts.tokens[:, :k], ((0, 0), (0, 1))), nxt[:, None])
    cache = restore_rows(cache, saved, positions, (i > a[:, None]) & active[:, None], cfg)
    kept = jnp.where(active, a + 1, 0)
    cache = cache.replace(length=start + kept)
    tables = getattr(params, "engram_tables", None)
    if tables is not None:  # the Engram ids of the kept positions only
        cache = cache.replace(history=kept_history(tables.token_map, history, tokens, kept))
    slots, count, finished = emit_tokens(slots, produced, a + 1, start)
    mtp_state, new = _drafter(cfg)(params, mtp, spec.mtp, streams, produced, start, kept, slots.sampling, drafts, cfg,
                                   sampled=sampled, confidence=schedule is not None, vocab=vocab, opts=opts)
    spec = update_speculation(spec, mtp_state, new, active, schedule)
    return cache, spec, slots, Verified(produced, count, finished, limit, a, logits)


def prefill_chunk(params: ModelParams, mtp: MTPParams, cache: Cache, spec: Speculation, tokens: jax.Array,
                  next_tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array, emit, *, cfg: ModelConfig,
                  ctx_bucket: int, schedule: Schedule | None, sampled: bool = True,
                  vocab: DraftVocab | None = None, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """A prompt chunk tokens [B, C] through the target and the MTP ring. next_tokens [B, C]:
    the token after each (from the prompt; after its end, the sampled first token).
    `emit(logits [B, V], length [B], is_last [B]) -> (first token [B], sampling state, aux)`
    samples the first token of rows whose prompt ends here; their drafts follow it.
    -> (cache, spec, aux)."""
    start = cache.length
    logits, streams, cache = target_chunk(params, tokens, cfg, cache, opts=opts, n_valid=n_valid,
                                          ctx_bucket=ctx_bucket, last_only=True)
    last = jnp.maximum(n_valid - 1, 0)
    logits = logits[:, 0]
    first, sampling, aux = emit(logits, cache.length, is_last)
    at_last = (jnp.arange(tokens.shape[1])[None] == last[:, None]) & is_last[:, None]  # row-local: no gather
    next_tokens = jnp.where(at_last, first[:, None], next_tokens)
    mtp_state, drafts = _drafter(cfg)(params, mtp, spec.mtp, streams, next_tokens, start, n_valid, sampling,
                                      spec.drafts, cfg, sampled=sampled, confidence=schedule is not None,
                                      draft=is_last, vocab=vocab, opts=opts)
    return cache, update_speculation(spec, mtp_state, drafts, n_valid > 0, schedule), aux
