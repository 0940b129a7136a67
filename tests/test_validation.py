"""Bad input is refused at the earliest point (construction or admission) with an error that
names the argument or field, the value and what was expected; never later inside `run()`,
never silently changed."""

import shutil

import numpy as np
import pytest

import dsjax
from dsjax.checkpoint import CheckpointError, SafetensorsFile, write_safetensors
from dsjax.engine import runner as runner_module  # the runner allocates the device state
from dsjax.engine import limits as limits_module
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.model.cache_layout import cache_bytes

VOCAB = 129280  # tiny's


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, max_slots=1, capacity=256)


# ----------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("inf")), r"temperature must be a finite number >= 0 .*got inf"),
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 .*got nan"),
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0 .*got -0.5"),
    (dict(temperature=True), r"temperature must be .*got True"),
    (dict(top_k=2.9), r"top_k must be an int >= 0 .*got 2.9"),
    (dict(top_k=True), r"top_k must be an int >= 0 .*got True"),
    (dict(top_k=-1), r"top_k must be an int >= 0 .*got -1"),
    (dict(top_k=2**40), r"top_k must be at most 2147483647 \(int32\), got 1099511627776"),
    (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\], got nan"),
    (dict(top_p=0), r"top_p must be a number in \(0, 1\], got 0"),
    (dict(min_p=float("nan")), r"min_p must be a number in \[0, 1\], got nan"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number > 0 .*got inf"),
    (dict(repetition_penalty=float("nan")), r"repetition_penalty must be .*got nan"),
    (dict(presence_penalty=float("nan")), r"presence_penalty must be a number in \[-2, 2\], got nan"),
    (dict(frequency_penalty=3.0), r"frequency_penalty must be a number in \[-2, 2\], got 3.0"),
    (dict(seed=1.5), r"seed must be an int in \[0, 2\*\*32 - 1\], got 1.5"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*32 - 1\], got -1"),
    (dict(seed=True), r"seed must be an int in \[0, 2\*\*32 - 1\], got True"),
    (dict(seed=2**32), r"seed must be an int in \[0, 2\*\*32 - 1\], got 4294967296"),
    (dict(logprobs=True), r"logprobs must be an int >= 0 .*got True"),
    (dict(logprobs=-1), r"logprobs must be an int >= 0 .*got -1"),
    (dict(ignore_eos="yes"), r"ignore_eos must be a bool, got 'yes'"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a tuple of int token ids, got 5"),
    (dict(stop_token_ids=(3, 1.5)), r"stop_token_ids\[1\] must be an int >= 0 .*got 1.5"),
    (dict(stop_token_ids=(True,)), r"stop_token_ids\[0\] must be an int >= 0 .*got True"),
    (dict(stop_token_ids=(-1,)), r"stop_token_ids\[0\] must be an int >= 0 .*got -1"),
    (dict(stop_token_ids=(2**40,)), r"stop_token_ids\[0\] must be at most 2147483647 \(int32\), got 1099511627776"),
])
def test_sampling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=r"^SamplingParams: " + match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, None])
def test_max_tokens_one_message(value):
    """A request makes at least one token (one with none would have no events): every bad
    max_tokens gets the same message, naming the value."""
    with pytest.raises(ValueError, match=rf"^SamplingParams: max_tokens must be an int >= 1 .*got {value!r}$"):
        SamplingParams(max_tokens=value)


def test_sampling_params_accept_numpy_scalars_unchanged():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), seed=np.uint32(2**32 - 1),
                       stop_token_ids=[1, np.int32(2)], max_tokens=np.int64(3), ignore_eos=np.bool_(True))
    assert (p.temperature, p.top_k, p.seed, p.max_tokens) == (0.5, 5, 2**32 - 1, 3)


