"""The model config's schema: `ModelConfig` (what the model IS), its layer schedule
(`LayerSpec` per layer, the MTP layer's spec) and its validation.

Field names are HF `DeepseekV4Config`'s, so an HF `config.json` maps onto it field for field
(reading and writing that form, legacy keys and named configs: `dsjax/config/io.py`). Every
field is checked once, in `_validate`; an error names the field and says what was expected.
How to run the model (kernels, MoE capacity, batch invariance) is not here: that is
`RuntimeOptions` (dsjax/config/options.py), passed beside the config.

The config is frozen and hashable: it is passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
TOPK_MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or an inconsistent value."""


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
class LayerSpec:
    """What one decoder layer is. V4.1's cross-layer sharing extends this, not the blocks."""

    index: int
    attention: str  # SLIDING | CSA | HCA
    compress_ratio: int  # 0 for window-only layers
    mlp: str  # HASH_MOE | TOPK_MOE

    @property
    def rope(self) -> str:
        return "main" if self.attention == SLIDING else "compress"

    @property
    def overlap(self) -> bool:  # CSA pools overlapping windows (2m slots, stride m)
        return self.attention == CSA

    @property
    def has_indexer(self) -> bool:
        return self.attention == CSA


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """`repeats` consecutive copies of a period of layers (`layers`: the first copy's
    specs). The decoder stores each period position's weights and cache with a leading
    [repeats] axis and `lax.scan`s over it, so a program holds one period, not every layer."""

    layers: tuple[LayerSpec, ...]
    repeats: int

    @property
    def first(self) -> int:
        return self.layers[0].index

    def layer(self, r: int, j: int) -> LayerSpec:
        """The spec of repeat r, period position j (its own index)."""
        spec = self.layers[j]
        return dataclasses.replace(spec, index=self.first + r * len(self.layers) + j)

    @property
    def indices(self) -> tuple[tuple[int, ...], ...]:
        """Per period position j, the layer indices it stacks (over the repeats)."""
        return tuple(tuple(self.first + r * len(self.layers) + j for r in range(self.repeats))
                     for j in range(len(self.layers)))


def _kind(layer: LayerSpec):
    return layer.attention, layer.mlp


def layer_runs(layers: tuple[LayerSpec, ...], max_period: int = 4) -> tuple[LayerRun, ...]:
    """Greedy: at each position the period p in 1..max_period whose repetition covers the
    most layers with repeats >= 2 (ties: the shorter period); else a single layer. Layers
    are alike when their (attention, mlp) kinds are, which makes their weights and cache
    states the same shapes.
    V4.1's cross-layer sharing (a layer reading an earlier layer's compressed KV / top-k)
    will constrain this: a layer and the layer it reads must then fall in the same period
    position pattern (or the shared state must be carried through the scan), so the
    grouping has to take the sharing edges as an input beside the kinds."""
    runs, i, n = [], 0, len(layers)
    while i < n:
        best_p, best_r = 1, 1
        for p in range(1, max_period + 1):
            kinds = [_kind(l) for l in layers[i:i + p]]
            if len(kinds) < p:
                break
            r = 1
            while i + (r + 1) * p <= n and [_kind(l) for l in layers[i + r * p:i + (r + 1) * p]] == kinds:
                r += 1
            if r >= 2 and r * p > best_p * best_r:
                best_p, best_r = p, r
        runs.append(LayerRun(tuple(layers[i:i + best_p]), best_r))
        i += best_p * best_r
    return tuple(runs)


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
    name: str = "custom"

    def __post_init__(self):
        _validate(self)

    # ----------------------------------------------------------------- derived
    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        ratio = {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}
        return tuple(
            LayerSpec(i, a, ratio[a], m)
            for i, (a, m) in enumerate(zip(self.layer_types, self.mlp_layer_types))
        )

    @property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """The layer plan the decoder stores and scans (see `layer_runs`)."""
        return layer_runs(self.layers)

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
    for tid in (c.bos_token_id, *c.eos_token_ids):
        if not isinstance(tid, int) or not 0 <= tid < c.vocab_size:
            raise ConfigError(f"field 'bos_token_id/eos_token_id': token id {tid!r} outside [0, {c.vocab_size})")
