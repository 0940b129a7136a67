"""Checkpoint tensor names for every dsjax weight.

V4 checkpoints come with three spellings of the same tensors:
  * DeepSeek's original (the hub release): `embed.weight`, `layers.L.attn.wq_a.weight`,
    `layers.L.ffn.experts.E.w1.weight`, `hc_head_fn`, `head.weight`, ...;
  * what `transformers` 5.x `save_pretrained` writes: the original names under a `model.`
    prefix, with `model.embed_tokens.weight` and `model.hc_head.hc_fn`;
  * HF's in-memory names (`model.layers.L.self_attn.q_a_proj.weight`, fused
    `mlp.experts.gate_up_proj [E, 2I, D]`), which other tools save.
`canonical_name` maps all three onto the original spelling; `weight_names` says which
canonical tensor each dsjax weight comes from, per layer (`layers.L.*`); the decoder stores
a layer run's weights stacked (`blocks.K.J.*`, leading [repeats] axis), and
`per_layer_paths` says which per-layer weights a stacked one stacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsjax.config import HASH_MOE, SLIDING, TOPK_MOE, LayerSpec, ModelConfig

# Applied in order; each is a no-op on names already in the original spelling.
_TO_ORIGINAL = [(re.compile(p), r) for p, r in (
    (r"^model\.", ""),
    (r"\.weight_scale_inv$", ".scale"),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)]


def canonical_name(name: str) -> str:
    for pattern, replacement in _TO_ORIGINAL:
        name = pattern.sub(replacement, name)
    return name


@dataclass(frozen=True)
class Source:
    """Where a dsjax weight comes from. `expert` names a routed-expert projection: the
    per-expert tensors `{name}.{e}.{expert}.weight` stacked over e, or HF's fused
    `{name}.gate_up_proj` (w1 rows, then w3 rows) / `{name}.down_proj`."""

    name: str
    expert: str | None = None  # "w1" | "w2" | "w3"

    def candidates(self, n_experts: int) -> list[str]:
        if self.expert is None:
            return [self.name]
        fused = "down_proj" if self.expert == "w2" else "gate_up_proj"
        return [f"{self.name}.{e}.{self.expert}.weight" for e in range(n_experts)] + [f"{self.name}.{fused}"]


def _hyper_connection(ours: str, theirs: str) -> dict[str, Source]:
    return {f"{ours}.{k}": Source(f"{theirs}_{k}") for k in ("fn", "base", "scale")}


def _compressor(ours: str, theirs: str) -> dict[str, Source]:
    return {
        f"{ours}.kv_proj": Source(f"{theirs}.wkv.weight"),
        f"{ours}.gate_proj": Source(f"{theirs}.wgate.weight"),
        f"{ours}.position_bias": Source(f"{theirs}.ape"),
        f"{ours}.kv_norm": Source(f"{theirs}.norm.weight"),
    }


def _block_common(ours: str, theirs: str) -> dict[str, Source]:
    """The tensors every V4 / V4.1 block has: mHC, norms, the attention projections and
    sinks, the router weight, routed and shared experts."""
    attn, ffn = f"{theirs}.attn", f"{theirs}.ffn"
    table = {}
    table.update(_hyper_connection(f"{ours}.attn_hc", f"{theirs}.hc_attn"))
    table.update(_hyper_connection(f"{ours}.ffn_hc", f"{theirs}.hc_ffn"))
    table[f"{ours}.attn_norm"] = Source(f"{theirs}.attn_norm.weight")
    table[f"{ours}.ffn_norm"] = Source(f"{theirs}.ffn_norm.weight")
    for k, v in (("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
                 ("kv_norm", "norm"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b")):  # V4.1's attn.kv_norm: .norm.
        table[f"{ours}.attn.{k}"] = Source(f"{attn}.{v}.weight")
    table[f"{ours}.attn.sinks"] = Source(f"{attn}.attn_sink")
    table[f"{ours}.moe.router"] = Source(f"{ffn}.gate.weight")
    for w in ("w1", "w2", "w3"):
        table[f"{ours}.moe.{w}"] = Source(f"{ffn}.experts", expert=w)
        table[f"{ours}.moe.shared_{w}"] = Source(f"{ffn}.shared_experts.{w}.weight")
    return table


def _block(ours: str, theirs: str, layer) -> dict[str, Source]:
    """One decoder block's tensors (a main layer, or the MTP layer's block)."""
    attn, ffn = f"{theirs}.attn", f"{theirs}.ffn"
    table = _block_common(ours, theirs)
    if layer.compress_ratio:
        table.update(_compressor(f"{ours}.attn.compressor", f"{attn}.compressor"))
    if layer.has_indexer:
        table.update(_compressor(f"{ours}.attn.indexer.compressor", f"{attn}.indexer.compressor"))
        table[f"{ours}.attn.indexer.q_b_proj"] = Source(f"{attn}.indexer.wq_b.weight")
        table[f"{ours}.attn.indexer.weights_proj"] = Source(f"{attn}.indexer.weights_proj.weight")
    if layer.mlp == HASH_MOE:
        table[f"{ours}.moe.tid2eid"] = Source(f"{ffn}.gate.tid2eid")
    else:
        table[f"{ours}.moe.router_bias"] = Source(f"{ffn}.gate.bias")
    return table


def _v41_block(ours: str, theirs: str, layer) -> dict[str, Source]:
    """One V4.1 block's tensors (spec deepseek-v41.md §8): a backbone layer's, or a DSpark
    stage's (`mtp.S`, window-only). Compressor, index-key and index-query tensors exist only
    on the layers that own those parts (`LayerSpec.sharing`)."""
    attn, ffn = f"{theirs}.attn", f"{theirs}.ffn"
    table = _block_common(ours, theirs)
    if layer.has_compressor:
        table[f"{ours}.attn.compressor.kv_proj"] = Source(f"{attn}.compressor.wkv.weight")
        table[f"{ours}.attn.compressor.norm"] = Source(f"{attn}.compressor.norm.weight")
        if layer.compress_ratio > 1:
            table[f"{ours}.attn.compressor.gate_proj"] = Source(f"{attn}.compressor.wgate.weight")
    if layer.compress_ratio and layer.has_index_keys:
        table[f"{ours}.attn.index_keys.k_proj"] = Source(f"{attn}.indexer.wk.weight")
        table[f"{ours}.attn.index_keys.k_norm"] = Source(f"{attn}.indexer.k_norm.weight")
    if layer.compress_ratio and layer.has_indexer:
        table[f"{ours}.attn.index_queries.q_b_proj"] = Source(f"{attn}.indexer.wq_b.weight")
        table[f"{ours}.attn.index_queries.weights_proj"] = Source(f"{attn}.indexer.weights_proj.weight")
    table[f"{ours}.moe.router_bias"] = Source(f"{ffn}.gate.bias")
    table[f"{ours}.moe.router_bias_vl"] = Source(f"{ffn}.gate.bias_vl")
    return table


def engram_table_name(layer: int) -> str:
    """The prefix of layer `layer`'s Engram table (`.weight` E4M3 rows, `.scale` E8M0): read
    from host memory by dsjax/checkpoint/engram_tables.py, never loaded as a device weight."""
    return f"layers.{layer}.engram.embed"


def _v41_weight_names(cfg: ModelConfig) -> dict[str, Source]:
    table = {"embed": Source("embed.weight"), "norm": Source("norm.weight")}
    if not cfg.tie_word_embeddings:
        table["lm_head"] = Source("head.weight")
    for layer in cfg.layers:
        table.update(_v41_block(f"layers.{layer.index}", f"layers.{layer.index}", layer))
    for k, layer in enumerate(cfg.engram.layer_ids if cfg.engram else ()):
        table[f"engram.{k}.wkv"] = Source(f"layers.{layer}.engram.wkv.weight")
        table[f"engram.{k}.q_weight"] = Source(f"layers.{layer}.engram.q_weight")
        table[f"engram.{k}.k_weight"] = Source(f"layers.{layer}.engram.k_weight")
    return table


def weight_names(cfg: ModelConfig) -> dict[str, Source]:
    """dsjax parameter path (as `dsjax.params.path_str` prints it) -> canonical tensor."""
    return _WEIGHT_NAMES[cfg.model_type](cfg)


def _v4_weight_names(cfg: ModelConfig) -> dict[str, Source]:
    table = {
        "embed": Source("embed.weight"),
        "norm": Source("norm.weight"),
        "hc_head.fn": Source("hc_head_fn"),
        "hc_head.base": Source("hc_head_base"),
        "hc_head.scale": Source("hc_head_scale"),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head"] = Source("head.weight")
    for layer in cfg.layers:
        table.update(_block(f"layers.{layer.index}", f"layers.{layer.index}", layer))
    return table


def per_layer_paths(cfg: ModelConfig, path: str) -> list[str] | None:
    """A stacked parameter path `blocks.K.J.<rest>` (run K, period position J) -> the
    `weight_names` paths `layers.L.<rest>` it stacks, in order; None for other paths."""
    stage = re.fullmatch(r"stages\.(.+)", path)  # V4.1's DSpark stages, stacked [n_stages]
    if stage is not None:
        return [f"stage.{s}.{stage.group(1)}" for s in range(cfg.num_nextn_predict_layers)]
    m = re.fullmatch(r"blocks\.(\d+)\.(\d+)\.(.+)", path)
    if m is None:
        return None
    run = cfg.layer_runs[int(m.group(1))]
    return [f"layers.{i}.{m.group(3)}" for i in run.indices[int(m.group(2))]]


def mtp_weight_names(cfg: ModelConfig) -> dict[str, Source]:
    """MTP-layer parameter path (dsjax.model.v4.mtp.MTPParams) -> canonical tensor (`mtp.0.*`);
    for V4.1 the DSpark head's (dsjax.model.v41.params.DSparkParams, `mtp.0..S`)."""
    return _DRAFTER_NAMES[cfg.model_type](cfg)


