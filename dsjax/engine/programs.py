"""The engine's jitted device programs: each takes the cache [slots, ...] and the `Slots`
state (donated), runs one prefill chunk / decode step / verify step, and describes what
it produced in a `DeviceOutput` stacked [steps, B]. The runner (`dsjax.engine.runner`)
calls them; they are pure functions of their arguments.

Plain engines: `prefill_step` (one slot's row, gathered from and scattered back into the
cache), `prefill_rows` (every row at once: the path under a mesh, where one row of a
batch-sharded cache cannot be sliced out) and `decode_step`. Speculative engines:
`spec_prefill_step` and `spec_decode_step` (a verify step over k drafts,
`dsjax.engine.speculative`). Every one of them books its tokens with `emit_tokens`.

Prefix caching (`dsjax.engine.prefix_cache`) adds two: `save_block` copies a block of a row
out, `restore_block` puts one back into a row (and admits its request with block 0).

Capture (`Engine(capture=...)`, `dsjax.engine.capture`): the forward programs take the
points to record (full dsjax.inspect names) as a static argument; with some, they run the
forward through `forward_capturing` and their output carries each emitted token's values
(`capture`) and, from a prefill, every chunk position's (`prompt_capture`). With none (every
engine that does not ask) they are the programs they were: the same trace, the same outputs.

Compile time is part of performance, so the engine's life needs no other program: the
state is made by one program (`init_state`), a prompt's first chunk admits its request
(the prefill programs take an `Admission`) and a cancel reaches the device with the next
decode step (the decode programs take the rows `cancelled`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.engine.sampler import SamplingState, asked_logprobs, sample_tokens
from dsjax.engine.slots import Admission, Slots, emit_tokens, init_slots, take_prompt_chunk
from dsjax.engine.speculative import DraftVocab, Schedule, Speculation, init_speculation, prefill_chunk, verify
from dsjax.model.interface import (INVARIANT_ROWS, Cache, CacheBlock, PackedHead, forward, forward_capturing,
                                   greedy_tokens, head_product, init_cache, over_tiles, put_block, put_rows, screens,
                                   step_head, take_block, take_rows)
from dsjax.sharding.rules import current_mesh, per_row, rows

# XLA:CPU vectorises the loops it emits itself (its matrix-vector products and fusions; library
# GEMMs are untouched) 256 bits wide by default, even on CPUs with AVX-512. The engine's decode
# steps are such loops reading weights from memory, and 512 bits ran them faster
# (docs/cpu-decode.md, "512-bit loops"). LLVM keeps to the CPU's widest vectors
# (AVX2: 256); GPU and TPU compilers do not read xla_cpu_* options (not yet run on one: no GPU
# lent so far). `compiler_options` only apply to top-level programs, so `forward` (called
# inside these) cannot carry them.
COMPILER_OPTIONS = {"xla_cpu_prefer_vector_width": 512}
program = functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)


@struct.dataclass
class DeviceOutput:
    """What one program produced, per step and row."""

    tokens: jax.Array  # [B]
    emitted: jax.Array  # [B] bool: a token was produced for this slot
    finished: jax.Array  # [B] bool
    logprob: jax.Array | None  # [B]   (programs with n_logprobs > 0; computed where a row asks, else zeros)
    top_values: jax.Array | None  # [B, n]
    top_ids: jax.Array | None
    drafts_checked: jax.Array | None = None  # [B] speculative engines: drafts verified this step
    drafts_accepted: jax.Array | None = None  # [B]
    next_limit: jax.Array | None = None  # [B] drafts each row asks the next step to verify
    draft_confidence: jax.Array | None = None  # [B, k] the drafter's confidence in the drafts verified (confidence)
    prompt_logprob: jax.Array | None = None  # [B, C] prefill with score=True: each position's next prompt token
    prompt_rank: jax.Array | None = None  # [B, C] int32: 1 + how many tokens are more likely
    prompt_top_values: jax.Array | None = None  # [B, C, n]
    prompt_top_ids: jax.Array | None = None
    capture: dict | None = None  # name -> [B, ...]: what the forward that made each token recorded (capture)
    prompt_capture: dict | None = None  # name -> [B, C, ...]: a prefill's every chunk position


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def screened_tokens(h: jax.Array, head: PackedHead, s: SamplingState, positions: jax.Array, rows: jax.Array,
                    n_logprobs: int = 0, mask: jax.Array | None = None):
    """`sample_tokens(h @ head.T, s, positions, mask)` [B] from the head's input rows h [B, D]
    (fp32). When every row in `rows` [B] is greedy, unpenalised, unbiased, asks for no logprobs
    and (mask [B, ceil(V/32)], a prompt's first token) may take any token, the screen finds
    each row's first maximum reading the head's bf16 copy and the fp32 tiles of a few
    candidates: the same tokens, bitwise, as the full product (`cpu_kernels.greedy_tokens`).
    Otherwise, or where the screen leaves a row undecided, the full fp32 logits and the
    sampler. n_logprobs > 0: -> (tokens, `asked_logprobs` of the rows in `rows` asking: zeros
    when the screen decided)."""
    plain = (s.temperature == 0) & (s.repetition_penalty == 1) & (s.presence_penalty == 0) & (
        s.frequency_penalty == 0) & jnp.all(s.bias_values == 0, axis=-1)
    if n_logprobs:
        plain &= s.logprobs == 0
    if mask is not None:
        plain &= jnp.all(mask == jnp.uint32(0xFFFFFFFF), axis=-1)
    undecided = jnp.full(h.shape[:1], -1, jnp.int32)
    tokens = jax.lax.cond(jnp.all(plain | ~rows), lambda: greedy_tokens(h, head), lambda: undecided)

    def full():
        logits = head_product(h, head)
        sampled = sample_tokens(logits, s, positions, mask)
        if not n_logprobs:
            return sampled
        return sampled, asked_logprobs(logits, sampled, rows & (s.logprobs > 0), n_logprobs)

    def screened():
        found = jnp.maximum(tokens, 0)
        if not n_logprobs:
            return found
        b = found.shape[0]
        return found, (jnp.zeros((b,), jnp.float32), jnp.zeros((b, n_logprobs), jnp.float32),
                       jnp.zeros((b, n_logprobs), jnp.int32))

    return jax.lax.cond(jnp.all((tokens >= 0) | ~rows), screened, full)


@jax.named_scope("sampler")  # a profile's op group (benchmarks/decode_trace.py)
def sample_and_emit(slots: Slots, logits: jax.Array, positions: jax.Array, emitting: jax.Array,
                    mask: jax.Array | None = None, *, n_logprobs: int):
    """Sample one token [B] from logits [B, V] at `positions` [B] for the rows in
    `emitting` (only among the tokens `mask` [B, ceil(V/32)] allows, if given), book it,
    describe the output."""
    tokens = sample_tokens(logits, slots.sampling, positions, mask)
    return emit_sampled(slots, tokens, positions, emitting, logits, n_logprobs=n_logprobs)


@jax.named_scope("sampler")
def emit_sampled(slots: Slots, tokens: jax.Array, positions: jax.Array, emitting: jax.Array,
                 logits: jax.Array | None = None, *, n_logprobs: int = 0):
    """Book the sampled tokens [B] for the rows in `emitting`, describe the output (with
    n_logprobs > 0, the logprobs from `logits` when an emitting row asks for them)."""
    asked = emitting & (slots.sampling.logprobs > 0)
    slots, _, finished = emit_tokens(slots, tokens[:, None], jnp.ones_like(positions), positions - 1, emitting)
    tokens = slots.last_token  # the sampled token where emitting, the old one elsewhere
    logprob = top_values = top_ids = None
    if n_logprobs:  # passes over the vocabulary: run in the steps where a row asks
        logprob, top_values, top_ids = asked_logprobs(logits, tokens, asked, n_logprobs)
    return slots, DeviceOutput(tokens, emitting, finished, logprob, top_values, top_ids)


def screened_emit(params, slots: Slots, h: jax.Array, positions: jax.Array, emitting: jax.Array, n_logprobs: int,
                  mask: jax.Array | None = None):
    """`sample_and_emit` from the head's input rows h [B, D] through the greedy screen of
    params' head (`screened_tokens`; `screens(params)` holds)."""
    picked = screened_tokens(h, step_head(params), slots.sampling, positions, emitting, n_logprobs, mask)
    tokens, logprobs = picked if n_logprobs else (picked, (None, None, None))
    slots, out = emit_sampled(slots, tokens, positions, emitting)
    return slots, out.replace(**dict(zip(("logprob", "top_values", "top_ids"), logprobs)))


def _one_step(tree):
    return jax.tree.map(lambda a: a[None], tree)


@functools.partial(program, static_argnames=("cfg", "batch", "capacity", "dtype", "num_draft_tokens"))
def init_state(*, cfg: ModelConfig, batch: int, capacity: int, dtype, num_draft_tokens: int):
    """An engine's empty device state, (cache, slots, speculation or None), made by one
    program: built eagerly, each distinct array shape compiles its own fill."""
    spec = init_speculation(cfg, batch, num_draft_tokens, dtype) if num_draft_tokens else None
    return init_cache(cfg, batch, capacity, dtype), init_slots(batch, capacity), spec


def _forward(params, tokens, cfg: ModelConfig, cache: Cache, capture: tuple[str, ...], **kw):
    """`forward`, or with points to `capture` the forward recording them: (logits, cache, name ->
    [B, C, ...] or None)."""
    if not capture:
        return *forward(params, tokens, cfg, cache, **kw), None
    return forward_capturing(params, tokens, cfg, cache, capture=capture, **kw)


def _at(found: dict | None, index: jax.Array | None = None) -> dict | None:
    """Each captured [B, C, ...] at chunk position index [B] (None: 0) -> [B, ...]."""
    if found is None:
        return None
    if index is None:
        return {n: a[:, 0] for n, a in found.items()}
    return {n: jnp.take_along_axis(a, index.reshape(-1, *(1,) * (a.ndim - 1)), axis=1)[:, 0] for n, a in found.items()}


def _stop_cancelled(slots: Slots, cancelled: jax.Array) -> Slots:
    return slots.replace(active=slots.active & ~cancelled)


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "n_logprobs", "n_steps", "capture"),
                   donate_argnames=("cache", "slots"))
