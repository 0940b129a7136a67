"""Where benchmark results go, and the timing loops the benchmarks share."""

import json
import os
import statistics
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


def median_seconds(fn, *args, repeats: int) -> float:
    """Median seconds per call after one warm-up (compiling) call: robust to the bursts of a
    shared box, where a mean is not."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_result(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", path)
