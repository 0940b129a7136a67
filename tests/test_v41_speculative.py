"""Lossless speculation with DSpark on DeepSeek-V4.1 (spec §6.7) in the engine: DSpark drafts
up to 5 tokens after the anchor, the main model verifies [anchor, drafts] in one chunk, each
row keeps the drafts it accepts (and the correction / bonus), the cache rows and Engram ids of
rejected positions are put back, the drafter's rings are fed the committed positions' taps.
tiny-v41 cut to an 8-token vocabulary with a Markov head that repeats the previous token: the
target's greedy output runs in repeats here, so drafts are right inside a run and wrong where
it changes. (The greedy tokens equal plain decoding's; sampled ones keep the distribution.)"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from scipy import stats

from dsjax.api import Model
from dsjax.checkpoint.engram_tables import EngramStore
from dsjax.config import load_config
from dsjax.engine.engine import Engine
from dsjax.engine.prefix_cache import PrefixCacheOptions
from dsjax.engine.sampler import SamplingParams
from dsjax.kernels import cpu as cpu_kernels
from dsjax.model.v41.params import dspark_specs, v41_model_specs
from dsjax.params import init_params
from dsjax.sharding.rules import make_mesh, shardings_for

CAP = 64
# The confidence policy with its cost curve pinned (nothing timed); the engines here that use it share programs.
CONFIDENCE = dict(spec_policy="confidence", verify_costs=[1.0, 1.3, 1.6, 1.9, 2.2, 2.5])


def _tiny8(mesh=None) -> Model:
    """tiny-v41 cut to 8 tokens with seeded Engram tables and the repeating Markov head, as a
    `dsjax.Model` with its DSpark head (default options: round trips, the reference's keys);
    its weights sharded over `mesh` if given."""
    cfg = load_config("tiny-v41")
    cfg = cfg.replace(vocab_size=8, eos_token_ids=(1,), pad_token_id=2,
                      v41=dataclasses.replace(cfg.v41, dspark=dataclasses.replace(cfg.v41.dspark, noise_token_id=7)))
    specs, ds_specs = v41_model_specs(cfg, jnp.float32), dspark_specs(cfg, jnp.float32)
    on_mesh = (lambda s: None) if mesh is None else (lambda s: shardings_for(s, mesh))  # noqa: E731
    markov = 4 * jnp.eye(8) if mesh is None else jax.device_put(4 * jnp.eye(8), NamedSharding(mesh, P()))
    params = init_params(specs, seed=0, shardings=on_mesh(specs)).replace(engram_tables=EngramStore.seeded(cfg, 1))
    ds = init_params(ds_specs, seed=1, shardings=on_mesh(ds_specs)).replace(markov_embed=markov, markov_head=markov)
    return Model(cfg, params, jnp.float32, mesh, mtp=ds)


@pytest.fixture(scope="module")
def tiny8():
    return _tiny8()


def _greedy_equals_plain(model, max_tokens: int, *spec_options, plain_model=None) -> list[Engine]:
    """Greedy requests (3 over 2 slots, one prompt of 2 tokens) through a speculative engine with
    5 drafts per each of `spec_options` (Engine keywords) give the plain engine's tokens (the
    plain engine on `plain_model`, default `model`). -> each speculative engine."""
    prompts = np.random.default_rng(2).integers(0, 8, (3, 7)).tolist()
    prompts[2] = prompts[2][:2]  # from start 2 a 6-position chunk is past the key rule's exact range: fewer drafts
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = Engine(plain_model or model, max_slots=2, capacity=CAP, prefill_chunk=8).generate(prompts, sampling)
    engines = []
    for options in spec_options:
        engine = Engine(model, max_slots=2, capacity=CAP, prefill_chunk=8, num_draft_tokens=5, **options)
        assert engine.generate(prompts, sampling) == plain, options
        engines.append(engine)
    return engines


def test_engine_dspark_speculation_equals_the_plain_engine(tiny8):
    """Greedy requests through `Engine(num_draft_tokens=5)` with the DSpark head (prefill
    seeding its rings, verify steps rolling back the caches and the Engram id history, drafts
    committed and redrawn) give the plain engine's tokens, under the default options
    (quantisation round trips, the reference's index keys) and with seeded Engram tables;
    drafts are both accepted and rejected. With confidence scheduling, the default policy
    (DSpark's sigma(c_k), the cost curve pinned so nothing is timed): rows verify fewer drafts
    than the maximum, and the calibration books every judged draft. (The fixed policy's greedy
    run is the mesh test's; one more engine here cost ~80 s of compiles for no other path.)"""
    (engine,) = _greedy_equals_plain(tiny8, 20, CONFIDENCE)
    confidence = engine.spec_metrics()
    assert 0 < confidence["drafts_accepted"] < confidence["drafts_proposed"]
    assert 0 < confidence["drafts_proposed"] < 5 * confidence["row_steps"]
    assert sum(confidence["calibration"]["judged"]) == sum(confidence["judged_by_position"]) > 0


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_engine_dspark_speculation_on_a_mesh_equals_the_plain_engine(tiny8):
    """The same on a mesh (data=2: each slot's row on its own batch shard; tensor=2: the
    vocabulary split, the target's and the drafter's logits gathered before their rows are
    sampled; prefill chunks over every row at once, the DSpark rings written, the Engram id
    history rolled back and the drafts drawn row by row): greedy tokens equal the plain engine's
    on one device, on the same weights, with the round trips off (with them, tensor-parallel
    sums can round a quantisation step the other way: test_v41_sharding). Each device fetches
    its rows' Engram entries through the host call by number, so no program calls back into
    Python (such a program JAX's persistent cache cannot keep: compiled in every process)."""
    off = lambda m: m.replace(options=m.options.replace(round_trips=False))  # noqa: E731
    (engine,) = _greedy_equals_plain(off(_tiny8(make_mesh("data=2,tensor=2"))), 12, dict(spec_policy="fixed"),
                                     plain_model=off(tiny8))
    m = engine.spec_metrics()
    assert 0 < m["drafts_accepted"] < m["drafts_proposed"]
    targets = [set(re.findall(r'custom_call_target="([^"]+)"', c.as_text())) for c in engine.runner.call.table.values()]
    assert any(cpu_kernels.HOST in t for t in targets) and not any("python" in x for t in targets for x in t)


def test_engine_sampled_dspark_speculation_keeps_the_distribution(tiny8):
    """Sampled requests (temperature 0.1, where this model's p is far from uniform; a seed each):
    the first token comes from the prefill,
    the second from a verify step over DSpark's drafts drawn from the drafter's processed
    distribution. Its frequencies over 320 requests fit the target's marginal
    sum_a p(a | prompt) p(b | prompt, a), from the model's full-sequence logits (chi-square)."""
    prompt = [3, 5, 2, 6, 1, 0, 4]
    n, temp = 320, 0.1
    engine = Engine(tiny8, max_slots=8, capacity=CAP, prefill_chunk=8, num_draft_tokens=3, spec_policy="fixed")
    out = np.array(engine.generate([prompt] * n, [SamplingParams(max_tokens=2, ignore_eos=True, temperature=temp,
                                                                 seed=i) for i in range(n)]))
    assert engine.spec_metrics()["drafts_accepted"] > 0
    seqs = np.array([prompt + [a] for a in range(8)])
    logits = tiny8.logits(seqs)  # [8, 8, 8]
    probs = np.asarray(jax.nn.softmax(logits.astype(np.float64) / temp, axis=-1), np.float64)
    first = probs[0, len(prompt) - 1]
    second = first @ probs[:, len(prompt)]  # the marginal of b
    for got, want in ((out[:, 0], first), (out[:, 1], second)):
        assert stats.chisquare(np.bincount(got, minlength=8), n * want / want.sum()).pvalue > 1e-3


def test_prefix_cache_hits_equal_fresh_runs(tiny8):
    """V4.1's prefix-cache blocks carry the KV sources' latents / index keys, the fp32 tails,
    the Engram id history and (with DSpark) the drafter's rings: prompts sharing 21 / 24 / 35
    tokens of a cached one hit whole 8-token blocks and give a fresh engine's greedy tokens,
    plain and speculative (whose block keys also cover the token after the block)."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 8, 40).tolist()
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    for options, hits in ((dict(), (16, 24, 32)), (dict(num_draft_tokens=5, **CONFIDENCE), (16, 16, 32))):
        def engine():
            return Engine(tiny8, max_slots=2, capacity=CAP, prefill_chunk=8, prefix_cache=PrefixCacheOptions(),
                          **options)
        warm = engine()
        warm.generate([base + [1, 2, 3]], sampling)
        for shared, hit in zip((21, 24, 35), hits):
            prompt = base[:shared] + rng.integers(0, 8, 5).tolist()
            rid = warm.add_request(prompt, sampling)
            for _ in warm.run():
                pass
            assert warm.requests[rid].cached_tokens == hit, (options, shared)
            assert warm.requests[rid].tokens == engine().generate([prompt], sampling)[0], (options, shared)


def test_prompt_chunks_follow_one_token_decodes(tiny8):
    """Under the reference's published-key rule (§2.7) a cached chunk starting at s > 0 equals
    one-token decodes only up to position 2 s + 1 (later ratio-2 scores would need keys that the
    chunk itself writes further on), so the engine cuts a V4.1 prompt on the prefill_chunk grid
    (`Engine.aligned_chunks`): 11 tokens run as positions 0..7 then 8..10, not 0..2 then 3..10.
    Oracle (§2.11): an 8-token prompt's greedy run is a prefill, then one-token decodes; its
    first 3 tokens appended to the prompt give the same tokens after them. (Cut 0..2, 3..10,
    both prompts' continuations differ.)"""
    prompts = [np.random.default_rng(seed).integers(0, 8, 8).tolist() for seed in (0, 1)]
    engine = Engine(tiny8, max_slots=2, capacity=CAP, prefill_chunk=8)  # the plain engine's programs
    assert engine.aligned_chunks
    runs = engine.generate(prompts, SamplingParams(max_tokens=11, ignore_eos=True))
    longer = engine.generate([p + run[:3] for p, run in zip(prompts, runs)],
                             SamplingParams(max_tokens=8, ignore_eos=True))
    assert longer == [run[3:] for run in runs]
