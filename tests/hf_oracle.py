"""The numerical oracle: tiny random HF `DeepseekV4ForCausalLM` models, saved with
`save_pretrained` so dsjax loads them exactly as it would a hub checkpoint.

HF's own init leaves sinks, position biases, router biases and mHC bases at zero and the
hash table all-zero, which would hide bugs in those mechanisms; `randomize` gives every
tensor a scale that keeps activations O(1).
"""

from __future__ import annotations

import math

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Three configs that together cover every layer type, hash and top-k MoE, hc_mult != 4,
# YaRN on compressed layers, batch > 1 and lengths off the compression grid.
BASE = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
    q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=16,
    index_n_heads=2, index_head_dim=16, index_topk=64, sliding_window=8, qk_rope_head_dim=8,
    rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    compress_rates={CSA: 4, HCA: 8}, eos_token_id=1, bos_token_id=0,
)
CONFIGS = {
    # all three attention types, one hash layer, hc_mult 3
    "mixed": dict(BASE, num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA], num_hash_layers=1, hc_mult=3),
    # a repeating schedule (2 x sliding/hash, 2 x (CSA, HCA)): the decoder's scanned layer runs
    "repeat": dict(BASE, num_hidden_layers=6, layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA], num_hash_layers=2,
                   hc_mult=3),
    # legacy keys (compress_ratios incl. the MTP entry, num_hash_layers), hc_mult 4, 2 hash layers;
    # HF's legacy path only knows ratios 0 / 4 / 128, so this one needs S > 128 for HCA entries
    "legacy": dict({k: v for k, v in BASE.items() if k not in ("compress_rates",)}, num_hidden_layers=3,
                   compress_ratios=[4, 128, 0, 0], num_hash_layers=2, hc_mult=4),
    # HCA-heavy, hc_mult 2, more experts, sigmoid-free topk layers only
    "hca": dict(BASE, num_hidden_layers=3, layer_types=[HCA, SLIDING, CSA], num_hash_layers=0, hc_mult=2,
                n_routed_experts=16, num_experts_per_tok=3, sliding_window=5, compress_rates={CSA: 4, HCA: 4}),
}


def make_config(name: str, **overrides) -> DeepseekV4Config:
    return DeepseekV4Config(**{**CONFIGS[name], **overrides})


@torch.no_grad()
def randomize(model: DeepseekV4ForCausalLM, seed: int = 0) -> DeepseekV4ForCausalLM:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif leaf in ("sinks", "position_bias"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif leaf in ("base", "hc_base"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif leaf in ("scale", "hc_scale"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif leaf in ("fn", "hc_fn"):
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * 4)
        else:  # projections [out, in] / experts [E, out, in]
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
        elif name.endswith("tid2eid"):
            rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                    for _ in range(b.shape[0])]
            b.copy_(torch.stack(rows))
    return model


def build(name: str, seed: int = 0, dtype=torch.float32, **overrides) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(make_config(name, **overrides)).eval()
    return randomize(model, seed).to(dtype)


def save(model: DeepseekV4ForCausalLM, directory, **kwargs) -> None:
    model.save_pretrained(directory, **kwargs)


@torch.no_grad()
def hf_logits(model, ids) -> "torch.Tensor":
    return model(torch.as_tensor(ids), use_cache=False).logits.float()
