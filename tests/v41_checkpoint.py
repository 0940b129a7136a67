"""Tiny DeepSeek-V4.1 checkpoints in DeepSeek's original format (spec deepseek-v41.md §8),
quantised by this test suite's own quantizers (tests/quantized_checkpoint.py: FP8 E4M3 with
E8M0 scales on 32 x 32 tiles, MXFP4 routed experts), with Engram tables of E4M3 rows and one
E8M0 scale per 32 values, and an HF-form config.json with its quantization_config.

`expected_names` lists the tensors §8 says a V4.1 checkpoint holds, from the config's source
lists alone (not from dsjax's name table), so the test can hold the two against each other."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from dsjax.checkpoint.names import mtp_weight_names, per_layer_paths, weight_names
from dsjax.config import to_hf_dict
from dsjax.params import path_str
from quantized_checkpoint import fp8_block_quantize, mxfp4_quantize, write_shards

BLOCK = 32
FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
       "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
       "shared_experts.w3.weight", "engram.wkv.weight", "main_proj.weight")
F32 = ("hc_", "attn_sink", "gate.bias")  # gate.bias and gate.bias_vl


def _block_names(prefix: str, n_experts: int) -> set[str]:
    """A block's tensors without compressor / indexer (13 attention, 2 norms, 6 mHC, 3 gate,
    6 shared-expert and 6 per routed expert, counting scales)."""
    names = {f"{prefix}.attn.attn_sink", f"{prefix}.attn.q_norm.weight", f"{prefix}.attn.kv_norm.weight",
             f"{prefix}.attn_norm.weight", f"{prefix}.ffn_norm.weight", f"{prefix}.ffn.gate.weight",
             f"{prefix}.ffn.gate.bias", f"{prefix}.ffn.gate.bias_vl"}
    names |= {f"{prefix}.hc_{a}_{k}" for a in ("attn", "ffn") for k in ("fn", "base", "scale")}
    for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
        names |= {f"{prefix}.attn.{w}.weight", f"{prefix}.attn.{w}.scale"}
    for w in ("w1", "w2", "w3"):
        names |= {f"{prefix}.ffn.shared_experts.{w}.{p}" for p in ("weight", "scale")}
        names |= {f"{prefix}.ffn.experts.{e}.{w}.{p}" for e in range(n_experts) for p in ("weight", "scale")}
    return names


def expected_names(cfg) -> set[str]:
    """Every tensor of a V4.1 text checkpoint by §8, from the config's lists."""
    v = cfg.v41
    names = {"embed.weight", "head.weight", "norm.weight"}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}"
        names |= _block_names(p, cfg.n_routed_experts)
        if layer in v.kv_source_layers:
            names |= {f"{p}.attn.compressor.wkv.weight", f"{p}.attn.compressor.norm.weight",
                      f"{p}.attn.indexer.wk.weight", f"{p}.attn.indexer.k_norm.weight"}
            if v.compress_ratios[layer] == 2:
                names.add(f"{p}.attn.compressor.wgate.weight")
        if layer in v.index_source_layers:
            names |= {f"{p}.attn.indexer.wq_b.weight", f"{p}.attn.indexer.wq_b.scale",
                      f"{p}.attn.indexer.weights_proj.weight"}
        if v.engram and layer in v.engram.layer_ids:
            names |= {f"{p}.engram.embed.weight", f"{p}.engram.embed.scale", f"{p}.engram.wkv.weight",
                      f"{p}.engram.wkv.scale", f"{p}.engram.q_weight", f"{p}.engram.k_weight"}
    if v.dspark and cfg.num_nextn_predict_layers:
        last = f"mtp.{cfg.num_nextn_predict_layers - 1}"
        for s in range(cfg.num_nextn_predict_layers):
            names |= _block_names(f"mtp.{s}", v.dspark.n_routed_experts)
        names |= {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", f"{last}.norm.weight",
                  f"{last}.markov_head.embed.weight", f"{last}.markov_head.head.weight",
                  f"{last}.confidence_head.proj.weight"}
    return names


