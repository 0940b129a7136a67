"""The structured-output half of `Engine`'s decode (dsjax/engine/engine.py, whose docstring
describes the engine's state and when a step is split): while a constrained row decodes, a
step is two dispatches, the forward and then the sampling under packed masks, and the host
reads every output back and advances the grammars while the device runs the forward.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from dsjax.engine.constraints import fill_masks, mask_words
from dsjax.engine.programs import StepOutput, decode_forward, decode_sample
from dsjax.engine.requests import Request


class ConstrainedDecode:
    """Mixed into `Engine`: its split decode step for constrained rows."""

    def _split_decode_call(self, bucket: int, masks, before_sample: Callable[[], None] | None = None) -> StepOutput:
        """A decode step in two dispatches: the forward, then (after `before_sample()` and
        `masks()`, which the host runs while the device runs the forward) the sampling
        under the packed masks [rows, words] int32."""
        self.cache, self.slots, logits, positions = decode_forward(
            self.step_params, self.cache, self.slots, self._take_cancelled(), cfg=self.cfg, opts=self.opts,
            ctx_bucket=bucket)
        if before_sample is not None:
            before_sample()
        masks = masks() if callable(masks) else masks
        self.slots, out = decode_sample(self.slots, logits, positions, self._place(masks.view(np.uint32)),
                                        n_logprobs=self.max_logprobs)
        return out

    def _masks(self, decoding: list[Request]) -> np.ndarray:
        """Packed allowed tokens [rows, words] int32 of the next step: all ones but for
        constrained rows (a new array each step: the device may still read the last one)."""
        masks = np.full((self.rows, mask_words(self.cfg.vocab_size)), -1, np.int32)
        fill_masks([(r.slot, r.constraint) for r in decoding if r.constraint is not None and not r.done], masks)
        return masks

    def _decode_constrained(self, decoding: list[Request]) -> None:
        """One split decode step (a constrained row decodes): every output still on the
        device is read back (advancing the grammars) while the device runs the forward."""

        def read_all():
            while self._pending:
                self._read_back(*self._pending.popleft())

        needed = min(max(r.dispatched for r in decoding) + 1, self.capacity)
        out = self._split_decode_call(self._bucket(needed), lambda: self._masks(decoding), read_all)
        for r in decoding:
            r.dispatched += 1
        self._pending.append((out, {r.slot: r for r in decoding}))
