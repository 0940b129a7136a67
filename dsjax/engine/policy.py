"""The speculation policy: how many MTP drafts each decode step verifies, if any, and what it costs.

"fixed" verifies all K drafts every step. "confidence" chooses, per step, between a plain
decode step (the engine's plain decode program: no verify, no drafting) and a verify step
over k = 1..K drafts, by the measured cost per emitted token (the `Scheduler` asks `step_k`
once a decode step and puts the answer in its `DecodePlan`; the `Runner` runs the plain or
the verify program and measures the costs; the engine books what it reads back):

    plain: seconds[0] a token;  verify k: seconds[k] / E_k,  E_k = 1 + sum_{j<=k} prod_{i<=j} a_i

seconds[k] the wall time of a whole verify step over k drafts (the target's k + 1 positions
and the drafter's K next drafts), seconds[0] a plain step's, timed on the machine at warm-up
(interleaved rounds of this engine's programs, so per batch size) and refreshed from the
step times the engine observes (the median of the latest OBSERVED of each kind; a kind not
yet observed scales with the others; pinned `verify_costs` are never refreshed); a_i the
acceptance observed at draft position i lately (counts decayed by RECENT_DECAY a verify
step, from a weak prior). Within a verify step each row asks for its own k
(`dsjax.engine.speculative.choose_limits`, on the device: its drafts' calibrated confidences
against the same costs relative to a plain step), the step verifies the largest k a decoding
row asked for (at least one), known one step late since outputs are read while the next step
runs. Whether to verify at all is the aggregate's choice above: a row's confidences are only
known while it drafts, and early on they are barely calibrated.

When no request waits, the batch drains: it finishes when its slowest row does, so E_k is the
pace of the row that needs the most steps (`expected_tokens`), not the mean.

The choice reads the acceptance optimistically: each a_i at one standard deviation above its
estimate (the decayed counts' Beta posterior, from the weak prior), so verification is tried
while what was seen cannot rule it out, and given up once it can: plain steps are chosen only
when even that reading of the acceptance loses. Where no acceptance could pay for a verify
step at the measured costs (a plain step that cheap), no verify step is ever run.

Plain steps leave the drafter behind (its ring misses their positions and the pending drafts
are for old ones: still lossless, only accepted less), so a switch to plain decoding lasts
`probe_gap` steps (PROBE_GAP doubling up to MAX_PROBE_GAP while plain keeps winning). Plain
steps teach nothing about the drafts: the acceptance counts fade by PLAIN_DECAY a plain step,
back toward the prior, so the optimistic reading widens until it says verify again; the
switch back begins with a probe of PROBE_STEPS verify steps that redraft and measure again
(the first, with stale drafts, checks one draft and is not booked in the acceptance
statistics). While verify steps win, PLAIN_PROBE plain steps every PLAIN_EVERY verify steps
(unless the costs are pinned) keep the plain step's observed time current: warm-up times
steps over idle rows, and the ratio of the two kinds as served (host work included) may
differ. During a plain run (and from the start, where plain steps win from the first) the
engine is the plain engine: prompts are prefilled by its prefill program, without the drafter
(`drafting`); their rows are cold (their pending drafts an earlier request's), and check none
of them in their first verify step.

The drafter's confidence is calibrated online: every judged draft's confidence and outcome
are binned, and the acceptance observed per bin (shrunk toward the bin's centre by
CALIBRATION_PRIOR pseudo-drafts; the programs get it every CALIBRATION_REFRESH verify steps)
replaces the raw confidence (a small drafter's softmax can be far below the rate at which its
greedy drafts match the target: docs/speculation.md). The output distribution never depends
on the policy; sampled tokens follow the steps chosen.

A policy with K = 0 is plain decoding: every question gets the no-speculation answer.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.engine.speculative import CALIBRATION_BINS, Schedule, calibration_centres

SPEC_POLICIES = ("confidence", "fixed")
CALIBRATION_PRIOR = 8.0  # pseudo-drafts per bin at the bin's centre: the raw confidence until drafts are judged
CALIBRATION_REFRESH = 16  # verify steps between the calibration's uploads to the device (uploaded every step: ~8 %
# of a batch-1 run under cProfile on 2 cores; with the prior above it moves little in 16 steps)
COUNTERS = ("target_steps", "plain_steps", "row_steps", "drafts_proposed", "drafts_accepted", "decode_tokens",
            "plain_prefills")
OBSERVED, OBSERVED_MIN = 16, 4  # step times of each kind a cost is the median of, at most / at least
COST_REFRESH = 0.05  # the costs move (and reach the device) when a kind's moves this much (margins: 10 %)
RECENT_DECAY = 0.9  # the recent acceptance counts, per verify step
RECENT_PRIOR = 2.0  # pseudo-drafts at 1/2 per draft position
PLAIN_DECAY = 0.5 ** (1 / 8)  # the acceptance counts fade this much a plain step (halved by 8: back to the prior)
OPTIMISM = 1.0  # standard deviations above its estimate each draft position's acceptance is read at
ROW_PRIOR = 4.0  # a row's own recent acceptance, shrunk toward the batch's by this many pseudo-drafts
# a verify step must look this much cheaper a token than a plain step to be chosen: plain steps
# carry no cost the model misses (stale drafts after a switch, the probes that follow)
VERIFY_MARGIN = 1.1
PROBE_GAP, MAX_PROBE_GAP, PROBE_STEPS = 8, 64, 3
# while verifying, PLAIN_PROBE plain steps every PLAIN_EVERY verify steps (every PROBE_GAP until
# OBSERVED_MIN plain steps were timed): the observed costs then compare the two kinds as served,
# host overhead included (warm-up times idle rows, which may flatter a verify step)
PLAIN_EVERY, PLAIN_PROBE = 128, 4  # (a plain step is timed between two others: `Engine._book`)


class SpeculationPolicy:
    """The scheduler's side of speculation: per slot, the drafts its latest output asked
    the next step to verify (`next_k`); the step costs; whether a step is plain; the counters
    behind `Engine.spec_metrics()`."""

    def __init__(self, num_draft_tokens: int, name: str = "confidence", verify_costs: list[float] | None = None,
                 max_slots: int = 1):
        k = num_draft_tokens
        if k < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k}")
        if name not in SPEC_POLICIES:
            raise ValueError(f"spec_policy must be one of {SPEC_POLICIES}, got {name!r}")
        self.num_draft_tokens, self.name = k, name
        self._seconds = None  # [K + 1] step seconds: a plain step, a verify step over k = 1..K drafts (`seconds`)
        self._observed_since = False  # step times observed since `seconds` was refreshed from them
        self.warm = None  # the same as measured at warm-up
        self.pinned = verify_costs is not None
        if verify_costs is not None:
            if len(verify_costs) != k + 1 or min(verify_costs) <= 0:
                raise ValueError(f"verify_costs must be {k + 1} positive numbers (a plain step, then verify steps "
                                 f"over k = 1..{k} drafts), got {verify_costs}")
            self._seconds = np.asarray(verify_costs, np.float64)
        self.observed = [collections.deque(maxlen=OBSERVED) for _ in range(k + 1)]
        self.next_k = [k] * max_slots
        self.stale: set[int] = set()  # slots whose drafts predate a plain step
        # slots whose prompt was prefilled by the plain program (`drafting`): their pending drafts
        # are an earlier request's, so their first verify step checks none of them
        self.cold: set[int] = set()
        # plain steps left in this plain run, verify steps left in the probe, the next plain run
        self.plain_left, self.probe_left, self.probe_gap = 0, 0, PROBE_GAP
        self.verifying = False  # whether the last decode step verified (a switch to verify steps probes)
        self.verify_run = 0  # verify steps since the last plain one (plain probes)
        self.last_stale, self.last_cold, self.last_probe = frozenset(), frozenset(), False  # (`step_k`)
        self.calibration = np.zeros((2, CALIBRATION_BINS), np.int64)  # [judged, accepted] per confidence bin
        self._recent = np.zeros((2, k))  # [judged, accepted] per draft position, decayed (`_faded`)
        self._row_recent = np.zeros((max_slots, 2, k))  # the same per slot (since its request's admission)
        self._plain_since = 0  # plain steps booked since the counts were last faded (`_faded`)
        self._schedule = self._costs = None
        self._calibrated_since = 0  # verify steps that booked drafts into the calibration since its upload
        self.reset()

    def reset(self) -> None:
        """Zero the counters (a benchmark times runs one at a time); the calibration and the
        costs stay."""
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.by_position = np.zeros((2, self.num_draft_tokens), np.int64)  # [reached, accepted] per draft position

    @property
    def seconds(self) -> np.ndarray | None:
        """[K + 1] step seconds in use: pinned, measured, or refreshed here from the step times
        `observe` appended (a step's booking on a 2-core CPU shares the cores XLA runs on)."""
        if self._observed_since:
            self._observed_since = False
            self._refresh()
        return self._seconds

    def _faded(self) -> tuple[np.ndarray, np.ndarray]:
        """The acceptance counts (batch, per slot), faded by the plain steps booked since they
        were last read (`count_plain` only counts them)."""
        if self._plain_since:
            fade = PLAIN_DECAY ** self._plain_since
            self._plain_since = 0
            self._recent *= fade
            self._row_recent *= fade
        return self._recent, self._row_recent

    def acceptance(self) -> np.ndarray:
        """Calibrated acceptance at each confidence bin's centre: (accepted + prior x centre) /
        (judged + prior)."""
        judged, accepted = self.calibration
        return (accepted + CALIBRATION_PRIOR * calibration_centres()) / (judged + CALIBRATION_PRIOR)

    @property
    def costs(self) -> jax.Array | None:
        """[K + 1] step costs relative to a plain step, on the device (the schedule's)."""
        seconds = self.seconds  # (a refresh drops the arrays made from the old ones)
        if seconds is None:
            return None
        if self._costs is None:
            self._costs = jnp.asarray(seconds / seconds[0], jnp.float32)
        return self._costs

    @property
    def schedule(self) -> Schedule | None:
        """The programs' argument: None for the fixed policy (or before the costs are known)."""
        if self.seconds is None or self.name != "confidence":
            return None
        if self._schedule is None or self._calibrated_since >= CALIBRATION_REFRESH:
            self._schedule = Schedule(self.costs, jnp.asarray(self.acceptance(), jnp.float32))
            self._calibrated_since = 0
        return self._schedule

    def step_schedule(self, probe: bool) -> Schedule | None:
        """The schedule of a verify step: inside a probe (`DecodePlan.probe`), equal costs (each
        row then asks the next step to check all its drafts, which the probe is for: with the
        costs that made plain steps win, rows would ask for one); else `schedule`."""
        schedule = self.schedule
        if schedule is None or not probe:
            return schedule
        return schedule.replace(costs=jnp.ones_like(schedule.costs))

    @property
    def enabled(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def verify_costs(self) -> list[float] | None:
        """The cost curve in use (pinned, measured or refreshed): a plain step, then verify
        steps over k = 1..K drafts, relative to the plain step."""
        return None if self.seconds is None else [float(c / self.seconds[0]) for c in self.seconds]

    @property
    def needs_costs(self) -> bool:
        return self.enabled and self.name == "confidence" and self._seconds is None

    @property
    def plain_steps(self) -> bool:
        """Whether a decode step may be plain (the engine's plain decode program)."""
        return self.enabled and self.name == "confidence"

    def verify_lengths(self) -> list[int]:
        """The verify lengths a decode step may dispatch (the confidence policy's plain step
        aside: `plain_steps`)."""
        k = self.num_draft_tokens
        return list(range(1, k + 1)) if self.name == "confidence" and k else [k]

    def variants(self) -> tuple[bool, ...]:
        """Speculative steps come in a greedy-only (False) and a sampling (True) variant."""
        return (False, True) if self.enabled else (False,)

    def admit(self, slot: int) -> None:
        self.next_k[slot] = self.num_draft_tokens
        self.stale.discard(slot)  # its prefill drafts after its prompt
        self.cold.discard(slot)
        self._faded()[1][slot] = 0

    def drafting(self) -> bool:
        """Whether a prompt chunk planned now goes through the drafter (the speculative
        prefill program, which drafts after the prompt): not while a run of plain steps goes
        on (the prefill is then the plain engine's program, and the row catches up when verify
        steps resume: its first checks none of its pending drafts, `prefilled`)."""
        if not self.plain_steps:
            return True
        if self.plain_left > 0:
            return False
        return self.verifying or self.probe_left > 0 or self._seconds is None or not self.plain_is_better()

    def prefilled(self, slot: int, drafted: bool, last: bool) -> None:
        """A prompt chunk of `slot` was planned, through the drafter or not (`drafting`); `last`:
        its prompt ends there (a drafted last chunk drafts after the first token)."""
        if not drafted:
            self.cold.add(slot)
            self.stale.add(slot)
            self.totals["plain_prefills"] += 1
        elif last:
            self.cold.discard(slot)
            self.stale.discard(slot)

    def expected_tokens(self, remaining: dict[int, int] | None = None, optimism: float = 0.0) -> np.ndarray:
        """E_k [K + 1]: tokens a row expects from a verify step over k drafts, from the
        recent acceptance at each draft position (E_0 = 1: a plain step). remaining (slot ->
        tokens it has left; given when no request waits, so the batch drains): the rate at
        which the batch finishes, max_r n_r / max_r (n_r / E_k,r) with E_k,r each row's own
        (its recent acceptance shrunk toward the batch's by ROW_PRIOR pseudo-drafts): a plain
        step advances every row by one, so a batch of rows that all must finish runs at its
        slowest row's pace, and the steps the faster rows save sit idle. optimism: the batch's
        acceptance at each position read this many standard deviations of its Beta posterior
        above the estimate (at most 1), the target the rows' own shrink toward."""
        recent, row_recent = self._faded()
        judged, accepted = recent
        n = judged + RECENT_PRIOR
        a = (accepted + RECENT_PRIOR / 2) / n
        if optimism:
            a = np.minimum(a + optimism * np.sqrt(a * (1 - a) / (n + 1)), 1.0)
        batch = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(a))])
        if not remaining or len(remaining) < 2:
            return batch
        slots = list(remaining)
        judged, accepted = row_recent[slots, 0], row_recent[slots, 1]  # [R, K]
        rows = (accepted + ROW_PRIOR * a) / (judged + ROW_PRIOR)
        e = 1.0 + np.concatenate([np.zeros((len(slots), 1)), np.cumsum(np.cumprod(rows, axis=1), axis=1)], axis=1)
        n = np.array([max(remaining[s], 1) for s in slots], np.float64)[:, None]
        return np.minimum(batch, n.max() / (n / e).max(axis=0))

    def plain_is_better(self, remaining: dict[int, int] | None = None) -> bool:
        """A plain step's seconds a token against the best verify step's (`expected_tokens`
        with the acceptance read OPTIMISM deviations high), the verify step held to VERIFY_MARGIN."""
        per_token = self.seconds / self.expected_tokens(remaining, OPTIMISM)
        return per_token[0] < per_token[1:].min() * VERIFY_MARGIN

    def step_k(self, slots: list[int], remaining: dict[int, int] | None = None) -> int:
        """Drafts the next decode step verifies for these decoding slots; 0: a plain step
        (confidence policy). remaining: tokens each slot has left, when no request waits
        (`expected_tokens`). Called once per dispatched decode step; `last_stale` then holds
        the slots whose drafts it verifies were made before a plain step, `last_probe` whether
        it is a probe step before the probe's last (`step_schedule`)."""
        k = self.num_draft_tokens
        self.last_stale = frozenset(self.stale.intersection(slots))
        self.last_cold, self.last_probe = frozenset(), False
        if self.name == "fixed" or not self.enabled or self._seconds is None:
            return k
        fresh = [s for s in slots if s not in self.stale]
        asked = max((self.next_k[s] for s in fresh), default=k)
        if self.plain_left:
            self.plain_left -= 1
            return self._plain(slots)
        if self.probe_left:  # verify whatever the numbers say: they are what the probe renews
            self.probe_left -= 1
            self.last_probe = self.probe_left > 0  # so that the next probe step's rows check all their drafts
        elif self.plain_is_better(remaining):
            self.plain_left = self.probe_gap - 1
            self.probe_gap = min(2 * self.probe_gap, MAX_PROBE_GAP)
            return self._plain(slots)
        elif not self.verifying:  # verify steps win again (or from the start): a probe begins
            self.probe_left = PROBE_STEPS - 1
            self.last_probe = True
        else:
            self.probe_gap = PROBE_GAP  # verifying wins: a later switch to plain decoding probes early again
            every = PLAIN_EVERY if len(self.observed[0]) >= OBSERVED_MIN else PROBE_GAP
            if not self.pinned and self.verify_run >= every:  # time plain steps as served
                self.plain_left, self.probe_left = PLAIN_PROBE - 1, 1
                return self._plain(slots)
        self.verify_run += 1
        self.verifying = True
        self.last_cold = frozenset(self.cold.intersection(slots))
        self.stale.difference_update(slots)  # this step drafts them anew
        self.cold.difference_update(slots)
        return 1 if self.last_stale else max(1, asked)

    def _plain(self, slots: list[int]) -> int:
        self.stale.update(slots)
        self.verify_run = 0
        self.verifying = False
        return 0

    def measure_costs(self, step: Callable[[int], object], rounds: int = 6, calls: int = 4) -> None:
        """Time `step(k)` (k = 0: a plain decode step; else a verify step over k drafts with
        its drafting, returning what to wait for) -> self.seconds: per kind, the median over
        interleaved rounds (the first compiles) of `calls` back-to-back calls, waited for at
        the end as the engine's dispatch overlaps them (one call waited for alone measured
        several times a step's time on a busy 2-core machine)."""
        n = self.num_draft_tokens + 1
        times = np.zeros((rounds, n))
        for r in range(rounds + 1):
            for k in range(n):
                t = time.perf_counter()
                for _ in range(calls if r else 1):
                    out = step(k)
                jax.block_until_ready(out)
                if r:
                    times[r - 1, k] = (time.perf_counter() - t) / calls
        self.warm = np.median(times, axis=0)
        self._set_seconds(self.warm)

    def observe(self, k: int, seconds: float) -> None:
        """A decode step's observed wall time (k = 0: plain). A kind observed OBSERVED_MIN
        times costs the median of its latest OBSERVED; the others their warm-up measurement
        scaled as the observed kinds moved from theirs (a busy machine slows every step).
        Pinned costs never move."""
        if self.pinned or self.warm is None or not self.plain_steps:
            return
        self.observed[k].append(seconds)  # the costs follow when next read (`seconds`)
        self._observed_since = True

    def _refresh(self) -> None:  # `observe`'s rule, applied to the step times observed so far
        seen = [j for j, d in enumerate(self.observed) if len(d) >= OBSERVED_MIN]
        if not seen:
            return
        medians = {j: statistics.median(self.observed[j]) for j in seen}
        scale = statistics.median([medians[j] / self.warm[j] for j in seen])
        new = [medians.get(j, self.warm[j] * scale) for j in range(len(self.warm))]
        if max(abs(a - b) / b for a, b in zip(new, self._seconds)) > COST_REFRESH:
            self._set_seconds(np.array(new))

    def _set_seconds(self, seconds: np.ndarray) -> None:
        self._seconds = np.asarray(seconds, np.float64)
        self._costs = self._schedule = None

    def count_plain(self, host, owners: dict) -> None:
        """Book a plain decode step's host outputs (`owners`: row -> Request)."""
        self.totals["target_steps"] += 1
        self.totals["plain_steps"] += 1
        self._plain_since += 1  # what was seen of the drafts grows old, back toward the prior (`_faded`)
        produced = host.emitted.sum(axis=0).tolist()  # per row, once (a step's booking runs beside the next)
        live = [(req, produced[row]) for row, req in owners.items() if not req.done]
        for req, n in live:
            req.target_steps += 1
            req.decode_tokens += n
        self.totals["row_steps"] += len(live)
        self.totals["decode_tokens"] += sum(n for _, n in live)

    def count(self, host, owners: dict, stale=frozenset()) -> None:
        """Book one verify step's host outputs: per request (`owners`: row -> Request) and
        engine-wide; each row's ask for the next step. Rows in `stale` verified drafts made
        before a plain step: their tokens count, their drafts' outcomes do not."""
        self.totals["target_steps"] += 1
        recent, row_recent = self._faded()
        recent *= RECENT_DECAY
        calibrated = False
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
            for key, n in (("row_steps", 1), ("drafts_proposed", checked), ("drafts_accepted", accepted),
                           ("decode_tokens", produced)):
                self.totals[key] += n
            self.next_k[row] = int(host.next_limit[row])
            if row in stale:
                continue
            self.by_position[0, :judged] += 1
            self.by_position[1, :accepted] += 1
            recent[0, :judged] += 1
            recent[1, :accepted] += 1
            row_recent[row] *= RECENT_DECAY
            row_recent[row, 0, :judged] += 1
            row_recent[row, 1, :accepted] += 1
            if host.draft_confidence is not None and judged:
                bins = np.minimum((host.draft_confidence[row, :judged] * CALIBRATION_BINS).astype(int),
                                  CALIBRATION_BINS - 1)
                np.add.at(self.calibration[0], bins, 1)
                np.add.at(self.calibration[1], bins[:accepted], 1)
                calibrated = True
        self._calibrated_since += calibrated

    def metrics(self) -> dict:
        """Counters since construction: target steps (verify and plain; `plain_steps` of them
        plain), the drafts proposed and accepted, and tokens per target step, per request
        (`tokens_per_row_step`) and for the whole batch (`tokens_per_target_step`); per draft
        position j, how often it was accepted when judged (`acceptance_by_position`: drafts
        before j accepted, j verified); the step costs in use (`verify_costs`, relative to a
        plain step, and `step_seconds`)."""
        t = dict(self.totals)
        reached, accepted = self.by_position
        t["acceptance_by_position"] = [float(a / r) if r else None for r, a in zip(reached, accepted)]
        t["judged_by_position"] = reached.tolist()
        t["acceptance_rate"] = t["drafts_accepted"] / max(t["drafts_proposed"], 1)
        t["tokens_per_row_step"] = t["decode_tokens"] / max(t["row_steps"], 1)
        t["tokens_per_target_step"] = t["decode_tokens"] / max(t["target_steps"], 1)
        t["verify_costs"] = self.verify_costs
        t["step_seconds"] = None if self.seconds is None or self.pinned else self.seconds.tolist()
        if self.name == "confidence" and self.enabled:  # the drafter's confidence vs what was accepted
            t["calibration"] = {"bin_centres": calibration_centres().tolist(), "judged": self.calibration[0].tolist(),
                                "accepted": self.calibration[1].tolist(), "acceptance": self.acceptance().tolist()}
        return t
