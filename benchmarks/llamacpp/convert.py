"""A dsjax / HF-format V4 checkpoint -> GGUF (f32 or bf16), through llama.cpp's own converter.

    python benchmarks/llamacpp/convert.py --llama-src DIR --checkpoint CKPT --outtype f32|bf16 --out X.gguf

llama.cpp's DeepSeek-V4 converter (`conversion/deepseek.py`, `DeepseekV4Model`) reads the
hub release: original tensor names, FP4 routed experts it repacks to MXFP4, FP8 / bf16
elsewhere, the release's config keys (`compress_ratios`, `num_hash_layers`, `rope_scaling`)
and its tokenizer. What `transformers` 5.x `save_pretrained` writes (and dsjax loads) differs
only in spelling and in carrying full-precision experts, so this script:

  * writes a staging copy with the release's names (`dsjax.checkpoint.names.canonical_name`,
    then llama.cpp's `attn.kv_norm`) and config keys derived from the HF config (per-layer
    compress ratios from `layer_types`, the hash layers as the leading `hash_moe` run, the
    compressed layers' YaRN as `rope_scaling`);
  * runs the vendored converter with four methods of `DeepseekV4Model` replaced: the routed
    experts are stacked and written at the output type (f32 / bf16), not repacked to MXFP4;
    no tensor is forced to its source dtype (the outtype decides, with llama.cpp's usual
    exceptions: norms, 1-D tensors, the router and indexer projections stay f32; and the
    mHC mixes stay f32, as in the release and in dsjax's 16-bit weights); the file
    type is the outtype's; and the vocabulary is llama.cpp's "none" with the model's
    vocab_size dummy tokens (the benchmark feeds token ids; no tokenizer is involved).

Nothing else of the model changes: the same graph (src/models/deepseek4.cpp) runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

RATIO_KEY = {"sliding_attention": None, "compressed_sparse_attention": "compressed_sparse_attention",
             "heavily_compressed_attention": "heavily_compressed_attention"}


def release_config(hf: dict) -> dict:
    """The HF config plus the release's keys llama.cpp's converter reads."""
    rates = hf["compress_rates"]
    ratios = [0 if RATIO_KEY[t] is None else int(rates[RATIO_KEY[t]]) for t in hf["layer_types"]]
    kinds = hf["mlp_layer_types"]
    n_hash = next((i for i, k in enumerate(kinds) if k != "hash_moe"), len(kinds))
    if "hash_moe" in kinds[n_hash:]:
        raise ValueError("llama.cpp's V4 takes hash-routed layers only as the leading run")
    compress = hf["rope_parameters"]["compress"]
    out = dict(hf)
    out.update(compress_ratios=ratios, num_hash_layers=n_hash, num_nextn_predict_layers=0,
               rope_theta=hf["rope_parameters"]["main"]["rope_theta"],
               compress_rope_theta=compress["rope_theta"],
               rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": compress["factor"],
                             "original_max_position_embeddings": compress["original_max_position_embeddings"],
                             "beta_fast": compress["beta_fast"], "beta_slow": compress["beta_slow"]})
    return out


def release_name(name: str) -> str:
    from dsjax.checkpoint.names import canonical_name

    return re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", canonical_name(name))


def stage(checkpoint: Path, staging: Path) -> None:
    """A copy of the checkpoint with the release's tensor names and config keys."""
    from safetensors.torch import load_file, save_file

    staging.mkdir(parents=True, exist_ok=True)
    with open(checkpoint / "config.json") as f:
        hf = json.load(f)
    with open(staging / "config.json", "w") as f:
        json.dump(release_config(hf), f, indent=2)
    for src in sorted(checkpoint.glob("*.safetensors")):
        tensors = {release_name(k): v.contiguous() for k, v in load_file(src).items()}
        save_file(tensors, staging / src.name, metadata={"format": "pt"})
    if (checkpoint / "model.safetensors.index.json").exists():
        with open(checkpoint / "model.safetensors.index.json") as f:
            index = json.load(f)
        index["weight_map"] = {release_name(k): v for k, v in index["weight_map"].items()}
        with open(staging / "model.safetensors.index.json", "w") as f:
            json.dump(index, f)


def patch_converter(llama_src: Path):
    """Import the vendored converter and replace DeepseekV4Model's four methods (see the docstring)."""
    sys.path[:0] = [str(llama_src), str(llama_src / "gguf-py")]
    import convert_hf_to_gguf
    import gguf
    import torch
    from conversion.base import LazyTorchTensor, TextModel
    from conversion.deepseek import DeepseekV4Model

    experts = (("w1", gguf.MODEL_TENSOR.FFN_GATE_EXP), ("w2", gguf.MODEL_TENSOR.FFN_DOWN_EXP),
               ("w3", gguf.MODEL_TENSOR.FFN_UP_EXP))

    def generate_extra_tensors(self):
        consumed = self._write_hash_routing_tensors()
        for bid in range(self.block_count):
            for proj, key in experts:
                names = [f"layers.{bid}.ffn.experts.{e}.{proj}.weight" for e in range(self.hparams["n_routed_experts"])]
                data = torch.stack([LazyTorchTensor.to_eager(self.model_tensors[n]()) for n in names])
                consumed += names
                yield self.format_tensor_name(key, bid), data
        for name in consumed:
            del self.model_tensors[name]

    original_modify = DeepseekV4Model.modify_tensors

    def modify_tensors(self, data_torch, name, bid):
        if name.startswith("blk."):  # the stacked experts, already named
            return [(name, data_torch)]
        return original_modify(self, data_torch, name, bid)

    def set_vocab(self):
        self._set_vocab_none()
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    DeepseekV4Model.generate_extra_tensors = generate_extra_tensors
    DeepseekV4Model.modify_tensors = modify_tensors
    def tensor_force_quant(self, name, new_name, bid, n_dims):
        # the mHC mixes stay f32 (as in the release, and in dsjax's 16-bit weights)
        return gguf.GGMLQuantizationType.F32 if "hc_" in name else False

    DeepseekV4Model.tensor_force_quant = tensor_force_quant
    DeepseekV4Model.prepare_tensors = lambda self: TextModel.prepare_tensors(self)
    DeepseekV4Model.set_vocab = set_vocab
    return convert_hf_to_gguf


def convert(llama_src: Path, checkpoint: Path, outtype: str, out: Path, staging: Path | None = None) -> Path:
    staging = staging or out.parent / "staging"
    if not (staging / "config.json").exists():
        stage(checkpoint, staging)
    converter = patch_converter(llama_src)
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(staging), "--outtype", outtype, "--outfile", str(out)]
    try:
        converter.main()
    finally:
        sys.argv = argv
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-src", required=True, type=Path)
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--outtype", choices=("f32", "bf16"), required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--staging", type=Path, help="where the renamed copy goes (default: beside --out)")
    ap.add_argument("--fresh", action="store_true", help="rewrite the staging copy")
    args = ap.parse_args()
    if args.fresh and args.staging and args.staging.exists():
        shutil.rmtree(args.staging)
    convert(args.llama_src, args.checkpoint, args.outtype, args.out, args.staging)


if __name__ == "__main__":
    main()
