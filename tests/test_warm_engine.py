"""`dsjax.generate` / `dsjax.score` / `Chat` on a warm engine (`dsjax.engine.warm`): repeated
calls reuse the engine built for the same model and shape, and give exactly the tokens and
scores a new engine gives."""

import threading

import numpy as np
import pytest

import dsjax
from dsjax.engine import warm
from dsjax.engine.engine import Engine
from dsjax.engine.requests import bucket_capacity
from dsjax.generate import plan


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32", seed=0)


@pytest.fixture
def built(monkeypatch):
    """The engines `warm_engine` builds, in order."""
    made = []

    def counting(model, **settings):
        made.append(Engine(model, **settings))
        return made[-1]

    monkeypatch.setattr(warm, "Engine", counting)
    return made


PROMPTS = np.random.default_rng(0).integers(0, 200, (3, 9)).tolist()
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=[3, 4, 5])


def _fresh(model, prompts, n, **kw):
    """The tokens a new engine gives (what `generate` ran before engines were kept)."""
    p = plan(model, prompts, n, **kw)
    return [c.ids for c in p.run(p.engine(model))]


def test_repeated_calls_reuse_one_engine_with_a_new_engines_tokens(tiny, built):
    warm.release(tiny)
    greedy = dsjax.generate(tiny, PROMPTS, 6)
    assert greedy == dsjax.generate(tiny, PROMPTS, 6) == _fresh(tiny, PROMPTS, 6)
    sampled = dsjax.generate(tiny, PROMPTS, 6, **SAMPLED)
    assert sampled == _fresh(tiny, PROMPTS, 6, **SAMPLED) != greedy
    assert len(built) == 1  # one shape class (3 slots, one capacity bucket): one engine for all four calls
    # another shape class (one prompt: one slot) replaces it; its tokens are a new engine's too
    assert dsjax.generate(tiny, PROMPTS[:1], 6) == _fresh(tiny, PROMPTS[:1], 6)
    assert len(built) == 2 and warm._warm[id(tiny)].engine is built[1]


def test_an_engine_left_by_an_exception_is_not_reused(tiny, built):
    warm.release(tiny)

    def fail(index, event, text):
        raise KeyboardInterrupt  # e.g. Ctrl-C in a notebook, requests still in flight

    with pytest.raises(KeyboardInterrupt):
        dsjax.generate(tiny, PROMPTS, 6, on_token=fail)
    assert id(tiny) not in warm._warm
    assert dsjax.generate(tiny, PROMPTS, 6) == _fresh(tiny, PROMPTS, 6)
    assert len(built) == 2


def test_new_weights_or_a_busy_engine_get_an_engine_of_their_own(tiny, built):
    warm.release(tiny)
    first = dsjax.generate(tiny, PROMPTS, 6)
    other = dsjax.load_model("tiny", dtype="float32", seed=1)
    tiny_params = tiny.params
    try:
        tiny.params = other.params  # weights replaced in place (a notebook's edit): not the old engine
        assert dsjax.generate(tiny, PROMPTS, 6) == _fresh(other, PROMPTS, 6) != first
    finally:
        tiny.params = tiny_params
    assert len(built) == 2
    # while one caller holds the warm engine, another (a thread) gets its own and the same tokens
    settings = plan(tiny, PROMPTS, 6).engine_settings(tiny)
    with warm.warm_engine(tiny, **settings) as held:
        out = []
        t = threading.Thread(target=lambda: out.append(dsjax.generate(tiny, PROMPTS, 6)))
        t.start()
        t.join()
        assert out == [first] and built[-1] is not held and len(built) == 4


def test_score_reuses_its_engine(tiny, built):
    warm.release(tiny)
    seqs = [p + [7, 8] for p in PROMPTS]
    a = dsjax.score(tiny, seqs)
    b = dsjax.score(tiny, seqs)
    capacity = bucket_capacity(max(map(len, seqs)) + 1, tiny.config)
    fresh = dsjax.score(tiny, seqs, engine=Engine(tiny, max_slots=3, capacity=capacity, max_logprobs=1))
    assert [s.token_logprobs for s in a] == [s.token_logprobs for s in b] == [s.token_logprobs for s in fresh]
    assert len(built) == 1
