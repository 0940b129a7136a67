"""Speculative decoding with the model's drafter (`dsjax.model.interface.Drafter`: V4's MTP
layer, V4.1's DSpark head): k drafts per request verified in ONE jitted target forward over
k+1 positions, lossless acceptance, and rollback of every cache row the rejected positions
wrote.

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
the one plain decoding of the kept tokens builds (`save_written`, `roll_back`). The drafter
only ever commits true positions (the target's features of the kept positions), so its state
needs no rollback; this file draws its drafts (`DraftSampler`) and never branches on which
drafter it has.

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

DeepSeek-V4.1 (`dsjax.model.v41.dspark.DSparkDrafter`): the committed positions' taps feed the
DSpark stages' key rings, and one DSpark call drafts the block after the next token, each
draft drawn (as above, with the request's keys) from the processed Markov-corrected logits
given the drafts before it; its confidence head gives the confidence policy sigma(c_k). The
rollback also puts back the Engram id history.
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
from dsjax.model.interface import (DEFAULT_OPTIONS, Cache, Drafter, batch_axes, drafter_for, greedy_tokens,
                                   head_product, head_rows, reference_key_rule, roll_back, save_written, screens,
                                   step_head)
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


def draft_vocab(params, ids) -> DraftVocab:
    """The head rows of token ids [|D|] (checked ones, `dsjax.engine.spec_options.check_draft_vocab`)."""
    ids = jnp.asarray(ids, jnp.int32)
    return DraftVocab(ids, head_rows(params, ids))


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
    return accept_greedy_tokens(argmax_first(logits.reshape(b * k1, v)).reshape(b, k1), drafts, limit)


def screened_argmax(h: jax.Array, head, needed: jax.Array) -> jax.Array:
    """The first maximum of each row's fp32 logits h [R, D] @ head.T, reading the head's bf16
    screen (`greedy_tokens`: bitwise the fp32 logits' first maximum) and only the rows'
    candidate fp32 tiles. Rows in `needed` [R] that the screen leaves undecided send the whole
    batch to the fp32 logits (a `lax.cond`, as the plain decode step's `screened_tokens`);
    rows not needed (an idle slot, positions past a row's limit) may hold anything.
    -> tokens [R] int32."""
    tokens = greedy_tokens(h, head)
    return jax.lax.cond(jnp.all((tokens >= 0) | ~needed), lambda: jnp.maximum(tokens, 0),
                        lambda: argmax_first(head_product(h, head)))


def accept_greedy_tokens(target: jax.Array, drafts: jax.Array, limit: jax.Array):
    """accept_greedy on the target's greedy tokens [B, k+1] (the first maximum at each position)."""
    k1 = target.shape[1]
    ok = (drafts == target[:, :-1]) & (jnp.arange(k1 - 1) < limit[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    return a, jnp.take_along_axis(target, a[:, None], axis=1)[:, 0]


# ----------------------------------------------------------------------------- drafting
@struct.dataclass
class Speculation:
    """Per slot: the drafter's state (`Drafter.init_state`: the MTP layer's window ring, V4.1's
    DSpark stages' rings), the pending drafts and how many of them the next verify step checks."""

    mtp: object  # the drafter's state (the name kept from when the MTP layer was the only drafter)
    drafts: Drafts
    limit: jax.Array  # [B] int32


def init_speculation(cfg: ModelConfig, batch: int, n_drafts: int, dtype) -> Speculation:
    f32 = jnp.float32
    drafts = Drafts(jnp.zeros((batch, n_drafts), jnp.int32), jnp.zeros((batch, n_drafts, cfg.vocab_size), f32),
                    jnp.zeros((batch, n_drafts), f32))
    return Speculation(drafter_for(cfg).init_state(cfg, batch, dtype), drafts, jnp.zeros((batch,), jnp.int32))


def calibrated(confidence: jax.Array, acceptance: jax.Array) -> jax.Array:
    """np.interp(confidence, calibration_centres(), acceptance), clamped at the end centres,
    as a sum of hat functions over the equally spaced centres: elementwise, so batch-major
    confidences stay on their batch shards (jnp.interp's table lookup is a gather)."""
    u = jnp.clip(confidence * CALIBRATION_BINS - 0.5, 0, CALIBRATION_BINS - 1)[..., None]
    hats = jnp.maximum(1.0 - jnp.abs(u - jnp.arange(CALIBRATION_BINS, dtype=u.dtype)), 0.0)
    return jnp.sum(hats * acceptance, axis=-1)


def choose_limits(confidence: jax.Array, costs: jax.Array | None, acceptance: jax.Array | None = None) -> jax.Array:
    """How many drafts to verify per row. Fixed (costs None): all of them. Otherwise the k >= 1
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
    # k >= 1: whether to verify at all is the host's choice (a plain step, `SpeculationPolicy`);
    # a row that checked none in a verify step would pay for the step and learn nothing
    return (jnp.argmax(expected[:, 1:] / costs[None, 1:], axis=1) + 1).astype(jnp.int32)


@struct.dataclass
class DraftSampler:
    """How drafts are drawn (`dsjax.model.interface.DraftSampling`): from each request's
    processed distribution with its (seed, position, DRAFT) key, greedy rows by argmax.
    sampled=False (every row greedy): no distributions formed; confidence=False (fixed
    policy): no confidences."""

    s: SamplingState
    row_sampled: jax.Array  # [B] bool: s.temperature > 0, formed once (a draft loop carries it)
    sampled: bool = struct.field(pytree_node=False)
    confidence: bool = struct.field(pytree_node=False)

    def pick(self, logits: jax.Array, position: jax.Array) -> jax.Array:
        if not self.sampled:
            return argmax_first(logits)
        return jnp.where(self.row_sampled, draw(processed_probs(logits, self.s), self.s.seed, position, DRAFT),
                         argmax_first(logits))

    def choose(self, logits: jax.Array, position: jax.Array):
        """-> (draft j [B], q [B, V'] or None, confidence [B] or None): q(d); for greedy rows (q
        one-hot) the drafter's softmax at d."""
        row_sampled, q, conf = self.row_sampled, None, None
        if self.sampled:
            q = self.probs(logits)
            j = jnp.where(row_sampled, draw(q, self.s.seed, position, DRAFT), argmax_first(logits))
        else:
            j = argmax_first(logits)
        if self.confidence:
            at_j = jnp.take_along_axis(logits, j[:, None], axis=1)[:, 0]
            conf = jnp.exp(at_j - jax.nn.logsumexp(logits, axis=-1))
            if self.sampled:
                conf = jnp.where(row_sampled, jnp.take_along_axis(q, j[:, None], axis=1)[:, 0], conf)
        return j, q, conf

    def probs(self, logits: jax.Array) -> jax.Array:
        return processed_probs(logits, self.s)


def commit_and_draft(drafter: Drafter, params, weights, state, features, next_tokens: jax.Array, start: jax.Array,
                     n_valid: jax.Array, s: SamplingState, old: Drafts, cfg: ModelConfig, *, sampled: bool,
                     confidence: bool, draft=True, vocab: DraftVocab | None = None,
                     opts: RuntimeOptions = DEFAULT_OPTIONS):
    """Commit true positions start .. start+n_valid-1 to the drafter's state (the target's
    features of them and the tokens after them [B, C]), then draft as many tokens as `old`
    holds after the last one (`Drafter`). sampled=False (every row greedy): drafts by argmax,
    old.q kept; confidence=False (fixed policy): old's confidences kept. draft: a traced bool
    to draft only when it holds (prefill: on a prompt's last chunk), else `old` is returned.
    vocab: draft only among its ids (None: the full vocabulary)."""
    state, context = drafter.commit(weights, params, state, features, next_tokens, start, n_valid, cfg, opts)
    sampler = DraftSampler(s, s.temperature > 0, sampled, confidence)

    def chain() -> Drafts:
        tokens, q, conf = drafter.draft(weights, params, state, context, cfg, opts, k=old.tokens.shape[1],
                                        sampler=sampler, vocab=vocab)
        return Drafts(tokens, old.q if q is None else q, old.confidence if conf is None else conf)

    return state, chain() if draft is True else jax.lax.cond(jnp.any(draft), chain, lambda: old)


def update_speculation(spec: Speculation, mtp_state, drafts: Drafts, rows: jax.Array,
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
    logits: jax.Array | None  # [B, k+1, V] fp32: the target's, tokens[:, i] was chosen from logits[:, i]
    # (None when a greedy batch verified through the head's screen: `verify`)


def verify(params, mtp, cache: Cache, spec: Speculation, slots, *, k: int,
           cfg: ModelConfig, ctx_bucket: int, schedule: Schedule | None, sampled: bool = True,
           vocab: DraftVocab | None = None, opts: RuntimeOptions = DEFAULT_OPTIONS, screen: bool = True,
           cold: jax.Array | None = None):
    """One speculative step for every active slot: feed [pending token, first k drafts] in
    one target forward, accept (at most each row's limit), roll the caches back to the
    kept positions, commit them to the drafter and draft anew. sampled=False: a batch of
    greedy rows only (no distributions formed: argmax on the logits). vocab: the drafter's
    reduced vocabulary for the next drafts (None: full); verification always uses the full head.
    A greedy batch whose head carries the greedy screen (`screens(params)`, a drafter whose
    target gives the head's input: `Drafter.screens_verify`; screen=False: the logits are
    wanted, for logprobs) verifies through it as the plain decode step reads its head: each of
    the k+1 positions' first maximum from the bf16 screen and a few fp32 tiles, bitwise the
    fp32 logits' argmax, so the greedy test is unchanged and no [B, k+1, V] logits are formed.
    cold [B] (or None): rows whose pending drafts are not theirs (an earlier request's, the
    prompt prefilled without the drafter) check none: one token, then drafts of their own.
    -> (cache, spec, slots, Verified)."""
    start, active = cache.length, slots.active
    drafts = spec.drafts
    tokens = jnp.concatenate([slots.last_token[:, None], drafts.tokens[:, :k]], axis=1)  # [B, k+1]
    positions = start[:, None] + jnp.arange(k + 1)
    drafter = drafter_for(cfg)
    saved = save_written(cache, positions, cfg)
    screened = screen and not sampled and drafter.screens_verify and screens(params)
    logits, features, cache = drafter.target_chunk(params, tokens, cfg, cache, opts=opts,
                                                   n_valid=jnp.where(active, k + 1, 0), ctx_bucket=ctx_bucket,
                                                   hidden=screened)
    limit = jnp.where(active if cold is None else active & ~cold, jnp.minimum(spec.limit, k), 0)
    if reference_key_rule(cfg, opts):  # exact at positions t <= 2 start + 1 only: a row keeps at most
        limit = jnp.minimum(limit, start + 1)  # start + 1 drafts (a short prompt's first steps)
    if screened:  # the positions a row's test reads: its pending token's and its first `limit` drafts'
        b = tokens.shape[0]
        needed = active[:, None] & (jnp.arange(k + 1) <= limit[:, None])
        target = screened_argmax(logits.reshape(b * (k + 1), -1), step_head(params), needed.reshape(-1))
        a, nxt = accept_greedy_tokens(target.reshape(b, k + 1), drafts.tokens[:, :k], limit)
        logits = None
    elif sampled:
        p = processed_probs(logits, slots.sampling)
        a, nxt = accept(p, drafts.q[:, :k], drafts.tokens[:, :k], limit, slots.sampling, start)
    else:
        a, nxt = accept_greedy(logits, drafts.tokens[:, :k], limit)
    i = jnp.arange(k + 1)
    produced = jnp.where(i < a[:, None], jnp.pad(drafts.tokens[:, :k], ((0, 0), (0, 1))), nxt[:, None])
    kept = jnp.where(active, a + 1, 0)
    cache = roll_back(params, cache, saved, positions, (i > a[:, None]) & active[:, None], tokens, kept, cfg)
    slots, count, finished = emit_tokens(slots, produced, a + 1, start)
    mtp_state, new = commit_and_draft(drafter, params, mtp, spec.mtp, features, produced, start, kept, slots.sampling,
                                      drafts, cfg, sampled=sampled, confidence=schedule is not None, vocab=vocab,
                                      opts=opts)
    spec = update_speculation(spec, mtp_state, new, active, schedule)
    return cache, spec, slots, Verified(produced, count, finished, limit, a, logits)


def prefill_chunk(params, mtp, cache: Cache, spec: Speculation, tokens: jax.Array,
                  next_tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array, emit, *, cfg: ModelConfig,
                  ctx_bucket: int, schedule: Schedule | None, sampled: bool = True,
                  vocab: DraftVocab | None = None, opts: RuntimeOptions = DEFAULT_OPTIONS):
    """A prompt chunk tokens [B, C] through the target and the drafter's state. next_tokens [B, C]:
    the token after each (from the prompt; after its end, the sampled first token).
    `emit(logits [B, V], length [B], is_last [B]) -> (first token [B], sampling state, aux)`
    samples the first token of rows whose prompt ends here; their drafts follow it.
    -> (cache, spec, aux)."""
    start, drafter = cache.length, drafter_for(cfg)
    logits, features, cache = drafter.target_chunk(params, tokens, cfg, cache, opts=opts, n_valid=n_valid,
                                                   ctx_bucket=ctx_bucket, last_only=True)
    last = jnp.maximum(n_valid - 1, 0)
    logits = logits[:, 0]
    first, sampling, aux = emit(logits, cache.length, is_last)
    at_last = (jnp.arange(tokens.shape[1])[None] == last[:, None]) & is_last[:, None]  # row-local: no gather
    next_tokens = jnp.where(at_last, first[:, None], next_tokens)
    mtp_state, drafts = commit_and_draft(drafter, params, mtp, spec.mtp, features, next_tokens, start, n_valid,
                                         sampling, spec.drafts, cfg, sampled=sampled, confidence=schedule is not None,
                                         draft=is_last, vocab=vocab, opts=opts)
    return cache, update_speculation(spec, mtp_state, drafts, n_valid > 0, schedule), aux
