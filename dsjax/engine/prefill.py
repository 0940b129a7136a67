"""The prefill half of `Engine`'s step (dsjax/engine/engine.py, whose docstring describes the
engine's state): which prompt chunks go in one call, the chunk arrays and context bucket of
each call, the device call itself, and the programs `warmup` must compile for them.

A prompt is fed `prefill_chunk` tokens at a time (its first chunk narrower, so the rest
align; or, `Engine.aligned_chunks`, its last; `Request.next_chunk`), one call per request on
one device (one row of the cache), all prefilling rows in one call under a mesh (a
batch-sharded cache cannot be sliced by row), and in batch-invariant mode the rows of one
tile and one chunk width together.
"""

from __future__ import annotations

import numpy as np

from dsjax.engine.constraints import mask_words
from dsjax.engine.programs import (StepOutput, prefill_rows, prefill_step, spec_prefill_rows, spec_prefill_step,
                                   start_decoding)
from dsjax.engine.requests import Request, admission, chunk_length, chunk_lengths
from dsjax.model.interface import INVARIANT_ROWS


class Prefill:
    """Mixed into `Engine`: its prompt-chunk scheduling and prefill calls."""

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk width, context bucket) a prefill call may have. Chunks narrower than
        prefill_chunk are a prompt's first (`Request.next_chunk`), at the smallest bucket (with
        aligned chunks, `Engine.aligned_chunks`, its last, at any bucket); full chunks at each
        bucket from `_prefill_bucket(0, prefill_chunk)` up."""
        shapes = {(w, self._prefill_bucket(0, w)) for w in chunk_lengths(self.prefill_chunk)}
        lowest = self._prefill_bucket(0, self.prefill_chunk)
        if self.aligned_chunks:  # a prompt's last chunk is the narrower one, at any position
            shapes |= {(w, b) for w in chunk_lengths(self.prefill_chunk) for b in self._buckets()
                       if b >= self._prefill_bucket(0, w)}
        return sorted(shapes | {(self.prefill_chunk, b) for b in self._buckets() if b >= lowest})

    def _prefill_call(self, slot: int, tokens, following, n_valid, is_last, admits, first_mask, bucket: int,
                      sampled: bool, score: bool = False) -> StepOutput:
        """One prompt chunk: rows [n, C] from `slot` on (`_prefill_rows`: 1, a batch-invariant
        tile, or every row on a mesh);
        `admits` (an `Admission`) says which rows start a prompt, `first_mask` (packed
        [rows, words] uint32) which first tokens a row whose prompt ends here may take.
        score: a row asks for prompt logprobs: the program that also scores each position's
        next prompt token (`following`), compiled on first use (`warmup(scoring=True)`)."""
        params, slot = self.step_params, np.int32(slot)  # numpy, not jnp: jnp.int32(x) compiles a conversion
        if score:  # the head at every position of the chunk: the model's own head (a GEMM), not the few-row
            params = self.model.params  # decode kernel's packed copy (`step_head_params`)
        if self.spec is not None:
            static = dict(cfg=self.cfg, opts=self.opts, ctx_bucket=bucket, sampled=sampled,
                          n_logprobs=self.max_logprobs)
            chunk = (tokens, following, n_valid, is_last, admits, first_mask)
            state = (params, self.model.mtp, self.cache, self.spec, self.slots)
            if self.mesh is not None:
                self.cache, self.spec, self.slots, out = spec_prefill_rows(
                    *state, *self._place(chunk), self.policy.schedule, self._draft, **static)
            else:
                self.cache, self.spec, self.slots, out = spec_prefill_step(
                    *state, slot, *chunk, self.policy.schedule, self._draft, **static)
        elif self.mesh is not None:
            self.cache, self.slots, out = prefill_rows(
                params, self.cache, self.slots, *self._place((tokens, n_valid, is_last, admits, first_mask)),
                self._place(following) if score else None, cfg=self.cfg, opts=self.opts, ctx_bucket=bucket, n_logprobs=self.max_logprobs)
        else:
            self.cache, self.slots, out = prefill_step(
                params, self.cache, self.slots, slot, tokens, n_valid, is_last, admits, first_mask,
                following if score else None, cfg=self.cfg,
                opts=self.opts, ctx_bucket=bucket, n_logprobs=self.max_logprobs)
        return out

    def _next_chunk(self, r: Request) -> list[int]:
        return r.next_chunk(self.prefill_chunk, aligned=self.aligned_chunks)

    def _prefill_bucket(self, prefilled: int, width: int) -> int:
        """The context bucket of a chunk of `width` after `prefilled` tokens. A full chunk
        reads at least the bucket of two full chunks, so a prompt's first full chunk runs
        the program of its second (one program fewer; reading up to 4x more entries costs
        little beside a full chunk's dense work)."""
        if width == self.prefill_chunk:
            return self._bucket(max(prefilled + width, 2 * width))
        return self._bucket(prefilled + width)

    def _chunk_arrays(self, width: int):
        """Zeroed (tokens, following tokens, n_valid, is_last, admission) and an all-ones
        first-token mask for one prefill call of `_prefill_rows` rows."""
        rows = self._prefill_rows
        return np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32), np.zeros(rows, np.int32), \
            np.zeros(rows, bool), admission([None] * rows), \
            np.full((rows, mask_words(self.cfg.vocab_size)), 0xFFFFFFFF, np.uint32)

    def _prefill_groups(self, reqs) -> list[list[Request]]:
        """The requests each prefill call takes: all (a mesh) or one (one device); in
        batch-invariant mode those of one chunk width (and one tile, on one device), so a
        chunk always runs at its own width, in a call of one shape, and those that score their
        prompt apart from those that do not (the scoring program reads a row's last logits off
        the head applied to the whole chunk, which may differ from the usual program's in the
        last bits: a row's logits must not depend on a neighbour's asking)."""
        if not self.batch_invariant:
            return [list(reqs)] if self.mesh is not None else [[r] for r in reqs]
        groups = {}
        for r in reqs:
            width = chunk_length(len(self._next_chunk(r)), self.prefill_chunk)
            tile = 0 if self.mesh is not None else r.slot // INVARIANT_ROWS
            groups.setdefault((width, tile, r.params.prompt_logprobs is not None), []).append(r)
        return list(groups.values())

    def _prefill(self, *reqs: Request) -> None:
        """One prompt chunk for each of `reqs`, in the calls `_prefill_groups` makes: over
        every row under a mesh (one row of a batch-sharded cache cannot be sliced out), else
        over the request's row (one row's cost, not the batch's) or its tile."""
        n = self._prefill_rows
        for group in self._prefill_groups(reqs):
            rows = [r.slot % n for r in group]
            chunks = [self._next_chunk(r) for r in group]
            width = chunk_length(max(len(c) for c in chunks), self.prefill_chunk)
            tokens, following, n_valid, is_last, _, first_mask = self._chunk_arrays(width)
            by_row = dict(zip(rows, group))
            admits = admission([by_row.get(row) for row in range(len(n_valid))])
            for row, r, chunk in zip(rows, group, chunks):
                after = r.prompt[r.prefilled + 1: r.prefilled + len(chunk) + 1]  # speculation's MTP ring input
                tokens[row, : len(chunk)], following[row, : len(after)], n_valid[row] = chunk, after, len(chunk)
                is_last[row] = r.prefilled + len(chunk) == len(r.prompt)
                if r.first_mask is not None:
                    first_mask[row] = r.first_mask
            scored = {row: (r, r.prefilled, int(n_valid[row])) for row, r in zip(rows, group)
                      if r.params.prompt_logprobs is not None}
            out = self._prefill_call(group[0].slot // n * n, tokens, following, n_valid, is_last, admits, first_mask,
                                     self._prefill_bucket(max(r.prefilled for r in group), width),
                                     any(r.params.temperature > 0 for r in group), bool(scored))
            owners = {}
            for row, r in zip(rows, group):
                r.admitted = True
                r.prefilled += int(n_valid[row])
                r.dispatched = r.prefilled
                if is_last[row]:
                    r.state, owners[row] = "decoding", r
            if owners or scored:  # (scores are read back before the first token: the queue keeps order)
                self._pending.append((out, owners, scored))
            if self.prefix is not None:
                self.prefix.save(group)

    def _start_constrained(self) -> None:
        """Constrained requests whose prompt is cached but for its last token start decoding
        from that token (their first token is then sampled under the mask)."""
        for r in self.slot_owner:
            if (r is not None and r.state == "prefilling" and r.constraint is not None and r.admitted
                    and r.prefilled == r.prefill_len):
                self.slots = start_decoding(self.slots, np.int32(r.slot), np.int32(r.prompt[-1]))
                r.state, r.dispatched = "decoding", r.prefilled
