"""DeepSeek's weight formats: FP8 E4M3 block-scaled linears and MXFP4 routed experts.

    FP8   .weight  F8_E4M3 [out, in]       .scale  F8_E8M0 [ceil(out/b0), ceil(in/b1)]
          W[o, i] = q[o, i] * 2^(s[o // b0, i // b1] - 127)          (b = 128 V4, 32 V4.1)
    MXFP4 .weight  I8 [out, in/2]           .scale  F8_E8M0 [out, in/32]
          two E2M1 codes per byte, low nibble first (element 2k low, 2k+1 high);
          code bits: sign (8) | magnitude index (0-7) into {0, .5, 1, 1.5, 2, 3, 4, 6}
          W[o, j] = e2m1(code[o, j]) * 2^(s[o, j // 32] - 127)

Numpy decoders (any slice, at load); the on-device forms live in
dsjax/layers/quantized.py. The tests carry their own independent quantizer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsjax.layers.quantized import E2M1_SIGNED, MXFP4_GROUP


# ----------------------------------------------------------------------------- numpy codecs
def e8m0_exponents(scale: np.ndarray) -> np.ndarray:
    """Stored E8M0 scales (ml_dtypes float8_e8m0fnu or raw bytes) -> the exponent byte."""
    return np.asarray(scale).view(np.uint8)


def dequant_fp8(q: np.ndarray, scale_exp: np.ndarray, block: tuple[int, int], rows: slice, cols: slice,
                dtype) -> np.ndarray:
    """W[rows, cols] from q (the same slice of the stored e4m3 values) and the exponent
    bytes of the scale blocks that cover it (starting at block rows.start // b0, cols.start // b1)."""
    b0, b1 = block
    r = np.arange(rows.start, rows.stop) // b0 - rows.start // b0
    c = np.arange(cols.start, cols.stop) // b1 - cols.start // b1
    s = np.ldexp(np.float32(1), scale_exp.astype(np.int32) - 127).astype(np.float32)
    return (q.astype(np.float32) * s[r][:, c]).astype(dtype)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """[..., n/2] bytes -> [..., n] float32 values (low nibble first)."""
    b = np.asarray(packed).view(np.uint8)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return E2M1_SIGNED[codes]


def dequant_fp4(packed: np.ndarray, scale_exp: np.ndarray, dtype) -> np.ndarray:
    """Whole rows: packed [..., in/2], exponents [..., in/32] -> [..., in]."""
    vals = unpack_e2m1(packed)
    s = np.ldexp(np.float32(1), scale_exp.astype(np.int32) - 127).astype(np.float32)
    return (vals * np.repeat(s, MXFP4_GROUP, axis=-1)[..., : vals.shape[-1]]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint stores its weights (from config.json's quantization_config)."""

    fp8_block: tuple[int, int] = (128, 128)
    experts_fp4: bool = False

    @classmethod
    def from_hf(cls, raw: dict) -> "QuantFormat | None":
        q = raw.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method", "fp8")
        if method != "fp8":
            raise ValueError(f"field 'quantization_config.quant_method': dsjax reads 'fp8', got {method!r}")
        block = q.get("weight_block_size", [128, 128])
        expert_dtype = q.get("expert_dtype", raw.get("expert_dtype"))
        return cls(fp8_block=(int(block[0]), int(block[1])), experts_fp4=expert_dtype == "fp4")