# ----------------------------------------------------------------------------- Engine arguments
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_slots=0), r"^max_slots must be an int >= 1, got 0$"),
    (dict(max_slots=-2), r"^max_slots must be an int >= 1, got -2$"),
    (dict(max_slots=2.0), r"^max_slots must be an int >= 1, got 2.0$"),
    (dict(max_slots=True), r"^max_slots must be an int >= 1, got True$"),
    (dict(capacity=0), r"^capacity must be an int >= 1, got 0$"),
    (dict(capacity=256.0), r"^capacity must be an int >= 1, got 256.0$"),
    (dict(capacity=100), r"^capacity 100 must be a multiple of 16"),
    (dict(prefill_chunk=0), r"^prefill_chunk must be an int >= 1, got 0$"),
    (dict(decode_steps=0), r"^decode_steps must be an int >= 1, got 0$"),
    (dict(decode_steps=1.5), r"^decode_steps must be an int >= 1, got 1.5$"),
    (dict(max_logprobs=-1), r"^max_logprobs must be an int >= 0, got -1$"),
    (dict(max_logprobs=VOCAB + 1), rf"^max_logprobs must be at most the vocabulary size \({VOCAB}\), got {VOCAB + 1}$"),
    (dict(num_draft_tokens=1.5), r"^num_draft_tokens must be an int >= 0, got 1.5$"),
    (dict(overlap="yes"), r"^overlap must be a bool, got 'yes'$"),
    (dict(greedy_screen="no"), r"^greedy_screen must be a bool, got 'no'$"),
    (dict(capacity=131072), r"^capacity 131072 exceeds 65536, .*max_position_embeddings 65536.*lower capacity"),
])
def test_engine_refuses_bad_arguments(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny, **kwargs)


def test_cache_that_does_not_fit_is_refused_before_allocation(tiny, monkeypatch):
    """The cache bytes (max_slots x capacity) are compared with the device's free memory
    before anything is allocated; the message names both and what to lower. Exactly enough
    memory is enough."""
    capacity, slots = 65536, 8
    per_slot = cache_bytes(tiny.config, capacity, tiny.dtype)["bytes_per_sequence"] + 4 * capacity  # + token history
    need = slots * per_slot

    def no_allocation(*a, **k):
        raise AssertionError("the cache was allocated before the memory check")

    with monkeypatch.context() as m:
        m.setattr(runner_module, "init_state", no_allocation)
        with pytest.raises(MemoryError, match=rf"cache needs .*\({need} bytes\) on one device for max_slots=8 x "
                                              rf"capacity=65536 tokens.*\({need - 1} bytes\) free; lower max_slots or "
                                              rf"capacity .*max_new_tokens"):
            Engine(tiny, max_slots=slots, capacity=capacity, device_memory_bytes=need - 1)
    Engine(tiny, max_slots=slots, capacity=capacity, device_memory_bytes=need)


def test_generate_too_long_fails_at_construction(tiny, monkeypatch):
    """generate sizes the cache from the longest prompt + max_new_tokens: past the model's
    positions that is a ValueError naming the limit; within them but beyond the device, a
    MemoryError (here the device is made small) — both before any compile or run."""
    with pytest.raises(ValueError, match=r"max_position_embeddings 65536.*max_new_tokens"):
        dsjax.generate(tiny, [[1, 2, 3]], max_new_tokens=10**9)
    monkeypatch.setattr(limits_module, "free_memory", lambda *a: 10**6)
    with pytest.raises(MemoryError, match=r"1000000 bytes\) free; lower max_slots or capacity.*max_new_tokens"):
        dsjax.generate(tiny, [[1, 2, 3]], max_new_tokens=60000)


def test_cancel_unknown_id(engine):
    with pytest.raises(KeyError, match="no request with id 'unknown'"):
        engine.cancel("unknown")


# ----------------------------------------------------------------------------- admission
@pytest.mark.parametrize("prompt, match", [
    ([1, 1.7], r"^prompt\[1\] is 1.7 \(float\): token ids must be ints$"),
    ([1, 2, True], r"^prompt\[2\] is True \(bool\): token ids must be ints$"),
    (np.array([1.0, 2.0]), r"^prompt\[0\] is .*1.0.* \(float64\): token ids must be ints$"),
    ([[1, 2]], r"^prompt\[0\] is \[1, 2\] \(list\): token ids must be ints$"),
    (np.array([[1, 2]]), r"^prompt must be a 1-D list of token ids, got an array of shape \(1, 2\)$"),
    ("hello", r"^prompt must be a list of token ids, got a str \(tokenize the text first\)$"),
    ([], r"^prompt must contain at least one token$"),
    ([0, -1], rf"^prompt\[1\]: token id -1 is outside the vocabulary \[0, {VOCAB}\)$"),
    ([0, 5, VOCAB], rf"^prompt\[2\]: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)$"),
    ([0, 2**40], rf"^prompt\[1\]: token id {2**40} is outside the vocabulary"),
])
def test_admission_refuses_bad_prompts(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert not engine.waiting and not engine.requests  # nothing was queued


@pytest.mark.parametrize("params, match", [
    (SamplingParams(stop_token_ids=(3, VOCAB)), rf"^stop_token_ids: token id {VOCAB} is outside the vocabulary"),
    (SamplingParams(top_k=VOCAB + 1), rf"^top_k={VOCAB + 1} exceeds the vocabulary size \({VOCAB}\)"),
    (SamplingParams(top_k=2**31 - 1), r"^top_k=2147483647 exceeds the vocabulary size"),
    (SamplingParams(max_tokens=100000), r"^prompt \(3 tokens\) \+ max_tokens \(100000\) = 100003 exceeds the model's "
                                        r"max_position_embeddings \(65536\)"),
    (SamplingParams(max_tokens=254), r"^prompt \(3 tokens\) \+ max_tokens \(254\) exceeds the engine's cache capacity "
                                     r"\(256 tokens\)"),
    (SamplingParams(logprobs=2), r"^logprobs=2 exceeds the engine's max_logprobs=0"),
])
def test_admission_refuses_what_the_model_cannot_serve(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2, 3], params)
    assert not engine.waiting and not engine.requests


