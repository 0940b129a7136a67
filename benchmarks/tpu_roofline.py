"""A paper roofline of the Mosaic TPU kernels (dsjax/kernels/tpu_*.py) and of one V4-Flash decode
step on v5e-8, v6e-8 and v7x-8 slices: bytes and FLOPs from the kernels' own block plans and
the model's weight specs, times from each generation's public HBM bandwidth and MXU peak. No
TPU has run these kernels; this says what to expect and which bound a first run should meet.

    python benchmarks/tpu_roofline.py      # writes benchmarks/results/tpu_roofline.json, prints its tables

Kernels. A call's HBM traffic is counted by walking its grid in order, as the Pallas TPU
pipeline copies: an operand's block is copied in (an output's written back) whenever its
block index differs from the previous step's (`grid_traffic`); its MXU FLOPs are the products
the kernel issues, padded tiles included (exp and the other VPU work left out). Shapes are
tpu_budget's cases at V4-Flash widths: 32 decode rows per device, 256-token prefill chunks, 1M
tokens of context; the grouped FFN as it runs on an 8-way expert-parallel slice (each device's
32 experts, receiving 32 x 6 decode rows, evenly: 6 per expert). Attention assumes every key
block is visible (the skip only saves compute where it is not). expected = max(HBM, MXU).

Decode step. Mesh expert=8 (experts split 8 ways, the batch over all 8 devices, the other
weights whole on each device), weights as the release stores them (quantized="resident":
FP8 projections, MXFP4 routed experts). Per device and step: every non-expert weight read
once, the local experts the batch hits (uniform routing: 1 - (1 - k/E)^B of them), its rows'
cache; FLOPs 2 per weight per token (the routed experts' k of E) plus attention's core
(window, CSA top-k and indexer, HCA entries). ICI: the expert dispatch moves each assignment's
row (bf16) there and back, 7/8 of them off-device, at half the chip's bidirectional ICI
bandwidth one way, after the MXU / HBM time (it sits between router and experts), latency
not modelled. expected = max(HBM, MXU) + ICI.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsjax.config import CSA, HCA, load_config  # noqa: E402
from dsjax.kernels import tpu_attention, tpu_grouped_matmul, tpu_index_scores  # noqa: E402
from dsjax.kernels.tpu_blocks import GENERATIONS  # noqa: E402
from dsjax.kernels.tpu_budget import FP8_BLOCKS, kernel_shapes  # noqa: E402
from dsjax.model.cache_layout import cache_shapes  # noqa: E402
from dsjax.model.stored import weight_specs  # noqa: E402
from dsjax.params import spec_leaves, weight_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import roofline_tables  # noqa: E402  (the one renderer: REPORT.md, docs/kernels.md)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tpu_roofline.json")
EP = 8  # the slices' devices, all on the expert axis
# Per chip, from Google Cloud's TPU pages (v5e: cloud.google.com/tpu/docs/v5e; v6e and TPU7x:
# the comparison table on cloud.google.com/tpu/docs/tpu7x). A TPU7x chip has two TensorCores,
# each its own JAX device, so v7x-8 here is 8 devices on 4 chips, each device half a chip.
CHIPS = {
    "v5e": dict(bf16_tflops=197, hbm_gb_s=819, hbm_gib=16, ici_gb_s=400, devices_per_chip=1,
                source="https://cloud.google.com/tpu/docs/v5e"),
    "v6e": dict(bf16_tflops=918, hbm_gb_s=1638, hbm_gib=32, ici_gb_s=800, devices_per_chip=1,
                source="https://cloud.google.com/tpu/docs/tpu7x"),
    "v7x": dict(bf16_tflops=2307, hbm_gb_s=7380, hbm_gib=192, ici_gb_s=1200, devices_per_chip=2,
                source="https://cloud.google.com/tpu/docs/tpu7x"),
}


def device(gen: str) -> dict:
    """One JAX device's share of its chip: FLOP/s, HBM bytes/s, HBM bytes, one-way ICI bytes/s."""
    c, n = CHIPS[gen], CHIPS[gen]["devices_per_chip"]
    return dict(flops=c["bf16_tflops"] * 1e12 / n, hbm=c["hbm_gb_s"] * 1e9 / n, hbm_bytes=c["hbm_gib"] * 2**30 / n,
                ici=c["ici_gb_s"] * 1e9 / 2 / n)


def grid_traffic(grid, operands) -> int:
    """HBM bytes of a Pallas TPU call: operands [(block bytes, index map of the grid indices)];
    a block moves whenever its index differs from the previous grid step's (inputs copied in,
    outputs written back)."""
    total, last = 0, [None] * len(operands)
    for step in itertools.product(*map(range, grid)):
        for i, (nbytes, at) in enumerate(operands):
            where = at(*step)
            if where != last[i]:
                total, last[i] = total + nbytes, where
    return total


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def _blocks(plan_entries):
    return [_nbytes(s, d) for s, d in plan_entries]


