"""DeepSeek-V4.1 as a `ModelFamily` (dsjax/model/family.py): what the rest of dsjax asks of the
generation, each answer from this package (params.py, backbone.py, shared_attention.py,
dspark.py) or the shared layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers.quantized import StoredFormat
from dsjax.model.cache import Cache, stack_shapes
from dsjax.model.v41.backbone import quirk_source, v41_forward_rows
from dsjax.model.v41.dspark import DSparkDrafter
from dsjax.model.v41.params import (V41_FP8_BLOCK, V41_FP8_LINEARS, dspark_config, dspark_specs, engram_table_values,
                                    v41_model_specs)
from dsjax.model.v41.shared_attention import TAIL_SLOTS, shared_attention_state_shapes


def reference_key_rule(cfg: ModelConfig, opts: RuntimeOptions) -> bool:
    """Whether cached chunks follow the reference's published-key rule (spec deepseek-v41.md §2.7:
    a one-token decode at an even position scores the last KV source's keys at ratio-2 index
    sources). A chunk starting at position s > 0 then equals one-token decodes only at positions
    t <= 2 s + 1: beyond, the keys it needs (the last KV source's, of positions s..t/2 - 1) are
    written by the chunk itself, later in the layer order, and the ratio-2 sources score their
    own instead (`shared_attention_extend`). So an engine keeps every chunk after position 0
    within that bound (prompt chunks on the prefill_chunk grid, at most s + 1 drafts)."""
    return not opts.index_keys_from_owner and quirk_source(cfg) is not None


def forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, hidden):
    """`dsjax.model.forward` for a V4.1 config over one tile of rows -> (logits fp32, cache), the
    Engram rows from the params' host tables if they have them; hidden: the head's input rows."""
    return v41_forward_rows(params, tokens, cfg, cache, opts, n_valid, ctx_bucket, last_only, head_rows=hidden)[:2]


class V41Family:
    """DeepSeek-V4.1: the backbone with cross-layer shared attention and Engram, the DSpark drafter."""

    model_type = "deepseek_v41"
    drafter_name = "DSpark"
    drafter = DSparkDrafter()
    drafter_takes_vocab = False  # DSpark scores the whole vocabulary
    stored_format = StoredFormat(V41_FP8_BLOCK, V41_FP8_LINEARS)  # spec deepseek-v41.md §7.3, §8
    forward_rows = staticmethod(forward_rows)
    reference_key_rule = staticmethod(reference_key_rule)
    host_table_values = staticmethod(engram_table_values)
    param_specs = staticmethod(v41_model_specs)
    drafter_specs = staticmethod(dspark_specs)  # None when the config declares no DSpark head

    @staticmethod
    def has_drafter(cfg: ModelConfig) -> bool:
        return cfg.v41.dspark is not None and bool(cfg.num_nextn_predict_layers)

    @staticmethod
    def drafter_tally(cfg: ModelConfig, dtype=jnp.bfloat16):
        """(the drafter's specs or (), the config its active share is counted by, copies): the
        DSpark stages come stacked, with DSpark's own MoE size."""
        drafter = dspark_specs(cfg, dtype)
        return (drafter, dspark_config(cfg), 1) if drafter is not None else ((), cfg, 1)

    @staticmethod
    def cache_shapes(cfg: ModelConfig, batch: int, capacity: int, dtype) -> Cache:
        """Per run, per period position, one `SharedAttentionState` stacked [repeats * inner, ...];
        the Engram id history."""
        e = cfg.v41.engram
        return Cache(length=jax.ShapeDtypeStruct((batch,), jnp.int32), layers=tuple(
            tuple(stack_shapes(shared_attention_state_shapes(cfg, layer, batch, capacity, dtype), run.repeats * n)
                  for layer, n in zip(run.layers, run.inner)) for run in cfg.layer_runs),
            history=None if e is None else jax.ShapeDtypeStruct((batch, e.max_ngram_size - 1), jnp.int32))

    @staticmethod
    def cache_minimum(cfg: ModelConfig) -> tuple[float, float | None]:
        """(elements per token the compressed KV needs at least, as spec §2.12's compact formats
        store it): only KV sources store latents (and index keys)."""
        minimum = compact = 0.0
        for layer in cfg.layers:
            if layer.has_compressor:
                minimum += (cfg.head_dim + cfg.index_head_dim * layer.has_index_keys) / layer.compress_ratio
                compact += (cfg.head_dim * 9 / 16 + cfg.index_head_dim * 17 / 32 * layer.has_index_keys
                            ) / layer.compress_ratio  # fp4 + e4m3 / 16; fp4 + e8m0 / 32
        return minimum, compact

    @staticmethod
    def min_ring(cfg: ModelConfig) -> int:
        """The smallest ring: the window, and the fp32 tails of ratio-2 KV sources."""
        tails = any(layer.has_compressor and layer.compress_ratio > 1 for layer in cfg.layers)
        return min([cfg.sliding_window] + [TAIL_SLOTS] * tails)

    @staticmethod
    def draft_block_limit(cfg: ModelConfig) -> int | None:
        """DSpark drafts a block of block_size tokens in one call."""
        return None if cfg.v41.dspark is None else cfg.v41.dspark.block_size


FAMILY = V41Family()
