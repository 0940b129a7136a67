"""Bad input is refused at the earliest point (construction or admission) with an error that
names the argument or field, the value and what was expected; never later inside `run()`,
never silently changed."""

import numpy as np
import pytest

from dsjax.engine.sampler import SamplingParams

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
