import os
import sys

# Eight fake CPU devices for the mesh tests (must precede the first jax import). Code that
# uses no mesh runs on device 0 as before.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
import pytest

from dsjax import code_memory

sys.path.insert(0, os.path.dirname(__file__))

# The longest modules first (serial seconds on the 2-core CPU box, 2026-12-02: 370, 306, 264,
# 215, 148, 122, 97, 80). The README's command runs the suite on two workers (pytest-xdist,
# `--dist loadfile`), which take whole modules in collection order: starting the longest ones
# first keeps both busy to the end (a long module collected last ran alone for ~5 minutes).
LONGEST_FIRST = ("test_speculative.py", "test_v41_speculative.py", "test_engine.py", "test_sharding.py",
                 "test_mosaic_tpu.py", "test_inspect.py", "test_batch.py", "test_notebooks.py", "test_cli.py",
                 "test_v41_checkpoint.py", "test_v41_resident.py", "test_serving.py", "test_serving_fields.py")


def pytest_configure(config):
    """JAX's persistent compile cache in every test process (the workers and what they start), as
    `load_model` turns it on for a user: DSJAX_COMPILE_CACHE, else ~/.cache/dsjax/jax. A program
    one module compiles is then read back by the next module that builds it (each module clears
    jit's caches) and by the next run (the suite's figures cold and warm: the CHANGELOG)."""
    from dsjax.compile_cache import setup_compile_cache

    setup_compile_cache()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (randomized HF model, directory it was saved to), built once per session."""
    import hf_oracle

    cache = {}

    def get(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            model = hf_oracle.build(name, **overrides)
            directory = tmp_path_factory.mktemp(f"hf_{name}")
            hf_oracle.save(model, directory)
            cache[key] = (model, directory)
        return cache[key]

    return get


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _no_stored_executables():
    """The commands keep executables for the process (`setup_compile_cache(executables=True)`);
    a CLI test run in-process must not leave it on for the tests after it (each would then
    compile past JAX's cache). tests/test_executables.py tests the store itself."""
    yield
    import dsjax.compile_cache

    dsjax.compile_cache._keep_executables = False


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop compiled executables after each test module. Every XLA:CPU executable keeps
    its own JIT-code memory mappings (~600 for an engine step of the tiny model); a whole
    suite's worth of compilations in one process exhausts vm.max_map_count and XLA then
    aborts or segfaults wherever it maps next (seen in JAX's cache read and write)."""
    yield
    code_memory.release()


@pytest.fixture(autouse=True)
def _bounded_code_mappings():
    """Within a module too: after a test that leaves the process over half the kernel's limit
    on mappings (65530 by default; a long module such as test_speculative.py reached 53k,
    and a worker that ran other modules first starts higher), drop compiled code before the
    next test. Module fixtures keep their own; the next program is read back from JAX's
    persistent cache."""
    yield
    if code_memory.limit() and code_memory.mappings() > code_memory.limit() // 2:
        code_memory.release()
