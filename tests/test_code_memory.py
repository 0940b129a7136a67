"""dsjax.code_memory: compiled programs dropped before the process reaches the kernel's limit on
memory mappings (XLA:CPU keeps a few hundred a program; past vm.max_map_count it crashes)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import code_memory
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.model import model_specs
from dsjax.params import init_params

pytestmark = pytest.mark.skipif(not code_memory.limit(), reason="no /proc: mappings are not watched")


@pytest.fixture(scope="module")
def model():
    cfg = dsjax.load_config("tiny").replace(vocab_size=64, name="tiny-v64")
    return dsjax.Model(cfg, init_params(model_specs(cfg, jnp.float32), 0), jnp.float32, None)


@pytest.fixture
def watched(monkeypatch):
    """A fresh watch state and a recording holder hook; `set_limit(n)` stands in for vm.max_map_count."""
    monkeypatch.setattr(code_memory, "_state", {"pressed": False, "checked": 0.0, "warned": False})
    released = []
    monkeypatch.setattr(code_memory, "_hooks", [*code_memory._hooks, lambda: released.append(True)])
    limit = {"n": code_memory.limit()}
    monkeypatch.setattr(code_memory, "limit", lambda: limit["n"])
    return released, lambda n: limit.update(n=n)


def test_release_gives_back_the_programs_mappings(model):
    """Each new padded sequence length (`dsjax.api.padded_size`: 16, 20, 40) is a program of its
    own, with its own mappings; dropping the compiled programs gives most of them back."""
    code_memory.release()
    before = code_memory.mappings()
    for s in (3, 20, 40):
        model.logits(np.arange(1, 1 + s)[None])
    grown = code_memory.mappings() - before
    assert grown > 3 * 100, grown  # a few hundred a program
    code_memory.release()
    assert code_memory.mappings() - before < grown / 3, (grown, code_memory.mappings() - before)


def test_a_compile_past_the_pressure_marks_the_process_and_logits_release_first(model, watched):
    released, set_limit = watched
    ids = np.arange(2, 13)[None]
    want = model.logits(ids)
    held = jax.jit(lambda v: v + 1)
    held(jnp.ones(3))
    assert held._cache_size() == 1 and not code_memory.under_pressure()

    set_limit(int(code_memory.mappings() / code_memory.PRESSURE) - 1)  # the process is now past the pressure
    assert not code_memory.under_pressure()  # nothing compiled since: not noticed yet
    code_memory._state["checked"] = 0.0  # past the read interval (the compiles above read the mappings)
    jax.jit(lambda v: v * 3)(jnp.ones(4))  # a compile: the watch reads the mappings
    assert code_memory.under_pressure()

    with pytest.warns(RuntimeWarning, match=r"near the kernel's limit of \d+ \(vm.max_map_count\)"):
        got = model.logits(ids)
    assert released == [True] and held._cache_size() == 0  # the holders and jit's caches dropped their programs
    np.testing.assert_array_equal(got, want)  # the same program, compiled again or read back from the cache

    code_memory._state.update(pressed=True)  # pressure again: released again, warned once per process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert code_memory.relieve()
    assert released == [True, True]


def test_an_engine_releases_between_steps_and_keeps_its_own_programs(model, watched):
    released, _ = watched
    engine = Engine(model, max_slots=2, capacity=64, prefill_chunk=16)
    prompts = [[5, 9, 2, 7], [3, 3, 8, 1, 6, 4]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = engine.generate(prompts, params)
    code_memory._state.update(pressed=True, warned=True)
    assert engine.generate(prompts, params) == want
    assert released == [True] and not code_memory.under_pressure()
