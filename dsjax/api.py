"""The public entry points notebooks and tests use: `load_model` and `Model`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.checkpoint import load_checkpoint
from dsjax.config import ModelConfig, load_config
from dsjax.model import ModelParams, forward, model_specs
from dsjax.params import init_params

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


@dataclasses.dataclass
class Model:
    """A config and its weights. Everything that runs is a pure function of these two."""

    config: ModelConfig
    params: ModelParams
    dtype: jnp.dtype

    def logits(self, token_ids) -> np.ndarray:
        """Full causal forward, no cache: token_ids [B, S] -> logits [B, S, vocab] (fp32)."""
        ids = np.asarray(token_ids)
        if ids.ndim == 1:
            raise ValueError(f"token_ids must be [batch, seq]; got a 1-D array of length {ids.shape[0]} "
                             f"(wrap a single sequence in a list)")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [batch, seq] array, got shape {ids.shape}")
        check_token_ids(ids, self.config.vocab_size)
        return np.asarray(forward(self.params, jnp.asarray(ids, jnp.int32), self.config))


def check_token_ids(ids: np.ndarray, vocab_size: int) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def load_model(path_or_config_name: str | Path, *, dtype="bfloat16", seed: int = 0) -> Model:
    """A checkpoint directory (HF layout: config.json + safetensors), or a named config
    (`tiny`, `v4-flash`, `v4-pro`) / config JSON file with seeded random weights."""
    dtype = resolve_dtype(dtype)
    path = Path(path_or_config_name)
    cfg = load_config(path_or_config_name)
    specs = model_specs(cfg, dtype)
    if path.is_dir():
        params = load_checkpoint(path, cfg, specs)
    else:
        params = init_params(specs, seed)
    return Model(cfg, params, dtype)