def decode_step(params, cache: Cache, slots: Slots, cancelled: jax.Array, *, cfg: ModelConfig, opts: RuntimeOptions,
                ctx_bucket: int, n_logprobs: int, n_steps: int = 1, capture: tuple[str, ...] = ()):
    """n_steps decode steps for every slot in one dispatch (a device-side loop; finished
    slots stop on the device). Rows `cancelled` [B] stop first. Outputs are stacked
    [n_steps, B] (the captured points too)."""
    slots = _stop_cancelled(slots, cancelled)

    screened = screens(params)  # the head's input rows, the screen's greedy tokens

    def one(carry, _):
        cache, slots = carry
        active = slots.active
        logits, cache, found = _forward(params, slots.last_token[:, None], cfg, cache, capture, opts=opts,
                                        n_valid=active.astype(jnp.int32), ctx_bucket=ctx_bucket, last_only=True,
                                        hidden=screened)
        if screened:  # (one device: per_row is the function itself)
            slots, out = screened_emit(params, slots, logits[:, 0], cache.length, active, n_logprobs)
        else:
            emit = per_row(functools.partial(sample_and_emit, n_logprobs=n_logprobs))
            slots, out = emit(slots, logits[:, 0], cache.length, active)
        return (cache, slots), out.replace(capture=_at(found))

    if n_steps == 1:
        (cache, slots), out = one((cache, slots), None)
        return cache, slots, _one_step(out)
    (cache, slots), out = jax.lax.scan(one, (cache, slots), None, length=n_steps)
    return cache, slots, out


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "capture"),
                   donate_argnames=("cache", "slots"))
