"""Reading and writing model configs: HF `config.json` (`from_hf_dict` / `to_hf_dict`),
V4.1's HF form and DeepSeek's flat `inference/config.json` (`from_flat_v41` /
`to_flat_v41`), the legacy keys older checkpoints ship (`compress_ratios`, `num_hash_layers`,
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

from dsjax.config.layer_plan import HASH_MOE
from dsjax.config.schema import (CSA, HCA, SLIDING, TOPK_MOE, ConfigError, DSparkConfig, EngramConfig,
                                 ModelConfig, RopeConfig, V41Config)

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
    "description",  # a named config's note on what it is for (configs/*-1gpu.json)
}


def from_hf_dict(raw: dict[str, Any], *, name: str = "custom") -> ModelConfig:
    """An HF `config.json` dict (current or legacy keys; V4.1's HF form with `text_config`, or
    DeepSeek's flat V4.1 `inference/config.json`) -> a validated ModelConfig."""
    raw = dict(raw)
    if is_flat_v41(raw):
        return from_flat_v41(raw, name=name)
    if raw.get("model_type") == "deepseek_v41":
        flat, extras = _v41_hf_to_flat(raw)
        return from_flat_v41(flat, name=name, extras=extras)
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"field 'model_type': expected 'deepseek_v4' or 'deepseek_v41', got {raw['model_type']!r}")
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
    if cfg.v41 is not None:
        return _to_hf_v41(cfg)

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


# ----------------------------------------------------------------------------- DeepSeek-V4.1
# The HF config.json of V4.1 nests the text model under `text_config` with these renames of
# DeepSeek's flat `inference/config.json` names (spec deepseek-v41.md §1.1); every other key
# has the same name in both.
_V41_HF_TO_FLAT = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "moe_intermediate_size": "moe_inter_dim",
    "num_attention_heads": "n_heads", "qk_rope_head_dim": "rope_head_dim", "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size", "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id", "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
_V41_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                 "compress_ratios", "kv_source_layers", "index_source_layers")
# Flat keys that size runtime buffers or other towers, not the text model.
_V41_FLAT_IGNORED = {"max_batch_size", "max_seq_len", "dtype", "expert_dtype", "scale_fmt", "image_token_id",
                     "description"}
_V41_HF_IGNORED = {"num_key_value_heads", "topk_method", "hidden_act", "rope_scaling", "model_type", "architectures",
                   "transformers_version", "torch_dtype", "dtype", "tie_word_embeddings", "max_position_embeddings",
                   "quantization_config", "vision_config", "bos_token_id", "eos_token_id", "pad_token_id",
                   "text_config", "use_cache", "initializer_range", "_name_or_path"}


def is_flat_v41(raw: dict) -> bool:
    """DeepSeek's flat `inference/config.json` (V4.1: `dim`, `n_layers`, `kv_source_layers`)."""
    return "dim" in raw and "n_layers" in raw and "model_type" not in raw


def _v41_hf_to_flat(raw: dict) -> tuple[dict, dict]:
    """An HF V4.1 config.json -> (DeepSeek's flat names, root extras: token ids, max positions)."""
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"field 'text_config': expected a dict, got {type(text).__name__}")
    if text.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"field 'text_config.num_key_value_heads': V4.1 has one shared KV head, "
                          f"got {text['num_key_value_heads']}")
    flat = {_V41_HF_TO_FLAT.get(k, k): v for k, v in text.items() if k not in _V41_HF_IGNORED}
    rope = text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"field 'text_config.rope_scaling': expected a dict, got {rope!r}")
    for hf, fl in (("factor", "rope_factor"), ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                   ("original_max_position_embeddings", "original_seq_len")):
        if hf in rope:
            flat[fl] = rope[hf]
    extras = {k: raw.get(k, text.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                    "max_position_embeddings", "tie_word_embeddings")}
    extras["image_token_id"] = raw.get("image_token_id", text.get("image_token_id"))
    return flat, extras


