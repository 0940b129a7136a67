"""Where one decode step's time goes, per op group, at batch 1 and 8 (issue: CPU decode speed).

    python benchmarks/decode_profile.py [--config bench-78m] [--batches 1 8] [--context 128]

Each op group runs as its own program (compiled with the engine's XLA options,
`dsjax.engine.programs.program`) on the live state of an engine that has
prefilled `--context` tokens per row, timed alone (median of `--repeats` calls, each
blocked on): the embedding, per layer the mHC mixing (both sublayers: mixes, collapse,
norm, expand), attention by kind (sliding / CSA with its Lightning Indexer / HCA), the MoE
(router, routed and shared experts), the head (collapse, norm, vocabulary projection) and
the sampler (an engine with the greedy screen: the head is the screen's greedy tokens, and
no sampler runs). Beside them: the whole decode program (`decode_step`, what the engine
dispatches; XLA fuses across the groups, so the groups' sum is not its time) and the
engine's wall time per step (the program plus host work: scheduling, reading tokens
back). Calling a group alone adds a dispatch (~tens of microseconds) to each.

bench-78m is the issue's model: `small` cut to hidden 256 and 6 layers (sliding x2,
CSA / HCA alternating), 16 experts top-2, vocabulary 129280: 78 M parameters.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from results_io import median_seconds, write_result  # noqa: E402
from roofline import memory_bandwidth, screened_step_bytes  # noqa: E402

from dsjax.model.cache_layout import decode_step_bytes  # noqa: E402

import dsjax
from dsjax.config import CSA, HCA, SLIDING
from dsjax.engine.engine import Engine
from dsjax.engine.programs import decode_step, program, screened_tokens, screens
from dsjax.engine.sampler import SamplingParams, sample_tokens
from dsjax.layers.attention import attention_extend
from dsjax.layers.hyper_connection import collapse, expand, hc_mixes
from dsjax.layers.moe import moe_forward
from dsjax.layers.norms import rms_norm
from dsjax.model.block import embed_streams, layer_block, layer_slot
from dsjax.model.head import head_input
from dsjax.model.v4.decoder import logits_of
from dsjax.params import init_params
from dsjax.model import model_specs

KIND = {SLIDING: "attention_sliding", CSA: "attention_csa_with_indexer", HCA: "attention_hca"}


def bench_config():
    small = dsjax.load_config("small")
    return small.replace(name="bench-78m", hidden_size=256, num_hidden_layers=6,
                         layer_types=small.layer_types[:6], mlp_layer_types=small.mlp_layer_types[:6])


def layer_state(cache, cfg, i):
    k, j, r = layer_slot(cfg, i)
    return jax.tree.map(lambda a: a[r], cache.layers[k][j])


def decoding_engine(model, batch: int, context: int, room: int = 64) -> Engine:
    """An engine with `batch` requests of `context` random prompt tokens, all decoding, its
    decode program compiled and outputs flowing, with room for `room` more tokens a row."""
    capacity = -(-(context + room) // 128) * 128  # a multiple of the HCA ratio
    engine = Engine(model, max_slots=batch, capacity=capacity, prefill_chunk=context)
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        engine.add_request(rng.integers(3, model.config.vocab_size, context).tolist(),
                           SamplingParams(max_tokens=capacity - context, ignore_eos=True))
    while any(r.state != "decoding" for r in engine.requests.values()):
        engine.step()
    for _ in range(3):  # a few decode steps: the step programs compiled, outputs flowing
        engine.step()
    return engine


def step_seconds(engine: Engine, steps: int) -> float:
    """The engine's wall time per decode step over `steps` steps (program + host work)."""
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    jax.block_until_ready(engine.cache)
    return (time.perf_counter() - t) / steps


