"""The prefix cache: a hit changes nothing in the output (bitwise in batch-invariant mode),
for hits ending inside a compression group, at a group end and beyond the window, with
speculation, and under eviction to a host tier and back; the counters say what happened."""

import numpy as np
import pytest

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.limits import check_prefix_cache
from dsjax.engine.prefix_cache import PrefixCache, PrefixCacheOptions, block_keys
from dsjax.engine.sampler import SamplingParams

BLOCK = 16  # tiny: window 16, compression ratios 4 and 16; the block is the prefill chunk


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32", seed=0, mtp=True)


def _engine(model, cache=PrefixCacheOptions(), **kw):
    kw = dict(max_slots=2, capacity=256, prefill_chunk=BLOCK, max_logprobs=2) | kw
    return Engine(model, prefix_cache=cache, **kw)


def _run(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    for _ in engine.run():
        pass
    return engine.requests[rid]


def _same(a, b, bitwise: bool):
    assert a.tokens == b.tokens
    if bitwise:
        assert np.array_equal(np.float32(a.logprobs), np.float32(b.logprobs))


SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=6, logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_hit_equals_a_run_without_the_cache(tiny, rng, batch_invariant):
    """One prompt fills the cache; prompts sharing 54 (inside a ratio-16 group), 64 (a group
    end) and 100 tokens (beyond the 16-token window) of it then hit 48 / 64 / 96 tokens and
    give what a fresh engine gives them: the same tokens, and in batch-invariant mode the
    same logits bit for bit. The counters: tokens taken, tokens a cached block held that
    were prefilled again (fewer than a block, so within window + largest ratio)."""
    base = rng.integers(2, 5000, 120).tolist()
    warm = _engine(tiny, batch_invariant=batch_invariant)
    _run(warm, base[:100] + rng.integers(2, 5000, 30).tolist(), SAMPLED)
    for shared, hit in ((54, 48), (64, 64), (100, 96)):
        prompt = base[:shared] + rng.integers(2, 5000, 9).tolist()
        got = _run(warm, prompt, SAMPLED)
        assert (got.cached_tokens, got.replayed_tokens) == (hit, shared - hit)
        assert got.replayed_tokens <= tiny.config.sliding_window + BLOCK  # window + largest ratio
        _same(got, _run(_engine(tiny, batch_invariant=batch_invariant), prompt, SAMPLED), bitwise=batch_invariant)
    metrics = warm.prefix_metrics()
    assert metrics["hits"] == 3 and metrics["lookups"] == 4
    assert metrics["prefill_tokens_saved"] == 48 + 64 + 96 and metrics["replayed_tokens"] == 6 + 0 + 4


def test_hit_with_speculative_decoding(tiny, rng):
    """Speculative engines cache the drafter's ring too (a block's key then covers the token
    after it, which that ring has read): greedy tokens with a hit equal a fresh engine's."""
    base = rng.integers(2, 5000, 80).tolist()
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    warm = _engine(tiny, num_draft_tokens=2, max_logprobs=0, spec_policy="fixed")  # nothing timed: k = 2 only
    _run(warm, base + [7, 8, 9], greedy)
    prompt = base[:70] + [11, 12]
    got = _run(warm, prompt, greedy)
    assert got.cached_tokens == 64
    assert got.tokens == _run(_engine(tiny, num_draft_tokens=2, max_logprobs=0, spec_policy="fixed"), prompt,
                              greedy).tokens


def test_next_chat_turn_hits_the_generated_reply(tiny, rng):
    """Blocks of generated tokens are stored too (plain decode, one step per dispatch): a
    40-token prompt and its 30-token reply leave 64 tokens in whole blocks, which the next
    turn (prompt + reply + its own message) takes, giving a fresh engine's greedy tokens. In
    batch-invariant mode only the prompt's blocks are kept (a hit must equal a prefill bit for
    bit, and a decode step's numerics are not a prefill's)."""
    first = rng.integers(2, 5000, 40).tolist()
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    for batch_invariant, hit in ((False, 64), (True, 32)):
        engine = _engine(tiny, batch_invariant=batch_invariant, max_logprobs=0)
        reply = _run(engine, first, greedy).tokens
        turn = first + reply + rng.integers(2, 5000, 6).tolist()
        got = _run(engine, turn, greedy)
        assert got.cached_tokens == hit
        # blocks ending at 48, 64 (the first reply) and 80, 96 (the second: a 76-token prompt + 30 tokens)
        assert engine.prefix_metrics()["generated_blocks"] == (0 if batch_invariant else 4)
        assert got.tokens == _run(_engine(tiny, batch_invariant=batch_invariant, max_logprobs=0), turn, greedy).tokens



def test_v41_decoded_first_block_is_kept_only_where_it_equals_a_prefill():
    """V4.1 under the reference's published-key rule (tiny-v41: index_topk 4, ratio-2 index
    sources), prefill_chunk 16: a fresh run prefills a prompt's first block, where a decode step
    at an even position t >= 10 (five or more ratio-2 entries visible) may select others, so a
    first block that ends in generated tokens is not kept (a 5-token prompt's chat), while a
    later generated block is (a 20-token prompt's, block 16..31). Each chat's next turn gives a
    fresh engine's tokens and log-probabilities (with that first block kept, the first chat's
    next turn gave other tokens)."""
    from test_v41_speculative import _tiny8  # tiny-v41 cut to 8 tokens, seeded Engram tables

    model = _tiny8()
    greedy = SamplingParams(max_tokens=14, ignore_eos=True, logprobs=1)
    firsts = [np.random.default_rng(n).integers(0, 8, n).tolist() for n in (5, 20)]
    warm = _engine(model, capacity=64, max_logprobs=1)
    fresh = Engine(model, max_slots=2, capacity=64, prefill_chunk=BLOCK, max_logprobs=1)
    for first, hit in zip(firsts, (0, 32)):
        turn = first + _run(warm, first, greedy).tokens + [1, 4, 5]
        got, want = _run(warm, turn, greedy), _run(fresh, turn, greedy)
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
        assert got.cached_tokens == hit

def test_shared_system_prompt_of_200_tokens_is_computed_once(tiny, rng):
    """Four requests arriving together behind a 200-token shared prompt, three slots: the
    others wait while the first prefills it, then take its 192 tokens of whole blocks (it is
    stored once: 12 blocks), and give what they give alone; a real config's block is its
    largest ratio (128), not thousands of tokens."""
    system = rng.integers(2, 5000, 200).tolist()
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = [system + rng.integers(2, 5000, 5).tolist() for _ in range(4)]
    engine = _engine(tiny, max_slots=3)
    ids = [engine.add_request(p, greedy) for p in prompts]
    for _ in engine.run():
        pass
    reqs = [engine.requests[i] for i in ids]
    assert [r.cached_tokens for r in reqs] == [0, 192, 192, 192]
    assert engine.prefix_metrics()["stored_blocks"] == 12
    alone = _engine(tiny, PrefixCacheOptions(device_bytes=0), max_slots=3)
    assert [r.tokens for r in reqs] == alone.generate(prompts[:3], greedy) + alone.generate(prompts[3:], greedy)
    check_prefix_cache(dsjax.load_config("v4-flash"), 128, None)
    with pytest.raises(ValueError, match="prefill_chunk=96 must be a multiple of the largest compression ratio"):
        check_prefix_cache(dsjax.load_config("v4-flash"), 96, None)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_eviction_and_host_tier_never_corrupt_outputs(tiny, rng, batch_invariant):
    """Random prompts over a few shared prefixes through an engine whose device budget holds
    a few blocks, with a host tier that holds a few more: admissions, hits, evictions and
    host round trips all happen, and every request's output equals a run of it on an engine
    that keeps nothing (bitwise logits in batch-invariant mode; tokens otherwise, where the
    replies' blocks are kept too)."""
    block_bytes = 44288  # one tiny block, float32 (checked below)
    cache = PrefixCacheOptions(device_bytes=5 * block_bytes, host_bytes=6 * block_bytes)
    engine = _engine(tiny, cache, batch_invariant=batch_invariant, max_slots=3)
    reference = _engine(tiny, PrefixCacheOptions(device_bytes=0), batch_invariant=batch_invariant, max_slots=3)
    prefixes = [rng.integers(2, 5000, n).tolist() for n in (40, 75, 110)]
    jobs = []
    for i in range(14):
        prefix = prefixes[rng.integers(len(prefixes))]
        prompt = prefix[: rng.integers(10, len(prefix) + 1)] + rng.integers(2, 5000, rng.integers(1, 20)).tolist()
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=int(rng.integers(1, 5)), logprobs=2,
                                ignore_eos=True)
        jobs.append((prompt, params))
    for start in range(0, len(jobs), 3):  # a few requests in flight at once
        ids = [engine.add_request(p, sp) for p, sp in jobs[start: start + 3]]
        for _ in engine.run():
            pass
        for rid, (prompt, params) in zip(ids, jobs[start: start + 3]):
            _same(engine.requests[rid], _run(reference, prompt, params), bitwise=batch_invariant)
    m = engine.prefix_metrics()
    assert engine.prefix.pool.entries and all(e.nbytes == block_bytes for e in engine.prefix.pool.entries.values())
    assert m["hits"] > 3 and m["evicted_blocks"] > 0
    assert m["device_to_host_blocks"] > 0 and m["host_to_device_blocks"] > 0
    assert m["device_bytes"] <= cache.device_bytes and m["host_bytes"] <= cache.host_bytes
    assert reference.prefix_metrics()["hits"] == 0


