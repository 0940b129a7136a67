"""Where benchmark results go, and the one timing loop the kernel benchmarks share."""

import json
import os
import time

import jax


def timed(fn, *args, repeats=10):
    """-> (seconds per call after one warm-up call, the last output)."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats, out


def write_result(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", path)
