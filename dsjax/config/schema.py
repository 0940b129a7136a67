"""The model config's schema: `ModelConfig` (what the model IS), V4.1's additions
(`V41Config`, `EngramConfig`, `DSparkConfig`) and the validation. Its layer schedule
(`LayerSpec` per layer, the scanned `layer_runs`) is dsjax/config/layer_plan.py.

Field names are HF `DeepseekV4Config`'s, so an HF `config.json` maps onto it field for field
(reading and writing that form, legacy keys and named configs: `dsjax/config/io.py`). Every
field is checked once, in `_validate`; an error names the field and says what was expected.
How to run the model (kernels, MoE capacity, batch invariance) is not here: that is
`RuntimeOptions` (dsjax/config/options.py), passed beside the config.

The config is frozen and hashable: it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools

from dsjax.config.layer_plan import (CSA, HCA, LAYER_TYPES, MLP_LAYER_TYPES, SLIDING, TOPK_MOE,  # noqa: F401
                                     ConfigError, LayerRun, LayerSpec, Sharing, layer_runs)

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE for one rope type (`main`: window-only layers; `compress`: CSA/HCA layers)."""

    theta: float
    scaling: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos/sin (YaRN mscale); V4 uses 1.0


@dataclasses.dataclass(frozen=True)
class EngramConfig:
    """V4.1's Engram n-gram memory (spec deepseek-v41.md §5); names as in DeepSeek's flat
    config without the `engram_` prefix."""

    layer_ids: tuple[int, ...] = (1, 14)
    num_embeddings: tuple[int, ...] = (384006168, 384016682)  # table rows per Engram layer
    max_ngram_size: int = 4  # n-grams 2..max
    vocab_size: int = 16000000  # where the bucket-prime search starts
    n_heads: int = 8
    head_dim: int = 256
    pad_id: int = 2
    compressed_vocab_size: int = 99092

    @property
    def n_hash(self) -> int:
        """Hash columns per token and layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """V4.1's DSpark draft head (spec deepseek-v41.md §6); its stages are the config's
    `num_nextn_predict_layers`."""

    block_size: int = 5
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (37, 38, 39)  # block inputs tapped for main_hidden
    markov_rank: int = 256
    n_routed_experts: int = 128
    n_activated_experts: int = 3


@dataclasses.dataclass(frozen=True)
class V41Config:
    """What DeepSeek-V4.1 adds to the V4 schema: per-layer compress ratios (no overlap), the
    KV / index sources other layers read, layer 20's candidate blocks, Engram and DSpark
    (spec deepseek-v41.md §1). `ModelConfig.layers` turns these into each layer's `Sharing`."""

    compress_ratios: tuple[int, ...]  # per backbone layer
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    gate_temp: float = 1.0
    image_token_id: int | None = None
    engram: EngramConfig | None = None
    dspark: DSparkConfig | None = None

    def sharing(self, i: int) -> Sharing | None:
        """Layer i's sources: the most recent KV / index source at or before it; an index
        source that owns no latents scores the most recent KV source's keys; index sources
        after the candidate source that own no latents are restricted to its candidates."""
        if not self.compress_ratios[i]:
            return None
        kv = max(k for k in self.kv_source_layers if k <= i)
        topk = max(k for k in self.index_source_layers if k <= i)
        cand = self.candidate_source_layer
        restricted = i in self.index_source_layers and i not in self.kv_source_layers and cand is not None and cand < i
        return Sharing(kv_from=kv, topk_from=topk, index_keys_from=i if i in self.kv_source_layers else kv,
                       candidates_from=cand if restricted else None, publishes_candidates=i == cand)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # sizes
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    # attention schedule
    layer_types: tuple[str, ...]
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # MoE
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    mlp_layer_types: tuple[str, ...] = ()
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    # RoPE
    rope_main: RopeConfig = RopeConfig(theta=10000.0)
    rope_compress: RopeConfig = RopeConfig(theta=160000.0)
    max_position_embeddings: int = 1048576
    # heads / tokens
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    v41: V41Config | None = None  # DeepSeek-V4.1's additions (None: a V4 model)
    name: str = "custom"

    def __post_init__(self):
        _validate(self)

    # ----------------------------------------------------------------- derived
    @property
    def model_type(self) -> str:
        return "deepseek_v4" if self.v41 is None else "deepseek_v41"

    @property
    def engram(self) -> EngramConfig | None:
        """The Engram memory's config (V4.1 models that have one), else None."""
        return None if self.v41 is None else self.v41.engram

    @property
    def dspark(self) -> DSparkConfig | None:
        """The DSpark drafter's config (V4.1 models that have one), else None."""
        return None if self.v41 is None else self.v41.dspark

    @functools.cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        if self.v41 is not None:
            v, engram = self.v41, self.v41.engram.layer_ids if self.v41.engram else ()
            return tuple(LayerSpec(i, a, v.compress_ratios[i], m, v.sharing(i), i in engram)
                         for i, (a, m) in enumerate(zip(self.layer_types, self.mlp_layer_types)))
        ratio = {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}
        return tuple(
            LayerSpec(i, a, ratio[a], m)
            for i, (a, m) in enumerate(zip(self.layer_types, self.mlp_layer_types))
        )

    @property
    def max_compress_ratio(self) -> int:
        """The largest compression ratio of any layer: a cache's capacity is a multiple of it."""
        return max([self.compress_rate_csa, self.compress_rate_hca] if self.v41 is None else
                   [max(self.v41.compress_ratios), 1])

    @functools.cached_property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """The layer plan the decoder stores and scans (see `layer_runs`; V4.1 merges its
        runs of alike consumers into one period position each)."""
        return layer_runs(self.layers, max_period=4 if self.v41 is None else 6, merge_alike=self.v41 is not None)

    @property
    def mtp_layer(self) -> LayerSpec:
        """The MTP (next-token-prediction) block: window-only attention, bias-routed MoE."""
        return LayerSpec(self.num_hidden_layers, SLIDING, 0, TOPK_MOE)

    def rope(self, kind: str) -> RopeConfig:
        return {"main": self.rope_main, "compress": self.rope_compress}[kind]

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- validation
def _validate(c: ModelConfig) -> None:
    def positive_int(name):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"field '{name}': expected a positive int, got {v!r}")

    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
              "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
              "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
              "compress_rate_csa", "compress_rate_hca", "max_position_embeddings"):
        positive_int(f)
    for f in ("n_shared_experts", "num_nextn_predict_layers"):
        v = getattr(c, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"field '{f}': expected an int >= 0, got {v!r}")
    for f in ("hc_eps", "rms_norm_eps", "routed_scaling_factor", "swiglu_limit"):
        v = getattr(c, f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConfigError(f"field '{f}': expected a positive number, got {v!r}")
    if c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.head_dim:
        raise ConfigError(f"field 'qk_rope_head_dim': expected an even number <= head_dim ({c.head_dim}), "
                          f"got {c.qk_rope_head_dim}")
    if c.qk_rope_head_dim > c.index_head_dim:
        raise ConfigError(f"field 'index_head_dim': must be >= qk_rope_head_dim ({c.qk_rope_head_dim}), "
                          f"got {c.index_head_dim}")
    if c.num_attention_heads % c.o_groups:
        raise ConfigError(f"field 'o_groups': must divide num_attention_heads ({c.num_attention_heads}), "
                          f"got {c.o_groups}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(f"field 'num_experts_per_tok': must be <= n_routed_experts ({c.n_routed_experts}), "
                          f"got {c.num_experts_per_tok}")
    if c.scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"field 'scoring_func': expected one of {SCORING_FUNCS}, got {c.scoring_func!r}")
    for name, types, allowed in (("layer_types", c.layer_types, LAYER_TYPES),
                                 ("mlp_layer_types", c.mlp_layer_types, MLP_LAYER_TYPES)):
        if len(types) != c.num_hidden_layers:
            raise ConfigError(f"field '{name}': expected {c.num_hidden_layers} entries (num_hidden_layers), "
                              f"got {len(types)}")
        bad = sorted({t for t in types if t not in allowed})
        if bad:
            raise ConfigError(f"field '{name}': entries must be one of {allowed}, got {bad}")
    for kind in ("main", "compress"):
        r = c.rope(kind)
        if not r.theta > 0:
            raise ConfigError(f"field 'rope_{kind}.theta': expected > 0, got {r.theta}")
        if r.scaling == "yarn" and (r.factor <= 0 or r.original_max_position_embeddings <= 0):
            raise ConfigError(f"field 'rope_{kind}': yarn needs factor > 0 and original_max_position_embeddings > 0")
    if c.v41 is not None:
        _validate_v41(c, c.v41)
    for tid in (c.bos_token_id, *c.eos_token_ids):
        if not isinstance(tid, int) or not 0 <= tid < c.vocab_size:
            raise ConfigError(f"field 'bos_token_id/eos_token_id': token id {tid!r} outside [0, {c.vocab_size})")