def test_admission_refuses_non_sampling_params(engine):
    with pytest.raises(TypeError, match=r"params must be a SamplingParams, got dict"):
        engine.add_request([1, 2, 3], {"max_tokens": 2})


def test_valid_edge_requests_are_admitted_unchanged(tiny):
    """top_k equal to the vocabulary, the last vocabulary id, numpy ids: admitted and kept as given."""
    eng = Engine(tiny, max_slots=1, capacity=256)
    rid = eng.add_request(np.array([0, VOCAB - 1], np.int64), SamplingParams(max_tokens=1, top_k=VOCAB,
                                                                              stop_token_ids=(VOCAB - 1,)))
    req = eng.requests[rid]
    assert req.prompt == [0, VOCAB - 1] and all(type(t) is int for t in req.prompt)
    assert req.params.top_k == VOCAB


# ----------------------------------------------------------------------------- load_model
@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=-1), r"^seed must be an int >= 0, got -1$"),
    (dict(seed=1.5), r"^seed must be an int >= 0, got 1.5$"),
    (dict(check_finite="no"), r"^check_finite must be a bool, got 'no'$"),
    (dict(mtp="yes"), r"^mtp must be a bool or None, got 'yes'$"),
    (dict(device_memory_bytes=0), r"^device_memory_bytes must be a positive int or None, got 0$"),
])
def test_load_model_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dsjax.load_model("tiny", **kwargs)


@pytest.fixture
def ckpt(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints("mixed")
    shutil.copytree(path, tmp_path / "ckpt")
    return tmp_path / "ckpt"


IDS = [[0, 5, 17, 300, 42, 7, 9, 11, 64, 128, 3]]


def test_config_json_beside_weights_loads_the_weights(ckpt):
    """A path to a checkpoint's config.json stands for the checkpoint: its weights, not seeded
    random ones."""
    from_dir = dsjax.load_model(ckpt, dtype="float32").logits(IDS)
    from_file = dsjax.load_model(ckpt / "config.json", dtype="float32").logits(IDS)
    np.testing.assert_array_equal(from_file, from_dir)


def test_bare_config_json_gives_seeded_random_weights(ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(ckpt / "config.json", bare / "config.json")
    a = dsjax.load_model(bare / "config.json", dtype="float32", seed=3).logits(IDS)
    b = dsjax.load_model(bare / "config.json", dtype="float32", seed=3).logits(IDS)
    c = dsjax.load_model(bare / "config.json", dtype="float32", seed=4).logits(IDS)
    real = dsjax.load_model(ckpt, dtype="float32").logits(IDS)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, real)


def _poison(directory, name, value):
    f = SafetensorsFile(directory / "model.safetensors")
    tensors = {n: np.array(f.read(n)) for n in f.tensors}
    f.close()
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[7] = value
    write_safetensors(directory / "model.safetensors", tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weight_is_refused_by_default(ckpt, dtype, value):
    """The scan is on by default, for every load dtype (bf16 included); it names the tensor
    and its file, and check_finite=False skips it."""
    name = "model.layers.1.attn.wq_b.weight"
    _poison(ckpt, name, value)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in model\.safetensors: non-finite values.*"
                                              rf"check_finite=False"):
        dsjax.load_model(ckpt, dtype=dtype)
    dsjax.load_model(ckpt, dtype=dtype, check_finite=False)