def _mtp_weight_names(cfg: ModelConfig) -> dict[str, Source]:
    table = {f"{k}": Source(f"mtp.0.{k}.weight") for k in ("e_proj", "h_proj", "enorm", "hnorm", "norm")}
    table.update({f"hc_head.{k}": Source(f"mtp.0.hc_head_{k}") for k in ("fn", "base", "scale")})
    table.update(_block("block", "mtp.0", cfg.mtp_layer))
    return table


def _dspark_weight_names(cfg: ModelConfig) -> dict[str, Source]:
    """DSpark (spec deepseek-v41.md §8): stages `mtp.S` are window-only V4.1 blocks; the
    extras live on the first and last stage."""
    n = cfg.num_nextn_predict_layers
    stage = LayerSpec(cfg.num_hidden_layers, SLIDING, 0, TOPK_MOE)
    table = {}
    for s in range(n):
        table.update(_v41_block(f"stage.{s}", f"mtp.{s}", stage))
    last = f"mtp.{n - 1}"
    table.update({"main_proj": Source("mtp.0.main_proj.weight"), "main_norm": Source("mtp.0.main_norm.weight"),
                  "norm": Source(f"{last}.norm.weight"), "markov_embed": Source(f"{last}.markov_head.embed.weight"),
                  "markov_head": Source(f"{last}.markov_head.head.weight"),
                  "confidence": Source(f"{last}.confidence_head.proj.weight")})
    return table


# Each generation's tables, by the config's model_type.
_WEIGHT_NAMES = {"deepseek_v4": _v4_weight_names, "deepseek_v41": _v41_weight_names}
_DRAFTER_NAMES = {"deepseek_v4": _mtp_weight_names, "deepseek_v41": _dspark_weight_names}

# Tensors a checkpoint may carry that the main model does not use: the MTP / DSpark drafter.
IGNORED_PREFIXES = ("mtp.",)
# V4.1's Engram tables: host memory, read by row (dsjax/checkpoint/engram_tables.py).
HOST_TABLE_MARK = ".engram.embed."