def _store(name: str, a: np.ndarray):
    """One tensor by (canonical) name -> ({hub name: array}, the values a loader reads back)."""
    a = np.asarray(a, np.float32)
    name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")  # the hub's spelling (§8)
    if name.endswith(FP8):
        q, s, deq = fp8_block_quantize(a, BLOCK)
        return {name: q, name[: -len("weight")] + "scale": s}, deq
    if ".experts." in name:
        q, s, deq = mxfp4_quantize(a)
        return {name: q, name[: -len("weight")] + "scale": s}, deq
    if any(m in name for m in F32):
        return {name: a}, a
    b = a.astype(ml_dtypes.bfloat16)
    return {name: b}, b.astype(np.float32)


def _tensors_of(tree, table, cfg):
    tensors = {}

    def leaf(path, a):
        a = np.asarray(a, np.float32)
        name = path_str(path)
        layers = per_layer_paths(cfg, name)
        parts = [(table[name], a, ())] if layers is None else [(table[q], a[r], (r,)) for r, q in enumerate(layers)]
        deq = np.empty(a.shape, np.float32)
        for src, x, at in parts:
            if src.expert is None:
                stored, deq[at] = _store(src.name, x)
                tensors.update(stored)
            else:
                for e in range(x.shape[0]):
                    stored, deq[(*at, e)] = _store(f"{src.name}.{e}.{src.expert}.weight", x[e])
                    tensors.update(stored)
        return deq

    return tensors, jax.tree_util.tree_map_with_path(leaf, tree)


def engram_table(rows: int, head_dim: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random rows stored as §5.5 says: (E4M3 [rows, hd], E8M0 [rows, hd / 32], dequantized f32)."""
    x = rng.normal(size=(rows, head_dim // 32, 32)).astype(np.float32)
    e = np.ceil(np.log2(np.abs(x).max(axis=-1) / 448.0)).astype(np.int32)
    q = (x / np.ldexp(np.float32(1), e)[..., None]).astype(ml_dtypes.float8_e4m3fn)
    deq = q.astype(np.float32) * np.ldexp(np.float32(1), e)[..., None]
    return (q.reshape(rows, head_dim), (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu),
            deq.reshape(rows, head_dim))


def random_weights(cfg, rng, perturb_dspark: bool = True):
    """Seeded backbone and DSpark params in fp32 with N(0, 0.05) noise added (so no weight is a
    plain initializer's), as the V4.1 checkpoint tests write them. -> (params, dspark)."""
    import jax.numpy as jnp

    from dsjax.model.v41.params import dspark_specs, v41_model_specs
    from dsjax.params import init_params

    def noisy(tree):
        return jax.tree.map(lambda a: a + 0.05 * rng.standard_normal(a.shape).astype(np.float32), tree)

    params = noisy(init_params(v41_model_specs(cfg, jnp.float32), seed=1))
    dspark = init_params(dspark_specs(cfg, jnp.float32), seed=2)
    return params, noisy(dspark) if perturb_dspark else dspark


def write(directory: Path, cfg, params, dspark, rng, shards: int = 3):
    """Write params (+ the DSpark head) and Engram tables -> (dequantized params, dequantized
    DSpark params, {Engram layer: dequantized table})."""
    tensors, deq = _tensors_of(params, weight_names(cfg), cfg)
    mtp_tensors, deq_dspark = _tensors_of(dspark, mtp_weight_names(cfg), cfg)
    tensors.update(mtp_tensors)
    tables = {}
    for layer, rows in zip(cfg.v41.engram.layer_ids, cfg.v41.engram.num_embeddings):
        q, s, tables[layer] = engram_table(rows, cfg.v41.engram.head_dim, rng)
        tensors[f"layers.{layer}.engram.embed.weight"], tensors[f"layers.{layer}.engram.embed.scale"] = q, s
    write_shards(directory, tensors, shards)
    config = to_hf_dict(cfg)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    (directory / "config.json").write_text(json.dumps(config))
    assert math.isfinite(sum(float(np.abs(t.astype(np.float32)).sum()) for t in tables.values()))
    return deq, deq_dspark, tables
