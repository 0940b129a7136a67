"""The memory roofline of decoding on this machine: how fast memory reads, and how many bytes
one decode step must read, so a measured tokens/s can be put as a fraction of the best a
memory-bound step could do.

    bandwidth = memory_bandwidth()                     # bytes/s, the best of several readers
    need = decode_step_bytes(cfg, batch=1, context=128, dtype=jnp.float32)  # dsjax.model.cache_layout
    roofline_tokens_per_s = batch * bandwidth / need

A step reads every weight once but the routed experts (only those its tokens pick: the
expected number of distinct experts among batch x top-k uniform picks) and the embedding
(one row per token), plus each row's cache (counted whole: an upper bound, small beside the
weights at short contexts).
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig


MATVEC_ROW = 4096  # floats per row of the matrix-vector reader


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> dict:
    """Read bandwidth in bytes/s by four readers of one fp32 array (> the caches): a jitted
    XLA sum, a jitted matrix-vector product over it as [n / 4096, 4096] rows (XLA:CPU's
    matrix-vector loop streams memory faster than its reductions: 27-29 against 21-24 GB/s on
    an Ice Lake VM, so a roofline from sums alone would be too low), and numpy sums over 1
    and over os.cpu_count() slices in threads (numpy releases the GIL).
    -> {"xla", "xla_matvec", "numpy_1_thread", "numpy_threads", "best"}."""
    import os

    a = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    x = jnp.asarray(a)
    xla_sum = jax.jit(jnp.sum)
    xla_matvec = jax.jit(jnp.matmul)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return nbytes / min(times)

    def threaded():
        parts = np.array_split(a, os.cpu_count() or 1)
        threads = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    rows = x[: x.size // MATVEC_ROW * MATVEC_ROW].reshape(-1, MATVEC_ROW)
    ones = jnp.ones((MATVEC_ROW,), jnp.float32)
    out = {"xla": best(lambda: jax.block_until_ready(xla_sum(x))),
           "xla_matvec": best(lambda: jax.block_until_ready(xla_matvec(rows, ones))),
           "numpy_1_thread": best(lambda: np.sum(a)),
           "numpy_threads": best(threaded)}
    out["best"] = max(out.values())
    return out


def screened_step_bytes(need: dict, cfg: ModelConfig) -> dict:
    """`decode_step_bytes` of an fp32 step whose greedy screen reads the head as its bf16 copy
    and its rows' norms (`dsjax.kernels.cpu.greedy_tokens`; the few candidate tiles it
    reads in fp32 are left out)."""
    head = need["by_group"]["lm_head"] / 2 + 4 * cfg.vocab_size
    return {"total": need["total"] - need["by_group"]["lm_head"] + head,
            "by_group": {**need["by_group"], "lm_head": head}}
