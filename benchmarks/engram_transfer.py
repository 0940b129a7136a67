"""Engram's host traffic in a V4.1 decode step: bytes moved per token, and how much of the
host lookup the step hides (issue 17, item 3).

    python benchmarks/engram_transfer.py [--config tiny-v41] [--batch 8] [--table-rows 4000000]

A tiny-v41 checkpoint is written to a temporary directory with Engram tables of
`--table-rows` rows per layer (sparse files: only the header and the rows a run touches
are real bytes, so a large table costs no disk), then decode steps run three ways:

  fetch   the host lookup alone (`EngramStore.fetch`: hash, gather the rows, next history)
  device  the jitted step with the rows given up front (no host work inside the step)
  inside  the jitted step with the lookup inside it (`engram_fetch`), as a `jax.pure_callback`
          (what a GPU, a TPU or a mesh runs) and, on a CPU, called by the store's number
          (`cpu_kernels.host_call`: what one CPU device runs; `by_number_*` in the JSON)

hidden = 1 - (inside - device) / fetch_in_step, clipped to [0, 1] (fetch_in_step: the lookup's
own time when the step calls it, operands handed over from the device): the share of the lookup that
overlaps the device work before the first Engram layer (1 = fully hidden, 0 = the step
waits for all of it); `inside_overhead_ms` says what the lookup inside the step costs it,
which can exceed the lookup itself (the callback's own cost: a host round trip in the
middle of the program).
Bytes per token = Engram layers x n_hash rows x (head_dim + head_dim / 32) bytes.
JSON in benchmarks/results/engram_transfer_<platform>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from results_io import write_result  # noqa: E402

from dsjax.checkpoint.engram_tables import EngramStore, write_engram_table  # noqa: E402
from dsjax.checkpoint.names import engram_table_name  # noqa: E402
from dsjax.config import RuntimeOptions, load_config  # noqa: E402
from dsjax.config.io import to_hf_dict  # noqa: E402
from dsjax.kernels import cpu as cpu_kernels  # noqa: E402
from dsjax.layers.engram import bucket_primes  # noqa: E402
from dsjax.model.cache_layout import init_cache  # noqa: E402
from dsjax.model.v41.backbone import v41_logits, v41_streams_cached  # noqa: E402
from dsjax.model.v41.params import v41_model_specs  # noqa: E402
from dsjax.params import init_params  # noqa: E402


def write_tables(directory: Path, cfg, rows_wanted: int):
    """Engram tables only (sparse files: the header and one zero row are real bytes), and a
    config whose bucket primes give about `rows_wanted` rows a layer. -> that config."""
    e = cfg.v41.engram
    start = max(rows_wanted // e.n_hash, 1000)
    primes = bucket_primes(e.layer_ids, e.max_ngram_size, e.n_heads, start)
    engram = dataclasses.replace(e, vocab_size=start, num_embeddings=tuple(int(p.sum()) for p in primes))
    cfg = cfg.replace(v41=dataclasses.replace(cfg.v41, engram=engram))
    q = np.zeros((1, engram.head_dim), ml_dtypes.float8_e4m3fn)
    scale = np.full((1, engram.head_dim // 32), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)
    for layer, rows in zip(engram.layer_ids, engram.num_embeddings):
        write_engram_table(directory / f"engram-{layer}.safetensors", q, scale, prefix=engram_table_name(layer),
                           rows=rows, row_ids=[0])
    (directory / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    return cfg


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(fns: dict, repeats: int) -> dict:
    """Each fn's median time over `repeats` rounds, the fns taken in turn within a round (the
    machine's speed drifts: a fn timed after another would carry the drift into the ratio)."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compiled outside the timing
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny-v41")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--table-rows", type=int, default=4_000_000)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_tables(Path(tmp), load_config(args.config), args.table_rows)
        store = EngramStore.from_checkpoint(tmp, cfg)
        params = init_params(v41_model_specs(cfg, jnp.float32), seed=0)
        opts = RuntimeOptions()
        b, cap = args.batch, 2 * args.context
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocab_size, (b, args.context + 1)).astype(np.int32)
        n1 = np.ones(b, np.int32)

        own = EngramStore.fetch.__get__(store)  # the store's own fetch: called by its number on a CPU

        @functools.partial(jax.jit, static_argnames="inside")
        def step(params, t, cache, rows, inside):
            fetch = {"callback": store.fetch, "by_number": own}.get(inside)
            streams, pi, cache, _ = v41_streams_cached(params, t, cfg, cache, ctx_bucket=cap, opts=opts,
                                                       engram_rows=rows if fetch is None else fetch)
            return v41_logits(params, streams, pi, cfg)[:, -1].argmax(-1), cache

        cache = init_cache(cfg, b, cap, jnp.float32)
        prefill_rows = tuple((jnp.asarray(q), jnp.asarray(s))
                             for q, s in store.rows(tokens[:, :args.context], np.asarray(cache.history))[0])
        _, cache = step(params, tokens[:, :args.context], cache, prefill_rows, inside="no")
        last = tokens[:, args.context:args.context + 1]
        history = np.asarray(cache.history)
        host = store.rows(last, history)[0]
        rows = tuple((jnp.asarray(q), jnp.asarray(s)) for q, s in host)
        rows = tuple((jax.device_put(q), jax.device_put(s)) for q, s in rows)
        t_fetch = median_time(lambda: store.fetch(last, history, n1), args.repeats)
        in_step, fetch = [], store.fetch  # the lookup's own time when the step calls it (operands converted)

        def timed_fetch(*operands):
            t = time.perf_counter()
            out = fetch(*operands)
            in_step.append(time.perf_counter() - t)
            return out

        store.fetch = timed_fetch  # read when the callback step is traced, below (a function: a pure_callback)
        ways = ["no", "callback"] + (["by_number"] if cpu_kernels.host_calls() else [])
        times = interleaved({w: functools.partial(step, params, last, cache, rows, inside=w) for w in ways},
                            args.repeats)
        t_device, t_inside, t_number = times["no"], times["callback"], times.get("by_number")
        e = cfg.v41.engram
        per_token = len(e.layer_ids) * e.n_hash * (e.head_dim + e.head_dim // 32)
        overhead = t_inside - t_device  # what the lookup inside the step costs it
        t_in_step = statistics.median(in_step)
        hidden = min(max(1 - overhead / t_in_step, 0.0), 1.0) if t_in_step > 0 else None
        result = {"config": cfg.name, "batch": b, "context": args.context, "table_rows": list(e.num_embeddings),
                  "bytes_per_token": per_token, "fetch_ms": t_fetch * 1e3, "fetch_in_step_ms": t_in_step * 1e3,
                  "step_rows_given_ms": t_device * 1e3,
                  "step_rows_fetched_inside_ms": t_inside * 1e3,
                  "inside_overhead_ms": overhead * 1e3, "hidden_fraction": hidden,
                  "step_rows_fetched_by_number_ms": None if t_number is None else t_number * 1e3,
                  "by_number_overhead_ms": None if t_number is None else (t_number - t_device) * 1e3,
                  "jax": jax.__version__, "platform": platform.machine(), "backend": jax.default_backend(),
                  "v41_flash_bytes_per_token": 2 * 24 * (256 + 8)}
        store.close()
    print(json.dumps(result, indent=2))
    write_result(result, os.path.join(os.path.dirname(__file__), "results",
                                      f"engram_transfer_{jax.default_backend()}.json"))


if __name__ == "__main__":
    main()