def attention_cost(b, s, h, d, t, k_own, dtype=jnp.bfloat16, gen=None) -> tuple[int, int]:
    """(HBM bytes, MXU FLOPs) of one `tpu_sink_attention` call (tpu_attention._plan's grid)."""
    p = tpu_attention._plan(b, s, h, d, t, k_own, dtype, gen=gen)
    pos, q, kv, lo, hi, sinks, *own = _blocks(p["ins"])
    n_shared, last = p["n_shared"], p["n_shared"] - 1
    shared = lambda b_, i, j: (b_, min(j, last))  # noqa: E731
    ops = [(pos, lambda b_, i, j: (b_, i)), (q, lambda b_, i, j: (b_, i)), (kv, shared), (lo, shared), (hi, shared),
           (sinks, lambda *_: 0), (_nbytes(*p["out"]), lambda b_, i, j: (b_, i))]
    if own:
        mine = lambda b_, i, j: (b_, i, max(j - n_shared, 0))  # noqa: E731
        ops += [(own[0], mine), (own[1], mine)]
    b_, qb, steps = p["grid"]
    flops = b_ * qb * (n_shared * 4 * p["rows"] * p["bk"] * d + p["n_own"] * p["bq"] * 4 * h * p["bo"] * d)
    return grid_traffic(p["grid"], ops), flops


