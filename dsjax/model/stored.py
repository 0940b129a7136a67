"""The weights of each model generation as DeepSeek stores them, and as `quantized="resident"`
keeps them on device: which projections stay FP8 (E4M3 with E8M0 block scales), on which
tiles, and that the routed experts stay MXFP4 (dsjax/layers/quantized.py); each generation
names its format (`ModelFamily.stored_format`). The memory report (`dsjax memory --quantized
resident`) counts these trees; the loader builds the same ones from a checkpoint's declared
format (dsjax/api.py)."""

from __future__ import annotations

import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.layers.quantized import StoredFormat, resident_specs
from dsjax.model.family import family_of


def stored_format(cfg: ModelConfig) -> StoredFormat:
    return family_of(cfg).stored_format


def weight_specs(cfg: ModelConfig, dtype=jnp.bfloat16, quantized: str = "dequantize",
                 fmt: StoredFormat | None = None):
    """(the model's spec tree, its drafter's: V4's MTP layer, V4.1's DSpark head, or None)
    with every weight in `dtype`, or (quantized="resident") kept as `fmt` stores it (default:
    the release's format)."""
    family = family_of(cfg)
    specs = family.param_specs(cfg, dtype)
    drafter = family.drafter_specs(cfg, dtype) if family.has_drafter(cfg) else None
    if quantized == "resident":
        fmt = fmt or stored_format(cfg)
        keep = lambda s: resident_specs(s, fmt.fp8_block, fmt.experts_fp4, fmt.fp8_linears)  # noqa: E731
        specs, drafter = keep(specs), None if drafter is None else keep(drafter)
    elif quantized != "dequantize":
        raise ValueError(f"quantized must be 'dequantize' or 'resident', got {quantized!r}")
    return specs, drafter
