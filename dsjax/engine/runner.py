"""The runner: the engine's device state and the dispatch of its compiled programs. It
executes a `StepPlan` (`dsjax.engine.scheduler`) and returns a `StepOutput`, the device
outputs still to read back; it decides nothing about requests.

Device state (batch-major, on a mesh each row on its batch shard): the cache [rows, ...],
the `Slots` pytree of per-row sampling settings and decode state, the drafter's state
(`spec`, speculative engines) and `step_params`, the weights the prefill and decode
programs run with: the model's, but for an engine on one XLA:CPU device (not
batch-invariant) with the CPU head kernel built, which keeps its fp32 or bf16 head packed
for it (`step_head_params`: the head's bytes again in memory; from two rows up the kernel is
faster than XLA's product). greedy_screen (`worth_screening`: up to 16 rows with
AVX512-BF16, else 4): an fp32 head also keeps a bf16 copy, from which greedy decode steps,
and greedy verify steps at each of their k + 1 positions (`verify_params`: V4's MTP; V4.1
verifies with the model's head; not in speculative engines that report logprobs), find the
fp32 logits' first maximum reading half the bytes (the same tokens, bitwise; a step with a
row asking for logprobs reads the fp32 head); False saves that memory. Otherwise a one-row engine (no drafts)
keeps a short-hidden fp32 head transposed (`one_row_head`).

Dispatch: a prefill call runs `prefill_step` over its rows (one row, or a batch-invariant
tile) or `prefill_rows` over every row on a mesh, and their speculative forms
(`spec_prefill_step` / `spec_prefill_rows`: the chunk also goes through the drafter's ring; a
confidence engine's prompts planned during a run of plain steps take the plain programs);
a decode step runs `decode_step` (`decode_steps` tokens a dispatch; the confidence policy's
plain steps too) or `spec_decode_step` (a verify step over k drafts; the confidence policy's `Schedule` and the drafter's reduced
vocabulary as arguments), or, split for structured output, `decode_forward` and then
`decode_sample` under packed masks made while the device runs the forward. Rows cancelled
since the last decode step reach the device with the next one. Prefix-cache blocks are
copied in (`restore_block`) and out (`save_block`) of rows here, into the pool the
scheduler's `PrefixPlanner` reads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.compile_cache import executable_directory
from dsjax.engine.constraints import mask_words
from dsjax.engine.executables import Deferred, Programs, Store
from dsjax.engine.prefix_cache import PrefixCache, Restore
from dsjax.engine.programs import (DeviceOutput, decode_forward, decode_sample, decode_step, init_state, prefill_rows,
                                   prefill_step, program, restore_block, save_block, spec_decode_step, spec_prefill_rows,
                                   spec_prefill_step, start_decoding)
from dsjax.engine.requests import Request, admission
from dsjax.engine.scheduler import DecodePlan, PrefillCall, StepPlan, WarmupItem
from dsjax.engine.speculative import Schedule, calibration_centres
from dsjax.engine.speculative import draft_vocab as gather_draft_vocab
from dsjax.model.interface import Model, batch_axes, block_layout, drafter_for, step_head_params, worth_screening
from dsjax.sharding.rules import batch_sharding


@dataclasses.dataclass
class Dispatch:
    """One program's outputs to read back: rows -> the requests they belong to (`owners`),
    and rows whose prompt logprobs it made (`scored`: row -> (request, first position, n)) or
    whose prompt's captured points (`captured`, alike)."""

    out: DeviceOutput
    owners: dict[int, Request]
    scored: dict | None = None
    captured: dict | None = None
    decode: DecodePlan | None = None  # the decode step's plan (the speculation policy books it)


@dataclasses.dataclass
class StepOutput:
    """What one plan's programs produced, on the device: the dispatches whose outputs carry
    tokens (or prompt logprobs), in order, and the generated-token blocks copied out
    (request, block index, block) for the prefix cache to key once their tokens are read."""

    dispatches: list[Dispatch] = dataclasses.field(default_factory=list)
    copies: list[tuple] = dataclasses.field(default_factory=list)


