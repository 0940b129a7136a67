"""The speculation policy: how many MTP drafts each verify step checks, and what it costs.

"fixed" verifies all K drafts every step. "confidence" lets each row ask for the k that
maximises its expected tokens (from the drafter's confidences) per unit of verify cost
(`dsjax.engine.speculative.choose_limits`, on the device); the step then verifies the
largest k any decoding row asked for, known one step late since outputs are read while the
next step runs. The cost curve (K + 1 relative costs of verifying k = 0..K drafts) is
pinned by the user or measured once on the device. The drafter's confidence is calibrated
online: every judged draft's confidence and outcome are binned, and the acceptance observed
per bin (shrunk toward the bin's centre by CALIBRATION_PRIOR pseudo-drafts) replaces the
raw confidence (a small drafter's softmax can be far below the rate at which its greedy
drafts match the target: docs/speculation.md). The output distribution never depends on
the policy; sampled tokens follow the k chosen.

A policy with K = 0 is plain decoding: every question gets the no-speculation answer.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.engine.speculative import CALIBRATION_BINS, Schedule, calibration_centres
from dsjax.model.interface import draft_block_limit, drafter_takes_vocab, min_ring

SPEC_POLICIES = ("confidence", "fixed")
CALIBRATION_PRIOR = 8.0  # pseudo-drafts per bin at the bin's centre: the raw confidence until drafts are judged
COUNTERS = ("target_steps", "row_steps", "drafts_proposed", "drafts_accepted", "decode_tokens")


def max_drafts(cfg: ModelConfig) -> int:
    """The most drafts a verify step can check: its k + 1 positions fit the smallest cache ring
    (DeepSeek-V4.1: and DSpark drafts a block of block_size)."""
    ring = min_ring(cfg) - 1
    return ring if (block := draft_block_limit(cfg)) is None else min(ring, block)


def check_speculation(num_draft_tokens: int, *, has_mtp: bool, max_drafts: int, unsupported: dict[str, bool]):
    """Refuse speculation the engine cannot run: no drafter (MTP layer / DSpark head), more
    drafts than `max_drafts`, or an engine option (name -> set) it does not combine with."""
    k = num_draft_tokens
    if not k:
        return
    if not has_mtp:
        raise ValueError("num_draft_tokens > 0 needs the model's drafter (the MTP layer; DeepSeek-V4.1: the DSpark "
                         "head): load a checkpoint with mtp.0.* tensors, or load_model(..., mtp=True)")
    if k > max_drafts:
        raise ValueError(f"num_draft_tokens={k} is too many for this model: at most {max_drafts} (a verify step's "
                         f"k + 1 positions fit its smallest cache ring; DSpark drafts a block at a time)")
    for name, bad in unsupported.items():
        if bad:
            raise ValueError(f"speculative decoding (num_draft_tokens > 0) does not support {name}")


def engine_draft_vocab(draft_vocab, model_ids, cfg: ModelConfig) -> np.ndarray | None:
    """The drafter vocabulary an Engine uses: `draft_vocab` None = the model's (`model_ids`, maybe
    None), False = the full vocabulary (None), else a list of ids, checked. DeepSeek-V4.1's
    DSpark head drafts over the whole vocabulary and takes none."""
    if draft_vocab is None:
        return None if model_ids is None else check_draft_vocab(model_ids, cfg.vocab_size, "model.draft_vocab")
    if draft_vocab is False:
        return None
    if not drafter_takes_vocab(cfg):
        raise ValueError("draft_vocab is for the MTP drafter; DeepSeek-V4.1's DSpark head drafts over the whole "
                         "vocabulary (leave draft_vocab None)")
    if draft_vocab is True:
        raise ValueError("draft_vocab must be None (the model's), False (the full vocabulary) or a list of "
                         "token ids, got True")
    return check_draft_vocab(draft_vocab, cfg.vocab_size)


def check_draft_vocab(ids, vocab_size: int, where: str = "draft_vocab") -> np.ndarray:
    """A drafter vocabulary (token ids the MTP drafter may propose) -> sorted int32 [|D|].
    Refused, naming `where`: not a 1-D list of integers, empty, out of [0, vocab_size),
    repeated ids."""
    a = np.asarray(ids)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{where} must be a 1-D list of integer token ids, got an array of shape {a.shape} "
                         f"and dtype {a.dtype}")
    if a.size == 0:
        raise ValueError(f"{where} is empty: the drafter needs at least one token id")
    bad = a[(a < 0) | (a >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary [0, {vocab_size}) "
                         f"({bad.size} such ids)")
    uniq, counts = np.unique(a, return_counts=True)
    if uniq.size != a.size:
        raise ValueError(f"{where}: token id {int(uniq[counts > 1][0])} appears more than once "
                         f"({a.size - uniq.size} repeats)")
    return uniq.astype(np.int32)


class SpeculationPolicy:
    """The scheduler's side of speculation: per slot, the drafts its latest output asked
    the next step to verify (`next_k`); the verify-cost curve; the counters behind
    `Engine.spec_metrics()`."""

    def __init__(self, num_draft_tokens: int, name: str = "confidence", verify_costs: list[float] | None = None,
                 max_slots: int = 1):
        k = num_draft_tokens
        if k < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k}")
        if name not in SPEC_POLICIES:
            raise ValueError(f"spec_policy must be one of {SPEC_POLICIES}, got {name!r}")
        self.num_draft_tokens, self.name = k, name
        self.costs = None  # [K + 1] relative verify costs, on the device
        if verify_costs is not None:
            if len(verify_costs) != k + 1 or min(verify_costs) <= 0:
                raise ValueError(f"verify_costs must be {k + 1} positive numbers (k = 0..{k}), got {verify_costs}")
            self.costs = jnp.asarray(verify_costs, jnp.float32)
        self.next_k = [k] * max_slots
        self.calibration = np.zeros((2, CALIBRATION_BINS), np.int64)  # [judged, accepted] per confidence bin
        self._schedule = None
        self.reset()

    def reset(self) -> None:
        """Zero the counters (a benchmark times runs one at a time); the calibration stays."""
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.by_position = np.zeros((2, self.num_draft_tokens), np.int64)  # [reached, accepted] per draft position

    def acceptance(self) -> np.ndarray:
        """Calibrated acceptance at each confidence bin's centre: (accepted + prior x centre) /
        (judged + prior)."""
        judged, accepted = self.calibration
        return (accepted + CALIBRATION_PRIOR * calibration_centres()) / (judged + CALIBRATION_PRIOR)

    @property
    def schedule(self) -> Schedule | None:
        """The programs' argument: None for the fixed policy (or before the costs are known)."""
        if self.costs is None or self.name != "confidence":
            return None
        if self._schedule is None:
            self._schedule = Schedule(self.costs, jnp.asarray(self.acceptance(), jnp.float32))
        return self._schedule

    @property
    def enabled(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def verify_costs(self) -> list[float] | None:
        """The cost curve in use (pinned or measured), k = 0..K, relative to k = 0."""
        return None if self.costs is None else [float(c) for c in np.asarray(self.costs)]

    @property
    def needs_costs(self) -> bool:
        return self.enabled and self.name == "confidence" and self.costs is None

    def verify_lengths(self) -> list[int]:
        """The verify lengths a decode step may dispatch ([0]: plain decoding)."""
        k = self.num_draft_tokens
        return list(range(k + 1)) if self.name == "confidence" else [k]

    def variants(self) -> tuple[bool, ...]:
        """Speculative steps come in a greedy-only (False) and a sampling (True) variant."""
        return (False, True) if self.enabled else (False,)

    def admit(self, slot: int) -> None:
        self.next_k[slot] = self.num_draft_tokens

    def step_k(self, slots: list[int]) -> int:
        """Drafts the next verify step checks for these decoding slots."""
        if self.name == "fixed" or not self.enabled:
            return self.num_draft_tokens
        return max(self.next_k[s] for s in slots)

    def measure_costs(self, verify: Callable[[int], object], reps: int = 10) -> None:
        """Time `verify(k)` (a verify step over k + 1 positions, returning what to wait for)
        for k = 0..K -> self.costs, relative to k = 0. The first call of each compiles."""
        seconds = []
        for k in range(self.num_draft_tokens + 1):
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                jax.block_until_ready(verify(k))
                times.append(time.perf_counter() - t)
            seconds.append(float(np.median(times[1:])))
        self.costs = jnp.asarray([t / seconds[0] for t in seconds], jnp.float32)

    def count(self, host, owners: dict) -> None:
        """Book one verify step's host outputs: per request (`owners`: row -> Request) and
        engine-wide; each row's ask for the next step."""
        self.totals["target_steps"] += 1
        for row, req in owners.items():
            if req.done:
                continue
            checked, accepted = int(host.drafts_checked[row]), int(host.drafts_accepted[row])
            produced = int(host.emitted[:, row].sum())
            req.target_steps += 1
            req.drafts_proposed += checked
            req.drafts_accepted += accepted
            req.decode_tokens += produced
            judged = min(accepted + 1, checked)  # draft j is judged iff drafts < j all passed
            self.by_position[0, :judged] += 1
            self.by_position[1, :accepted] += 1
            if host.draft_confidence is not None and judged:
                bins = np.minimum((host.draft_confidence[row, :judged] * CALIBRATION_BINS).astype(int),
                                  CALIBRATION_BINS - 1)
                np.add.at(self.calibration[0], bins, 1)
                np.add.at(self.calibration[1], bins[:accepted], 1)
                self._schedule = None
            for key, n in (("row_steps", 1), ("drafts_proposed", checked), ("drafts_accepted", accepted),
                           ("decode_tokens", produced)):
                self.totals[key] += n
            self.next_k[row] = int(host.next_limit[row])

    def metrics(self) -> dict:
        """Counters since construction: target (verify) steps, the drafts proposed and
        accepted, and tokens per target step, per request (`tokens_per_row_step`) and for
        the whole batch (`tokens_per_target_step`); per draft position j, how often it was
        accepted when judged (`acceptance_by_position`: drafts before j accepted, j verified)."""
        t = dict(self.totals)
        reached, accepted = self.by_position
        t["acceptance_by_position"] = [float(a / r) if r else None for r, a in zip(reached, accepted)]
        t["judged_by_position"] = reached.tolist()
        t["acceptance_rate"] = t["drafts_accepted"] / max(t["drafts_proposed"], 1)
        t["tokens_per_row_step"] = t["decode_tokens"] / max(t["row_steps"], 1)
        t["tokens_per_target_step"] = t["decode_tokens"] / max(t["target_steps"], 1)
        t["verify_costs"] = self.verify_costs
        if self.name == "confidence" and self.enabled:  # the drafter's confidence vs what was accepted
            t["calibration"] = {"bin_centres": calibration_centres().tolist(), "judged": self.calibration[0].tolist(),
                                "accepted": self.calibration[1].tolist(), "acceptance": self.acceptance().tolist()}
        return t
