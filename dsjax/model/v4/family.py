"""DeepSeek-V4 as a `ModelFamily` (dsjax/model/family.py): what the rest of dsjax asks of the
generation, each answer from this package (decoder.py, mtp.py) or the shared layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers.attention import attention_state_shapes
from dsjax.layers.quantized import FP8_LINEARS, StoredFormat
from dsjax.model.cache import Cache, stack_shapes
from dsjax.model.v4.decoder import forward_rows, model_specs
from dsjax.model.v4.mtp import MTPDrafter, mtp_specs


class V4Family:
    """DeepSeek-V4: the decoder with per-layer attention, the MTP drafter."""

    model_type = "deepseek_v4"
    drafter_name = "MTP"
    drafter = MTPDrafter()
    drafter_takes_vocab = True  # the MTP drafter can score a reduced draft vocabulary
    stored_format = StoredFormat((128, 128), FP8_LINEARS)  # spec deepseek-v4.md, "Weight names"
    forward_rows = staticmethod(forward_rows)
    param_specs = staticmethod(model_specs)
    drafter_specs = staticmethod(mtp_specs)  # whether or not the config declares one: `load_model(mtp=True)`

    @staticmethod
    def has_drafter(cfg: ModelConfig) -> bool:
        return bool(cfg.num_nextn_predict_layers)

    @staticmethod
    def drafter_tally(cfg: ModelConfig, dtype=jnp.bfloat16):
        """(the drafter's specs, the config its active share is counted by, copies): one MTP
        layer declared, num_nextn_predict_layers of them counted."""
        return mtp_specs(cfg, dtype), cfg, cfg.num_nextn_predict_layers

    @staticmethod
    def host_table_values(cfg: ModelConfig) -> int:
        return 0  # no host tables

    @staticmethod
    def cache_shapes(cfg: ModelConfig, batch: int, capacity: int, dtype) -> Cache:
        """Per run, per period position, one `AttentionState` stacked [repeats, ...]."""
        return Cache(
            length=jax.ShapeDtypeStruct((batch,), jnp.int32),
            layers=tuple(tuple(stack_shapes(attention_state_shapes(cfg, layer, batch, capacity, dtype), run.repeats)
                               for layer in run.layers) for run in cfg.layer_runs))

    @staticmethod
    def cache_minimum(cfg: ModelConfig) -> tuple[float, float | None]:
        """(elements per token the compressed KV needs at least, compact stored elements or None):
        per layer 512 (1/4 + 1/128) + 128/4, as the spec states."""
        minimum = 0.0
        for layer in cfg.layers:
            if layer.compress_ratio:
                minimum += cfg.head_dim / layer.compress_ratio
            if layer.has_indexer:
                minimum += cfg.index_head_dim / layer.compress_ratio
        return minimum, None

    @staticmethod
    def min_ring(cfg: ModelConfig) -> int:
        """The smallest ring: the window, each compressor's (doubled when overlapping), each indexer's."""
        sizes = [cfg.sliding_window]
        for layer in cfg.layers:
            if layer.compress_ratio:
                sizes.append(layer.compress_ratio * (2 if layer.overlap else 1))
            if layer.has_indexer:
                sizes.append(2 * layer.compress_ratio)
        return min(sizes)

    @staticmethod
    def draft_block_limit(cfg: ModelConfig) -> int | None:
        return None  # the MTP layer drafts one token at a time

    @staticmethod
    def reference_key_rule(cfg: ModelConfig, opts: RuntimeOptions) -> bool:
        return False  # every cached chunk equals one-token decodes


FAMILY = V4Family()