def index_scores_cost(b, s, h, d, t, dtype=jnp.bfloat16, gen=None) -> tuple[int, int]:
    """(HBM bytes, MXU FLOPs) of one `tpu_index_scores` call."""
    p = tpu_index_scores._plan(b, s, h, d, t, dtype, gen=gen)
    q, keys, w = _blocks(p["ins"])
    grid = (b, p["sp"] // p["bq"], p["tp"] // p["bt"])
    ops = [(q, lambda i, j, k: (i, j)), (keys, lambda i, j, k: (i, k)), (w, lambda i, j, k: (i, j)),
           (_nbytes(*p["out"]), lambda i, j, k: (i, j, k))]
    flops = math.prod(grid) * (2 * p["rows"] * p["bt"] * d + 2 * p["bq"] * p["rows"] * p["bt"])
    return grid_traffic(grid, ops), flops


def even_groups(m: int, experts: int) -> np.ndarray:
    """m rows spread as evenly as they go over `experts` groups (uniform routing's expectation)."""
    return np.full(experts, m // experts) + (np.arange(experts) < m % experts)


def grouped_ffn_cost(m, d, inter, dtype=jnp.bfloat16, gen=None, mxfp4=False, experts=32, fp8=None) -> tuple[int, int]:
    """(HBM bytes, MXU FLOPs) of one `tpu_grouped_ffn` call (both kernels) on m rows over
    `experts` local experts, evenly (`even_groups`); fp8: FP8 experts in these blocks."""
    sizes = even_groups(m, experts)
    cost = [0, 0]
    for k_dim, n_dim, n_w, out in ((d, inter, 2, dtype), (inter, d, 1, jnp.float32)):
        p = tpu_grouped_matmul._plan(m, k_dim, n_dim, dtype, out, n_w, gen=gen, mxfp4=mxfp4, fp8=fp8)
        expert, tile, *_, used = (np.asarray(a) for a in jax.device_get(
            tpu_grouped_matmul.group_visits(jnp.asarray(sizes, jnp.int32), m, p["tm"])))
        grid = (p["np"] // p["tn"], len(expert), p["kp"] // p["tk"])
        x_at = lambda n, v, k: (tile[v], k)  # noqa: E731
        w_at = lambda n, v, k: (expert[v], n, k)  # noqa: E731
        blocks = _blocks(p["ins"])
        if mxfp4:  # x's even and odd columns; per weight its bytes and its rows' exponents (whole K)
            ops = [(blocks[0], x_at), (blocks[1], x_at)] + [
                (bb, at) for _ in range(n_w) for bb, at in ((blocks[2], w_at), (blocks[3], lambda n, v, k: (expert[v], n)))]
        elif fp8:  # x; per weight its bytes and the expert's exponents (whole)
            ops = [(blocks[0], x_at)] + [(bb, at) for _ in range(n_w)
                                         for bb, at in ((blocks[1], w_at), (blocks[2], lambda n, v, k: expert[v]))]
        else:
            ops = [(blocks[0], x_at)] + [(blocks[1], w_at)] * n_w
        ops.append((_nbytes(*p["out"]), lambda n, v, k: (tile[v], n)))
        cost[0] += grid_traffic(grid, ops)
        step = 2 * p["tm"] * p["tn"] * p["tk"] + (2 * p["tn"] * (p["kp"] // 32) * (p["tk"] // 2) if mxfp4 else 0)
        if fp8:  # the exponents spread over the tile: two one-hot products, the cheaper order
            (nb, kb), tn, tk = p["ins"][2][0][1:], p["tn"], p["tk"]
            step += 2 * min(tn * kb * (nb + tk), nb * tk * (kb + tn))
        cost[1] += grid[0] * int(used[0]) * grid[2] * n_w * step  # used visits only
    return cost[0], cost[1]


def call_time(nbytes: float, flops: float, gen: str) -> dict:
    """A kernel call's roofline on one `gen` device: the slower of streaming its bytes from HBM
    and issuing its FLOPs on the MXU."""
    dev = device(gen)
    hbm_us, mxu_us = 1e6 * nbytes / dev["hbm"], 1e6 * flops / dev["flops"]
    return dict(hbm_us=hbm_us, mxu_us=mxu_us, expected_us=max(hbm_us, mxu_us), bound="HBM" if hbm_us >= mxu_us else "MXU")


def kernel_rows(cfg) -> list[dict]:
    """Each tpu_budget case at cfg's shapes: bytes, FLOPs and per generation the expected time."""
    rows = []
    for name, (fn, args) in kernel_shapes(cfg, FP8_BLOCKS[cfg.name]).items():
        module, mxfp4 = getattr(fn, "func", fn).__module__, getattr(fn, "keywords", {}).get("mxfp4", False)
        fp8 = getattr(fn, "keywords", {}).get("fp8")
        per_gen = {}
        for gen in GENERATIONS:
            if module == tpu_attention.__name__:
                nbytes, flops = attention_cost(*args, gen=gen)
            elif module == tpu_index_scores.__name__:
                nbytes, flops = index_scores_cost(*args, gen=gen)
            else:
                nbytes, flops = grouped_ffn_cost(*args, gen=gen, mxfp4=mxfp4, experts=cfg.n_routed_experts // EP,
                                                 fp8=fp8)
            per_gen[gen] = dict(mbytes=nbytes / 1e6, gflop=flops / 1e9, **call_time(nbytes, flops, gen))
        rows.append(dict(kernel=name, shape=", ".join(map(str, args)), **per_gen))
    return rows


def attention_core_flops(cfg, context: int) -> float:
    """FLOPs of one token's attention core over all layers at `context` (QK and PV of the
    window and each layer's compressed entries or CSA top-k; the indexer's scores)."""
    h, d, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    total = 0.0
    for layer in cfg.layers:
        keys = w + (cfg.index_topk if layer.attention == CSA else
                    context // cfg.compress_rate_hca if layer.attention == HCA else 0)
        total += 4 * h * d * keys
        if layer.attention == CSA:
            total += 2 * cfg.index_n_heads * (cfg.index_head_dim + 1) * (context // cfg.compress_rate_csa)
    return total


def decode_step_rows(cfg, batches=(8, 256), context: int = 8192) -> list[dict]:
    """One decode step per device on each generation's 8-device slice (mesh expert=8)."""
    stored, groups, params = weight_specs(cfg, jnp.bfloat16, "resident")[0], {}, {}
    for path, spec in spec_leaves(stored):
        groups[weight_group(path)] = groups.get(weight_group(path), 0) + spec.nbytes
    for path, spec in spec_leaves(weight_specs(cfg, jnp.bfloat16)[0]):
        params[weight_group(path)] = params.get(weight_group(path), 0) + math.prod(spec.shape)
    e, k, dim = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    dense = sum(v for g, v in groups.items() if g not in ("routed_experts", "embed"))
    held = dense + groups["embed"] + groups["routed_experts"] / EP
    flops_token = (2 * sum(v for g, v in params.items() if g not in ("routed_experts", "embed"))
                   + 2 * params["routed_experts"] * k / e + attention_core_flops(cfg, context))
    moe_layers = len(cfg.layers)
    out = []
    for batch in batches:
        local = batch // EP
        cache = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache_shapes(cfg, local, context, jnp.bfloat16)))
        experts = groups["routed_experts"] / EP * (1 - (1 - k / e) ** batch)
        nbytes = dense + experts + cache + local * groups["embed"] / cfg.vocab_size
        ici_bytes = 2 * moe_layers * local * k * (EP - 1) / EP * dim * 2  # bf16 rows there and back
        for gen in GENERATIONS:
            dev = device(gen)
            hbm_ms, mxu_ms = 1e3 * nbytes / dev["hbm"], 1e3 * local * flops_token / dev["flops"]
            ici_ms = 1e3 * ici_bytes / dev["ici"]
            step = max(hbm_ms, mxu_ms) + ici_ms
            out.append(dict(slice=f"{gen}-8", batch=batch, context=context, gbytes_per_device=nbytes / 1e9,
                            gflop_per_device=local * flops_token / 1e9, hbm_ms=hbm_ms, mxu_ms=mxu_ms, ici_ms=ici_ms,
                            expected_ms=step, tokens_per_s=batch / step * 1e3,
                            held_gib_per_device=(held + cache) / 2**30, fits=held + cache <= dev["hbm_bytes"]))
    return out


@functools.cache
def roofline(model: str = "v4-flash") -> dict:
    cfg = load_config(model)
    return {"model": model, "note": "paper roofline: no TPU has run these kernels (benchmarks/tpu_roofline.py)",
            "chips": {g: dict(CHIPS[g]) for g in GENERATIONS}, "kernels": kernel_rows(cfg),
            "decode_step": decode_step_rows(cfg)}


def main() -> None:
    result = roofline()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(roofline_tables(result)))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
