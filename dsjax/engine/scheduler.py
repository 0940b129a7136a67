"""The scheduler: which request gets which slot, which prompt chunk each prefilling request
runs at which width and context bucket, which prefix blocks are restored and saved, and
whether and how a decode step runs. Host only: it reads and writes `Request`s and its own
bookkeeping and emits a `StepPlan` each step, a plain value the runner
(`dsjax.engine.runner`) executes; it makes no device call and holds no device array.

The plan of one step (`Scheduler.schedule`):
  1. admission: each free slot takes the next waiting request (first in line; with a
     prefix cache `PrefixPlanner.take_next`), whose longest cached prefix is restored
     (`Restore`);
  2. one prompt chunk per prefilling request (`PrefillCall`s): `prefill_chunk` tokens at a
     time, the first chunk narrower so the rest align (or, `aligned_chunks`, the last; the
     prefix cache's blocks and V4.1's published-key rule need the absolute grid). A call
     takes one request's row on one device, every row on a mesh (a batch-sharded cache
     cannot be sliced by row), and in batch-invariant mode the rows of one tile and one
     chunk width together. A request's last chunk samples its first token;
  3. constrained requests whose prompt is cached but for its last token start decoding from
     it (`starts`), so that their first token is sampled under the grammar's mask;
  4. one decode step for every decoding slot (`DecodePlan`): its context bucket, the drafts
     k a verify step checks (`SpeculationPolicy.step_k`; 0: the confidence policy's plain
     step), the greedy or sampling variant,
     the rows cancelled since the last one, and whether it is split for structured output
     (a constrained row decodes: the masks are made while the device runs the forward).

Request state moves here when the plan is made (prefilled, dispatched, decoding): the
device runs the plan's steps in order, so the next plan may count on them.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from dsjax.engine.constraints import fill_masks, mask_words
from dsjax.engine.policy import SpeculationPolicy
from dsjax.engine.prefix_cache import BlockSave, PrefixPlanner, Restore
from dsjax.engine.requests import (MIN_BUCKET, Request, chunk_length, chunk_lengths, context_bucket,
                                   context_buckets)
from dsjax.model.interface import INVARIANT_ROWS


@dataclasses.dataclass
class Chunk:
    """One request's prompt chunk in a prefill call."""

    row: int  # its row among the call's rows
    request: Request
    start: int  # prompt tokens before it
    tokens: list[int]
    following: list[int]  # the prompt token after each (the drafter's ring; prompt logprobs)
    is_last: bool  # the prompt ends here: the first token is sampled
    admits: bool  # the prompt starts here: the slot takes the request's settings


@dataclasses.dataclass
class PrefillCall:
    """One prefill program call over `rows` rows from row `row` on."""

    row: int
    rows: int
    width: int  # chunk width (padded)
    bucket: int  # context bucket
    sampled: bool  # a row samples (speculation's sampling variant)
    score: bool  # a row asks for prompt logprobs (the scoring program)
    draft: bool = True  # speculation: the chunk goes through the drafter (else the plain prefill program)
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    saves: list[BlockSave] = dataclasses.field(default_factory=list)  # prefix blocks the call completes

    @property
    def owners(self) -> dict[int, Request]:
        """Rows whose first token this call samples -> their requests."""
        return {c.row: c.request for c in self.chunks if c.is_last}

    @property
    def captured(self) -> dict[int, tuple[Request, int, int]]:
        """Rows whose request asks for its prompt's captured points (SamplingParams.capture) ->
        (request, first position, tokens)."""
        return {c.row: (c.request, c.start, len(c.tokens)) for c in self.chunks if c.request.params.capture}

    @property
    def scored(self) -> dict[int, tuple[Request, int, int]]:
        """Rows whose prompt logprobs this call makes -> (request, first position, tokens)."""
        return {c.row: (c.request, c.start, len(c.tokens)) for c in self.chunks
                if c.request.params.prompt_logprobs is not None}


@dataclasses.dataclass
class DecodePlan:
    """One decode step (a verify step over k drafts with speculation) for every slot."""

    bucket: int
    k: int = 0
    sampled: bool = False
    owners: dict[int, Request] = dataclasses.field(default_factory=dict)  # decoding rows
    cancelled: tuple[int, ...] = ()  # rows the step stops first
    constrained: bool = False  # split in two programs, the sampling under packed masks
    copies: list[tuple[Request, int, int]] = dataclasses.field(default_factory=list)  # generated blocks (row, j)
    # speculation: k = 0 is the confidence policy's plain step (the plain decode program); rows
    # whose drafts predate a plain step (their outcomes are not booked); a probe step before
    # the probe's last (`SpeculationPolicy.step_schedule`)
    stale: frozenset = frozenset()
    cold: frozenset = frozenset()  # rows whose pending drafts are an earlier request's: they check none
    probe: bool = False
    clean: bool = True  # no prefill chunk runs in the same plan (its wall time is the step's)
    index: int = 0  # decode plans made before this one


