"""Scoring prompts: `dsjax.score` and the engine's prompt logprobs equal the float64
log-softmax of `Model.logits` (the full-sequence forward) gathered at the tokens, for
prompts cut into several prefill chunks, behind prefix-cache blocks, and beside generating
requests; bitwise the same alone or in a batch in batch-invariant mode."""

import numpy as np
import pytest

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.prefix_cache import PrefixCacheOptions
from dsjax.engine.sampler import SamplingParams
from dsjax.serving.server import build

CHUNK = 32  # the built-in model's largest compression ratio: a prefix-cache block


@pytest.fixture(scope="module")
def model():
    return dsjax.load_model()  # the built-in dsjax-tiny-py (fp32 on CPU)


@pytest.fixture(scope="module")
def engine(model):
    """Prompts of ~100 tokens run as 3-4 chunks; the prefix cache stores their blocks."""
    return Engine(model, max_slots=2, capacity=256, prefill_chunk=CHUNK, max_logprobs=3,
                  prefix_cache=PrefixCacheOptions(device_bytes=64 << 20))


def oracle(model, ids) -> np.ndarray:
    """log-softmax in float64 of the full-sequence logits [S, V] of `ids`."""
    z = model.logits([ids])[0].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_score_equals_the_full_forward_across_chunks_and_cached_blocks(model, engine, rng):
    """A shared 70-token prefix (two whole blocks in the prefix cache once the first request
    stores them) under three continuations; rolling and continuation scores both equal the
    oracle to 1e-5, whether or not the blocks were cached (scored prompts recompute them)."""
    prefix = rng.integers(2, 5000, 70).tolist()
    conts = [rng.integers(2, 5000, n).tolist() for n in (5, 40, 1)]
    # a plain request first stores the prefix's blocks
    engine.add_request(prefix + conts[0], SamplingParams(max_tokens=2))
    for _ in engine.run():
        pass
    before = engine.prefix_metrics()
    assert before["stored_blocks"] >= 2
    got = dsjax.score(model, [prefix] * 3, conts, engine=engine)
    assert engine.prefix_metrics()["lookups"] == before["lookups"]  # recomputed, not taken from the cache
    for s, cont in zip(got, conts):
        ref = oracle(model, prefix + cont)
        want = ref[np.arange(len(prefix) - 1, len(prefix) + len(cont) - 1), cont]
        np.testing.assert_allclose(s.token_logprobs, want, rtol=0, atol=1e-5)
        assert abs(s.logprob - want.sum()) < 1e-4
        assert s.is_greedy == all(ref[len(prefix) - 1 + i].argmax() == t for i, t in enumerate(cont))
        assert s.tokens == cont and s.context == prefix
    rolling = dsjax.score(model, [prefix + conts[1]], engine=engine)[0]
    ref = oracle(model, prefix + conts[1])
    want = ref[np.arange(len(prefix) + 39), (prefix + conts[1])[1:]]
    np.testing.assert_allclose(rolling.token_logprobs, want, rtol=0, atol=1e-5)
    assert len(rolling.tokens) == len(prefix) + 39
    greedy = [int(ref[len(prefix) - 1].argmax())]  # a continuation of the model's choice is greedy
    assert dsjax.score(model, [prefix], [greedy], engine=engine)[0].is_greedy


def test_prompt_logprobs_beside_generation(model, engine, rng):
    """A request that generates and asks for its prompt's logprobs (top 3) gets them on its
    first event, equal to the oracle's, and the same tokens as without them; a neighbour
    that does not ask gets none."""
    prompt = rng.integers(2, 5000, 45).tolist()
    other = rng.integers(2, 5000, 20).tolist()
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    a = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3))
    b = engine.add_request(other, plain)
    first = {}
    for event in engine.run():
        first.setdefault(event.request_id, event)
    assert first[b].prompt_logprobs is None
    scores = first[a].prompt_logprobs
    assert len(scores) == len(prompt) and scores[0] is None
    ref = oracle(model, prompt)
    np.testing.assert_allclose([s[0] for s in scores[1:]], ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-5)
    for i in (0, 20, len(prompt) - 2):
        top_ids = [t for t, _ in scores[i + 1][1]]
        assert top_ids == np.argsort(-ref[i], kind="stable")[:3].tolist()
        np.testing.assert_allclose([v for _, v in scores[i + 1][1]], np.sort(ref[i])[::-1][:3], atol=1e-5)
    engine.add_request(prompt, plain, request_id="again")
    for _ in engine.run():
        pass
    assert engine.requests["again"].tokens == engine.requests[a].tokens


def test_scores_are_bitwise_batch_invariant(model, rng):
    """Batch-invariant mode: a sequence's scores alone equal its scores among others, bit for bit."""
    seqs = [rng.integers(2, 5000, n).tolist() for n in (50, 9, 33)]
    engine = Engine(model, max_slots=3, capacity=256, prefill_chunk=CHUNK, max_logprobs=1, batch_invariant=True)
    together = dsjax.score(model, seqs, engine=engine)
    alone = dsjax.score(model, seqs[:1], engine=engine)
    assert np.array_equal(np.float32(alone[0].token_logprobs), np.float32(together[0].token_logprobs))
    # a request that does not score its prompt keeps its logits bitwise beside one that does (same tile)
    plain = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)
    runs = []
    for neighbour in (False, True):
        rid = engine.add_request(seqs[1], plain)
        if neighbour:
            engine.add_request(seqs[1][::-1], SamplingParams(max_tokens=0, prompt_logprobs=1))  # same chunk width
        for _ in engine.run():
            pass
        runs.append(engine.requests[rid])
    assert runs[0].tokens == runs[1].tokens
    assert np.array_equal(np.float32(runs[0].logprobs), np.float32(runs[1].logprobs))


def test_the_built_in_model_serves_with_thinking_off(model):
    """The built-in code model has no chat of its own: requests that do not say get thinking
    off (a random-weights config keeps the recipe's default, on: tests/test_serving.py)."""
    s = build(model, name="dsjax-tiny-py", max_slots=1, capacity=256, prefill_chunk=CHUNK, warmup=False)
    try:
        assert s.ctx.default_thinking is False
    finally:
        s.close()


def test_score_refuses_what_it_cannot_score(model, engine):
    with pytest.raises(ValueError, match="at least 2"):
        dsjax.score(model, [[5]])
    with pytest.raises(ValueError, match="one each"):
        dsjax.score(model, [[5, 6]], [[1], [2]])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the engine's max_logprobs=3"):
        engine.validate([5, 6], SamplingParams(max_tokens=0, prompt_logprobs=4))
    speculative = Engine(model, max_slots=1, capacity=256, prefill_chunk=CHUNK, num_draft_tokens=1, max_logprobs=1)
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        speculative.validate([5, 6], SamplingParams(max_tokens=0, prompt_logprobs=0))
