"""The runner's programs as stored executables (`dsjax.engine.executables`): a second start
reads every program from the store instead of tracing it, and runs exactly the programs
jit would have built."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import dsjax
from dsjax.command import compile_counter
from dsjax.engine import executables
from dsjax.engine.engine import Engine
from dsjax.engine.executables import EXECUTABLE_LOADED, Programs, Store, whole_key
from dsjax.engine.requests import SamplingParams


@struct.dataclass
class Box:
    a: jax.Array
    scale: float = struct.field(pytree_node=False)


@jax.jit
def _double(box: Box, x):
    return box.a * box.scale + x


@functools.partial(jax.jit, static_argnames=("k",))
def _scaled(x, *, k):
    return x * k


@pytest.fixture
def loads():
    """How many executables were read from a store in the test."""
    seen = []
    listener = lambda event, **kw: seen.append(event) if event == EXECUTABLE_LOADED else None  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    yield seen
    jax.monitoring.unregister_event_listener(listener)


def test_programs_equal_jit_and_the_store_gives_the_same_executable(tmp_path, loads):
    box, x = Box(jnp.arange(4.0), 3.0), np.ones(4, np.float32)
    executables.clear()
    first = Programs(Store(tmp_path))
    np.testing.assert_array_equal(first(_double, box, x), _double(box, x))
    np.testing.assert_array_equal(first(_scaled, x, k=2.0), x * 2)
    assert not loads
    executables.clear()  # a new process: nothing in memory
    second = Programs(Store(tmp_path))
    np.testing.assert_array_equal(second(_double, box, x), _double(box, x))
    np.testing.assert_array_equal(second(_scaled, x, k=2.0), x * 2)
    assert len(loads) == 2
    np.testing.assert_array_equal(second(_scaled, x, k=5.0), x * 5)  # another static argument: compiled anew
    assert len(loads) == 2


def test_the_key_sees_inside_pytrees_and_a_stale_short_match_cannot_run(tmp_path):
    x = np.ones(4, np.float32)
    small, wide, rescaled = Box(jnp.arange(4.0), 3.0), Box(jnp.arange(8.0).reshape(2, 4), 3.0), Box(jnp.arange(4.0), 2.0)
    keys = {whole_key(_double, (b, x), {}) for b in (small, wide, rescaled)}
    assert len(keys) == 3  # a leaf's shape, a static field: each another program
    assert whole_key(_double, (small, x), {}) == whole_key(_double, (Box(jnp.zeros(4), 3.0), x), {})  # values: not
    programs = Programs(Store(tmp_path))
    np.testing.assert_array_equal(programs(_double, small, x), small.a * 3 + x)
    # same top-level types and shapes (the runner's short key), another shape inside the pytree
    np.testing.assert_array_equal(programs(_double, wide, x), wide.a * 3 + x)
    np.testing.assert_array_equal(programs(_double, small, x), small.a * 3 + x)


def test_a_torn_store_file_costs_a_compile_not_a_failure(tmp_path, loads):
    x = np.ones(4, np.float32)
    executables.clear()
    Programs(Store(tmp_path))(_scaled, x, k=2.0)
    (path,) = Store(tmp_path).directory.glob("*.exe")
    path.write_bytes(path.read_bytes()[:100])
    executables.clear()
    np.testing.assert_array_equal(Programs(Store(tmp_path))(_scaled, x, k=2.0), x * 2)
    assert not loads


def test_a_warm_engine_start_reads_every_program_from_the_store(tmp_path, monkeypatch, loads):
    """The second engine (as after a restart: nothing in memory) builds none of its programs,
    loads them all, and generates the first one's tokens. With a new store (dsjax's sources
    changed, so the store's directory did) every program is read from JAX's persistent cache
    instead of compiled, and stored: the start after that loads them all from the new store,
    and they run (XLA:CPU re-serializes an executable read from JAX's cache without some of
    its functions: "Function ... not found" when run, unless stored as that cache's bytes)."""
    from dsjax.compile_cache import current

    if not current().enabled:
        pytest.skip("JAX's persistent cache is off (DSJAX_COMPILE_CACHE)")
    tiny = dsjax.load_model("tiny", dtype="float32", seed=0)
    prompts = np.random.default_rng(1).integers(0, 200, (3, 11)).tolist()
    sp = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.9, seed=4),
          SamplingParams(max_tokens=6)]

    def start_and_run(store):
        monkeypatch.setattr("dsjax.engine.runner.executable_directory", lambda: tmp_path / store)
        executables.clear()
        jax.clear_caches()
        loads.clear()
        with compile_counter() as counts:
            engine = Engine(tiny, max_slots=2, capacity=64, prefill_chunk=16)
            engine.warmup()
        return counts, engine.generate(prompts, sp)

    cold, tokens = start_and_run("first")
    assert cold["programs"] >= 3 and not loads  # the state, a prompt chunk, a decode step
    warm, again = start_and_run("first")
    assert warm["programs"] == warm["cached"] == len(loads) == cold["programs"]  # every one read whole
    assert again == tokens and all(len(t) == 6 for t in tokens)
    moved, again = start_and_run("moved")
    assert moved["programs"] == moved["cached"] == cold["programs"] and not loads  # JAX's cache: no compile
    assert again == tokens and len(list((tmp_path / "moved").rglob("*.exe"))) == cold["programs"]
    warm, again = start_and_run("moved")
    assert warm["programs"] == warm["cached"] == len(loads) == cold["programs"] and again == tokens


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (fake) devices")
def test_a_mesh_engines_programs_are_read_from_jaxs_cache_with_the_store_on(tmp_path, monkeypatch, loads):
    """The store keeps one-device executables only; a mesh engine's programs (with the store on,
    as every command has it) go through JAX's persistent cache, so a second start reads each one
    from there instead of compiling it (they used to skip that cache and compile every start)."""
    model = dsjax.load_model("tiny", dtype="float32", seed=0, mesh="data=2")
    monkeypatch.setattr("dsjax.engine.runner.executable_directory", lambda: tmp_path)
    prompts = np.random.default_rng(2).integers(0, 200, (2, 9)).tolist()

    def start_and_run():
        executables.clear()
        jax.clear_caches()
        with compile_counter() as counts:
            engine = Engine(model, max_slots=2, capacity=64, prefill_chunk=16)
            tokens = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        return counts, tokens

    _, tokens = start_and_run()
    warm, again = start_and_run()
    assert warm["programs"] >= 2 and warm["cached"] == warm["programs"] and not loads, warm
    assert again == tokens and not list(tmp_path.rglob("*.exe"))