def _validate_v41(c: ModelConfig, v: V41Config) -> None:
    n = c.num_hidden_layers
    ratios = v.compress_ratios
    if len(ratios) != n or any(not isinstance(r, int) or r < 0 for r in ratios):
        raise ConfigError(f"field 'compress_ratios': expected {n} ints >= 0 (one per backbone layer), got {ratios}")
    want = tuple(CSA if r else SLIDING for r in ratios)
    if c.layer_types != want or set(c.mlp_layer_types) != {TOPK_MOE}:
        raise ConfigError("fields 'layer_types' / 'mlp_layer_types' of a V4.1 config follow compress_ratios "
                          "(0: sliding window, > 0: compressed sparse) and are all top-k MoE")
    for name, layers in (("kv_source_layers", v.kv_source_layers), ("index_source_layers", v.index_source_layers)):
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < n or not ratios[i]]
        if bad or list(layers) != sorted(set(layers)):
            raise ConfigError(f"field '{name}': expected increasing layer ids of compressed layers "
                              f"(compress_ratios > 0), got {list(layers)}")
    for i, r in enumerate(ratios):
        if not r:
            continue
        kv = [k for k in v.kv_source_layers if k <= i]
        if not kv or ratios[kv[-1]] != r:
            raise ConfigError(f"field 'kv_source_layers': compressed layer {i} (ratio {r}) needs a KV source of "
                              f"ratio {r} at or before it, got {list(v.kv_source_layers)}")
        if not any(k <= i for k in v.index_source_layers):
            raise ConfigError(f"field 'index_source_layers': compressed layer {i} needs an index source at or "
                              f"before it, got {list(v.index_source_layers)}")
    cand = v.candidate_source_layer
    if cand is not None and (cand not in v.kv_source_layers or cand not in v.index_source_layers):
        raise ConfigError(f"field 'candidate_source_layer': must be both a KV and an index source, got {cand}")
    for name in ("candidate_topk_blocks", "candidate_block_size"):
        val = getattr(v, name)
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ConfigError(f"field '{name}': expected a positive int, got {val!r}")
    if not v.gate_temp > 0:
        raise ConfigError(f"field 'gate_temp': expected > 0, got {v.gate_temp}")
    e = v.engram
    if e is not None:
        if any(not 0 <= i < n for i in e.layer_ids) or len(e.num_embeddings) != len(e.layer_ids):
            raise ConfigError(f"fields 'engram_layer_ids' / 'engram_num_embeddings': expected one table size per "
                              f"Engram layer in [0, {n}), got {list(e.layer_ids)} / {list(e.num_embeddings)}")
        for name in ("max_ngram_size", "vocab_size", "n_heads", "head_dim", "compressed_vocab_size"):
            val = getattr(e, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= (1 if name == "max_ngram_size" else 0):
                raise ConfigError(f"field 'engram_{name}': expected a positive int, got {val!r}")
    d = v.dspark
    if d is not None:
        if any(not 0 <= i < n for i in d.target_layer_ids):
            raise ConfigError(f"field 'dspark_target_layer_ids': expected layer ids in [0, {n}), "
                              f"got {list(d.target_layer_ids)}")
        if not 0 < d.n_activated_experts <= d.n_routed_experts:
            raise ConfigError(f"field 'dspark_n_activated_experts': expected 1..dspark_n_routed_experts "
                              f"({d.n_routed_experts}), got {d.n_activated_experts}")
        if not 0 <= d.noise_token_id < c.vocab_size:
            raise ConfigError(f"field 'dspark_noise_token_id': expected a token id < {c.vocab_size}, "
                              f"got {d.noise_token_id}")
