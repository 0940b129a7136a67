"""Tiny checkpoints in DeepSeek's original naming, FP8 / MXFP4 quantized by this test
suite's own quantizer (written from the format description, independent of dsjax's
decoder), sharded over several files with an index."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np

from dsjax.checkpoint import SafetensorsFile, write_safetensors
from dsjax.checkpoint.names import canonical_name

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FP8_NAMES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
             "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
             "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")


def fp8_block_quantize(w, block):
    """-> (e4m3 values, e8m0 scales, dequantized float32)."""
    out, inn = w.shape
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    exps = np.zeros((math.ceil(out / block), math.ceil(inn / block)), np.uint8)
    deq = np.zeros(w.shape, np.float32)
    for i in range(exps.shape[0]):
        for j in range(exps.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            e = math.ceil(math.log2(max(float(np.abs(tile).max()), 1e-30) / 448.0))
            scale = 2.0 ** e
            qt = (tile / scale).astype(ml_dtypes.float8_e4m3fn)
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt
            exps[i, j] = e + 127
            deq[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt.astype(np.float32) * scale
    return q, exps.view(ml_dtypes.float8_e8m0fnu), deq


def mxfp4_quantize(w):
    """[out, in] -> (int8 [out, in/2] low nibble first, e8m0 [out, in/32], dequantized)."""
    out, inn = w.shape
    packed = np.zeros((out, inn // 2), np.uint8)
    exps = np.zeros((out, inn // 32), np.uint8)
    deq = np.zeros(w.shape, np.float32)
    for r in range(out):
        for g in range(inn // 32):
            vals = w[r, g * 32:(g + 1) * 32]
            e = math.ceil(math.log2(max(float(np.abs(vals).max()), 1e-30) / 6.0))
            exps[r, g] = e + 127
            for k, v in enumerate(vals):
                x = abs(float(v)) / 2.0 ** e
                code = min(range(8), key=lambda c: (abs(FP4_VALUES[c] - x), c % 2))  # nearest, ties to even
                sign = 8 if v < 0 and code else 0
                col = g * 32 + k
                nibble = code | sign
                packed[r, col // 2] |= nibble if col % 2 == 0 else nibble << 4
                deq[r, col] = (-1 if sign else 1) * FP4_VALUES[code] * 2.0 ** e
    return packed.view(np.int8), exps.view(ml_dtypes.float8_e8m0fnu), deq


def original_state(hf_model) -> dict[str, np.ndarray]:
    """HF in-memory weights -> DeepSeek's original names (per-expert w1 / w2 / w3)."""
    out = {}
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy() if t.is_floating_point() else t.numpy()
        canon = canonical_name(name)
        if canon.endswith("experts.gate_up_proj"):
            i = a.shape[1] // 2
            for e in range(a.shape[0]):
                out[canon.replace("gate_up_proj", f"{e}.w1.weight")] = a[e, :i]
                out[canon.replace("gate_up_proj", f"{e}.w3.weight")] = a[e, i:]
        elif canon.endswith("experts.down_proj"):
            for e in range(a.shape[0]):
                out[canon.replace("down_proj", f"{e}.w2.weight")] = a[e]
        else:
            out[canon] = a
    return out


def mtp_state(cfg, seed: int = 7) -> dict[str, np.ndarray]:
    """Random MTP-layer tensors (`mtp.0.*`) in the original naming, for a dsjax config."""
    from dsjax.checkpoint.names import mtp_weight_names
    from dsjax.model import mtp_specs
    from dsjax.params import spec_leaves

    rng = np.random.default_rng(seed)
    table, out = mtp_weight_names(cfg), {}
    for path, spec in spec_leaves(mtp_specs(cfg, np.float32)):
        src = table[path]
        if np.issubdtype(np.dtype(spec.dtype), np.integer):
            continue
        values = (rng.normal(size=spec.shape) / np.sqrt(spec.shape[-1])).astype(np.float32)
        if src.expert is None:
            out[src.name] = values
        else:
            for e in range(spec.shape[0]):
                out[f"{src.name}.{e}.{src.expert}.weight"] = values[e]
    return out


def write_shards(directory, tensors: dict[str, np.ndarray], shards: int) -> None:
    """Tensors over `shards` files (round-robin by name) with a safetensors index."""
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write(hf_model, directory, block: int = 32, shards: int = 3, mtp_cfg=None) -> dict[str, np.ndarray]:
    """Write the quantized checkpoint (with an MTP layer when `mtp_cfg`, a dsjax config, is
    given); return the dequantized weights under HF's in-memory names (what the HF oracle
    must run with) and, under "mtp.0.*" keys, the MTP layer's."""
    state = original_state(hf_model)
    if mtp_cfg is not None:
        state.update(mtp_state(mtp_cfg))
    tensors, dequantized = {}, {}
    for name, a in state.items():
        if name.endswith(FP8_NAMES):
            q, s, deq = fp8_block_quantize(a, block)
            tensors[name], tensors[name[:-len("weight")] + "scale"] = q, s
        elif ".experts." in name:
            q, s, deq = mxfp4_quantize(a)
            tensors[name], tensors[name[:-len("weight")] + "scale"] = q, s
        else:
            tensors[name] = a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 and a.ndim == 2 and \
                name in ("embed.weight", "head.weight") else a
            deq = np.asarray(tensors[name], np.float32) if a.dtype != np.int64 else a
        dequantized[name] = deq
    write_shards(directory, tensors, shards)
    config = hf_model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "activation_scheme": "dynamic", "weight_block_size": [block, block],
                                     "expert_dtype": "fp4"}
    (directory / "config.json").write_text(json.dumps(config))
    out = _to_hf_names(hf_model, dequantized)
    out.update({k: v for k, v in dequantized.items() if k.startswith("mtp.")})
    return out


def _to_hf_names(hf_model, original: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, t in hf_model.state_dict().items():
        canon = canonical_name(name)
        if canon.endswith("experts.gate_up_proj"):
            e = t.shape[0]
            out[name] = np.stack([np.concatenate([original[canon.replace("gate_up_proj", f"{i}.w1.weight")],
                                                  original[canon.replace("gate_up_proj", f"{i}.w3.weight")]])
                                  for i in range(e)])
        elif canon.endswith("experts.down_proj"):
            out[name] = np.stack([original[canon.replace("down_proj", f"{i}.w2.weight")] for i in range(t.shape[0])])
        else:
            out[name] = original[canon]
    return out


def edit_tensors(directory, tensor, fn) -> str:
    """Rewrite the shard of a checkpoint directory that holds `tensor`: fn(tensors) edits its
    {name: array} in place (pop, replace); the index follows. -> the shard's file name."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    fname = index[tensor]
    f = SafetensorsFile(directory / fname)
    tensors = {n: np.array(f.read(n)) for n in f.tensors}
    f.close()
    fn(tensors)
    write_safetensors(directory / fname, tensors)
    index = {k: v for k, v in index.items() if v != fname or k in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return fname
