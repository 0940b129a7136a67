"""Logprobs behind a condition: an engine whose programs can report top-n logprobs (a fixed
`logprob_width`, as `dsjax serve` builds it) computes them only in steps where a row asks,
and otherwise takes the logprob-less path (the greedy screen included). Its tokens are those
of an engine without logprobs, whoever asks; the logprobs of the rows that ask are the
log-softmax of the full-sequence forward's logits; the rows that do not ask get none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.kernels import cpu as cpu_kernels
from dsjax.model import forward

WIDTH = 20  # serve's: OpenAI's most top_logprobs


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32", seed=0)


def _requests(rng, logprobs: tuple[int, ...]):
    """Greedy and seeded sampled requests (one of each per entry of `logprobs`, which each asks)."""
    out = []
    for i, n in enumerate(logprobs):
        prompt = rng.integers(0, 5000, int(rng.integers(5, 40))).tolist()
        out.append((prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=n)))
        out.append((prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True,
                                           logprobs=n)))
    return out


def _run(engine, requests):
    ids = [engine.add_request(p, sp) for p, sp in requests]
    events = {rid: [] for rid in ids}
    for e in engine.run():
        events[e.request_id].append(e)
    return [events[rid] for rid in ids]


def _log_softmax64(model, ids: list[int]) -> np.ndarray:
    """Float64 log-softmax of the full-sequence forward's logits [S, V] (the oracle)."""
    z = np.asarray(forward(model.params, jnp.asarray([ids]), model.config)[0])[0].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_tokens_and_logprobs_of_a_fixed_width_engine(tiny, rng):
    """Four slots (the screened head where the CPU kernel is built): requests without logprobs
    on a width-20 engine, then with half of them asking (mixed in the same steps), give the
    tokens a width-0 engine gives, greedy and sampled; the logprobs and top-n of the rows that
    ask are the float64 oracle's (ties: lower id first), the others' are None."""
    plain = _requests(rng, (0, 0, 0))
    want = [[e.token for e in ev] for ev in _run(Engine(tiny, max_slots=4, capacity=256, prefill_chunk=32), plain)]
    for max_logprobs in (0, 5):
        engine = Engine(tiny, max_slots=4, capacity=256, prefill_chunk=32, max_logprobs=max_logprobs,
                        logprob_width=WIDTH)
        if cpu_kernels.available():  # the greedy screen is built whatever max_logprobs says
            assert engine.step_params.lm_head.screen is not None
        got = _run(engine, plain)
        assert [[e.token for e in ev] for ev in got] == want
        assert all(e.logprob is None and e.top_logprobs is None for ev in got for e in ev)
    asking = [(p, SamplingParams(**{**sp.__dict__, "logprobs": n}))
              for (p, sp), n in zip(plain, (3, 0, 0, 5, 1, 0))]
    got = _run(engine, asking)
    assert [[e.token for e in ev] for ev in got] == want
    for (prompt, sp), ev in zip(asking, got):
        if not sp.logprobs:
            assert all(e.logprob is None and e.top_logprobs is None for e in ev)
            continue
        tokens = [e.token for e in ev]
        ref = _log_softmax64(tiny, prompt + tokens)[len(prompt) - 1: -1]  # each generated token's distribution
        np.testing.assert_allclose([e.logprob for e in ev], ref[np.arange(len(tokens)), tokens], atol=1e-5)
        order = np.argsort(-ref, axis=-1, kind="stable")[:, : sp.logprobs]
        assert [[t for t, _ in e.top_logprobs] for e in ev] == order.tolist()
        np.testing.assert_allclose([[v for _, v in e.top_logprobs] for e in ev],
                                   np.take_along_axis(ref, order, -1), atol=1e-5)


def test_logprob_width_is_checked(tiny):
    with pytest.raises(ValueError, match=r"logprob_width must be an int from max_logprobs \(5\)"):
        Engine(tiny, max_slots=1, capacity=256, max_logprobs=5, logprob_width=3)
    with pytest.raises(ValueError, match="logprobs=6 exceeds the engine's max_logprobs=5"):
        Engine(tiny, max_slots=1, capacity=256, max_logprobs=5, logprob_width=WIDTH).add_request(
            [1, 2, 3], SamplingParams(logprobs=6))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_logprobs_on_a_mesh_match_one_device(tiny, rng):
    """Rows and vocabulary split (data=2, tensor=2): the condition's two branches are placed
    alike, and a request that asks gets one device's logprobs (to the last bits), one that does
    not gets none."""
    jobs = [(rng.integers(0, 5000, 20).tolist(), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)),
            (rng.integers(0, 5000, 9).tolist(), SamplingParams(max_tokens=6, ignore_eos=True))]
    mesh_model = dsjax.load_model("tiny", dtype="float32", seed=0, mesh="data=2,tensor=2")
    kw = dict(max_slots=2, capacity=256, prefill_chunk=16, max_logprobs=3, logprob_width=WIDTH)
    on_mesh, alone = (_run(Engine(m, **kw), jobs) for m in (mesh_model, tiny))
    assert [[e.token for e in ev] for ev in on_mesh] == [[e.token for e in ev] for ev in alone]
    np.testing.assert_allclose([e.logprob for e in on_mesh[0]], [e.logprob for e in alone[0]], atol=1e-5)
    assert [[t for t, _ in e.top_logprobs] for e in on_mesh[0]] == [[t for t, _ in e.top_logprobs] for e in alone[0]]
    assert all(e.logprob is None for e in on_mesh[1])
