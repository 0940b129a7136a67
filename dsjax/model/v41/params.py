"""DeepSeek-V4.1's parameters (spec deepseek-v41.md §8): the backbone's blocks with
cross-layer shared attention, Engram's device-side weights, and the DSpark draft head; which
of them its release stores FP8. Engram's tables (196.6 G values) stay on the host and are
counted, not declared, here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import SLIDING, TOPK_MOE, LayerSpec, ModelConfig
from dsjax.layers.engram import Engram, engram_specs
from dsjax.layers.hyper_connection import hyper_connection_specs
from dsjax.layers.moe import moe_specs
from dsjax.model.block import Block, norm_spec
from dsjax.model.v41.shared_attention import shared_attention_specs
from dsjax.params import ParamSpec, stack_specs


@struct.dataclass
class DSparkParams:
    """The DSpark draft head (`mtp.0..2`): stages that are window-only V4.1 blocks with their
    own MoE size, fed the main model's taps; the Markov-corrected head and a confidence head."""

    stages: Block  # leaves [n_stages, ...]
    main_proj: jax.Array  # [D, len(target_layer_ids) * D]   mtp.0.main_proj
    main_norm: jax.Array  # [D] fp32                          mtp.0.main_norm
    norm: jax.Array  # [D] fp32                               mtp.2.norm
    markov_embed: jax.Array  # [V, rank]                      mtp.2.markov_head.embed
    markov_head: jax.Array  # [V, rank]                       mtp.2.markov_head.head
    confidence: jax.Array  # [1, D + rank]                    mtp.2.confidence_head.proj


@struct.dataclass
class ModelParamsV41:
    embed: jax.Array  # [V, D]
    blocks: tuple[tuple[Block, ...], ...]  # per layer run, per period position: leaves [repeats * inner, ...]
    norm: jax.Array  # [D] fp32
    lm_head: jax.Array | None  # [V, D]; None when tied to embed
    engram: tuple[Engram, ...] = ()  # per Engram layer (cfg.v41.engram.layer_ids); tables on the host
    # the host tables themselves (an `EngramStore`, not an array: static to jit, compared by identity): when
    # set, a forward given no engram_rows fetches its rows from them during the step (`engram_fetch`)
    engram_tables: Any = struct.field(pytree_node=False, default=None)
    # one whole-sequence forward's Engram rows, fetched from those tables on the host before the call
    # (`with_sequence_rows`): per Engram layer (E4M3 [B, S, n_hash, hd], E8M0 exponents [B, S, n_hash, hd / 32]);
    # the program then holds no host callback, so JAX's persistent cache keeps it. None otherwise.
    engram_rows: Any = None


# The weights a V4.1 checkpoint stores in FP8 (E4M3, UE8M0 scales on 32 x 32 tiles, spec §7.3, §8)
# that a resident model keeps so, by the end of their dsjax path; with the MXFP4 routed experts.
# attn.wo_a (o_a_proj) is stored FP8 too, but the reference dequantizes it to bf16 at load (its
# grouped product is a bf16 einsum, §8), and so does dsjax: it is not listed.
V41_FP8_LINEARS = ("attn.q_a_proj", "attn.q_b_proj", "attn.kv_proj", "attn.o_b_proj", "attn.index_queries.q_b_proj",
                   "moe.shared_w1", "moe.shared_w2", "moe.shared_w3", "wkv", "main_proj")  # wkv: engram.K.wkv
V41_FP8_BLOCK = (32, 32)


def v41_block_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> Block:
    return Block(attn_hc=hyper_connection_specs(cfg), attn_norm=norm_spec(cfg),
                 attn=shared_attention_specs(cfg, layer, dtype), ffn_hc=hyper_connection_specs(cfg),
                 ffn_norm=norm_spec(cfg), moe=moe_specs(cfg, layer, dtype, image_bias=True))


def v41_model_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> ModelParamsV41:
    v, d, e = cfg.vocab_size, cfg.hidden_size, cfg.v41.engram
    return ModelParamsV41(
        embed=ParamSpec((v, d), dtype, ("vocab", "embed")),
        blocks=tuple(tuple(stack_specs(v41_block_specs(cfg, layer, dtype), run.repeats * n)
                           for layer, n in zip(run.layers, run.inner)) for run in cfg.layer_runs),
        norm=norm_spec(cfg),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), dtype, ("vocab", "embed")),
        engram=tuple(engram_specs(cfg.hc_mult, d, e.n_hash, e.head_dim, dtype) for _ in e.layer_ids) if e else ())


def dspark_config(cfg: ModelConfig) -> ModelConfig:
    """The config a DSpark stage is a block of: the backbone's sizes with DSpark's MoE."""
    ds = cfg.v41.dspark
    return cfg.replace(n_routed_experts=ds.n_routed_experts, num_experts_per_tok=ds.n_activated_experts)


def dspark_specs(cfg: ModelConfig, dtype=jnp.bfloat16) -> DSparkParams | None:
    ds = cfg.v41.dspark if cfg.v41 is not None else None
    if ds is None or not cfg.num_nextn_predict_layers:
        return None
    v, d, rank = cfg.vocab_size, cfg.hidden_size, ds.markov_rank
    stage = LayerSpec(cfg.num_hidden_layers, SLIDING, 0, TOPK_MOE)
    return DSparkParams(
        stages=stack_specs(v41_block_specs(dspark_config(cfg), stage, dtype), cfg.num_nextn_predict_layers),
        main_proj=ParamSpec((d, len(ds.target_layer_ids) * d), dtype, ("embed_out", None)),
        main_norm=norm_spec(cfg), norm=norm_spec(cfg),
        markov_embed=ParamSpec((v, rank), dtype, ("vocab", None)),
        markov_head=ParamSpec((v, rank), dtype, ("vocab", None)),
        confidence=ParamSpec((1, d + rank), jnp.float32, (None, None)))


def engram_table_values(cfg: ModelConfig) -> int:
    """Values in the Engram tables (host memory): rows x head_dim per Engram layer."""
    e = cfg.v41.engram if cfg.v41 is not None else None
    return 0 if e is None else sum(e.num_embeddings) * e.head_dim
