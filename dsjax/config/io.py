"""Reading and writing model configs: HF `config.json` (`from_hf_dict` / `to_hf_dict`),
the legacy keys older checkpoints ship (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `compress_rate_csa/hca`, a flat yarn `rope_scaling` /
`rope_parameters`), config JSON files, and the named configs (`tiny`, `small`, `v4-flash`,
`v4-pro`: JSON files in `configs/` in the same HF form). The schema and its validation are
dsjax/config/schema.py; everything here ends in a `ModelConfig(...)` that validates itself.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

from dsjax.config.schema import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ConfigError, ModelConfig, RopeConfig

_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


# Fields copied 1:1 between HF config.json and ModelConfig.
_HF_SCALAR_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
    "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "n_shared_experts", "scoring_func", "norm_topk_prob",
    "routed_scaling_factor", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "rms_norm_eps", "max_position_embeddings", "num_nextn_predict_layers",
    "tie_word_embeddings", "bos_token_id", "pad_token_id",
)
# Sizes with no sensible default: a config.json without them is rejected.
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
             "q_lora_rank", "o_groups", "o_lora_rank")
# HF bookkeeping keys that carry no model semantics.
_IGNORED = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "attention_bias", "attention_dropout", "mlp_bias", "hidden_act",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "topk_method",
    "quantization_config", "quantization", "auto_map", "first_k_dense_replace", "n_group",
    "topk_group", "kv_lora_rank", "qk_nope_head_dim", "pretraining_tp", "rope_interleave",
    "intermediate_size", "compress_rope_parameters", "expert_dtype", "_name_or_path",
    "num_key_value_heads", "partial_rotary_factor", "rope_theta", "compress_rope_theta",
    "rope_scaling", "rope_parameters", "compress_rates", "compress_ratios", "compress_rate_csa",
    "compress_rate_hca", "num_hash_layers", "layer_types", "mlp_layer_types", "eos_token_id",
    "id2label", "label2id", "return_dict", "output_attentions", "output_hidden_states",
    "tie_encoder_decoder", "is_encoder_decoder", "chunk_size_feed_forward", "problem_type",
}


def from_hf_dict(raw: dict[str, Any], *, name: str = "custom") -> ModelConfig:
    """An HF `config.json` dict (current or legacy keys) -> a validated ModelConfig."""
    raw = dict(raw)
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"field 'model_type': expected 'deepseek_v4', got {raw['model_type']!r}")
    for key in _REQUIRED:
        if raw.get(key) is None:
            raise ConfigError(f"field '{key}' is missing")
    unknown = sorted(k for k in raw if k not in _IGNORED and k not in _HF_SCALAR_FIELDS)
    if unknown:
        warnings.warn(f"config fields not used by dsjax (ignored): {unknown}", stacklevel=3)
    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError(
            f"field 'num_key_value_heads': DeepSeek-V4 has one shared KV head, got {raw['num_key_value_heads']}")

    n = _int(raw, "num_hidden_layers")
    head_dim = _int(raw, "head_dim")
    kw: dict[str, Any] = {k: raw[k] for k in _HF_SCALAR_FIELDS if k in raw and raw[k] is not None}
    kw["pad_token_id"] = raw.get("pad_token_id")

    # compress rates: dict, then legacy scalar overrides
    rates = raw.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"field 'compress_rates': expected a dict {{layer type: ratio}}, got {rates!r}")
    kw["compress_rate_csa"] = raw.get("compress_rate_csa", rates.get(CSA, 4))
    kw["compress_rate_hca"] = raw.get("compress_rate_hca", rates.get(HCA, 128))

    # layer types: explicit > legacy per-layer compress_ratios > HF's V4-Pro default
    layer_types = raw.get("layer_types")
    if layer_types is None and raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, (list, tuple)):
            raise ConfigError(f"field 'compress_ratios': expected a list of ints, got {ratios!r}")
        by_ratio = {0: SLIDING, kw["compress_rate_csa"]: CSA, kw["compress_rate_hca"]: HCA, **_RATIO_TO_LAYER_TYPE}
        bad = [r for r in ratios if r not in by_ratio]
        if bad:
            raise ConfigError(f"field 'compress_ratios': entries must be one of {sorted(by_ratio)}, got {bad}")
        layer_types = [by_ratio[r] for r in ratios]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if not isinstance(layer_types, (list, tuple)):
        raise ConfigError(f"field 'layer_types': expected a list, got {layer_types!r}")
    # legacy compress_ratios lists carry the MTP layer's entry too; keep the decoder layers
    kw["layer_types"] = tuple(layer_types[:n]) if raw.get("layer_types") is None else tuple(layer_types)

    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        n_hash = raw.get("num_hash_layers", 3)
        if not isinstance(n_hash, int) or n_hash < 0:
            raise ConfigError(f"field 'num_hash_layers': expected an int >= 0, got {n_hash!r}")
        mlp = [HASH_MOE] * min(n, n_hash) + [TOPK_MOE] * max(0, n - n_hash)
    if not isinstance(mlp, (list, tuple)):
        raise ConfigError(f"field 'mlp_layer_types': expected a list, got {mlp!r}")
    kw["mlp_layer_types"] = tuple(mlp)

    # partial rope: qk_rope_head_dim (legacy) or partial_rotary_factor
    if raw.get("qk_rope_head_dim") is None:
        factor = raw.get("partial_rotary_factor") or 0.125
        kw["qk_rope_head_dim"] = int(head_dim * factor)

    kw["rope_main"], kw["rope_compress"] = _parse_rope(raw)

    eos = raw.get("eos_token_id", 1)
    kw["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelConfig(name=name, **kw)


def _parse_rope(raw: dict) -> tuple[RopeConfig, RopeConfig]:
    """Both rope types from the nested HF form or the flat legacy yarn dicts."""
    main_theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"field 'rope_parameters': expected a dict, got {params!r}")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main = _rope_from_dict(params["main"], main_theta, "rope_parameters.main", compress=False)
        compress = _rope_from_dict(params["compress"], compress_theta, "rope_parameters.compress", compress=True)
        return main, compress
    # flat form: it is the compressed layers' scaling; window-only layers use plain RoPE
    flat = {k: v for k, v in params.items() if k not in ("main", "compress", "rope_theta")}
    return RopeConfig(theta=main_theta), _rope_from_dict(flat, compress_theta, "rope_parameters", compress=True)


def _rope_from_dict(d: dict, default_theta: float, where: str, *, compress: bool) -> RopeConfig:
    kind = d.get("rope_type", d.get("type", "default"))
    theta = float(d.get("rope_theta", default_theta))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ConfigError(f"field '{where}.rope_type': dsjax supports 'default' and 'yarn', got {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if d.get(key) is None:
            raise ConfigError(f"field '{where}.{key}' is missing (needed for yarn)")
    factor = float(d["factor"])
    att = d.get("attention_factor")
    if att is None:
        # HF forces 1.0 on compressed layers (the V4 reference applies no mscale);
        # elsewhere YaRN's usual 0.1*ln(factor)+1.
        att = 1.0 if compress or factor <= 1 else 0.1 * math.log(factor) + 1.0
    return RopeConfig(
        theta=theta, scaling="yarn", factor=factor,
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
        attention_factor=float(att))


def _int(raw: dict, key: str) -> int:
    v = raw[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"field '{key}': expected an int, got {v!r}")
    return v


# ----------------------------------------------------------------------------- named configs
def configs_dir() -> Path:
    """`configs/` of a source checkout / editable install, else the wheel's data dir."""
    for candidate in (Path(__file__).resolve().parents[2] / "configs",
                      Path(sys.prefix) / "share" / "dsjax" / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("dsjax named configs not found (expected a configs/ directory)")


def named_configs() -> list[str]:
    try:
        return sorted(p.stem for p in configs_dir().glob("*.json"))
    except FileNotFoundError:
        return []


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A named config (`tiny`, `v4-flash`, `v4-pro`), a JSON file, or a checkpoint directory."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p.parent}: no config.json in this directory")
        return from_json(p)
    if p.suffix == ".json" and p.is_file():
        return from_json(p)
    named = configs_dir() / f"{name_or_path}.json"
    if named.is_file():
        return from_json(named)
    raise FileNotFoundError(
        f"{str(name_or_path)!r} is neither a checkpoint directory, a config JSON file, nor a named config "
        f"(named configs: {', '.join(named_configs())})")


def from_json(path: str | Path) -> ModelConfig:
    """A config JSON file (HF `config.json` form); errors name the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return from_hf_dict(raw, name=path.stem if path.name != "config.json" else path.parent.name)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config in HF `config.json` form (what `from_hf_dict` reads back)."""

    def rope_dict(r: RopeConfig) -> dict:
        d = {"rope_type": r.scaling, "rope_theta": r.theta,
             "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim}
        if r.scaling == "yarn":
            d.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                     beta_fast=r.beta_fast, beta_slow=r.beta_slow, attention_factor=r.attention_factor)
        return d

    out = {k: getattr(cfg, k) for k in _HF_SCALAR_FIELDS}
    out.update(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        layer_types=list(cfg.layer_types), mlp_layer_types=list(cfg.mlp_layer_types),
        compress_rates={CSA: cfg.compress_rate_csa, HCA: cfg.compress_rate_hca},
        rope_theta=cfg.rope_main.theta, compress_rope_theta=cfg.rope_compress.theta,
        rope_parameters={"main": rope_dict(cfg.rope_main), "compress": rope_dict(cfg.rope_compress)},
        partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim, num_key_value_heads=1,
        eos_token_id=list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0],
    )
    return out