def test_lambdas_of_one_name_are_not_one_program(tmp_path):
    x = np.ones(4, np.float32)
    programs = Programs(Store(tmp_path))
    np.testing.assert_array_equal(programs(jax.jit(lambda v: v * 2), x), x * 2)
    np.testing.assert_array_equal(programs(jax.jit(lambda v: v + 1), x), x + 1)


def test_compiles_ahead_defer_the_call_then_run_the_same_program(tmp_path, loads):
    """Inside `Programs.ahead`, a call of a program not compiled yet starts its compile and
    raises Deferred (nothing runs); called again it waits for that compile and gives jit's
    result; the executable is stored as a compile outside `ahead` would store it."""
    box, x = Box(jnp.arange(4.0), 3.0), np.ones(4, np.float32)
    executables.clear()
    programs = Programs(Store(tmp_path))
    with programs.ahead(2):
        for fn, args, static in ((_double, (box, x), {}), (_scaled, (x,), dict(k=4.0))):
            with pytest.raises(executables.Deferred):
                programs(fn, *args, **static)
        np.testing.assert_array_equal(programs(_double, box, x), _double(box, x))
        np.testing.assert_array_equal(programs(_scaled, x, k=4.0), x * 4)
    assert not programs.pending and len(list(Store(tmp_path).directory.glob("*.exe"))) == 2
    executables.clear()
    np.testing.assert_array_equal(Programs(Store(tmp_path))(_scaled, x, k=4.0), x * 4)
    assert len(loads) == 1


_V41_RUN = """
import json
from jax import monitoring
import dsjax
seen = {"compiles": 0, "hits": 0}
monitoring.register_event_listener(lambda e, **kw: seen.update(hits=seen["hits"] + 1) if e.endswith("/cache_hits") else None)
monitoring.register_event_duration_secs_listener(
    lambda e, s, **kw: seen.update(compiles=seen["compiles"] + 1) if e.endswith("backend_compile_duration") else None)
engine = dsjax.Engine(dsjax.load_model("tiny-v41"), max_slots=1, capacity=64, prefill_chunk=16)
tokens = engine.generate([[5, 9, 2, 7, 11, 3]], dsjax.SamplingParams(max_tokens=5, ignore_eos=True))
print(json.dumps({"tokens": tokens, **seen}))
"""


def test_a_v41_engines_programs_are_read_back_in_another_process():
    """V4.1's steps fetch Engram rows from the host during the step. On a CPU they call the store
    by number (`cpu_kernels.host_call`), not through a `jax.pure_callback`, so JAX's persistent
    cache keeps them: a second process compiles nothing (every program is a cache hit) and
    makes the same tokens."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _V41_RUN], env=env, capture_output=True, text=True,
                                      check=True, timeout=600).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[1]["tokens"] == runs[0]["tokens"] and len(runs[0]["tokens"][0]) == 5
    assert runs[1]["compiles"] > 0 and runs[1]["hits"] == runs[1]["compiles"], runs[1]
