"""How to run a model, as opposed to what the model is: `RuntimeOptions`.

The config (`ModelConfig`) describes the checkpoint; these options describe one run of it
and travel beside the config (as a static argument of the jitted programs), never inside
it, so a kernel choice does not reach parameter specs or checkpoint naming.
"""

from __future__ import annotations

import dataclasses

KERNELS = ("reference", "pallas", "mosaic_gpu", "mosaic_tpu")
QUANTIZED = ("dequantize", "resident")
EP_DISPATCH = ("auto", "ragged", "padded")  # dsjax/sharding/expert_dispatch.py


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """kernels: "reference" (pure jnp), "pallas" (dsjax/kernels: the Mosaic GPU
    kernels on Hopper+, the Mosaic TPU kernels on a TPU, the generic Pallas kernels elsewhere,
    interpreted on CPU), "mosaic_gpu" (the Mosaic GPU kernels; GPU interpret mode off the GPU)
    or "mosaic_tpu" (the Mosaic TPU kernels; TPU interpret mode off a TPU).
    moe_capacity_factor: cap expert-parallel send buffers at ceil(tokens * k / ep * factor)
    and drop assignments past it; None (default) = dropless.
    ep_dispatch: how expert-parallel rows travel: "auto" (default; `jax.lax.ragged_all_to_all`
    on TPU / GPU, each row sent once, and a padded all_to_all on CPU, chosen when the program
    is lowered), "ragged" (on CPU over an emulated collective: checks, not speed) or "padded".
    A capacity factor drops rows, which only the padded form does.
    batch_invariant: every cached forward runs tiles of a fixed number of rows (one program
    shape at any batch size or mesh layout), so a request's logits are bitwise independent
    of its neighbours, its slot and the mesh (docs/batch-invariance.md).
    quantized: how FP8 / MXFP4 checkpoint weights were loaded ("dequantize" | "resident");
    recorded by `load_model`, read by reports.
    index_keys_from_owner (V4.1): a ratio-2 index source always scores its own KV source's
    keys. False (default) reproduces DeepSeek's reference, where a one-token decode at an
    even position scores the keys the last KV source published (spec deepseek-v41.md §2.7).
    round_trips (V4.1): the reference's FP8 / FP4 round trips (Lin8 / Lin4 activations, cached
    rows, index queries and keys) and the bf16 roundings the spec names (index scores, the
    compressor's pooled sums, attention probabilities before PV), in float32 and bf16 runs
    alike (part of the trained numerics, so on by default; off for fp32 checks of the
    mechanisms).
    compute_dtype: the activations' dtype when the weights are stored narrower ("float32" with
    16-bit weights: `dsjax.store_weights`); None: the embedding's dtype."""

    kernels: str = "reference"
    moe_capacity_factor: float | None = None
    ep_dispatch: str = "auto"
    batch_invariant: bool = False
    quantized: str = "dequantize"
    index_keys_from_owner: bool = False
    round_trips: bool = True
    compute_dtype: str | None = None

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        cf = self.moe_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ValueError(f"moe_capacity_factor must be a positive number or None, got {cf!r}")
        if self.ep_dispatch not in EP_DISPATCH:
            raise ValueError(f"ep_dispatch must be one of {EP_DISPATCH}, got {self.ep_dispatch!r}")
        if cf is not None and self.ep_dispatch == "ragged":
            raise ValueError("moe_capacity_factor drops assignments, which only ep_dispatch='padded' (or 'auto') "
                             "does; ep_dispatch='ragged' is dropless")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be 'float32', 'bfloat16' or None, got {self.compute_dtype!r}")
        if self.quantized not in QUANTIZED:
            raise ValueError(f"quantized must be one of {QUANTIZED}, got {self.quantized!r}")

    def replace(self, **changes) -> "RuntimeOptions":
        return dataclasses.replace(self, **changes)
