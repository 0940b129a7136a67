import os
import sys

# Eight fake CPU devices for the mesh tests (must precede the first jax import). Code that
# uses no mesh runs on device 0 as before.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop compiled executables after each test module. Every XLA:CPU executable keeps
    its own JIT-code memory mappings; a whole suite's worth of compilations in one process
    exhausts vm.max_map_count and LLVM then fails with 'Cannot allocate memory'."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