class Runner:
    """Owns the device state and the programs; `execute(plan)` runs one step's plan."""

    def __init__(self, model: Model, *, rows: int, capacity: int, opts, logprob_width: int, decode_steps: int,
                 policy, draft_vocab, prefill_rows: int, greedy_screen: bool, pool: PrefixCache | None = None,
                 block: int = 0, capture: tuple[str, ...] = ()):
        self.model, self.cfg, self.mesh, self.opts = model, model.config, model.mesh, opts
        self.capture = capture  # full names the forward programs record (a static argument; () for most engines)
        self.rows, self.capacity, self.prefill_rows = rows, capacity, prefill_rows
        self.n_logprobs, self.decode_steps, self.policy, self.pool = logprob_width, decode_steps, policy, pool
        k = policy.num_draft_tokens
        self.draft = (gather_draft_vocab(model.params, draft_vocab)  # the speculative programs' argument
                      if k and draft_vocab is not None else None)
        self.step_params = model.params
        if self.mesh is None and not opts.batch_invariant:
            self.step_params = step_head_params(model.params, model.dtype, one_row=rows == 1 and not k,
                                                screen=greedy_screen and not (k and logprob_width)
                                                and worth_screening(model.params, rows))
        # a verify step reads the step head (greedy batches through its screen) where its drafter's
        # target gives the head's input; DeepSeek-V4.1's DSpark verifies with the model's own head
        self.verify_params = self.step_params if drafter_for(self.cfg).screens_verify else model.params
        store = executable_directory()
        self.call = Programs(store and Store(store))  # every program below runs through it
        empty = dict(cfg=self.cfg, batch=rows, capacity=capacity, dtype=model.dtype, num_draft_tokens=k)
        if self.mesh is None:
            self.cache, self.slots, self.spec = self.call(init_state, **empty)
        else:  # made in place on the mesh: a one-device array cannot be moved onto a mesh spanning hosts
            made = functools.partial(init_state.__wrapped__, **empty)
            self.cache, self.slots, self.spec = program(made, out_shardings=self.shardings(jax.eval_shape(made)))()
        self.none_cancelled = jax.device_put(np.zeros(rows, bool), self.mesh and self.shardings(np.zeros(rows, bool)))
        self.block_static = None if pool is None else dict(block=block, layout=block_layout(self.cfg, capacity,
                                                                                               model.dtype))

    def shardings(self, tree):
        """Where batch-major state lies on the mesh: rows over the batch axes."""
        return jax.tree.map(lambda a, ax: batch_sharding(self.mesh, a.ndim, ax), tree, batch_axes(tree))

    def place(self, tree):
        """Batch-major host data (or state) onto the mesh."""
        return tree if self.mesh is None else jax.device_put(tree, self.shardings(tree))

    # ------------------------------------------------------------------ a plan
    def execute(self, plan: StepPlan,
                before_sample: Callable[[StepOutput, DecodePlan], np.ndarray] | None = None) -> StepOutput:
        """Run the plan's programs in order. A split decode step calls before_sample(output so
        far, its plan) between its halves, while the device runs the forward: it returns the
        masks."""
        output = StepOutput()
        for restore in plan.restores:
            self.restore(restore)
        for call in plan.prefills:
            out = self.prefill(call)
            if call.owners or call.scored or call.captured:  # (read back before the first token: the queue keeps order)
                output.dispatches.append(Dispatch(out, call.owners, call.scored, call.captured))
            for s in call.saves:
                self.pool.keep(s.key, s.parent, s.tokens, lambda s=s: self._copy_block(s.slot, s.j, self._drafter()))
        for row, token in plan.starts:
            self.slots = self.call(start_decoding, self.slots, np.int32(row), np.int32(token))
        if plan.decode is not None:
            d = plan.decode
            out = self.split_decode(d, lambda: before_sample(output, d)) if d.constrained else self.decode(d)
            output.dispatches.append(Dispatch(out, d.owners, decode=d))
            output.copies = [(r, j, self._copy_block(row, j, None)) for r, row, j in d.copies]
        if self.pool is not None:
            self.pool.settle()  # host-tier copies, now that the device has work
        return output

    def _row_mask(self, rows) -> jax.Array:
        """A [rows] bool mask of these rows (cancelled rows; a verify step's cold rows)."""
        if not rows:
            return self.none_cancelled
        return self.place(np.isin(np.arange(self.rows), list(rows)))

    def prefill(self, call: PrefillCall) -> DeviceOutput:
        """One prompt chunk for the call's rows: [n, C] from row `call.row` on (n: 1, a
        batch-invariant tile, or every row on a mesh). Rows without a chunk are untouched;
        score: the program that also scores each position's next prompt token, with the
        model's own head (a GEMM over the chunk), not the few-row kernel's packed copy."""
        n = call.rows
        tokens, following = np.zeros((n, call.width), np.int32), np.zeros((n, call.width), np.int32)
        n_valid, is_last = np.zeros(n, np.int32), np.zeros(n, bool)
        first_mask = np.full((n, mask_words(self.cfg.vocab_size)), 0xFFFFFFFF, np.uint32)
        admits = [None] * n
        for c in call.chunks:
            tokens[c.row, : len(c.tokens)], following[c.row, : len(c.following)] = c.tokens, c.following
            n_valid[c.row], is_last[c.row] = len(c.tokens), c.is_last
            if c.request.first_mask is not None:
                first_mask[c.row] = c.request.first_mask
            if c.admits:
                admits[c.row] = c.request
        admits = admission(admits)
        params, slot = (self.model.params if call.score else self.step_params), np.int32(call.row)
        static = dict(cfg=self.cfg, opts=self.opts, ctx_bucket=call.bucket, n_logprobs=self.n_logprobs)
        plain = {**static, **self._capture()}  # (capture: plain engines only)
        if self.spec is not None and call.draft:
            chunk = (tokens, following, n_valid, is_last, admits, first_mask)
            state = (params, self.model.mtp, self.cache, self.spec, self.slots)
            drafting = (self.policy.schedule, self.draft)
            if self.mesh is not None:
                self.cache, self.spec, self.slots, out = self.call(spec_prefill_rows, *state, *self.place(chunk),
                                                                   *drafting, sampled=call.sampled, **static)
            else:
                self.cache, self.spec, self.slots, out = self.call(spec_prefill_step, *state, slot, *chunk,
                                                                   *drafting, sampled=call.sampled, **static)
        elif self.mesh is not None:
            self.cache, self.slots, out = self.call(
                prefill_rows, params, self.cache, self.slots,
                *self.place((tokens, n_valid, is_last, admits, first_mask)),
                self.place(following) if call.score else None, **plain)
        else:
            self.cache, self.slots, out = self.call(prefill_step, params, self.cache, self.slots, slot, tokens, n_valid,
                                                    is_last, admits, first_mask, following if call.score else None,
                                                    **plain)
        return out

    def decode(self, d: DecodePlan) -> DeviceOutput:
        """One decode step for every row (`decode_steps` tokens), or a verify step over d.k
        drafts (d.k = 0 with speculation: the confidence policy's plain step, the same program
        as plain decoding's; the drafter's state waits)."""
        cancelled = self._row_mask(d.cancelled)
        if self.spec is None or not d.k:
            self.cache, self.slots, out = self.call(
                decode_step, self.step_params, self.cache, self.slots, cancelled, cfg=self.cfg, opts=self.opts,
                ctx_bucket=d.bucket, n_logprobs=self.n_logprobs, n_steps=self.decode_steps, **self._capture())
        else:
            self.cache, self.spec, self.slots, out = self.call(
                spec_decode_step, self.verify_params, self.model.mtp, self.cache, self.spec, self.slots, cancelled,
                self.policy.step_schedule(d.probe), self.draft, self._row_mask(d.cold), k=d.k, cfg=self.cfg,
                opts=self.opts, ctx_bucket=d.bucket, sampled=d.sampled, n_logprobs=self.n_logprobs)
        return out

    def split_decode(self, d: DecodePlan, masks: Callable[[], np.ndarray]) -> DeviceOutput:
        """A decode step in two dispatches: the forward, then (after `masks()`, which the host
        runs while the device runs the forward) the sampling under the packed masks [rows,
        words] int32."""
        self.cache, self.slots, logits, positions, *found = self.call(
            decode_forward, self.step_params, self.cache, self.slots, self._row_mask(d.cancelled), cfg=self.cfg,
            opts=self.opts, ctx_bucket=d.bucket, **self._capture())
        self.slots, out = self.call(decode_sample, self.slots, logits, positions, self.place(masks().view(np.uint32)),
                                    n_logprobs=self.n_logprobs)
        return out.replace(capture=found[0]) if found else out

    def _capture(self) -> dict:
        """The capture argument of the plain programs: absent when the engine captures nothing, so
        their calls (and programs) are what they were without it."""
        return {"capture": self.capture} if self.capture else {}

    # ------------------------------------------------------------------ prefix-cache blocks
    def _drafter(self):
        return None if self.spec is None else self.spec.mtp

    def _copy_block(self, row: int, j: int, drafter):
        """Block j of `row` (with the drafter's ring, or None), copied out at its end."""
        return self.call(save_block, self.cache, drafter, np.int32(row), np.int32(j), **self.block_static)

    def restore(self, r: Restore) -> None:
        """Put a prompt's cached blocks into its row, as if their prompt chunks had run there
        (block 0 admits the request)."""
        b = self.block_static["block"]
        for j, entry in enumerate(r.blocks):
            tokens = np.asarray(r.request.prompt[j * b: (j + 1) * b], np.int32)[None]
            self.cache, self.slots, drafter = self.call(
                restore_block, self.cache, self.slots, self._drafter(), self.pool.device_block(entry), tokens,
                np.int32(r.slot), np.int32(j), admission([r.request] if j == 0 else [None]), **self.block_static)
            if drafter is not None:
                self.spec = self.spec.replace(mtp=drafter)

    def store(self, blocks) -> None:
        """Generated-token blocks the prefix planner keyed: (key, parent, tokens, block)."""
        for key, parent, tokens, blk in blocks:
            self.pool.insert_generated(key, parent, tokens, blk)

    def _block_round_trip(self) -> None:
        """Save block 0 of row 0 and put it back (row 0 is empty before any request: putting
        its own block back changes nothing); the state is left as it was."""
        blk = self._copy_block(0, 0, self._drafter())
        length, slots = np.asarray(self.cache.length), self.slots
        self.cache, _, drafter = self.call(
            restore_block, self.cache, jax.device_put(jax.tree.map(np.asarray, slots)), self._drafter(), blk,
            np.zeros((1, self.block_static["block"]), np.int32), np.int32(0), np.int32(0), admission([None]),
            **self.block_static)
        if drafter is not None:
            self.spec = self.spec.replace(mtp=drafter)
        self.cache, self.slots = self.cache.replace(length=jax.device_put(length)), slots

    # ------------------------------------------------------------------ warm-up
    def measure_costs(self, bucket: int) -> None:
        """Confidence scheduling: time plain decode steps and verify steps over k = 1..K drafts
        (with their drafting) on idle copies of the slot state, at context `bucket`, in
        interleaved rounds (`SpeculationPolicy.measure_costs`). Runs once (warm-up, or the
        first step); the engine's observed step times refresh them."""
        if not self.policy.needs_costs:
            return
        idle = [jax.tree.map(jnp.copy, self.spec),
                jax.tree.map(jnp.copy, self.slots).replace(active=jnp.zeros_like(self.slots.active))]
        placeholder = Schedule(jnp.ones(self.policy.num_draft_tokens + 1, jnp.float32),
                               jnp.asarray(calibration_centres(), jnp.float32))

        def step(k: int):
            if not k:
                self.cache, idle[1], out = self.call(
                    decode_step, self.step_params, self.cache, idle[1], self.none_cancelled, cfg=self.cfg,
                    opts=self.opts, ctx_bucket=bucket, n_logprobs=self.n_logprobs, n_steps=self.decode_steps)
            else:
                self.cache, idle[0], idle[1], out = self.call(
                    spec_decode_step, self.verify_params, self.model.mtp, self.cache, *idle, self.none_cancelled,
                    placeholder, self.draft, self.none_cancelled, k=k, cfg=self.cfg, opts=self.opts,
                    ctx_bucket=bucket, sampled=False, n_logprobs=self.n_logprobs)
            return self.cache, out

        self.policy.measure_costs(step)

    def warmup(self, items: list[WarmupItem], masks: Callable[[StepOutput, DecodePlan], np.ndarray],
               progress: Callable[[int, int, str], None] | None = None, threads: int | None = None) -> None:
        """Run the scheduler's warm-up plans (no-op work on the live state), compiling each
        program; `masks` those of the split steps. The programs compile on `threads` threads
        (default: a thread per core, at most 4) while this one traces the next: a plan that
        meets a program not compiled yet stops there (`Deferred`, before that program runs)
        and runs again from its start in the next pass, so a plan must be harmless to repeat
        (the warm-up plans are no-op work)."""
        threads = threads or min(4, os.cpu_count() or 1)
        left, first = list(enumerate(items, 1)), True
        with self.call.ahead(threads):
            while left:
                deferred = []
                for i, item in left:
                    if first and progress is not None:
                        progress(i, len(items), item.what)
                    try:
                        if item.plan is None:
                            self._block_round_trip()
                        else:
                            self.execute(item.plan, masks)
                    except Deferred:
                        deferred.append((i, item))
                left, first = deferred, False
        jax.block_until_ready(self.cache)
