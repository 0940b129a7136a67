"""`Engine`: fixed decode slots, continuous batching, streaming, async dispatch.

Device side (jitted, donated): the cache [slots, ...] and a `Slots` pytree of per-slot
sampling settings and decode state. Each `step()`:
  1. admits waiting requests into free slots;
  2. runs one prefill chunk per prefilling request (one row, gathered from / scattered
     back into the slot cache; the last chunk samples the first token);
  3. dispatches one decode step for all slots (finished / empty slots are no-ops);
  4. reads back the *previous* step's tokens while the device runs this one (JAX's async
     dispatch), turning them into events. Stop conditions are evaluated on the device, so
     the host being one step behind never feeds a finished slot.

With num_draft_tokens > 0 the decode step is a speculative verify step
(`dsjax.engine.speculative`): each slot's pending token and up to k MTP drafts go through
the target at once, and a slot advances by 1..k+1 tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.api import Model, check_token_ids
from dsjax.config import ModelConfig
from dsjax.model.cache import Cache, init_cache, min_ring
from dsjax.engine.sampler import SamplingParams, SamplingState, record_tokens, sample_tokens, top_logprobs
from dsjax.engine.speculative import Speculation, init_speculation, prefill_chunk, verify
from dsjax.engine.step import context_bucket, extend
from dsjax.sharding.distributed import to_host
from dsjax.sharding.rules import batch_sharding, per_row, rows

MAX_STOP_IDS = 16


@struct.dataclass
class Slots:
    sampling: SamplingState
    last_token: jax.Array  # [B] i32: the next decode input
    active: jax.Array  # [B] bool: decoding
    n_generated: jax.Array  # [B] i32
    max_tokens: jax.Array  # [B] i32
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] i32, -1 padded


@struct.dataclass
class StepOutput:
    tokens: jax.Array  # [B]
    emitted: jax.Array  # [B] bool: a token was produced for this slot
    finished: jax.Array  # [B] bool
    logprob: jax.Array | None  # [B]   (engines with max_logprobs > 0)
    top_values: jax.Array | None  # [B, n]
    top_ids: jax.Array | None
    drafts_checked: jax.Array | None = None  # [B] speculative engines: drafts verified this step
    drafts_accepted: jax.Array | None = None  # [B]
    next_limit: jax.Array | None = None  # [B] drafts each row asks the next step to verify


def _init_slots(batch: int, capacity: int) -> Slots:
    f32, i32 = jnp.float32, jnp.int32
    z = lambda dt: jnp.zeros((batch,), dt)  # noqa: E731
    return Slots(
        sampling=SamplingState(z(f32), z(i32), jnp.ones((batch,), f32), z(f32), jnp.ones((batch,), f32), z(f32),
                               z(f32), z(jnp.uint32), jnp.zeros((batch, capacity), i32), z(i32)),
        last_token=z(i32), active=z(bool), n_generated=z(i32), max_tokens=z(i32),
        stop_ids=jnp.full((batch, MAX_STOP_IDS), -1, i32))


def _emit(slots: Slots, logits: jax.Array, positions: jax.Array, emitting: jax.Array, n_logprobs: int):
    """Sample for the rows in `emitting`, update their decode state, describe the output."""
    tokens = sample_tokens(logits, slots.sampling, positions)
    tokens = jnp.where(emitting, tokens, slots.last_token)
    n_generated = slots.n_generated + emitting
    stop = jnp.any(tokens[:, None] == slots.stop_ids, axis=-1) | (n_generated >= slots.max_tokens)
    finished = emitting & stop
    logprob = top_values = top_ids = None
    if n_logprobs:  # a pass over the vocabulary per row: only for engines that report logprobs
        logprob, top_values, top_ids = top_logprobs(logits, tokens, n_logprobs)
    slots = slots.replace(sampling=record_tokens(slots.sampling, tokens, positions, emitting), last_token=tokens,
                          active=jnp.where(emitting, ~finished, slots.active), n_generated=n_generated)
    return slots, StepOutput(tokens, emitting, finished, logprob, top_values, top_ids)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx_bucket", "batch_invariant", "n_logprobs", "n_steps"),
                   donate_argnames=("cache", "slots"))
def decode_step(params, cache: Cache, slots: Slots, *, cfg: ModelConfig, ctx_bucket: int, batch_invariant: bool,
                n_logprobs: int, n_steps: int = 1):
    """n_steps decode steps for every slot in one dispatch (a device-side loop; finished
    slots stop on the device). Outputs are stacked [n_steps, B]."""

    def one(carry, _):
        cache, slots = carry
        active = slots.active
        logits, cache = extend(params, cache, slots.last_token[:, None], active.astype(jnp.int32), cfg=cfg,
                               ctx_bucket=ctx_bucket, batch_invariant=batch_invariant)
        slots, out = per_row(functools.partial(_emit, n_logprobs=n_logprobs))(slots, logits[:, 0], cache.length,
                                                                              active)
        return (cache, slots), out

    if n_steps == 1:
        (cache, slots), out = one((cache, slots), None)
        return cache, slots, jax.tree.map(lambda a: a[None], out)
    (cache, slots), out = jax.lax.scan(one, (cache, slots), None, length=n_steps)
    return cache, slots, out


def _row(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0), tree)


def _set_row(tree, row, i):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, i, axis=0), tree, row)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx_bucket", "n_logprobs"), donate_argnames=("cache", "slots"))
def prefill_step(params, cache: Cache, slots: Slots, slot: jax.Array, tokens: jax.Array, n_valid: jax.Array,
                 is_last: jax.Array, *, cfg: ModelConfig, ctx_bucket: int, n_logprobs: int):
    """One prompt chunk tokens [1, C] for one slot; on the last chunk, sample the first token."""
    logits, row = extend(params, _row(cache, slot), tokens, n_valid, cfg=cfg, ctx_bucket=ctx_bucket)
    cache = _set_row(cache, row, slot)
    slot_state, out = _emit(_row(slots, slot), logits[:, 0], row.length, is_last[None], n_logprobs)
    return cache, _set_row(slots, slot_state, slot), jax.tree.map(lambda a: a[None], out)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx_bucket", "n_logprobs"), donate_argnames=("cache", "slots"))
def prefill_rows(params, cache: Cache, slots: Slots, tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array, *,
                 cfg: ModelConfig, ctx_bucket: int, n_logprobs: int):
    """A prompt chunk for every slot at once (tokens [B, C]; rows with n_valid 0 untouched);
    rows whose prompt ends here sample their first token. The prefill path under a mesh,
    where one row of a batch-sharded cache cannot be sliced out."""
    logits, cache = extend(params, cache, tokens, n_valid, cfg=cfg, ctx_bucket=ctx_bucket)
    emit = per_row(functools.partial(_emit, n_logprobs=n_logprobs))
    slots, out = emit(slots, logits[:, 0], cache.length, is_last)
    return cache, slots, jax.tree.map(lambda a: a[None], out)


@functools.partial(jax.jit, static_argnames=("cfg", "ctx_bucket", "sampled"),
                   donate_argnames=("cache", "spec", "slots"))
def spec_prefill_step(params, mtp, cache: Cache, spec: Speculation, slots: Slots, slot: jax.Array, tokens: jax.Array,
                      next_tokens: jax.Array, n_valid: jax.Array, is_last: jax.Array, costs, *, cfg: ModelConfig,
                      ctx_bucket: int, sampled: bool):
    """prefill_step for speculative engines: the chunk also goes through the MTP ring, and
    a prompt's last chunk drafts the first speculation after the sampled first token.
    sampled=False: the request is greedy (drafts by argmax, no draft distributions)."""
    row_slots = _row(slots, slot)

    def emit(logits, length, last):
        state, out = _emit(row_slots, logits, length, last, 0)
        return out.tokens, state.sampling, (state, out)

    row_cache, row_spec, (row_slots, out) = prefill_chunk(
        params, mtp, _row(cache, slot), _row(spec, slot), tokens, next_tokens, n_valid, is_last[None], emit,
        cfg=cfg, ctx_bucket=ctx_bucket, costs=costs, sampled=sampled)
    return (_set_row(cache, row_cache, slot), _set_row(spec, row_spec, slot), _set_row(slots, row_slots, slot),
            jax.tree.map(lambda a: a[None], out))


@functools.partial(jax.jit, static_argnames=("cfg", "ctx_bucket", "k", "sampled"),
                   donate_argnames=("cache", "spec", "slots"))
def spec_decode_step(params, mtp, cache: Cache, spec: Speculation, slots: Slots, costs, *, k: int, cfg: ModelConfig,
                     ctx_bucket: int, sampled: bool):
    """One verify step over k drafts for every slot; outputs stacked [k+1, B] like
    decode_step's, with the drafts checked / accepted per row. sampled=False: every
    decoding row is greedy (argmax on the logits; no distributions formed)."""
    cache, spec, slots, tokens, count, finished, checked, accepted = verify(
        params, mtp, cache, spec, slots, k=k, cfg=cfg, ctx_bucket=ctx_bucket, costs=costs, sampled=sampled)
    j = jnp.arange(k + 1)[:, None]
    out = StepOutput(tokens.T, j < count[None], finished[None] & (j == count[None] - 1), None, None, None,
                     checked, accepted, spec.limit)
    return cache, spec, slots, out


@functools.partial(jax.jit, donate_argnames=("cache", "slots"))
def admit_slot(cache: Cache, slots: Slots, slot, settings: dict, prompt: jax.Array, stop_ids: jax.Array):
    """Reset one slot for a new request: empty cache row, its sampling settings, its prompt
    as the start of the token history."""
    s = slots.sampling
    max_tokens = settings.pop("max_tokens")
    def put(a, v):
        return a.at[slot].set(v, out_sharding=rows(a))

    sampling = s.replace(**{k: put(getattr(s, k), v) for k, v in settings.items()}, history=put(s.history, prompt))
    slots = slots.replace(sampling=sampling, active=put(slots.active, False), n_generated=put(slots.n_generated, 0),
                          max_tokens=put(slots.max_tokens, max_tokens), stop_ids=put(slots.stop_ids, stop_ids))
    return cache.replace(length=put(cache.length, 0)), slots


@functools.partial(jax.jit, donate_argnames=("slots",))
def deactivate_slot(slots: Slots, slot) -> Slots:
    return slots.replace(active=slots.active.at[slot].set(False, out_sharding=rows(slots.active)))


# ----------------------------------------------------------------------------- host side
@dataclasses.dataclass
class TokenEvent:
    request_id: str
    token: int
    logprob: float | None  # raw-distribution logprob (engines with max_logprobs > 0)
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # None while running; "stop" | "length" when this is the last token


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[TokenEvent], None] | None = None
    state: str = "waiting"  # waiting | prefilling | decoding | finished | cancelled
    slot: int | None = None
    prefilled: int = 0
    dispatched: int = 0  # tokens the device will have cached (upper bound while decoding)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    target_steps: int = 0  # speculative engines: verify steps this request took part in
    drafts_proposed: int = 0  # drafts sent to verification
    drafts_accepted: int = 0
    decode_tokens: int = 0  # tokens those steps produced (all but the prefill's first)


SPEC_POLICIES = ("confidence", "fixed")


class Engine:
    """Continuous batching over `max_slots` decode slots with a `capacity`-token cache each.

    num_draft_tokens > 0: speculative decoding with the model's MTP layer. Each decode step
    verifies up to that many drafts per slot in one target forward (lossless: the output
    distribution is the target's). spec_policy "fixed" verifies all of them; "confidence"
    lets each row verify the k maximising its expected tokens (from the drafter's
    confidences) per unit of measured verify cost, and the step verifies the largest k any
    row asked for (known one step late, as outputs are read while the next step runs).
    The cost curve is measured at warmup() or the first step(); pass verify_costs (K + 1
    relative costs of verifying k = 0..K drafts) to pin it, e.g. for reproducible runs: the
    output distribution never depends on it, but sampled tokens follow the k chosen."""

    def __init__(self, model: Model, *, max_slots: int = 8, capacity: int = 4096, prefill_chunk: int = 256,
                 batch_invariant: bool = False, max_logprobs: int = 0, overlap: bool = True, decode_steps: int = 1,
                 num_draft_tokens: int = 0, spec_policy: str = "confidence", verify_costs: list[float] | None = None):
        cfg = model.config
        ratio = max(cfg.compress_rate_csa, cfg.compress_rate_hca)
        if capacity % ratio:
            raise ValueError(f"capacity {capacity} must be a multiple of {ratio} (the largest compression ratio)")
        self.model, self.cfg = model, cfg
        self.max_slots, self.capacity, self.prefill_chunk = max_slots, capacity, prefill_chunk
        self.batch_invariant, self.max_logprobs, self.overlap = batch_invariant, max_logprobs, overlap
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.decode_steps = decode_steps  # tokens per slot per decode dispatch (fewer host round trips)
        self.mesh = model.mesh
        if self.mesh is not None:
            shards = model.batch_shards()
            if max_slots % shards:
                raise ValueError(f"max_slots={max_slots} must be a multiple of the mesh's batch shards ({shards})")
            if batch_invariant:
                raise ValueError("batch_invariant mode runs each slot alone; it is not supported on a mesh")
        self.num_draft_tokens, self.spec_policy = num_draft_tokens, spec_policy
        self._check_speculation()
        self.spec = self.costs = None  # costs: [K + 1] relative verify costs, on the device
        if verify_costs is not None:
            if len(verify_costs) != num_draft_tokens + 1 or min(verify_costs) <= 0:
                raise ValueError(f"verify_costs must be {num_draft_tokens + 1} positive numbers (k = 0.."
                                 f"{num_draft_tokens}), got {verify_costs}")
            self.costs = jnp.asarray(verify_costs, jnp.float32)
        if num_draft_tokens:
            self.spec = init_speculation(cfg, max_slots, num_draft_tokens, model.dtype)
        self._next_k = [num_draft_tokens] * max_slots  # per slot: drafts its latest output asked to verify
        self.spec_totals = {"target_steps": 0, "row_steps": 0, "drafts_proposed": 0, "drafts_accepted": 0,
                            "decode_tokens": 0}
        self.cache = self._place(init_cache(cfg, max_slots, capacity, model.dtype))
        self.slots = self._place(_init_slots(max_slots, capacity))
        # compile the cancel path now (a no-op on empty slots) so a later cancel is not a hiccup
        with model.mesh_context():
            self.slots = deactivate_slot(self.slots, jnp.int32(0))
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[str] = collections.deque()
        self.slot_owner: list[str | None] = [None] * max_slots
        self._pending: collections.deque = collections.deque()  # (StepOutput, slot -> request id)
        self._ids = itertools.count()
        self.steps = 0

    def _check_speculation(self) -> None:
        k = self.num_draft_tokens
        if k < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k}")
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy must be one of {SPEC_POLICIES}, got {self.spec_policy!r}")
        if not k:
            return
        if self.model.mtp is None:
            raise ValueError("num_draft_tokens > 0 needs the model's MTP layer: load a checkpoint with mtp.0.* "
                             "tensors, or load_model(..., mtp=True)")
        limit = min_ring(self.cfg) - 1
        if k > limit:
            raise ValueError(f"num_draft_tokens={k} is too many for this model: a verify step writes k + 1 "
                             f"positions, at most its smallest cache ring ({limit + 1})")
        for name, bad in (("a mesh", self.mesh is not None), ("batch_invariant", self.batch_invariant),
                          ("max_logprobs > 0", self.max_logprobs > 0), ("decode_steps > 1", self.decode_steps > 1)):
            if bad:
                raise ValueError(f"speculative decoding (num_draft_tokens > 0) does not support {name}")

    def _place(self, tree):
        """Batch-major state onto the mesh: rows over the batch axes."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda a: jax.device_put(a, batch_sharding(self.mesh, a.ndim)), tree)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], params: SamplingParams = SamplingParams(), request_id: str | None = None,
                    on_token: Callable[[TokenEvent], None] | None = None) -> str:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        check_token_ids(np.asarray(prompt), self.cfg.vocab_size)
        if len(prompt) + params.max_tokens > self.capacity:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's "
                             f"cache capacity ({self.capacity} tokens)")
        if self.num_draft_tokens:
            if len(prompt) + params.max_tokens + self.num_draft_tokens > self.capacity:
                raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) + "
                                 f"num_draft_tokens ({self.num_draft_tokens}) exceeds the engine's cache capacity "
                                 f"({self.capacity} tokens)")
            if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty:
                raise ValueError("penalties are not supported with speculative decoding (their token statistics "
                                 "would change inside the draft chain); use an engine with num_draft_tokens=0")
        if params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds the engine's max_logprobs={self.max_logprobs}")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.cfg.eos_token_ids))
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stops)}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests and self.requests[request_id].state not in ("finished", "cancelled"):
            raise ValueError(f"request id {request_id!r} is already running")
        self.requests[request_id] = Request(request_id, prompt, params, on_token)
        self.waiting.append(request_id)
        return request_id

    def cancel(self, request_id: str) -> None:
        """Stop a request now; its slot is free for the next admission at once."""
        with self.model.mesh_context():
            self._cancel(request_id)

    def _cancel(self, request_id: str) -> None:
        req = self.requests[request_id]
        if req.state in ("finished", "cancelled"):
            return
        if req.state == "waiting":
            self.waiting.remove(request_id)
        else:
            self.slots = deactivate_slot(self.slots, jnp.int32(req.slot))
            self.slot_owner[req.slot] = None
        req.state, req.finish_reason, req.slot = "cancelled", "cancelled", None

    @property
    def free_slots(self) -> list[int]:
        return [i for i, owner in enumerate(self.slot_owner) if owner is None]

    def has_work(self) -> bool:
        return bool(self.waiting or self._pending or any(o is not None for o in self.slot_owner))

    def warmup(self) -> int:
        with self.model.mesh_context():
            return self._warmup()

    def _warmup(self) -> int:
        """Compile every prefill chunk length and decode step for every context bucket now
        (on the live cache, as no-op steps: n_valid 0, no slot active), so serving never
        stops to compile. Returns the number of shapes compiled."""
        if any(o is not None for o in self.slot_owner):
            raise RuntimeError("warmup() must run before requests are admitted")
        self._reset_slot(0, [0], SamplingParams())
        buckets = sorted({self._bucket(n) for n in (2 ** i for i in range(4, 31)) if n <= 2 * self.capacity})
        chunks = [c for c in (2 ** i for i in range(4, 31)) if c < self.prefill_chunk] + [self.prefill_chunk]
        self._measure_costs()
        b = self.max_slots
        ks = self._verify_lengths()
        for bucket in buckets:
            for c in chunks:
                if self.mesh is None:
                    zeros = np.zeros((1, c), np.int32)
                    for sampled in self._variants():
                        self._prefill_call(0, zeros, zeros, np.zeros((1,), np.int32), False, bucket, sampled)
                else:
                    self.cache, self.slots, _ = prefill_rows(
                        self.model.params, self.cache, self.slots, self._place(np.zeros((b, c), np.int32)),
                        self._place(np.zeros(b, np.int32)), self._place(np.zeros(b, bool)), cfg=self.cfg,
                        ctx_bucket=bucket, n_logprobs=self.max_logprobs)
            for k in ks:
                for sampled in self._variants():
                    self._decode_call(bucket, k, sampled)
        jax.block_until_ready(self.cache)
        return len(buckets) * (len(chunks) + len(ks)) * len(self._variants()) + 1

    def _variants(self) -> tuple[bool, ...]:
        """Speculative steps come in a greedy-only and a sampling variant."""
        return (False, True) if self.num_draft_tokens else (False,)

    def _verify_lengths(self) -> list[int]:
        """The verify lengths decode may dispatch ([0] without speculation)."""
        if not self.num_draft_tokens:
            return [0]
        return list(range(self.num_draft_tokens + 1)) if self.spec_policy == "confidence" else [self.num_draft_tokens]

    def _measure_costs(self, reps: int = 10) -> None:
        """Confidence scheduling: time a verify step over k + 1 positions for k = 0..K (on
        idle copies of the slot state, at the smallest context bucket) -> self.costs, relative
        to k = 0. Runs once (warmup(), or the first step())."""
        if self.spec_policy != "confidence" or self.costs is not None or not self.num_draft_tokens:
            return
        placeholder = jnp.ones(self.num_draft_tokens + 1, jnp.float32)
        seconds = []
        for k in range(self.num_draft_tokens + 1):
            slots = jax.tree.map(jnp.copy, self.slots).replace(active=jnp.zeros_like(self.slots.active))
            spec = jax.tree.map(jnp.copy, self.spec)
            times = []
            for _ in range(reps + 1):  # the first call compiles
                t = time.perf_counter()
                self.cache, spec, slots, out = spec_decode_step(
                    self.model.params, self.model.mtp, self.cache, spec, slots, placeholder, k=k, cfg=self.cfg,
                    ctx_bucket=self._bucket(1), sampled=False)
                jax.block_until_ready((self.cache, out))
                times.append(time.perf_counter() - t)
            seconds.append(float(np.median(times[1:])))
        self.costs = jnp.asarray([t / seconds[0] for t in seconds], jnp.float32)

    def _prefill_call(self, slot: int, tokens, next_tokens, n_valid, is_last: bool, bucket: int,
                      sampled: bool = False) -> StepOutput:
        if self.spec is None:
            self.cache, self.slots, out = prefill_step(
                self.model.params, self.cache, self.slots, jnp.int32(slot), tokens, n_valid, np.bool_(is_last),
                cfg=self.cfg, ctx_bucket=bucket, n_logprobs=self.max_logprobs)
        else:
            self.cache, self.spec, self.slots, out = spec_prefill_step(
                self.model.params, self.model.mtp, self.cache, self.spec, self.slots, jnp.int32(slot), tokens,
                next_tokens, n_valid, np.bool_(is_last), self.costs, cfg=self.cfg, ctx_bucket=bucket, sampled=sampled)
        return out

    def _decode_call(self, bucket: int, k: int, sampled: bool = False) -> StepOutput:
        if self.spec is None:
            self.cache, self.slots, out = decode_step(
                self.model.params, self.cache, self.slots, cfg=self.cfg, ctx_bucket=bucket,
                batch_invariant=self.batch_invariant, n_logprobs=self.max_logprobs, n_steps=self.decode_steps)
        else:
            self.cache, self.spec, self.slots, out = spec_decode_step(
                self.model.params, self.model.mtp, self.cache, self.spec, self.slots, self.costs, k=k, cfg=self.cfg,
                ctx_bucket=bucket, sampled=sampled)
        return out

    # ------------------------------------------------------------------ stepping
    def _admit(self) -> None:
        for slot in self.free_slots:
            if not self.waiting:
                return
            req = self.requests[self.waiting.popleft()]
            self._reset_slot(slot, req.prompt, req.params)
            req.state, req.slot = "prefilling", slot
            self._next_k[slot] = self.num_draft_tokens
            self.slot_owner[slot] = req.request_id

    def _reset_slot(self, slot: int, prompt: list[int], p: SamplingParams) -> None:
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.cfg.eos_token_ids)))
        history = np.zeros(self.capacity, np.int32)
        history[: len(prompt)] = prompt
        settings = {"temperature": np.float32(p.temperature), "top_k": np.int32(p.top_k),
                    "top_p": np.float32(p.top_p), "min_p": np.float32(p.min_p),
                    "repetition_penalty": np.float32(p.repetition_penalty),
                    "presence_penalty": np.float32(p.presence_penalty),
                    "frequency_penalty": np.float32(p.frequency_penalty), "seed": np.uint32(p.seed),
                    "prompt_len": np.int32(len(prompt)), "max_tokens": np.int32(p.max_tokens)}
        stop_ids = np.full(MAX_STOP_IDS, -1, np.int32)
        stop_ids[: len(stops)] = stops
        self.cache, self.slots = admit_slot(self.cache, self.slots, jnp.int32(slot), settings, history, stop_ids)

    def _bucket(self, tokens_needed: int) -> int:
        return self.capacity if self.batch_invariant else context_bucket(tokens_needed, self.capacity)

    def _prefill(self, req: Request) -> None:
        chunk = self._next_chunk(req)
        c = min(self.prefill_chunk, max(16, 1 << (len(chunk) - 1).bit_length()))
        tokens = np.zeros((1, c), np.int32)
        tokens[0, : len(chunk)] = chunk
        is_last = req.prefilled + len(chunk) == len(req.prompt)
        following = np.zeros((1, c), np.int32)  # the token after each (speculative engines' MTP ring)
        after = req.prompt[req.prefilled + 1: req.prefilled + len(chunk) + 1]
        following[0, : len(after)] = after
        out = self._prefill_call(req.slot, tokens, following, np.array([len(chunk)], np.int32), is_last,
                                 self._bucket(req.prefilled + c), req.params.temperature > 0)
        req.prefilled += len(chunk)
        req.dispatched = req.prefilled
        if is_last:
            req.state = "decoding"
            self._pending.append((out, {0: req.request_id}))

    def _next_chunk(self, req: Request) -> list[int]:
        """The next prompt chunk: a power of two >= 16 covering the rest of the prompt, at
        most prefill_chunk (a short prompt does not pay for a full chunk; few shapes)."""
        remaining = len(req.prompt) - req.prefilled
        c = min(self.prefill_chunk, max(16, 1 << (remaining - 1).bit_length()))
        return req.prompt[req.prefilled: req.prefilled + c]

    def _prefill_all(self, reqs: list[Request]) -> None:
        """One chunk for every prefilling slot in one call (the mesh path)."""
        chunks = {r.slot: self._next_chunk(r) for r in reqs}
        c = min(self.prefill_chunk, max(16, 1 << (max(len(ch) for ch in chunks.values()) - 1).bit_length()))
        tokens = np.zeros((self.max_slots, c), np.int32)
        n_valid = np.zeros(self.max_slots, np.int32)
        is_last = np.zeros(self.max_slots, bool)
        for r in reqs:
            ch = chunks[r.slot]
            tokens[r.slot, : len(ch)], n_valid[r.slot] = ch, len(ch)
            is_last[r.slot] = r.prefilled + len(ch) == len(r.prompt)
        needed = max(r.prefilled + c for r in reqs)
        self.cache, self.slots, out = prefill_rows(
            self.model.params, self.cache, self.slots, self._place(tokens), self._place(n_valid),
            self._place(is_last), cfg=self.cfg, ctx_bucket=self._bucket(needed), n_logprobs=self.max_logprobs)
        finished_prompts = {}
        for r in reqs:
            r.prefilled += int(n_valid[r.slot])
            r.dispatched = r.prefilled
            if is_last[r.slot]:
                r.state = "decoding"
                finished_prompts[r.slot] = r.request_id
        if finished_prompts:
            self._pending.append((out, finished_prompts))

    def _decode(self) -> bool:
        decoding = [self.requests[o] for o in self.slot_owner if o is not None]
        decoding = [r for r in decoding if r.state == "decoding"]
        if not decoding:
            return False
        k = 0
        if self.num_draft_tokens:
            k = self.num_draft_tokens if self.spec_policy == "fixed" else max(self._next_k[r.slot] for r in decoding)
        n = k + 1 if self.num_draft_tokens else self.decode_steps  # positions written per slot, at most
        needed = min(max(r.dispatched for r in decoding) + n, self.capacity)
        out = self._decode_call(self._bucket(needed), k, any(r.params.temperature > 0 for r in decoding))
        for r in decoding:
            r.dispatched += n
        self._pending.append((out, {r.slot: r.request_id for r in decoding}))
        return True

    def step(self) -> list[TokenEvent]:
        """Advance every request by at most one prefill chunk / `decode_steps` tokens."""
        with self.model.mesh_context():
            return self._step()

    def _step(self) -> list[TokenEvent]:
        self._measure_costs()
        self._admit()
        prefilling = [self.requests[o] for o in self.slot_owner
                      if o is not None and self.requests[o].state == "prefilling"]
        if self.mesh is not None and prefilling:
            self._prefill_all(prefilling)
        for req in prefilling if self.mesh is None else ():
            self._prefill(req)
        dispatched = self._decode()
        self.steps += 1
        keep = 1 if (dispatched and self.overlap) else 0
        events = []
        while len(self._pending) > keep:
            events += self._process(*self._pending.popleft())
        return events

    def _process(self, out: StepOutput, owners: dict[int, str]) -> list[TokenEvent]:
        """Turn one dispatch's outputs ([steps, rows]) into events, in order."""
        host = to_host(out)
        if host.drafts_checked is not None:
            self._count_speculation(host, owners)
        events = []
        for step in range(host.tokens.shape[0]):
            for row, request_id in owners.items():
                req = self.requests[request_id]
                if req.state in ("finished", "cancelled") or not host.emitted[step, row]:
                    continue
                events.append(self._emit_event(req, host, step, row))
        return events

    def _count_speculation(self, host: StepOutput, owners: dict[int, str]) -> None:
        totals = self.spec_totals
        totals["target_steps"] += 1
        for row, request_id in owners.items():
            req = self.requests[request_id]
            if req.state in ("finished", "cancelled"):
                continue
            checked, accepted = int(host.drafts_checked[row]), int(host.drafts_accepted[row])
            produced = int(host.emitted[:, row].sum())
            req.target_steps += 1
            req.drafts_proposed += checked
            req.drafts_accepted += accepted
            req.decode_tokens += produced
            for key, n in (("row_steps", 1), ("drafts_proposed", checked), ("drafts_accepted", accepted),
                           ("decode_tokens", produced)):
                totals[key] += n
            self._next_k[row] = int(host.next_limit[row])

    @property
    def verify_costs(self) -> list[float] | None:
        """The cost curve in use (pinned or measured), k = 0..K, relative to k = 0."""
        return None if self.costs is None else [float(c) for c in np.asarray(self.costs)]

    def spec_metrics(self) -> dict:
        """Engine-wide speculation counters since construction: target (verify) steps, the
        drafts proposed and accepted, and tokens per target step, per request
        (`tokens_per_row_step`) and for the whole batch (`tokens_per_target_step`)."""
        t = dict(self.spec_totals)
        t["acceptance_rate"] = t["drafts_accepted"] / max(t["drafts_proposed"], 1)
        t["tokens_per_row_step"] = t["decode_tokens"] / max(t["row_steps"], 1)
        t["tokens_per_target_step"] = t["decode_tokens"] / max(t["target_steps"], 1)
        t["verify_costs"] = self.verify_costs
        return t

    def _emit_event(self, req: Request, host: StepOutput, step: int, row: int) -> TokenEvent:
        token = int(host.tokens[step, row])
        top = None
        if req.params.logprobs:
            n = req.params.logprobs
            top = [(int(i), float(v)) for i, v in zip(host.top_ids[step, row][:n], host.top_values[step, row][:n])]
        finish = None
        if host.finished[step, row]:
            finish = "stop" if self._is_stop(req, token) else "length"
        logprob = float(host.logprob[step, row]) if host.logprob is not None else None
        req.tokens.append(token)
        req.logprobs.append(logprob)
        event = TokenEvent(req.request_id, token, logprob, top, finish)
        if finish is not None:
            req.state, req.finish_reason = "finished", finish
            self.slot_owner[req.slot] = None
            req.slot = None
        if req.on_token is not None:
            req.on_token(event)
        return event

    def _is_stop(self, req: Request, token: int) -> bool:
        stops = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.cfg.eos_token_ids))
        return token in stops

    def run(self) -> Iterator[TokenEvent]:
        """Step until every request has finished, yielding token events as they arrive."""
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        for _ in self.run():
            pass
        return [self.requests[i].tokens for i in ids]