def decode_forward(params, cache: Cache, slots: Slots, cancelled: jax.Array, *, cfg: ModelConfig,
                   opts: RuntimeOptions, ctx_bucket: int, capture: tuple[str, ...] = ()):
    """The forward half of a decode step, for batches with a constrained row (structured
    output): rows `cancelled` [B] stop first; -> (cache, slots, next-token logits [B, V],
    their positions [B]). While the device runs it, the host brings the constrained rows'
    grammars up to the last token and computes their masks; `decode_sample` then samples.
    Together: `decode_step` with n_steps=1 and a mask. With capture, a fifth output: the
    captured points [1, B, ...] (for the sampling half's output)."""
    slots = _stop_cancelled(slots, cancelled)
    logits, cache, found = _forward(params, slots.last_token[:, None], cfg, cache, capture, opts=opts,
                                    n_valid=slots.active.astype(jnp.int32), ctx_bucket=ctx_bucket, last_only=True)
    if found is None:
        return cache, slots, logits[:, 0], cache.length
    return cache, slots, logits[:, 0], cache.length, _one_step(_at(found))


@functools.partial(program, static_argnames=("n_logprobs",), donate_argnames=("slots",))
def decode_sample(slots: Slots, logits: jax.Array, positions: jax.Array, mask: jax.Array, *, n_logprobs: int):
    """The sampling half: one token per active slot from logits [B, V], only among the tokens
    the packed mask [B, ceil(V/32)] uint32 allows (all ones for unconstrained rows)."""
    emit = per_row(functools.partial(sample_and_emit, n_logprobs=n_logprobs))
    slots, out = emit(slots, logits, positions, slots.active, mask)
    return slots, _one_step(out)


