"""The scheduler on the host alone (no model, no device call): admission order, slot reuse
after a finish and a cancel, prompt chunks and their context buckets at bucket boundaries,
prefix-block decisions, batch-invariant grouping, the plan of a speculative engine and the
warm-up plans. Every expectation is derived by hand from the rules in
dsjax/engine/scheduler.py and dsjax/engine/requests.py (chunk widths 16 x 4^i up to the
prefill chunk, context buckets 256 x 4^i up to the capacity), not read off a run."""

import ast
import pathlib
import types

import numpy as np
import pytest

import dsjax.engine.scheduler as scheduler_module
import dsjax.engine.policy as policy_module
from dsjax.engine.policy import SpeculationPolicy
from dsjax.engine.prefix_cache import ROOT, PrefixCache, PrefixCacheOptions, PrefixPlanner, block_keys
from dsjax.engine.requests import Request, context_bucket, context_buckets, smallest_useful_bucket
from dsjax.engine.sampler import SamplingParams
from dsjax.engine.scheduler import DecodePlan, Scheduler

VOCAB = 1000


def _scheduler(*, max_slots=2, capacity=4096, prefill_chunk=256, k=0, policy="fixed", batch_invariant=False,
               prefix=None, decode_steps=1, aligned=None, costs=None):
    rows = 8 * -(-max_slots // 8) if batch_invariant else max_slots
    return Scheduler(max_slots=max_slots, rows=rows, capacity=capacity, prefill_chunk=prefill_chunk,
                     prefill_rows=8 if batch_invariant else 1, batch_invariant=batch_invariant, on_mesh=False,
                     decode_steps=decode_steps, policy=SpeculationPolicy(k, policy, costs, rows), vocab_size=VOCAB,
                     aligned_chunks=prefix is not None if aligned is None else aligned, prefix=prefix)


def _request(name: str, n: int, first: int = 0, **params) -> Request:
    return Request(name, list(range(first, first + n)), SamplingParams(**params), ())


def _add(s: Scheduler, *reqs: Request):
    for r in reqs:
        s.add(r)
    return reqs


def test_scheduler_makes_no_device_call():
    """The module imports no jax and no device module: plans are plain values."""
    tree = ast.parse(pathlib.Path(scheduler_module.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "jax" or m in ("dsjax.engine.programs",
                                                                          "dsjax.engine.runner")}


def test_admission_is_first_come_and_slots_are_reused_after_finish_and_cancel():
    s = _scheduler(max_slots=2)
    a, b, c, d = _add(s, *(_request(x, 20) for x in "abcd"))
    plan = s.schedule()  # a, b take slots 0 and 1; each prompt is one chunk (20 tokens), then they decode
    assert [(call.row, [ch.request for ch in call.chunks]) for call in plan.prefills] == [(0, [a]), (1, [b])]
    assert s.slot_owner == [a, b] and list(s.waiting) == [c, d] and s.free_slots == []
    assert plan.decode.owners == {0: a, 1: b} and plan.decode.cancelled == ()
    a.state = "finished"
    s.finish(a)  # a's last token was delivered
    s.cancel(b)
    b.state = "cancelled"  # (the engine marks it)
    assert s.free_slots == [0, 1] and s.cancelled == {1}
    plan = s.schedule()  # c takes slot 0, d slot 1: the row d's first chunk resets needs no cancel
    assert s.slot_owner == [c, d] and (c.slot, d.slot) == (0, 1) and not s.waiting
    assert plan.decode.cancelled == () and plan.decode.owners == {0: c, 1: d}
    s.cancel(d)
    e, = _add(s, _request("e", 20))
    s.cancel(e)  # a waiting request leaves the line, nothing reaches the device
    assert s.cancelled == {1} and not s.waiting
    plan = s.schedule()  # nothing to admit: the next decode step stops row 1
    assert plan.prefills == [] and plan.decode.cancelled == (1,) and s.cancelled == set()


def test_chunks_and_context_buckets_across_bucket_boundaries():
    """prefill_chunk 256, capacity 4096 (buckets 256, 1024, 4096). A 1100-token prompt: a
    first chunk of 1100 mod 256 = 76 tokens (width 256: 76 > 64), then four of 256, ending
    at 332, 588, 844, 1100; a full chunk reads the bucket of max(end, 512): 1024 four times,
    then 4096 (1100 > 1024). A 20-token prompt: one chunk of width 64 at bucket 256."""
    s = _scheduler(max_slots=2)
    long, short = _add(s, _request("long", 1100), _request("short", 20, first=7))
    seen = []
    while long.state != "decoding":
        plan = s.schedule()
        seen += [(call.row, call.width, call.bucket, [len(c.tokens) for c in call.chunks]) for call in plan.prefills]
    assert seen == [(0, 256, 1024, [76]), (1, 64, 256, [20]), (0, 256, 1024, [256]), (0, 256, 1024, [256]),
                    (0, 256, 1024, [256]), (0, 256, 4096, [256])]
    assert long.prefilled == long.dispatched - 1 == 1100  # the last plan's decode step dispatched one more
    assert s.prefill_calls() == []  # no request is prefilling now
    # a chunk's following tokens are the prompt shifted by one (speculation's ring, prompt logprobs)
    s2 = _scheduler()
    r, = _add(s2, _request("r", 20, first=7))
    chunk = s2.schedule().prefills[0].chunks[0]
    assert chunk.tokens == list(range(7, 27)) and chunk.following == list(range(8, 27)) and chunk.is_last
    assert chunk.admits and chunk.start == 0


def test_decode_bucket_follows_the_longest_row():
    """A decode step reads the bucket of max(dispatched) + decode_steps: a 254-token prompt
    decodes at 256 while its rows end at most at 256, then at 1024."""
    s = _scheduler(max_slots=1, decode_steps=2)
    r, = _add(s, _request("r", 254))
    buckets = [s.schedule().decode.bucket for _ in range(3)]  # dispatched 254 -> 256 -> 258
    assert buckets == [256, 1024, 1024] and r.dispatched == 260


def test_aligned_chunks_end_on_the_absolute_grid():
    """aligned_chunks (a prefix cache; V4.1's key rule): a 270-token prompt runs 256 then 14
    tokens (width 16; bucket of 272: 1024), the narrower chunk last."""
    s = _scheduler(max_slots=1, aligned=True)
    _add(s, _request("r", 270))
    plans = [s.schedule() for _ in range(2)]
    assert [(c.width, c.bucket, len(c.chunks[0].tokens)) for p in plans for c in p.prefills] == [(256, 1024, 256),
                                                                                                  (16, 1024, 14)]


def _prefix_scheduler(**kw):
    pool = PrefixCache(PrefixCacheOptions(), 16, lookahead=False)
    planner = PrefixPlanner(pool, keeps_generated=False, first_generated=True)
    return _scheduler(prefill_chunk=16, capacity=256, prefix=planner, **kw), pool


def _run_saves(pool: PrefixCache, plan):
    """What the runner does with a plan's saves, with a host array for the block's copy."""
    for call in plan.prefills:
        for save in call.saves:
            pool.keep(save.key, save.parent, save.tokens, lambda: np.zeros(4, np.float32))


def test_prefix_blocks_saved_restored_and_shared_prefixes_computed_once():
    """Blocks of 16: a 40-token prompt stores blocks 0 and 1 (chunks end at 16 and 32; its
    last, 8 tokens, ends no block). A request with the same prompt arriving with it waits
    while the first prefills those blocks (admitted on the third plan, restoring both: 32
    cached tokens, 8 to prefill); a prompt sharing 35 tokens restores the same two."""
    s, pool = _prefix_scheduler(max_slots=2)
    prompt = list(range(100, 140))
    a, c = _add(s, Request("a", prompt, SamplingParams(), ()), Request("c", prompt, SamplingParams(), ()))
    keys = block_keys(prompt, 16, 2, False)
    plans = []
    for _ in range(3):
        plans.append(s.schedule())
        _run_saves(pool, plans[-1])
    saves = [[(v.slot, v.j, v.key, v.parent, v.tokens) for call in p.prefills for v in call.saves] for p in plans]
    assert saves[0] == [(0, 0, keys[0], ROOT, prompt[:16])] and saves[1] == [(0, 1, keys[1], keys[0], prompt[16:32])]
    assert [p.restores for p in plans[:2]] == [[], []] and s.slot_owner[1] is c
    restore, = plans[2].restores
    assert (restore.slot, restore.request) == (1, c) and [e.key for e in restore.blocks] == keys
    assert (c.cached_tokens, c.admitted, c.prefilled) == (32, True, 32 + 8)  # restored, then its last chunk
    calls = plans[2].prefills  # a's last chunk and c's (no admission: its restored block 0 admitted it)
    assert [(call.row, c_.start, len(c_.tokens), c_.admits) for call in calls for c_ in call.chunks] == [
        (0, 32, 8, False), (1, 32, 8, False)]
    assert [v for call in calls for v in call.saves] == []
    b = Request("b", prompt[:35] + [7] * 5, SamplingParams(), ())
    s.finish(a)
    _add(s, b)
    restore, = s.schedule().restores
    assert restore.request is b and [e.key for e in restore.blocks] == keys and b.cached_tokens == 32
    assert pool.metrics()["hits"] == 2 and pool.metrics()["prefill_tokens_saved"] == 64


def test_batch_invariant_calls_take_one_width_and_one_tile():
    """Batch-invariant (tiles of 8 rows, one bucket: the capacity): requests of 5 and 40
    tokens in tile 0 run in two calls (widths 16 and 64), one of 5 tokens in slot 9 in a
    third (tile 1, its row 1); each chunk at its row within the tile."""
    s = _scheduler(max_slots=16, batch_invariant=True, capacity=1024)
    reqs = _add(s, *[_request(f"r{i}", n) for i, n in enumerate([5, 40] + [60] * 7 + [5])])
    plan = s.schedule()
    calls = {(c.row, c.width): [(ch.row, ch.request.request_id) for ch in c.chunks] for c in plan.prefills}
    assert calls == {(0, 16): [(0, "r0")], (0, 64): [(1, "r1")] + [(i, f"r{i}") for i in range(2, 8)],
                     (8, 64): [(0, "r8")], (8, 16): [(1, "r9")]}
    assert {c.bucket for c in plan.prefills} == {1024} and all(c.rows == 8 for c in plan.prefills)
    assert plan.decode.bucket == 1024 and len(plan.decode.owners) == len(reqs)


def test_speculative_plan_verifies_k_drafts_and_advances_k_plus_one():
    """Fixed policy, 3 drafts: each verify step checks k = 3 and may write 4 positions per
    row, so a row's dispatched count grows by 4 and the bucket covers it; a sampled row
    picks the sampling variant. Confidence policy (verify steps pinned cheap): the step
    verifies the largest k any decoding row asked for."""
    s = _scheduler(max_slots=2, k=3, capacity=1024)
    g, t = _add(s, _request("g", 250), _request("t", 20, temperature=0.7))
    d = s.schedule().decode
    assert (d.k, d.sampled, d.bucket) == (3, True, 256) and (g.dispatched, t.dispatched) == (254, 24)
    d = s.schedule().decode  # 254 + 4 = 258 > 256
    assert (d.k, d.bucket) == (3, 1024) and g.dispatched == 258
    c = _scheduler(max_slots=3, k=2, policy="confidence", costs=[1.0, 1.01, 1.02])
    reqs = _add(c, *[_request(f"r{i}", 10) for i in range(3)])
    assert c.schedule().decode.k == 2  # just admitted: each row asks for all K
    c.policy.next_k = [1, 2, 1]
    assert c.schedule().decode.k == 2
    c.finish(reqs[1])
    reqs[1].state = "finished"
    assert c.schedule().decode.k == 1 and reqs[0].dispatched == 10 + 3 + 3 + 2


def test_warmup_plans_count_every_program():
    """The README's engine (capacity 4096, prefill_chunk 256): prefill at (16, 256), (64, 256),
    (256, 1024), (256, 4096) and decode at 256, 1024, 4096: 7 programs; with structured output
    a start, a split forward per bucket and its sampling half: 12. A speculative engine
    (confidence, K = 2) compiles each in a greedy and a sampling variant and verify steps at
    k = 1, 2, and the plain engine's programs for its plain runs, the decode step per bucket and
    the prefill per shape (one program for both variants): (4 + 3 x 2) x 2 + 3 + 4 = 27; fixed
    (k = 2 only): (4 + 3) x 2 = 14. A prefix cache adds its save and restore."""
    s = _scheduler(max_slots=8)
    assert s.prefill_shapes() == [(16, 256), (64, 256), (256, 1024), (256, 4096)]
    assert sum(i.programs for i in s.warmup_plans()) == 7
    items = s.warmup_plans(constrained=True)
    assert sum(i.programs for i in items) == 12
    split = [i.plan.decode for i in items if i.plan.decode is not None and i.plan.decode.constrained]
    assert [(d.bucket, d.cancelled) for d in split] == [(256, (0,)), (1024, ()), (4096, ())]
    assert sum(i.programs for i in s.warmup_plans(scoring=True)) == 11
    spec = _scheduler(max_slots=8, k=2, policy="confidence")
    decodes = [(i.plan.decode.bucket, i.plan.decode.k, i.plan.decode.sampled) for i in spec.warmup_plans()
               if i.plan.decode is not None]
    assert len(spec.warmup_plans()) == 27 and len(set(decodes)) == 15
    assert sorted(d for d in decodes if d[1] == 0) == [(256, 0, False), (1024, 0, False), (4096, 0, False)]
    plain_prefills = [(c.width, c.bucket) for i in spec.warmup_plans() for c in i.plan.prefills if not c.draft]
    assert plain_prefills == spec.prefill_shapes()
    assert len(_scheduler(max_slots=8, k=2).warmup_plans()) == 14
    prefix, _ = _prefix_scheduler()  # capacity 256, chunk 16: widths 16 at bucket 256, and the round trip
    assert [(i.what, i.programs) for i in prefix.warmup_plans()] == [
        ("prefill 16 tokens, context 256", 1), ("decode, context 256", 1),
        ("prefix cache: save and restore a block", 2)]


def test_masks_without_constrained_rows_allow_every_token():
    s = _scheduler(max_slots=2)
    masks = s.masks(DecodePlan(256))
    assert masks.shape == (2, -(-VOCAB // 32)) and (masks == -1).all()


def test_smallest_useful_bucket_closed_form():
    """Buckets whose whole cache costs at most 1/8 of the step's weight bytes merge into the
    largest such bucket: with a cache of c bytes per token and w bytes of weights, that is the
    largest bucket b (256 x 4^i) with c b <= w / 8."""
    for per_token, weights in [(1.0, 8 * 4096), (1.0, 8 * 4095), (3.0, 8 * 3 * 256), (1.0, 100.0), (0.0, 1.0)]:
        got = smallest_useful_bucket(lambda ctx: (per_token * ctx, weights), 65536)
        fits = [b for b in (256, 1024, 4096, 16384, 65536) if per_token * b <= weights / 8]
        assert got == (fits[-1] if fits else 256)
    assert context_buckets(65536, 4096) == [4096, 16384, 65536] and context_bucket(5000, 65536, 4096) == 16384
    assert context_buckets(3000, smallest_useful_bucket(lambda ctx: (0.0, 1.0), 3000)) == [3000]


# ----------------------------------------------------------------------------- plain steps or verify
def _verified(d: DecodePlan, accepted: int, k: int = 3):
    """A verify step's host outputs: each row accepted min(accepted, d.k) drafts, asks for K next."""
    rows = max(d.owners) + 1
    a = min(accepted, d.k)
    emitted = np.zeros((d.k + 1, rows), bool)
    emitted[: a + 1] = True
    return types.SimpleNamespace(drafts_checked=np.full(rows, d.k), drafts_accepted=np.full(rows, a), emitted=emitted,
                                 next_limit=np.full(rows, k), draft_confidence=None)


def _run_decodes(s: Scheduler, n: int, accepted: int) -> list[DecodePlan]:
    """n decode plans, each booked with the policy as the engine does once read back."""
    plans = []
    for _ in range(n):
        d = s.schedule().decode
        plans.append(d)
        if d.k:
            s.policy.count(_verified(d, accepted), d.owners, d.stale)
        else:
            s.policy.count_plain(types.SimpleNamespace(emitted=np.ones((1, max(d.owners) + 1), bool)), d.owners)
    return plans


def test_confidence_policy_plans_plain_steps_when_verify_is_dear():
    """Verify steps pinned at 4x a plain step: no acceptance could pay for one (4 tokens for
    4.2x a step, held to VERIFY_MARGIN), so every step is plain from the first (k = 0, one
    position a row), no probe ever runs, and the prompts are prefilled without the drafter.
    Pinned cheap (1.1x) with drafts accepted, it keeps verifying."""
    s = _scheduler(max_slots=2, k=3, policy="confidence", costs=[1.0, 4.0, 4.1, 4.2])
    reqs = _add(s, _request("a", 10), _request("b", 12))
    first = s.schedule()
    assert [c.draft for c in first.prefills] == [False, False] and first.decode.k == 0
    s.policy.count_plain(types.SimpleNamespace(emitted=np.ones((1, 2), bool)), first.decode.owners)
    ks = [d.k for d in _run_decodes(s, 300, accepted=3)]
    assert ks == [0] * 300
    assert reqs[0].dispatched == 10 + 301
    m = s.policy.metrics()
    assert m["plain_steps"] == m["target_steps"] == 301 and m["plain_prefills"] == 2

    cheap = _scheduler(max_slots=2, k=3, policy="confidence", costs=[1.0, 1.1, 1.15, 1.2])
    _add(cheap, _request("a", 10), _request("b", 12))
    assert all(d.k == 3 for d in _run_decodes(cheap, 50, accepted=3))
    assert cheap.policy.metrics()["plain_steps"] == 0


def test_confidence_policy_tries_verify_steps_while_the_acceptance_seen_allows_them():
    """Verify steps at 2-2.4x a plain step pay if drafts are accepted often enough. Before any
    draft is judged the optimistic reading of the prior says they may be, so the first steps
    are a probe (every row checks all its drafts); drafts never accepted make plain steps win,
    in runs of PROBE_GAP doubling while they keep winning. The acceptance seen fades over plain
    steps (PLAIN_DECAY), so verify steps are tried again now and then, each return a probe whose
    first step checks one stale draft (not booked); it never verifies most steps. With every
    draft accepted, the same costs verify throughout."""
    gap, probe = policy_module.PROBE_GAP, policy_module.PROBE_STEPS
    s = _scheduler(max_slots=2, k=3, policy="confidence", costs=[1.0, 2.0, 2.2, 2.4])
    _add(s, _request("a", 10, max_tokens=1000), _request("b", 12, max_tokens=1000))
    plans = _run_decodes(s, 400, accepted=0)
    ks = [d.k for d in plans]
    assert ks[:probe] == [3] * probe and [d.probe for d in plans[:probe]] == [True] * (probe - 1) + [False]
    assert ks[probe: probe + gap] == [0] * gap
    returns = [i for i in range(1, len(ks)) if ks[i] and not ks[i - 1]]
    assert len(returns) >= 2  # it tries again
    assert all(ks[i] == 1 and plans[i].stale == {0, 1} for i in returns)
    assert ks.count(0) > 0.85 * len(ks)
    runs = [j - i for i, j in zip([probe] + returns, returns)]
    assert runs == sorted(runs)  # plain runs grow while plain keeps winning

    good = _scheduler(max_slots=2, k=3, policy="confidence", costs=[1.0, 2.0, 2.2, 2.4])
    _add(good, _request("a", 10, max_tokens=1000), _request("b", 12, max_tokens=1000))
    assert [d.k for d in _run_decodes(good, 100, accepted=3)] == [3] * 100


def test_policy_costs_measured_interleaved_and_refreshed_from_observed_steps():
    """measure_costs times each kind (a plain step, verify steps over k = 1..K) in interleaved
    rounds; observed step times replace them (the median of the latest; a kind not observed
    yet scales with the observed ones); pinned costs never move."""
    policy = SpeculationPolicy(3, "confidence", max_slots=1)
    calls = []
    policy.measure_costs(lambda k: calls.append(k) or np.zeros(()), rounds=2, calls=1)
    assert calls == [0, 1, 2, 3] * 3 and policy.seconds.shape == (4,) and (policy.seconds > 0).all()
    policy.warm = np.array([1.0, 2.0, 2.2, 2.4])
    policy._set_seconds(policy.warm)
    for t in (0.5, 0.6, 0.4, 0.5):  # plain steps observed: the verify steps' costs move as theirs did
        policy.observe(0, t)
    np.testing.assert_allclose(policy.seconds, [0.5, 1.0, 1.1, 1.2])
    for t in (1.5,) * policy_module.OBSERVED_MIN:  # and k = 1: the others scale by the median of the two moves
        policy.observe(1, t)
    np.testing.assert_allclose(policy.seconds, [0.5, 1.5, 2.2 * 0.625, 2.4 * 0.625])
    assert policy.verify_costs == pytest.approx([1.0, 3.0, 2.75, 3.0])
    pinned = SpeculationPolicy(3, "confidence", verify_costs=[1.0, 2.0, 2.2, 2.4])
    pinned.observe(0, 0.5)
    assert pinned.verify_costs == [1.0, 2.0, 2.2, 2.4]


def test_measured_policy_times_plain_steps_while_verifying_and_follows_them():
    """Costs measured, not pinned: warm-up says a verify step costs 1.5x a plain one, so with
    drafts accepted the policy verifies, but takes PLAIN_PROBE plain steps after PROBE_GAP
    verify steps (then every PLAIN_EVERY once OBSERVED_MIN plain steps were timed). When the
    steps as served show verify at 5x a plain step (host work the warm-up missed), it switches
    to plain steps, for good: no acceptance could pay for a verify step at those costs."""
    s = _scheduler(max_slots=1, k=3, policy="confidence")
    s.policy.measure_costs(lambda k: np.zeros(()), rounds=1, calls=1)
    s.policy.warm = np.array([1.0, 1.5, 1.5, 1.5])
    s.policy._set_seconds(s.policy.warm)
    _add(s, _request("a", 10))
    gap, n = policy_module.PROBE_GAP, policy_module.PLAIN_PROBE
    ks = [d.k for d in _run_decodes(s, gap + n + 1, accepted=3)]
    assert ks == [3] * gap + [0] * n + [1]  # (the first verify steps are the first probe's)
    for k, t in [(0, 1.0)] * 4 + [(3, 5.0)] * 4:  # as served: a verify step is 5x a plain one
        s.policy.observe(k, t)
    # k = 1, 2 not observed: scaled by the median move of the observed kinds (1 and 5 / 1.5)
    assert s.policy.verify_costs == pytest.approx([1.0, 3.25, 3.25, 5.0])
    assert [d.k for d in _run_decodes(s, 4 * gap, accepted=3)] == [0] * (4 * gap)


def test_plain_runs_prefill_with_the_plain_program_and_cold_rows_check_no_drafts():
    """A request admitted during a run of plain steps is prefilled by the plain engine's
    program (no drafter); its pending drafts are then an earlier request's, so the probe's
    first verify step marks its row cold (it checks none) as well as stale; the step after
    drafts it anew. Admitted while verify steps run, a prompt goes through the drafter."""
    s = _scheduler(max_slots=3, k=3, policy="confidence", costs=[1.0, 2.0, 2.2, 2.4])
    _add(s, _request("a", 10, max_tokens=400), _request("b", 12, max_tokens=400))
    first = s.schedule()
    assert [c.draft for c in first.prefills] == [True, True]  # (the first probe: verify steps)
    s.policy.count(_verified(first.decode, 0), first.decode.owners, first.decode.stale)
    gap, probe = policy_module.PROBE_GAP, policy_module.PROBE_STEPS
    plans = _run_decodes(s, probe, accepted=0)  # drafts rejected: after the probe, a plain run
    assert plans[-1].k == 0
    (c,) = _add(s, _request("c", 9, max_tokens=400))
    plan = s.schedule()
    assert [(p.draft, p.chunks[0].request.request_id) for p in plan.prefills] == [(False, "c")]
    assert plan.decode.k == 0 and s.policy.cold == {c.slot} and s.policy.totals["plain_prefills"] == 1
    s.policy.count_plain(types.SimpleNamespace(emitted=np.ones((1, 3), bool)), plan.decode.owners)
    plans = _run_decodes(s, 8 * gap, accepted=3)  # until the faded acceptance tries verify again
    resumed = [d for d in plans if d.k][0]
    assert resumed.k == 1 and resumed.cold == {c.slot} and resumed.stale == {0, 1, 2}
    after = plans[plans.index(resumed) + 1]
    assert after.k == 3 and after.cold == frozenset() and not s.policy.cold


def test_a_draining_batch_runs_at_its_slowest_rows_pace():
    """Row 0's drafts are always accepted, row 1's never. Per row on average a verify step
    over 3 drafts at 1.8x a plain step wins; but with nothing waiting the batch finishes when
    row 1 does, near one token a step either way, so plain steps win. When row 1 has a token left,
    row 0's pace decides again."""
    policy = SpeculationPolicy(3, "confidence", verify_costs=[1.0, 1.4, 1.6, 1.8], max_slots=2)
    req = lambda: Request("r", [1], SamplingParams(), ())  # noqa: E731
    for _ in range(8):
        host = types.SimpleNamespace(drafts_checked=np.array([3, 3]), drafts_accepted=np.array([3, 0]),
                                     emitted=np.array([[1, 1], [1, 0], [1, 0], [1, 0]], bool),
                                     next_limit=np.array([3, 3]), draft_confidence=None)
        policy.count(host, {0: req(), 1: req()})
    assert not policy.plain_is_better()
    assert policy.plain_is_better({0: 40, 1: 40})
    assert not policy.plain_is_better({0: 40, 1: 1})