def test_pool_evicts_least_recent_and_drops_chained_blocks():
    """The pool alone: LRU order, a dropped block takes its chain's later blocks with it,
    and lookups count tokens a cached block held beyond the chain (`replayed`)."""
    pool = PrefixCache(PrefixCacheOptions(device_bytes=3 * 64), block=4, lookahead=False)
    prompt = list(range(20))
    keys = block_keys(prompt, 4, 4, False)
    blk = lambda: np.zeros(16, np.float32)  # noqa: E731  64 bytes
    for j in range(3):
        pool.insert(keys[j], keys[j - 1] if j else b"", prompt[4 * j: 4 * j + 4], blk())
    chain, replayed = pool.lookup(prompt[:10] + [99], keys, 10)
    assert len(chain) == 2 and replayed == 2  # tokens 8, 9 of block 2 are cached but prefilled again
    other = block_keys([50] * 8, 4, 2, False)
    pool.insert(other[0], b"", [50] * 4, blk())  # over budget: block 2 (the least recent) goes
    assert set(pool.entries) == {keys[0], keys[1], other[0]}
    pool.insert(other[1], other[0], [50] * 4, blk())  # then block 1: a lookup leaves a chain's tail older than its head
    assert set(pool.entries) == {keys[0], other[0], other[1]}
    assert pool.metrics()["evicted_blocks"] == 2 and pool.device_bytes == 192
    pool.options = PrefixCacheOptions(device_bytes=128)
    pool.insert(keys[1], keys[0], prompt[4:8], blk())  # block 0 goes, and with it block 1 chained after it
    assert set(pool.entries) == {other[0], other[1]} and pool.metrics()["evicted_blocks"] == 4
    with pytest.raises(ValueError, match="device_bytes must be an int >= 0"):
        PrefixCacheOptions(device_bytes=-1)