@functools.partial(program, donate_argnames=("slots",))
def start_decoding(slots: Slots, slot, token) -> Slots:
    """Make `slot` decode from `token` (its prompt's last, not yet cached): how a constrained
    request starts, so that its first token is sampled under a mask by decode_sample rather
    than inside a prefill chunk."""
    put = lambda a, v: a.at[slot].set(v, out_sharding=rows(a))  # noqa: E731
    return slots.replace(active=put(slots.active, True), last_token=put(slots.last_token, token))


def prompt_scores(logits: jax.Array, following: jax.Array, n: int):
    """Each position's raw-distribution logprob of the token after it (following [B, C]) from
    the chunk's logits [B, C, V], its rank (1: the most likely; vLLM's prompt_logprobs ranks)
    and the top n: [B, C], [B, C], [B, C, n] x 2 (n = 0: no top). Every logprob is its logit
    less the row's logsumexp, so the chosen token's equals its top entry's bit for bit when it
    is the top one (lm-eval's is_greedy compares them); the rank compares logits. A chunk's
    logits are C rows of the vocabulary: a few passes over them, no log-softmax array, and
    one top_k (lower ids first among equals) rather than the decode step's n repeated maxima."""
    b, c, v = logits.shape
    z = logits.reshape(b * c, v).astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    token = jnp.take_along_axis(z, following.reshape(-1, 1), axis=-1)[:, 0]
    rank = (jnp.sum(z > token[:, None], axis=-1, dtype=jnp.int32) + 1).reshape(b, c)
    chosen = (token - lse).reshape(b, c)
    if not n:
        return chosen, rank, None, None
    values, ids = jax.lax.top_k(z, n)
    return chosen, rank, (values - lse[:, None]).reshape(b, c, n), ids.reshape(b, c, n)