@dataclasses.dataclass
class StepPlan:
    """What one engine step runs, in order: restores, prefill calls, constrained starts,
    the decode step."""

    restores: list[Restore] = dataclasses.field(default_factory=list)
    prefills: list[PrefillCall] = dataclasses.field(default_factory=list)
    starts: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, token)
    decode: DecodePlan | None = None


@dataclasses.dataclass
class WarmupItem:
    """One compile step of warm-up: a plan of no-op work (no row active, no token valid),
    or the prefix cache's block round trip (`plan` None); `programs` it compiles."""

    what: str
    plan: StepPlan | None
    programs: int = 1


class Scheduler:
    """Slots, admission, chunking, buckets, prefix decisions and the speculation policy's k.

    rows: rows of the device state (max_slots, rounded up to whole tiles in batch-invariant
    mode; only the first max_slots are admitted to). prefill_rows: rows of a prefill call
    (1; a batch-invariant tile; every row on a mesh). speculative: decode steps verify drafts
    (`policy` says how many); decode_steps: tokens per slot per plain decode dispatch."""

    def __init__(self, *, max_slots: int, rows: int, capacity: int, prefill_chunk: int, prefill_rows: int,
                 batch_invariant: bool, on_mesh: bool, decode_steps: int, policy: SpeculationPolicy,
                 vocab_size: int, aligned_chunks: bool, prefix: PrefixPlanner | None = None,
                 smallest_bucket: int = MIN_BUCKET):
        self.max_slots, self.rows, self.capacity, self.prefill_chunk = max_slots, rows, capacity, prefill_chunk
        self.smallest_bucket = smallest_bucket
        self.prefill_rows, self.batch_invariant, self.on_mesh = prefill_rows, batch_invariant, on_mesh
        self.decode_steps, self.policy, self.vocab_size = decode_steps, policy, vocab_size
        self.speculative = policy.enabled
        self.aligned_chunks, self.prefix = aligned_chunks, prefix
        self.waiting: collections.deque[Request] = collections.deque()
        self.slot_owner: list[Request | None] = [None] * rows
        self.cancelled: set[int] = set()  # rows cancelled while decoding: stopped by the next decode step
        self.decode_plans = 0

    # ------------------------------------------------------------------ requests and slots
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def cancel(self, req: Request) -> None:
        """Take a request out of line, or out of its slot (free at once; the next decode step
        stops the row on the device)."""
        if req.state == "waiting":
            self.waiting.remove(req)
        else:
            self.cancelled.add(req.slot)
            self.slot_owner[req.slot] = None

    def finish(self, req: Request) -> None:
        """A request's last token was delivered: its slot is free."""
        self.slot_owner[req.slot] = None
        req.slot = None

    @property
    def free_slots(self) -> list[int]:
        return [i for i, owner in enumerate(self.slot_owner[: self.max_slots]) if owner is None]

    def busy(self) -> bool:
        """Requests wait or hold a slot."""
        return bool(self.waiting or any(o is not None for o in self.slot_owner))

    # ------------------------------------------------------------------ shapes
    def bucket(self, tokens_needed: int) -> int:
        return self.capacity if self.batch_invariant else context_bucket(tokens_needed, self.capacity,
                                                                          self.smallest_bucket)

    def buckets(self) -> list[int]:
        return [self.capacity] if self.batch_invariant else context_buckets(self.capacity, self.smallest_bucket)

    def next_chunk(self, r: Request) -> list[int]:
        return r.next_chunk(self.prefill_chunk, aligned=self.aligned_chunks)

    def prefill_bucket(self, prefilled: int, width: int) -> int:
        """The context bucket of a chunk of `width` after `prefilled` tokens. A full chunk
        reads at least the bucket of two full chunks, so a prompt's first full chunk runs
        the program of its second (one program fewer; reading up to 4x more entries costs
        little beside a full chunk's dense work)."""
        if width == self.prefill_chunk:
            return self.bucket(max(prefilled + width, 2 * width))
        return self.bucket(prefilled + width)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk width, context bucket) a prefill call may have. Chunks narrower than
        prefill_chunk are a prompt's first (`Request.next_chunk`), at the smallest bucket (with
        aligned chunks its last, at any bucket); full chunks at each bucket from
        `prefill_bucket(0, prefill_chunk)` up."""
        widths = chunk_lengths(self.prefill_chunk)
        shapes = {(w, self.prefill_bucket(0, w)) for w in widths}
        lowest = self.prefill_bucket(0, self.prefill_chunk)
        if self.aligned_chunks:  # a prompt's last chunk is the narrower one, at any position
            shapes |= {(w, b) for w in widths for b in self.buckets() if b >= self.prefill_bucket(0, w)}
        return sorted(shapes | {(self.prefill_chunk, b) for b in self.buckets() if b >= lowest})

    # ------------------------------------------------------------------ the plan
    def schedule(self) -> StepPlan:
        """The next step's plan; its parts in order (each moves the requests' state on)."""
        restores = self.admit()
        plan = StepPlan(restores, self.prefill_calls(), self.start_constrained(), self.decode())
        if plan.decode is not None:
            plan.decode.clean, plan.decode.index = not (plan.restores or plan.prefills), self.decode_plans
            self.decode_plans += 1
        return plan

    def admit(self) -> list[Restore]:
        """Give free slots to waiting requests; the prefix blocks each restores."""
        restores = []
        for slot in self.free_slots:
            req = (self.prefix.take_next(self.waiting, self.slot_owner) if self.prefix is not None
                   else self.waiting.popleft() if self.waiting else None)
            if req is None:
                break
            self.cancelled.discard(slot)  # its first prompt chunk (or restored block) resets and stops the row
            req.state, req.slot = "prefilling", slot
            self.policy.admit(slot)
            self.slot_owner[slot] = req
            if self.prefix is not None and (restore := self.prefix.restore(req)) is not None:
                restores.append(restore)
        return restores

    def prefill_groups(self, reqs: list[Request]) -> list[list[Request]]:
        """The requests each prefill call takes: all (a mesh) or one (one device); in
        batch-invariant mode those of one chunk width (and one tile, on one device), so a
        chunk always runs at its own width, in a call of one shape, and those that score their
        prompt apart from those that do not (the scoring program reads a row's last logits off
        the head applied to the whole chunk, which may differ from the usual program's in the
        last bits: a row's logits must not depend on a neighbour's asking)."""
        if not self.batch_invariant:
            return ([list(reqs)] if reqs else []) if self.on_mesh else [[r] for r in reqs]
        groups = {}
        for r in reqs:
            width = chunk_length(len(self.next_chunk(r)), self.prefill_chunk)
            tile = 0 if self.on_mesh else r.slot // INVARIANT_ROWS
            groups.setdefault((width, tile, r.params.prompt_logprobs is not None), []).append(r)
        return list(groups.values())

    def prefill_calls(self) -> list[PrefillCall]:
        """A prompt chunk for every prefilling request (an admitted one at least once, if only
        to admit it), in the calls `prefill_groups` makes."""
        prefilling = [r for r in self.slot_owner
                      if r is not None and r.state == "prefilling" and (r.prefilled < r.prefill_len or not r.admitted)]
        return [self._prefill_call(group) for group in self.prefill_groups(prefilling)]

    def _prefill_call(self, group: list[Request]) -> PrefillCall:
        """One prompt chunk for each request of `group`; their state moves past it."""
        n = self.prefill_rows
        chunks = [self.next_chunk(r) for r in group]
        width = chunk_length(max(len(c) for c in chunks), self.prefill_chunk)
        call = PrefillCall(group[0].slot // n * n, n, width,
                           self.prefill_bucket(max(r.prefilled for r in group), width),
                           any(r.params.temperature > 0 for r in group),
                           any(r.params.prompt_logprobs is not None for r in group))
        # a prefix cache's blocks keep the drafter's ring: their prompt chunks always fill it
        call.draft = self.speculative and (self.policy.drafting() or self.prefix is not None)
        for r, tokens in zip(group, chunks):
            following = r.prompt[r.prefilled + 1: r.prefilled + len(tokens) + 1]
            is_last = r.prefilled + len(tokens) == len(r.prompt)
            call.chunks.append(Chunk(r.slot % n, r, r.prefilled, tokens, following, is_last, not r.admitted))
            r.admitted = True
            r.prefilled += len(tokens)
            r.dispatched = r.prefilled
            if is_last:
                r.state = "decoding"
            if self.speculative:
                self.policy.prefilled(r.slot, call.draft, is_last)
        if self.prefix is not None:
            call.saves = self.prefix.saves(group)
        return call

    def start_constrained(self) -> list[tuple[int, int]]:
        """Constrained requests whose prompt is cached but for its last token start decoding
        from that token (their first token is then sampled under the mask)."""
        starts = []
        for r in self.slot_owner:
            if (r is not None and r.state == "prefilling" and r.constraint is not None and r.admitted
                    and r.prefilled == r.prefill_len):
                starts.append((r.slot, r.prompt[-1]))
                r.state, r.dispatched = "decoding", r.prefilled
        return starts

    def _take_cancelled(self) -> tuple[int, ...]:
        cancelled = tuple(sorted(self.cancelled))
        self.cancelled.clear()
        return cancelled

    def decode(self) -> DecodePlan | None:
        """The decode step of every decoding slot, or None (none decodes)."""
        decoding = [r for r in self.slot_owner if r is not None and r.state == "decoding"]
        if not decoding:
            return None
        owners = {r.slot: r for r in decoding}
        if any(r.constraint is not None for r in decoding):  # one token per dispatch, split
            plan = DecodePlan(self.bucket(min(max(r.dispatched for r in decoding) + 1, self.capacity)),
                              owners=owners, cancelled=self._take_cancelled(), constrained=True)
            for r in decoding:
                r.dispatched += 1
            return plan
        # nothing waits: the batch drains, and finishes when its slowest row does
        remaining = None if self.waiting else {r.slot: r.params.max_tokens - len(r.tokens) for r in decoding}
        k = self.policy.step_k([r.slot for r in decoding], remaining)
        n = k + 1 if self.speculative else self.decode_steps  # positions written per slot, at most
        needed = min(max(r.dispatched for r in decoding) + n, self.capacity)
        plan = DecodePlan(self.bucket(needed), k, any(r.params.temperature > 0 for r in decoding), owners,
                          self._take_cancelled(), stale=self.policy.last_stale, cold=self.policy.last_cold,
                          probe=self.policy.last_probe)
        for r in decoding:
            r.dispatched += n
        if self.prefix is not None:
            plan.copies = self.prefix.after_decode(decoding)
        return plan

    def masks(self, decode: DecodePlan) -> np.ndarray:
        """Packed allowed tokens [rows, words] int32 of a split decode step: all ones but for
        constrained rows (a new array each step: the device may still read the last one).
        Made once the grammars took every token read back before it."""
        masks = np.full((self.rows, mask_words(self.vocab_size)), -1, np.int32)
        fill_masks([(r.slot, r.constraint) for r in decode.owners.values() if r.constraint is not None and not r.done],
                   masks)
        return masks

    # ------------------------------------------------------------------ warm-up
    def warmup_plans(self, *, constrained: bool = False, scoring: bool = False) -> list[WarmupItem]:
        """The no-op plans that compile every program serving may run: a prefill call per
        `prefill_shapes` (and variant; scored too with `scoring`), a decode step per context
        bucket (and verify length and variant), with `constrained` a start and a split step
        per bucket (the first also stops the started row), and the prefix cache's block
        round trip."""
        ks, variants = self.policy.verify_lengths(), self.policy.variants()
        n, items = self.prefill_rows, []
        for (width, bucket), sampled in [(s, v) for s in self.prefill_shapes() for v in variants]:
            for score in (False, True) if scoring else (False,):
                items.append(WarmupItem(f"prefill {width} tokens, context {bucket}" + ", scored" * score,
                                        StepPlan(prefills=[PrefillCall(0, n, width, bucket, sampled, score,
                                                                       self.speculative)])))
        if self.policy.plain_steps and self.prefix is None:  # prompts prefilled during plain runs
            items += [WarmupItem(f"prefill {width} tokens, context {bucket}, plain",
                                 StepPlan(prefills=[PrefillCall(0, n, width, bucket, False, False, False)]))
                      for width, bucket in self.prefill_shapes()]
        for bucket, k, sampled in [(b, k, v) for b in self.buckets() for k in ks for v in variants]:
            what = f"decode, context {bucket}" + (f", {k} drafts" if self.speculative else "")
            items.append(WarmupItem(what, StepPlan(decode=DecodePlan(bucket, k, sampled))))
        if self.policy.plain_steps:  # the confidence policy's plain steps: the plain decode program
            items += [WarmupItem(f"decode, context {b}, plain", StepPlan(decode=DecodePlan(b, 0)))
                      for b in self.buckets()]
        if constrained:  # row 0 starts decoding, and the next step's cancel stops it
            items.append(WarmupItem("structured output: start a slot", StepPlan(starts=[(0, 0)])))
            items += [WarmupItem(f"structured output: decode, context {b}",
                                 StepPlan(decode=DecodePlan(b, cancelled=(0,) * (i == 0), constrained=True)),
                                 1 + (i == 0))  # the forward per bucket; the sampling half once
                      for i, b in enumerate(self.buckets())]
        if self.prefix is not None:
            items.append(WarmupItem("prefix cache: save and restore a block", None, 2))
        return items
