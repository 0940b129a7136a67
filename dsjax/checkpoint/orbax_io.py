"""orbax checkpoints: `dsjax convert SRC DST` writes one (sharded, with its config), and
`load_model(DST)` restores it directly into the target sharding.

Layout of DST: `config.json` (HF form), `dsjax_orbax.json` (how the weights are stored:
dtype, quantized-resident or not), `params/` (the orbax PyTree checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import orbax.checkpoint as ocp

from dsjax.config import to_hf_dict

MARKER = "dsjax_orbax.json"


def is_orbax(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def read_marker(directory: str | Path) -> dict:
    return json.loads((Path(directory) / MARKER).read_text())


def save(model, directory: str | Path, *, quantized: str, fp8_block=(128, 128), experts_fp4: bool = False) -> None:
    """Write `model`'s params (as they are: sharded, possibly FP8 / FP4-resident)."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    config = to_hf_dict(model.config)
    if quantized == "resident":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                         "weight_block_size": list(fp8_block),
                                         "expert_dtype": "fp4" if experts_fp4 else "fp8"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", model.params)
    if model.mtp is not None:
        checkpointer.save(directory / "mtp", model.mtp)
    checkpointer.wait_until_finished()
    import jax
    import jax.numpy as jnp

    (directory / MARKER).write_text(json.dumps({
        "format": "orbax", "dtype": str(jnp.dtype(model.dtype)), "quantized": quantized,
        "fp8_block": list(fp8_block), "experts_fp4": experts_fp4, "mtp": model.mtp is not None,
        "jax": jax.__version__}))


def restore(directory: str | Path, target, item: str = "params"):
    """Restore `item` ("params" or "mtp") into `target`: a tree of jax.ShapeDtypeStruct
    (with shardings) matching what was saved."""
    return ocp.StandardCheckpointer().restore(Path(directory).resolve() / item, target)