def _prefill(params, cache: Cache, slots: Slots, tokens, n_valid, is_last, admission: Admission, first_mask,
             cfg: ModelConfig, opts: RuntimeOptions, ctx_bucket: int, n_logprobs: int, following=None,
             capture: tuple[str, ...] = ()):
    slots, length = per_row(take_prompt_chunk)(slots, cache.length, tokens, n_valid, admission)
    cache = cache.admit(length, admission.reset)
    score = following is not None  # the chunk's every position through the head, not its last only
    screened = screens(params) and not score  # the head's input row, the first token through the greedy screen
    logits, cache, found = _forward(params, tokens, cfg, cache, capture, opts=opts, n_valid=n_valid,
                                    ctx_bucket=ctx_bucket, last_only=not score, hidden=screened)
    last = logits[:, 0]
    if score:  # the logits the first token is sampled from: the chunk's last valid position's
        last = jnp.take_along_axis(logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    if screened:  # (one device: per_row is the function itself)
        slots, out = screened_emit(params, slots, last, cache.length, is_last, n_logprobs, first_mask)
    else:
        slots, out = per_row(functools.partial(sample_and_emit, n_logprobs=n_logprobs))(
            slots, last, cache.length, is_last, first_mask)
    if score:
        chosen, rank, values, ids = prompt_scores(logits, following, n_logprobs)
        out = out.replace(prompt_logprob=chosen, prompt_rank=rank, prompt_top_values=values, prompt_top_ids=ids)
    if found is not None:  # the first token's: the chunk's last valid position
        out = out.replace(capture=_at(found, jnp.maximum(n_valid - 1, 0)), prompt_capture=found)
    return cache, slots, _one_step(out)


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "n_logprobs", "capture"),
                   donate_argnames=("cache", "slots"))
def prefill_rows(params, cache: Cache, slots: Slots, tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array,
                 admission: Admission, first_mask: jax.Array, following: jax.Array | None = None, *,
                 cfg: ModelConfig, opts: RuntimeOptions, ctx_bucket: int, n_logprobs: int,
                 capture: tuple[str, ...] = ()):
    """A prompt chunk for every slot at once (tokens [B, C]; rows with n_valid 0 untouched);
    rows whose prompt starts here (admission.reset [B]) take their request first, rows whose
    prompt ends here (is_last [B]) sample their first token among those first_mask [B,
    ceil(V/32)] uint32 allows (all ones but for a token-healed request). following [B, C]
    (the prompt token after each position) asks for prompt logprobs (`prompt_scores`): the
    head then runs at every position of the chunk, and the output carries them; None (the
    usual program) reads the head at the last position only. capture: the points to record
    (the output's `capture` at each row's last valid position, `prompt_capture` at all)."""
    return _prefill(params, cache, slots, tokens, n_valid, is_last, admission, first_mask, cfg, opts, ctx_bucket,
                    n_logprobs, following, capture)


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "n_logprobs", "capture"),
                   donate_argnames=("cache", "slots"))
def prefill_step(params, cache: Cache, slots: Slots, slot: jax.Array, tokens: jax.Array, n_valid: jax.Array,
                 is_last: jax.Array, admission: Admission, first_mask: jax.Array, following: jax.Array | None = None,
                 *, cfg: ModelConfig, opts: RuntimeOptions, ctx_bucket: int, n_logprobs: int,
                 capture: tuple[str, ...] = ()):
    """prefill_rows for the n rows from `slot` on (tokens [n, C], n_valid [n], is_last [n],
    admission rows [n], first_mask [n, W], following [n, C] or None; n = 1, or a
    batch-invariant tile): the cost of those rows, not of the whole batch."""
    n = tokens.shape[0]  # one row, or (batch-invariant) the slot's tile
    row_cache, row_slots, out = _prefill(params, take_rows(cache, slot, n), take_rows(slots, slot, n), tokens,
                                         n_valid, is_last, admission, first_mask, cfg, opts, ctx_bucket, n_logprobs,
                                         following, capture)
    return put_rows(cache, row_cache, slot), put_rows(slots, row_slots, slot), out


