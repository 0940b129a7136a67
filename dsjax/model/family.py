"""Which model generation a config is, chosen once: `family_of(cfg)` looks the config's
`model_type` up in a table of `ModelFamily` objects, one per sibling package on the shared
layers (after Gemma's `gemma/gm/nn/gemma3n/`, `gemma4/`):

    dsjax/model/v4/    DeepSeek-V4: decoder.py (params, blocks, forward), mtp.py (the MTP drafter)
    dsjax/model/v41/   DeepSeek-V4.1: params.py, backbone.py, shared_attention.py (shared-KV
                       attention), dspark.py (the DSpark drafter)

Code outside a package asks its family what differs between generations (parameter specs,
the forward, the cache layout, the drafter, the stored format, speculation limits) instead
of testing the config itself (tests/test_layering.py holds dsjax to that).
"""

from __future__ import annotations

from typing import Any, Protocol

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers.quantized import StoredFormat
from dsjax.model.cache import Cache
from dsjax.model.v4.family import FAMILY as V4
from dsjax.model.v41.family import FAMILY as V41


class ModelFamily(Protocol):
    """What dsjax needs of a model generation."""

    model_type: str  # the config's `model_type`: "deepseek_v4" | "deepseek_v41"
    drafter_name: str  # its speculative drafter, as reports name it ("MTP", "DSpark")
    drafter: Any  # that drafter (`dsjax.model.interface.Drafter`)
    drafter_takes_vocab: bool  # whether the drafter can score a reduced draft vocabulary
    stored_format: StoredFormat  # how its release stores the weights (FP8 tiles, MXFP4 experts)

    def param_specs(self, cfg: ModelConfig, dtype) -> Any:
        """The backbone's parameter tree of `ParamSpec`s."""

    def drafter_specs(self, cfg: ModelConfig, dtype) -> Any:
        """The drafter's parameter specs (None: the generation cannot build one for `cfg`)."""

    def has_drafter(self, cfg: ModelConfig) -> bool:
        """Whether the config declares a drafter (its release ships one)."""

    def drafter_tally(self, cfg: ModelConfig, dtype) -> tuple[Any, ModelConfig, int]:
        """(the drafter's specs, the config its active share is counted by, copies): `dsjax params`."""

    def host_table_values(self, cfg: ModelConfig) -> int:
        """Values in tables kept in host memory, not on device (V4.1's Engram tables)."""

    def forward_rows(self, params, tokens, cfg: ModelConfig, cache: Cache | None, opts: RuntimeOptions, n_valid,
                     ctx_bucket: int | None, last_only: bool, hidden: bool) -> tuple[Any, Cache | None]:
        """`dsjax.model.forward` over one tile of rows -> (logits fp32 or the head's input rows, cache)."""

    def cache_shapes(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> Cache:
        """The abstract cache (its layer states, stacked as the layer plan stores them)."""

    def cache_minimum(self, cfg: ModelConfig) -> tuple[float, float | None]:
        """(elements per token the compressed KV needs at least, compact stored elements or None)."""

    def min_ring(self, cfg: ModelConfig) -> int:
        """The smallest ring of the cache (a verify step writes at most that many positions)."""

    def draft_block_limit(self, cfg: ModelConfig) -> int | None:
        """The most tokens the drafter proposes in one call (None: no limit of its own)."""

    def reference_key_rule(self, cfg: ModelConfig, opts: RuntimeOptions) -> bool:
        """Whether cached chunks follow a rule that bounds how far they may reach (V4.1 §2.7)."""


FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (V4, V41)}


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The model generation of a config (by its `model_type`)."""
    return FAMILIES[cfg.model_type]
