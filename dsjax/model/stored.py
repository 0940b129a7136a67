"""The weights of each model generation as DeepSeek stores them, and as `quantized="resident"`
keeps them on device: which projections stay FP8 (E4M3 with E8M0 block scales), on which
tiles, and that the routed experts stay MXFP4 (dsjax/layers/quantized.py). The memory report
(`dsjax memory --quantized resident`) counts these trees; the loader builds the same ones from
a checkpoint's declared format (dsjax/api.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dsjax.config import ModelConfig
from dsjax.layers.quantized import FP8_LINEARS, resident_specs
from dsjax.model.decoder import model_specs
from dsjax.model.mtp import mtp_specs
from dsjax.model.v41 import V41_FP8_BLOCK, V41_FP8_LINEARS, dspark_specs, v41_model_specs


@dataclasses.dataclass(frozen=True)
class StoredFormat:
    """How a model generation's release stores its weights."""

    fp8_block: tuple[int, int]  # E8M0 scale tiles of the FP8 projections
    fp8_linears: tuple[str, ...]  # the projections kept FP8 on device (dsjax path endings)
    experts_fp4: bool = True  # routed experts: MXFP4 (E2M1 pairs + E8M0 per 32)


V4_FORMAT = StoredFormat((128, 128), FP8_LINEARS)  # spec deepseek-v4.md, "Weight names"
V41_FORMAT = StoredFormat(V41_FP8_BLOCK, V41_FP8_LINEARS)  # spec deepseek-v41.md §7.3, §8


def stored_format(cfg: ModelConfig) -> StoredFormat:
    return V4_FORMAT if cfg.v41 is None else V41_FORMAT


def weight_specs(cfg: ModelConfig, dtype=jnp.bfloat16, quantized: str = "dequantize",
                 fmt: StoredFormat | None = None):
    """(the model's spec tree, its drafter's: V4's MTP layer, V4.1's DSpark head, or None)
    with every weight in `dtype`, or (quantized="resident") kept as `fmt` stores it (default:
    the release's format)."""
    if cfg.v41 is None:
        specs, drafter = model_specs(cfg, dtype), mtp_specs(cfg, dtype) if cfg.num_nextn_predict_layers else None
    else:
        specs, drafter = v41_model_specs(cfg, dtype), dspark_specs(cfg, dtype)
    if quantized == "resident":
        fmt = fmt or stored_format(cfg)
        keep = lambda s: resident_specs(s, fmt.fp8_block, fmt.experts_fp4, fmt.fp8_linears)  # noqa: E731
        specs, drafter = keep(specs), None if drafter is None else keep(drafter)
    elif quantized != "dequantize":
        raise ValueError(f"quantized must be 'dequantize' or 'resident', got {quantized!r}")
    return specs, drafter