def _spec_prefill(params, mtp, cache: Cache, spec: Speculation, slots: Slots, tokens, next_tokens, n_valid, is_last,
                  admission: Admission, first_mask, schedule, vocab, cfg: ModelConfig, opts: RuntimeOptions,
                  ctx_bucket: int, sampled: bool, n_logprobs: int):
    slots, length = per_row(take_prompt_chunk)(slots, cache.length, tokens, n_valid, admission)
    cache = cache.admit(length, admission.reset)

    def emit(logits, length, last):
        state, out = per_row(functools.partial(sample_and_emit, n_logprobs=n_logprobs))(slots, logits, length, last,
                                                                                        first_mask)
        return out.tokens, state.sampling, (state, out)

    cache, spec, (slots, out) = prefill_chunk(params, mtp, cache, spec, tokens, next_tokens, n_valid, is_last, emit,
                                              cfg=cfg, ctx_bucket=ctx_bucket, schedule=schedule, sampled=sampled,
                                              vocab=vocab, opts=opts)
    return cache, spec, slots, _one_step(out)


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "sampled", "n_logprobs"),
                   donate_argnames=("cache", "spec", "slots"))
def spec_prefill_rows(params, mtp, cache: Cache, spec: Speculation, slots: Slots, tokens: jax.Array,
                      next_tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array, admission: Admission,
                      first_mask: jax.Array, schedule, vocab: DraftVocab | None, *, cfg: ModelConfig,
                      opts: RuntimeOptions, ctx_bucket: int, sampled: bool, n_logprobs: int):
    """prefill_rows for speculative engines (every slot at once, tokens [B, C]: the path under a
    mesh): the chunk also goes through the drafter's ring (next_tokens [B, C]: the token after
    each), and a prompt's last chunk drafts the first speculation after the sampled first
    token. sampled=False: the rows are greedy (drafts by argmax, no draft distributions).
    vocab: the drafter's reduced vocabulary (None: the full one)."""
    return _spec_prefill(params, mtp, cache, spec, slots, tokens, next_tokens, n_valid, is_last, admission,
                         first_mask, schedule, vocab, cfg, opts, ctx_bucket, sampled, n_logprobs)


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "sampled", "n_logprobs"),
                   donate_argnames=("cache", "spec", "slots"))
def spec_prefill_step(params, mtp, cache: Cache, spec: Speculation, slots: Slots, slot: jax.Array, tokens: jax.Array,
                      next_tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array, admission: Admission,
                      first_mask: jax.Array, schedule, vocab: DraftVocab | None, *, cfg: ModelConfig,
                      opts: RuntimeOptions, ctx_bucket: int, sampled: bool, n_logprobs: int):
    """spec_prefill_rows for the n rows from `slot` on (tokens [n, C]; n = 1, or a
    batch-invariant tile): the cost of those rows, not of the whole batch."""
    n = tokens.shape[0]  # one row, or (batch-invariant) the slot's tile
    row_cache, row_spec, row_slots, out = _spec_prefill(
        params, mtp, take_rows(cache, slot, n), take_rows(spec, slot, n), take_rows(slots, slot, n), tokens,
        next_tokens, n_valid, is_last, admission, first_mask, schedule, vocab, cfg, opts, ctx_bucket, sampled,
        n_logprobs)
    return put_rows(cache, row_cache, slot), put_rows(spec, row_spec, slot), put_rows(slots, row_slots, slot), out


@functools.partial(program, static_argnames=("cfg", "opts", "ctx_bucket", "k", "sampled", "n_logprobs"),
                   donate_argnames=("cache", "spec", "slots"))