def from_flat_v41(flat: dict, *, name: str = "custom", extras: dict | None = None) -> ModelConfig:
    """DeepSeek's flat V4.1 `inference/config.json` (or an HF one mapped onto its names) ->
    a validated ModelConfig with `v41` set. Missing optional fields take the reference's values."""
    extras = extras or {}
    for key in _V41_REQUIRED:
        if flat.get(key) is None:
            raise ConfigError(f"field '{key}' is missing")
    n = _int(flat, "n_layers")
    ratios = flat["compress_ratios"]
    if not isinstance(ratios, (list, tuple)) or len(ratios) < n:
        raise ConfigError(f"field 'compress_ratios': expected a list of at least n_layers ({n}) ints, got {ratios!r}")
    ratios = tuple(ratios[:n])  # DeepSeek's list also covers the DSpark stages (ratio 0)
    g = flat.get
    engram = None
    if g("engram_layer_ids"):
        engram = EngramConfig(
            layer_ids=tuple(g("engram_layer_ids")), num_embeddings=tuple(g("engram_num_embeddings") or ()),
            max_ngram_size=g("engram_max_ngram_size", 4), vocab_size=g("engram_vocab_size", 16000000),
            n_heads=g("engram_n_heads", 8), head_dim=g("engram_head_dim", 256), pad_id=g("engram_pad_id", 2),
            compressed_vocab_size=g("engram_compressed_vocab_size", 99092))
    dspark = None
    if g("dspark_target_layer_ids"):
        dspark = DSparkConfig(
            block_size=g("dspark_block_size", 5), noise_token_id=g("dspark_noise_token_id", 128799),
            target_layer_ids=tuple(g("dspark_target_layer_ids")), markov_rank=g("dspark_markov_rank", 256),
            n_routed_experts=g("dspark_n_routed_experts", 128), n_activated_experts=g("dspark_n_activated_experts", 3))
    v41 = V41Config(
        compress_ratios=ratios, kv_source_layers=tuple(flat["kv_source_layers"]),
        index_source_layers=tuple(flat["index_source_layers"]), candidate_source_layer=g("candidate_source_layer"),
        candidate_topk_blocks=g("candidate_topk_blocks", 2048), candidate_block_size=g("candidate_block_size", 8),
        gate_temp=float(g("gate_temp", 1.0)),
        image_token_id=extras.get("image_token_id") if extras.get("image_token_id") is not None
        else g("image_token_id"), engram=engram, dspark=dspark)
    known = set(_V41_REQUIRED) | _V41_FLAT_IGNORED | set(_V41_FLAT_TO_FIELD) | {
        "rope_theta", "compress_rope_theta", "rope_factor", "original_seq_len", "beta_fast", "beta_slow",
        "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "gate_temp", "n_mtp_layers",
        "norm_topk_prob", "vocab_size"}
    unknown = sorted(k for k in flat if k not in known and not k.startswith(("engram_", "dspark_", "vision_")))
    if unknown:
        warnings.warn(f"config fields not used by dsjax (ignored): {unknown}", stacklevel=3)
    kw = {field: flat[key] for key, field in _V41_FLAT_TO_FIELD.items() if flat.get(key) is not None}
    compress = RopeConfig(theta=float(g("compress_rope_theta", 160000.0)))
    if g("rope_factor", 1) != 1:  # YaRN without mscale: the attention scale stays head_dim^-1/2 (§2.1)
        compress = RopeConfig(theta=compress.theta, scaling="yarn", factor=float(g("rope_factor")),
                              original_max_position_embeddings=int(g("original_seq_len", 65536)),
                              beta_fast=float(g("beta_fast", 32)), beta_slow=float(g("beta_slow", 1)))
    eos = extras.get("eos_token_id", 1)
    eos = 1 if eos is None else eos
    return ModelConfig(
        name=name, **kw, vocab_size=_int(flat, "vocab_size"),
        layer_types=tuple(CSA if r else SLIDING for r in ratios), mlp_layer_types=(TOPK_MOE,) * n,
        rope_main=RopeConfig(theta=float(g("rope_theta", 10000.0))), rope_compress=compress,
        num_nextn_predict_layers=g("n_mtp_layers", 0), norm_topk_prob=g("norm_topk_prob", True),
        bos_token_id=extras.get("bos_token_id") if extras.get("bos_token_id") is not None else 0,
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
        pad_token_id=extras.get("pad_token_id") if extras.get("pad_token_id") is not None else 2,
        max_position_embeddings=extras.get("max_position_embeddings") or 1048576,
        tie_word_embeddings=bool(extras.get("tie_word_embeddings") or False), v41=v41)