def profile(model, batch: int, context: int, repeats: int, bandwidth: float) -> dict:
    cfg = model.config
    engine = decoding_engine(model, batch, context)
    params = engine.step_params  # what its programs run with (the head packed, screened at few rows)

    engine_step = step_seconds(engine, 16)

    cache, slots = engine.cache, engine.slots
    bucket = engine.scheduler.bucket(int(np.max(np.asarray(cache.length))) + 1)
    cancelled = jnp.zeros(engine.rows, bool)
    times = []
    for _ in range(repeats + 1):  # the program the engine dispatches, on fresh copies (it donates its state)
        c, s = jax.block_until_ready((jax.tree.map(jnp.copy, cache), jax.tree.map(jnp.copy, slots)))
        t = time.perf_counter()
        jax.block_until_ready(decode_step(params, c, s, cancelled, cfg=cfg, opts=engine.opts, ctx_bucket=bucket,
                                          n_logprobs=0))
        times.append(time.perf_counter() - t)
    groups: dict[str, float] = {"whole_decode_program": float(np.median(times[1:]))}

    tokens = slots.last_token[:, None]
    start, n_valid = cache.length, jnp.ones((engine.rows,), jnp.int32)
    # weights are arguments, never closed over (XLA would fold them as constants)
    groups["embedding"] = median_seconds(program(lambda p, t: embed_streams(p, t, cfg)), params, tokens,
                                         repeats=repeats)
    streams = embed_streams(params, tokens, cfg)
    x = streams[:, :, 0]

    def mhc(block, streams, y):
        for hc, norm in ((block.attn_hc, block.attn_norm), (block.ffn_hc, block.ffn_norm)):
            pre, post, comb = hc_mixes(hc, streams, cfg)
            h = rms_norm(collapse(streams, pre), norm, cfg.rms_norm_eps)
            streams = expand(y + 0 * h, streams, post, comb)
        return streams

    for layer in cfg.layers:
        block = layer_block(params, cfg, layer.index)
        state = layer_state(cache, cfg, layer.index)
        n_entries = bucket // layer.compress_ratio if layer.compress_ratio else 0
        attend = program(lambda p, st, h, at, n, layer=layer, e=n_entries: attention_extend(p, st, h, at, n, layer,
                                                                                            cfg, e)[0])
        moe = program(lambda p, h, t: moe_forward(p, h, t, cfg))
        for name, seconds in (("mhc", median_seconds(program(mhc), block, streams, x, repeats=repeats)),
                              (KIND[layer.attention], median_seconds(attend, block.attn, state, x, start, n_valid,
                                                                     repeats=repeats)),
                              ("moe", median_seconds(moe, block.moe, x, tokens, repeats=repeats))):
            groups[name] = groups.get(name, 0.0) + seconds
    if screens(params):  # greedy rows: the screen finds the tokens (what the engine's step runs), no sampler
        rows = jnp.ones((engine.rows,), bool)
        screened = program(lambda p, s, st: screened_tokens(head_input(p.hc_head, p.norm, s, cfg)[:, 0], p.lm_head,
                                                            st, start, rows))
        groups["head"] = median_seconds(screened, params, streams, slots.sampling, repeats=repeats)
        groups["sampler"] = 0.0
    else:
        groups["head"] = median_seconds(program(lambda p, s: logits_of(p, s, cfg)), params, streams, repeats=repeats)
        logits = logits_of(params, streams, cfg)[:, 0]
        groups["sampler"] = median_seconds(program(lambda lg, s, p: sample_tokens(lg, s, p)), logits,
                                           slots.sampling, start, repeats=repeats)
    parts = sum(v for k, v in groups.items() if k != "whole_decode_program")
    weights = jnp.bfloat16 if model.options.compute_dtype else jnp.float32  # store_weights: 16-bit projections
    need = decode_step_bytes(cfg, batch=batch, context=context + 8, dtype=weights)
    if screens(params) and params.lm_head.tiles.dtype == jnp.float32:  # (a bf16 head is its own screen)
        need = screened_step_bytes(need, cfg)
    roofline = batch * bandwidth / need["total"]
    return {"batch": batch, "engine_step_s": engine_step, "tokens_per_s": batch / engine_step,
            "step_bytes": need, "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": batch / engine_step / roofline,
            "host_overhead_s": engine_step - groups["whole_decode_program"],
            "groups_s": groups, "groups_sum_s": parts,
            "groups_share_of_sum": {k: v / parts for k, v in groups.items() if k != "whole_decode_program"}}


def step_args(description: str, stem: str) -> argparse.ArgumentParser:
    """The arguments decode_profile.py and decode_trace.py share: which model, batches, context,
    weight storage, and where the JSON goes (default results/<stem>[_bf16_weights].json)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="bench-78m", help="bench-78m (the issue's model) or a named config")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128, help="tokens in each row's cache")
    ap.add_argument("--weight-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="bfloat16: dsjax.store_weights (16-bit projection weights; activations fp32 either way)")
    ap.add_argument("--out", help=f"default: results/{stem}[_bf16_weights].json")
    ap.set_defaults(stem=stem)
    return ap


def step_model(args) -> tuple:
    """(random-weight model as --weight-dtype says, output path) from `step_args`."""
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", args.stem
                                   + ("_bf16_weights" if args.weight_dtype == "bfloat16" else "") + ".json")
    if args.config == "bench-78m":
        cfg = bench_config()
        model = dsjax.Model(cfg, init_params(model_specs(cfg, jnp.float32), 0), jnp.float32, None)
    else:  # a named config (V4 or V4.1) with seeded random weights
        model = dsjax.load_model(args.config, dtype="float32", mtp=False)
        cfg = model.config
    if args.weight_dtype == "bfloat16":
        model = dsjax.store_weights(model)  # 16-bit weights, fp32 activations
    return model, out


def main():
    ap = step_args(__doc__, "decode_profile_cpu")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model, out = step_model(args)
    cfg = model.config
    bandwidth = memory_bandwidth()
    print(f"read bandwidth: {bandwidth['best'] / 1e9:.1f} GB/s (XLA sum {bandwidth['xla'] / 1e9:.1f}, XLA matrix-vector "
          f"{bandwidth['xla_matvec'] / 1e9:.1f}, numpy 1 thread "
          f"{bandwidth['numpy_1_thread'] / 1e9:.1f}, threaded {bandwidth['numpy_threads'] / 1e9:.1f})")
    runs = [profile(model, b, args.context, args.repeats, bandwidth["best"]) for b in args.batches]
    for r in runs:
        print(f"batch {r['batch']}: {r['tokens_per_s']:.1f} tok/s ({r['fraction_of_roofline']:.0%} of the roofline "
              f"{r['roofline_tokens_per_s']:.0f}: {r['step_bytes']['total'] / 1e6:.0f} MB a step), engine step "
              f"{r['engine_step_s'] * 1e3:.2f} ms, program {r['groups_s']['whole_decode_program'] * 1e3:.2f} ms, "
              f"host {r['host_overhead_s'] * 1e3:.2f} ms")
        for k, v in sorted(r["groups_s"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:28s} {v * 1e3:8.3f} ms")
    write_result({"config": cfg.name, "dtype": "float32", "weight_dtype": args.weight_dtype, "context": args.context,
                  "jax": jax.__version__,
                  "read_bandwidth_bytes_per_s": bandwidth,
                  "device": str(jax.devices()[0]), "platform": platform.platform(), "runs": runs}, out)


if __name__ == "__main__":
    main()