def spec_decode_step(params, mtp, cache: Cache, spec: Speculation, slots: Slots, cancelled: jax.Array,
                     schedule: Schedule | None, vocab: DraftVocab | None, cold: jax.Array | None = None, *, k: int,
                     cfg: ModelConfig, opts: RuntimeOptions, ctx_bucket: int, sampled: bool, n_logprobs: int = 0):
    """One verify step over k drafts for every slot; outputs stacked [k+1, B] like
    decode_step's (with logprobs of each emitted token when n_logprobs > 0), with the drafts
    checked / accepted per row (and, for the confidence policy's calibration, the
    drafter's confidence in each). Rows `cancelled` [B] stop first; rows `cold` [B] (prefilled
    without the drafter: their pending drafts are not theirs) check none. sampled=False: every
    decoding row is greedy (argmax on the logits; no distributions formed). vocab: the
    drafter's reduced vocabulary (None: the full one). Batch-invariant mode: the whole step
    runs in tiles of INVARIANT_ROWS rows (`over_tiles`; on a mesh, one tile per device), as
    `forward` does."""

    def step(state, rows):
        (cache, spec, slots), (cancelled, cold) = state, rows
        slots = _stop_cancelled(slots, cancelled)
        judged = spec.drafts.confidence[:, :k] if schedule is not None else None
        cache, spec, slots, v = verify(params, mtp, cache, spec, slots, k=k, cfg=cfg, ctx_bucket=ctx_bucket,
                                       schedule=schedule, sampled=sampled, vocab=vocab, opts=opts,
                                       screen=not n_logprobs, cold=cold)
        logprob = top_values = top_ids = None
        if n_logprobs:  # of every position, when a row that emitted asks; the host reads those emitted
            b = v.tokens.shape[0]
            asked = jnp.repeat((v.count > 0) & (slots.sampling.logprobs > 0), k + 1)
            flat = asked_logprobs(v.logits.reshape(b * (k + 1), -1), v.tokens.reshape(-1), asked, n_logprobs)
            logprob, top_values, top_ids = (a.reshape(b, k + 1, *a.shape[1:]) for a in flat)
        j = jnp.arange(k + 1)[None]
        out = DeviceOutput(v.tokens, j < v.count[:, None], v.finished[:, None] & (j == v.count[:, None] - 1), logprob,
                         top_values, top_ids, v.checked, v.accepted, spec.limit, judged)
        return (cache, spec, slots), out

    if opts.batch_invariant and current_mesh() is None:  # on a mesh each device holds one tile, as in `forward`
        (cache, spec, slots), out = over_tiles(step, (cache, spec, slots), (cancelled, cold), INVARIANT_ROWS)
    else:
        (cache, spec, slots), out = step((cache, spec, slots), (cancelled, cold))
    per_position = lambda a: None if a is None else jnp.swapaxes(a, 0, 1)  # noqa: E731  [B, k+1, ...] -> [k+1, B, ...]
    out = out.replace(**{f: per_position(getattr(out, f)) for f in ("tokens", "emitted", "finished", "logprob",
                                                                     "top_values", "top_ids")})
    return cache, spec, slots, out


@functools.partial(program, static_argnames=("block", "layout"))
def save_block(cache: Cache, drafter, row, j, *, block: int, layout: tuple[int, ...]) -> CacheBlock:
    """Block j of cache row `row` (with its drafter ring, or None), copied out at its end."""
    return take_block(cache, drafter, row, j, block=block, layout=layout)


@functools.partial(program, static_argnames=("block", "layout"), donate_argnames=("cache", "slots", "drafter"))
def restore_block(cache: Cache, slots: Slots, drafter, blk: CacheBlock, tokens: jax.Array, row, j, admission: Admission, *,
                  block: int, layout: tuple[int, ...]):
    """Put cached block j (tokens [1, block]) into row `row` as if its prompt chunk had run
    there: the tokens are booked (`take_prompt_chunk`; block 0's admission resets the row to
    its request), the row's length becomes (j + 1) * block, the block's entries and end state
    are put in place. -> (cache, slots, drafter)."""
    row_slots, length = take_prompt_chunk(take_rows(slots, row), jax.lax.dynamic_slice_in_dim(cache.length, row, 1),
                                          tokens, jnp.full((1,), block, jnp.int32), admission)
    slots = put_rows(slots, row_slots, row)
    cache = cache.replace(length=jax.lax.dynamic_update_slice_in_dim(cache.length, length + block, row, 0))
    cache, drafter = put_block(cache, drafter, blk, row, j, block=block, layout=layout)
    return cache, slots, drafter