# flat name -> ModelConfig field (the sizes and MoE / mHC fields)
_V41_FLAT_TO_FIELD = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank", "window_size": "sliding_window", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "n_routed_experts": "n_routed_experts",
    "n_activated_experts": "num_experts_per_tok", "moe_inter_dim": "moe_intermediate_size",
    "n_shared_experts": "n_shared_experts", "score_func": "scoring_func", "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "norm_eps": "rms_norm_eps",
}


def to_flat_v41(cfg: ModelConfig) -> dict[str, Any]:
    """A V4.1 config as DeepSeek's flat `inference/config.json` (what `from_flat_v41` reads)."""
    v = cfg.v41
    if v is None:
        raise ConfigError(f"config {cfg.name!r} is not a DeepSeek-V4.1 config")
    out = {key: getattr(cfg, field) for key, field in _V41_FLAT_TO_FIELD.items()}
    n_mtp = cfg.num_nextn_predict_layers
    out.update(vocab_size=cfg.vocab_size, n_mtp_layers=n_mtp, compress_ratios=list(v.compress_ratios) + [0] * n_mtp,
               kv_source_layers=list(v.kv_source_layers), index_source_layers=list(v.index_source_layers),
               candidate_source_layer=v.candidate_source_layer, candidate_topk_blocks=v.candidate_topk_blocks,
               candidate_block_size=v.candidate_block_size, rope_theta=cfg.rope_main.theta,
               compress_rope_theta=cfg.rope_compress.theta, dtype="fp8", expert_dtype="fp4")
    r = cfg.rope_compress
    if r.scaling == "yarn":
        out.update(rope_factor=r.factor, original_seq_len=r.original_max_position_embeddings,
                   beta_fast=r.beta_fast, beta_slow=r.beta_slow)
    if v.gate_temp != 1.0:
        out["gate_temp"] = v.gate_temp
    if v.image_token_id is not None:
        out["image_token_id"] = v.image_token_id
    if v.engram is not None:
        e = v.engram
        out.update(engram_layer_ids=list(e.layer_ids), engram_num_embeddings=list(e.num_embeddings),
                   engram_max_ngram_size=e.max_ngram_size, engram_vocab_size=e.vocab_size,
                   engram_n_heads=e.n_heads, engram_head_dim=e.head_dim, engram_pad_id=e.pad_id,
                   engram_compressed_vocab_size=e.compressed_vocab_size)
    if v.dspark is not None:
        d = v.dspark
        out.update(dspark_block_size=d.block_size, dspark_noise_token_id=d.noise_token_id,
                   dspark_target_layer_ids=list(d.target_layer_ids), dspark_markov_rank=d.markov_rank,
                   dspark_n_routed_experts=d.n_routed_experts, dspark_n_activated_experts=d.n_activated_experts)
    return out


def _to_hf_v41(cfg: ModelConfig) -> dict[str, Any]:
    flat = to_flat_v41(cfg)
    to_hf = {fl: hf for hf, fl in _V41_HF_TO_FLAT.items()}
    text = {to_hf.get(k, k): v for k, v in flat.items() if k not in ("rope_factor", "original_seq_len",
                                                                     "beta_fast", "beta_slow", "image_token_id")}
    r = cfg.rope_compress
    if r.scaling == "yarn":
        text["rope_scaling"] = {"rope_type": "yarn", "factor": r.factor, "beta_fast": r.beta_fast,
                                "beta_slow": r.beta_slow, "original_max_position_embeddings":
                                r.original_max_position_embeddings}
    text.update(num_key_value_heads=1, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", topk_method="noaux_tc")
    out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
           "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]}
    if cfg.v41.image_token_id is not None:
        out["image_token_id"] = cfg.v41.image_token_id
    return out
