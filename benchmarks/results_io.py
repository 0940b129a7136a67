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


def interleaved_reads(run, x, weights: dict, rounds: int, nbytes: int) -> dict:
    """run(x, w) for each named w, the forms taking turns round by round (a shared box's
    bandwidth drifts) -> {name: {min_s, median_s, read_bytes_per_s_at_min}}, nbytes read a call."""
    times = {name: [] for name in weights}
    for _ in range(rounds):
        for name, w in weights.items():
            t = time.perf_counter()
            jax.block_until_ready(run(x, w))
            times[name].append(time.perf_counter() - t)
    return {name: {"min_s": min(ts), "median_s": statistics.median(ts), "read_bytes_per_s_at_min": nbytes / min(ts)}
            for name, ts in times.items()}


def write_result(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", path)
