"""`Engine`: fixed decode slots, continuous batching, streaming, async dispatch.

The engine is the loop joining two parts (vLLM v1's scheduler / model runner):
  - the `Scheduler` (`dsjax.engine.scheduler`, host only) owns the queue and the slots and
    makes each step's `StepPlan`: admissions and prefix blocks to restore, one prompt chunk
    per prefilling request (width, context bucket, blocks to save), the decode step
    (context bucket, drafts k, variant, cancelled rows, split for structured output);
  - the `Runner` (`dsjax.engine.runner`) owns the device state (cache, `Slots`, the
    drafter's state) and the compiled programs (`dsjax.engine.programs`), executes the
    plan and returns a `StepOutput`: the device outputs to read back.
Each `step()` plans, executes, and reads back the *previous* step's tokens while the
device runs this one (JAX's async dispatch), turning them into events. Stop conditions
are evaluated on the device, so the host being one step behind never feeds a finished slot.

Outputs are attributed to `Request` objects (`dsjax.engine.requests`), never to the user's
id, and a request's events are made one at a time as they are taken: once `cancel()`
returns, no token of that request is delivered, even one already computed.

With num_draft_tokens > 0 the decode step is a speculative verify step
(`dsjax.engine.speculative`): each slot's pending token and up to k drafts go through
the target at once, and a slot advances by 1..k+1 tokens; `dsjax.engine.policy` says k.

Structured output (`add_request(..., constraint=)`, `dsjax.engine.constraints`): a
constrained row's next mask depends on the token it just sampled, so it never runs ahead.
While any constrained row decodes, a step is split in two programs: `decode_forward`
(dispatched first; the device runs it while the host reads every earlier output back,
advances the grammars and computes the packed masks) and `decode_sample` (the masks
applied, one token per slot). Such steps make one token per dispatch whatever
`decode_steps` says; steps without a constrained row run the fused `decode_step`. A
constrained request's prefill leaves its prompt's last token to that first split step, so
its first token is masked too. Constraints are refused with speculative decoding.

Capture (`capture=` patterns of dsjax.inspect's names, `dsjax.engine.capture`): the forward
programs also record those points per token (routing, indexer selections, streams) and a
request with `SamplingParams(capture=True)` gets them in its events. It is a construction
option: an engine without it runs exactly the programs it ran before.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Callable, Iterator

import numpy as np

from dsjax import code_memory
from dsjax.engine.capture import resolve
from dsjax.engine.constraints import Constraint
from dsjax.engine.limits import check_cache_fits, check_engine_args, check_prefix_cache
from dsjax.engine.policy import SpeculationPolicy
from dsjax.engine.prefix_cache import PrefixCache, PrefixCacheOptions, PrefixPlanner
from dsjax.engine.programs import DeviceOutput
from dsjax.engine.requests import (Request, TokenEvent, check_constraint, check_request, first_tokens_mask,
                                   smallest_useful_bucket, stop_ids)
from dsjax.engine.runner import Dispatch, Runner, StepOutput
from dsjax.engine.sampler import SamplingParams
from dsjax.engine.scheduler import DecodePlan, Scheduler
from dsjax.engine.spec_options import check_speculation, engine_draft_vocab, max_drafts
from dsjax.model.interface import (INVARIANT_ROWS, Model, capture_points, decodes_equal_prefill, reference_key_rule,
                                   step_bytes)
from dsjax.sharding.distributed import to_host


def _part(part: str, name: str) -> property:
    """An attribute of the engine's scheduler or runner, read and set through the engine."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class Engine:
    """Continuous batching over `max_slots` decode slots with a `capacity`-token cache each.

    num_draft_tokens > 0: speculative decoding with the model's MTP layer. Each decode step
    verifies up to that many drafts per slot in one target forward (lossless: the output
    distribution is the target's). spec_policy "fixed" (the default in batch-invariant
    mode) verifies all of them; "confidence" (the default otherwise) chooses per step between
    a plain decode step (the plain engine's program: no drafting) and a verify step, by the
    seconds per emitted token each costs here, and lets each row verify the k >= 1 maximising
    its expected tokens (from the drafter's calibrated confidences) per unit of cost; the step
    verifies the largest k any row asked for (known one step late, as outputs are read while
    the next step runs; `dsjax.engine.policy`). The step costs are measured at warmup() or
    the first step() and refreshed from the step times observed; pass verify_costs (K + 1
    costs: a plain step, then verify steps over k = 1..K drafts, in any unit) to pin them,
    e.g. for reproducible runs: the output distribution never depends on them, but sampled
    tokens follow the steps chosen.

    draft_vocab: the token ids the drafter proposes from (it scores only their head rows,
    far cheaper than the full vocabulary's); verification stays exact, so outputs do not
    depend on it, only the acceptance rate does. None: the model's (`model.draft_vocab`,
    read from a checkpoint's draft_vocab.json) if it has one, else the full vocabulary;
    False: the full vocabulary; a list / array of ids: those.

    batch_invariant: a request's logits are bitwise independent of the batch and of the
    mesh layout: every forward runs tiles of INVARIANT_ROWS rows of one fixed shape (decode:
    a scan over tiles, or on a mesh one tile per device; prefill: the slot's tile, one
    chunk width per call), the MoE sums in expert order over fixed row tiles, and there is
    one context bucket, the capacity. The device state has max_slots rounded up to whole
    tiles (`rows`; on a mesh one tile per batch shard). With speculation: the fixed policy,
    each verify step in tiles too (on a mesh one tile per device; docs/batch-invariance.md).

    On a mesh, speculation runs as on one device but for the prefill, which (as a plain
    engine's) runs every row at once (`spec_prefill_rows`); the drafter's state (`spec`) is
    batch-major like the cache, each row on its own batch shard.

    Arguments are checked here, and the cache is checked to fit before it is allocated:
    in `device_memory_bytes` per device if given, else in what the device reports free
    (the weights already loaded deducted).

    prefix_cache: keep what prompts leave in the cache across requests
    (`dsjax.engine.prefix_cache`): a prompt's longest cached prefix of whole prefill_chunk
    blocks is put back at admission and only the rest is prefilled. Prompts are then cut into
    chunks on the absolute prefill_chunk grid (the last one narrower), so that every chunk
    ends a block; outputs with a hit equal those without (bitwise in batch-invariant mode).
    `prefix_metrics()` counts hits, tokens saved and tier traffic. A V4.1 model under the
    reference's published-key rule (the default) cuts prompts on that grid too
    (`aligned_chunks`): a chunk starting at s > 0 equals one-token decodes only up to position
    2 s + 1 (`dsjax.model.interface.reference_key_rule`), and a full chunk after a narrower first one
    would pass it.

    max_logprobs: the most top logprobs a request may ask for (`SamplingParams.logprobs`,
    `prompt_logprobs`). logprob_width: how many the programs compute per token (a static
    argument of every program; None: max_logprobs); a request gets its first `logprobs`. The
    programs of a width > 0 compute logprobs only in steps where a row asks (`jax.lax.cond`),
    so a step without such a row costs what a width-0 engine's does; engines that differ only
    in max_logprobs share their programs when they fix one width (`dsjax serve` does: 20).

    greedy_screen: on one XLA:CPU device, greedy decode steps of few rows find the fp32
    head's first maximum from a bf16 copy of it (the same tokens, bitwise; half the head's
    bytes again in memory; a step with a row asking for logprobs reads the fp32 head); False
    saves that memory. Which weights the programs run with
    (`step_params`: the head packed for the CPU head kernel, screened, or transposed for one
    row) is the runner's (`dsjax.engine.runner`).

    capture: points of the forward to record for every token computed (`dsjax.inspect` names or
    fnmatch patterns over them: "layers.*.moe.experts", "layers.*.moe.weights",
    "layers.*.indexer.selected", any layer point with one value per token); requests with
    SamplingParams(capture=True) receive them in their TokenEvents (`dsjax.engine.capture`).
    A static argument of the forward programs: as many programs as without, each recording
    them. Not with speculative decoding or a prefix cache (positions a verify step rejects or
    a cached block restores have no capture of their own) yet.

    min_bucket: the smallest context bucket (a prefill and a decode program per bucket);
    None: the smallest whose whole cache a decode step of `max_slots` rows reads in more than
    1/8 of its weight bytes (`requests.smallest_useful_bucket`: for a small model, one bucket,
    the capacity)."""

    def __init__(self, model: Model, *, max_slots: int = 8, capacity: int = 4096, prefill_chunk: int = 256,
                 batch_invariant: bool | None = None, max_logprobs: int = 0, overlap: bool = True, decode_steps: int = 1,
                 num_draft_tokens: int = 0, spec_policy: str | None = None, verify_costs: list[float] | None = None,
                 draft_vocab=None, device_memory_bytes: int | None = None,
                 prefix_cache: PrefixCacheOptions | None = None, greedy_screen: bool = True, capture=(),
                 min_bucket: int | None = None, logprob_width: int | None = None):
        cfg = model.config
        check_engine_args(cfg, max_slots=max_slots, capacity=capacity, prefill_chunk=prefill_chunk,
                          decode_steps=decode_steps, max_logprobs=max_logprobs, num_draft_tokens=num_draft_tokens,
                          overlap=overlap, batch_invariant=batch_invariant, greedy_screen=greedy_screen,
                          logprob_width=logprob_width)
        if batch_invariant is None:
            batch_invariant = model.options.batch_invariant
        self.model, self.cfg, self.mesh = model, cfg, model.mesh
        self.opts = model.options.replace(batch_invariant=bool(batch_invariant))  # static argument of every program
        self.max_slots, self.capacity, self.prefill_chunk = max_slots, capacity, prefill_chunk
        self.batch_invariant, self.max_logprobs, self.overlap = batch_invariant, max_logprobs, overlap
        self.logprob_width = max_logprobs if logprob_width is None else logprob_width  # static in every program
        self.decode_steps = decode_steps  # tokens per slot per decode dispatch (fewer host round trips)
        shards = 1 if self.mesh is None else model.batch_shards()
        if max_slots % shards:
            raise ValueError(f"max_slots={max_slots} must be a multiple of the mesh's batch shards ({shards})")
        # rows of the device state: max_slots, rounded up in batch-invariant mode to whole
        # tiles of INVARIANT_ROWS (`forward`); the spare rows are never admitted to
        self.rows = -(-max_slots // INVARIANT_ROWS) * INVARIANT_ROWS if batch_invariant else max_slots
        if self.mesh is not None and batch_invariant:  # each device holds one tile
            if max_slots > INVARIANT_ROWS * shards:
                raise ValueError(f"batch_invariant on a mesh: max_slots={max_slots} is over {INVARIANT_ROWS} slots on "
                                 f"each of its {shards} batch shards")
            self.rows = INVARIANT_ROWS * shards
        # rows of a prefill call: every row (a mesh), else the slot's own row, or in
        # batch-invariant mode its tile (the shape a mesh device prefills)
        prefill_rows = self.rows if self.mesh is not None else INVARIANT_ROWS if batch_invariant else 1
        spec_policy = spec_policy or ("fixed" if batch_invariant else "confidence")
        self.policy = SpeculationPolicy(num_draft_tokens, spec_policy, verify_costs, self.rows)
        check_speculation(num_draft_tokens, has_mtp=model.mtp is not None, max_drafts=max_drafts(cfg),
                          unsupported={"decode_steps > 1": decode_steps > 1,
                                       # a step's verify length is the batch's, from measured timings
                                       "spec_policy='confidence' in batch-invariant mode (use 'fixed')":
                                           batch_invariant and spec_policy == "confidence"})
        self.num_draft_tokens, self.spec_policy = num_draft_tokens, spec_policy
        # sorted ids [|D|] or None (the full vocabulary)
        self.draft_vocab = engine_draft_vocab(draft_vocab, model.draft_vocab, cfg)
        pool = None
        if prefix_cache is not None:
            check_prefix_cache(cfg, prefill_chunk, self.mesh)
            pool = PrefixCache(prefix_cache, prefill_chunk, lookahead=bool(num_draft_tokens))
        check_cache_fits(model, self.rows, capacity, device_memory_bytes)
        self.capture = ()  # full names the programs record
        if capture:
            for what, on in (("speculative decoding (num_draft_tokens)", num_draft_tokens), ("a prefix cache", pool)):
                if on:
                    raise ValueError(f"capture is not supported with {what} yet: construct the engine without it")
            self.capture = resolve(capture, capture_points(model, capacity))
        self.runner = Runner(model, rows=self.rows, capacity=capacity, opts=self.opts, logprob_width=self.logprob_width,
                             decode_steps=decode_steps, policy=self.policy, draft_vocab=self.draft_vocab,
                             prefill_rows=prefill_rows, greedy_screen=greedy_screen, pool=pool, block=prefill_chunk,
                             capture=self.capture)
        self.prefix = None if pool is None else PrefixPlanner(
            pool, keeps_generated=not batch_invariant and not num_draft_tokens and decode_steps == 1,
            first_generated=decodes_equal_prefill(cfg, self.opts, prefill_chunk))
        # prompt chunks on the absolute prefill_chunk grid (the last one narrower): a prefix cache's
        # blocks, and V4.1's published-key rule (a chunk at s > 0 exact up to 2 s + 1 only)
        self.aligned_chunks = pool is not None or reference_key_rule(cfg, self.opts)
        self.scheduler = Scheduler(max_slots=max_slots, rows=self.rows, capacity=capacity, prefill_chunk=prefill_chunk,
                                   prefill_rows=prefill_rows, batch_invariant=batch_invariant,
                                   on_mesh=self.mesh is not None, decode_steps=decode_steps, policy=self.policy,
                                   vocab_size=cfg.vocab_size, aligned_chunks=self.aligned_chunks, prefix=self.prefix,
                                   smallest_bucket=min_bucket or smallest_useful_bucket(
                                       lambda ctx: step_bytes(cfg, self.rows, ctx, model.dtype), capacity))
        self.requests: dict[str, Request] = {}  # by id: the latest request of each id
        self._pending: collections.deque[Dispatch] = collections.deque()  # on the device
        self._outbox: collections.deque[tuple[Request, DeviceOutput, int, int]] = collections.deque()  # read back
        self._ids = itertools.count()
        self.steps = 0
        self._last_read = None  # (decode plan index, time, verify?) of the last decode step read back (`_book`)
        self._latest_decode = None  # the decode plan dispatched last

    # the device state is the runner's, the queue and slots the scheduler's (read, and in
    # benchmarks replaced, under these names)
    cache = _part("runner", "cache")
    slots = _part("runner", "slots")
    spec = _part("runner", "spec")
    step_params = _part("runner", "step_params")
    waiting = _part("scheduler", "waiting")
    slot_owner = _part("scheduler", "slot_owner")

    # ------------------------------------------------------------------ speculation
    # the policy's, under the names callers use: [K + 1] verify costs on the device (None: fixed
    # policy or not measured yet), the same as floats, the counters (a benchmark resets them)
    costs = property(lambda self: self.policy.costs)
    verify_costs = property(lambda self: self.policy.verify_costs)
    spec_totals = property(lambda self: self.policy.totals, lambda self, t: setattr(self.policy, "totals", t))

    def prefix_metrics(self) -> dict:
        """Prefix-cache counters since construction (`PrefixCache.metrics`; {} without one)."""
        return {} if self.prefix is None else self.prefix.pool.metrics()

    def spec_metrics(self) -> dict:
        """Speculation counters since construction (`SpeculationPolicy.metrics`)."""
        return self.policy.metrics()

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk width, context bucket) a prefill call may have (`Scheduler.prefill_shapes`)."""
        return self.scheduler.prefill_shapes()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], params: SamplingParams = SamplingParams(), request_id: str | None = None,
                    on_token: Callable[[TokenEvent], None] | None = None, *, constraint: Constraint | None = None,
                    first_tokens=None) -> str:
        """Queue a request; returns its id. constraint: structured output, a `Constraint`
        from `ConstraintCompiler.compile` (one per request) whose grammar every generated
        token is sampled under (whether the output starts with reasoning is the
        constraint's `thinking`). first_tokens: ids the first generated token is drawn
        from (the model's distribution restricted to them; token healing, see
        `Tokenizer.heal`), applied by the prefill that samples it: no other program, and
        speculation works as usual."""
        stops = self.validate(prompt, params, constraint)
        first_mask = None if first_tokens is None else first_tokens_mask(first_tokens, constraint, self.cfg.vocab_size)
        prompt = [int(t) for t in prompt]  # checked above: ints (numpy's too), so nothing changes but the type
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests and not self.requests[request_id].done:
            raise ValueError(f"request id {request_id!r} is already running")
        if constraint is not None:
            constraint.claimed = True
        req = self.requests[request_id] = Request(request_id, prompt, params, stops, on_token, constraint, first_mask)
        self.scheduler.add(req)
        return request_id

    def validate(self, prompt: list[int], params: SamplingParams, constraint: Constraint | None = None) -> tuple[int, ...]:
        """Check a request against this engine (ids, lengths, capacity, settings, a
        constraint) without admitting it: ValueError / TypeError name the problem. Returns
        its stop ids. Reads only the engine's fixed settings, so any thread may call it."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        stops = stop_ids(params, self.cfg.eos_token_ids)
        check_request(prompt, params, stops, vocab_size=self.cfg.vocab_size,
                      max_positions=self.cfg.max_position_embeddings, capacity=self.capacity,
                      num_draft_tokens=self.num_draft_tokens, max_logprobs=self.max_logprobs)
        if constraint is not None:
            check_constraint(constraint, params, vocab_size=self.cfg.vocab_size,
                             speculative=bool(self.num_draft_tokens))
        if params.prompt_logprobs is not None and self.mesh is not None:  # its scoring program is untested there
            raise ValueError("prompt_logprobs is not supported on a mesh yet; score on one device")
        if params.capture and not self.capture:
            raise ValueError("capture=True: this engine captures nothing; construct it with Engine(..., capture=names)")
        return stops

    def forget(self, request_id: str) -> None:
        """Drop a finished or cancelled request from `requests` (a long-running server would
        otherwise keep every request it ever served)."""
        req = self.requests.get(request_id)
        if req is not None and req.done:
            del self.requests[request_id]

    def cancel(self, request_id: str) -> None:
        """Stop a request now: its slot is free for the next admission at once, and none of
        its tokens still in flight or read back is delivered."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request with id {request_id!r}")
        if req.done:
            return
        self.scheduler.cancel(req)
        req.state, req.finish_reason, req.slot = "cancelled", "cancelled", None

    @property
    def free_slots(self) -> list[int]:
        return self.scheduler.free_slots

    def has_work(self) -> bool:
        return bool(self._pending or self._outbox or self.scheduler.busy())

    def warmup(self, *, constrained: bool = False, scoring: bool = False,
               progress: Callable[[int, int, str], None] | None = None) -> int:
        """Compile every prefill and decode program serving may run (`prefill_shapes`, a
        decode step per context bucket) now, on the live cache as no-op steps (n_valid 0, no
        slot active), so serving never stops to compile. constrained: also the programs of
        structured output (the split decode step per bucket, its sampling half, starting a
        slot). scoring: also the prefill programs that score the prompt (requests with
        prompt_logprobs; one per prefill shape, else compiled on first use). The runner
        executes the no-op plans the scheduler lists (`Scheduler.warmup_plans`).
        progress(i, total, what): called before each plan (1-based i), e.g. to print a line
        per program. Returns the number of programs compiled: 7 for the README's engine
        (capacity 4096, prefill_chunk 256), 12 with constrained=True."""
        if any(o is not None for o in self.slot_owner):
            raise RuntimeError("warmup() must run before requests are admitted")
        if constrained and self.num_draft_tokens:
            raise ValueError("constrained=True: structured output is not supported with speculative decoding")
        scoring = scoring and not self.num_draft_tokens  # (prompt_logprobs is refused with speculation)
        items = self.scheduler.warmup_plans(constrained=constrained, scoring=scoring)
        with self.model.mesh_context():
            self.runner.measure_costs(self.scheduler.bucket(1))
            self.runner.warmup(items, lambda out, decode: self.scheduler.masks(decode), progress)
        return sum(item.programs for item in items)

    # ------------------------------------------------------------------ stepping
    def _dispatch(self) -> None:
        """Plan a step (admission, a prefill chunk per prefilling request, a decode step), run
        it, and read back the outputs now due: with overlap all but the decode step just
        dispatched, which the device runs while the host makes the previous step's events."""
        code_memory.relieve()  # past most of the kernel's limit on code mappings: drop other programs first
        with self.model.mesh_context():
            self.runner.measure_costs(self.scheduler.bucket(1))
            if self.prefix is not None:  # blocks of generated tokens, now that those are read back
                self.runner.store(self.prefix.key_generated())
            plan = self.scheduler.schedule()
            if plan.decode is not None:
                self._latest_decode = plan.decode
            output = self.runner.execute(plan, self._before_sample)
            self._pending.extend(output.dispatches)
            if self.prefix is not None:
                self.prefix.copied(output.copies)
            self.steps += 1
            keep = 1 if (plan.decode is not None and self.overlap) else 0
            while len(self._pending) > keep:
                self._read_back(self._pending.popleft())

    def _before_sample(self, output: StepOutput, decode: DecodePlan) -> np.ndarray:
        """A split decode step's masks, made while the device runs its forward: every output
        before it is read back first (advancing the grammars to the last token)."""
        self._pending.extend(output.dispatches)
        output.dispatches.clear()
        while self._pending:
            self._read_back(self._pending.popleft())
        return self.scheduler.masks(decode)

    def _read_back(self, dispatch: Dispatch) -> None:
        """One dispatch's outputs ([steps, rows]) to the host, queued as events to make; a
        prefill chunk's prompt logprobs (`scored`: row -> (request, first position, tokens))
        go to their requests at once, before any token of theirs is booked."""
        host, owners, scored = to_host(dispatch.out), dispatch.owners, dispatch.scored
        for row, (req, start, n) in (scored or {}).items():
            req.take_scores(host, row, start, n)
        for row, (req, start, n) in (dispatch.captured or {}).items():
            req.take_capture(host, row, start, n)
        if dispatch.decode is not None and self.num_draft_tokens:
            self._book(host, dispatch.decode)
        for step in range(host.tokens.shape[0]):
            for row, req in owners.items():
                if host.emitted[step, row]:
                    self._outbox.append((req, host, step, row))
                    if req.constraint is not None and not req.done:  # before the next mask is computed
                        req.constraint.advance([host.tokens[step, row]])

    def _book(self, host, d: DecodePlan) -> None:
        """A speculative engine's decode step read back, booked with the policy: its outcome, and
        its wall time when it is known: the time since the read-back before, where the decode
        steps dispatched just before and just after it (already dispatched: outputs are read
        while the next step runs) are of its kind (plain or verify) and it ran beside no prefill
        chunk. An interval between two read-backs then holds one step of that kind whichever
        step's work the device and the host spent it on."""
        now = time.perf_counter()
        last, self._last_read = self._last_read, (d.index, now, bool(d.k))
        nxt = self._latest_decode
        if (last is not None and last[0] == d.index - 1 and last[2] == bool(d.k) and d.clean
                and nxt is not None and nxt.index == d.index + 1 and bool(nxt.k) == bool(d.k)):
            self.policy.observe(d.k, now - last[1])
        any_emitted = host.emitted.any(axis=0).tolist()
        emitted = {row: r for row, r in d.owners.items() if any_emitted[row]}
        if host.drafts_checked is not None:  # rows that emitted nothing had finished on the device before
            self.policy.count(host, emitted, d.stale)
        else:
            self.policy.count_plain(host, emitted)

    def _deliver(self) -> Iterator[TokenEvent]:
        """The events read back, in order, each made when it is taken: a request cancelled
        (or finished) meanwhile gets none. What a consumer leaves, the next call delivers."""
        while self._outbox:
            req, host, step, row = self._outbox.popleft()
            if req.done:
                continue
            event = req.book(host, step, row)
            if req.done:  # finished: its slot is free
                self.scheduler.finish(req)
            if req.on_token is not None:
                req.on_token(event)
            yield event

    def step(self) -> list[TokenEvent]:
        """Advance every request by at most one prefill chunk / `decode_steps` tokens (a
        verify step: 1..k+1)."""
        self._dispatch()
        return list(self._deliver())

    def run(self) -> Iterator[TokenEvent]:
        """Step until every request has finished, yielding token events as they arrive."""
        while self.has_work():
            self._dispatch()
            yield from self._deliver()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.requests[self.add_request(p, sp)] for p, sp in zip(prompts, params)]
        for _ in self.run():
            pass
        return [r.tokens for r in reqs]
