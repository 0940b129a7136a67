"""Load a V4 checkpoint directory (any of the three spellings, see names.py) into the dsjax
parameter pytree.

Every tensor is checked before anything is used: a tensor the model needs but the files
lack, a tensor the files have but the model does not use, or a shape or type that does not
fit the config is a `CheckpointError` naming the tensor, its file, and what was expected.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.checkpoint.names import IGNORED_PREFIXES, Source, canonical_name, weight_names
from dsjax.checkpoint.safetensors_io import CheckpointError, CheckpointFiles
from dsjax.config import ModelConfig
from dsjax.params import ParamSpec, is_spec, path_str


class _Index:
    """Canonical tensor name -> name as stored, over all files of a checkpoint."""

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.stored: dict[str, str] = {}
        for name in files.tensors:
            canon = canonical_name(name)
            if canon in self.stored:
                raise CheckpointError(f"tensors '{self.stored[canon]}' and '{name}' are the same weight "
                                      f"('{canon}') spelled twice")
            self.stored[canon] = name

    def has(self, canon: str) -> bool:
        return canon in self.stored

    def info(self, canon: str):
        return self.files.tensors[self.stored[canon]]

    def read(self, canon: str) -> np.ndarray:
        return self.files.read(self.stored[canon])

    def where(self, canon: str) -> str:
        info = self.info(canon)
        return f"tensor '{info.name}' in {info.file.name}"


def _check(index: _Index, canon: str, shape: tuple[int, ...], spec: ParamSpec, path: str) -> None:
    info = index.info(canon)
    if tuple(info.shape) != tuple(shape):
        raise CheckpointError(f"{index.where(canon)}: shape {list(info.shape)}, expected {list(shape)} "
                              f"(dsjax weight {path}) for this config")
    integral = np.issubdtype(np.dtype(spec.dtype), np.integer)
    if integral != info.dtype.startswith(("I", "U")):
        raise CheckpointError(f"{index.where(canon)}: dtype {info.dtype}, expected "
                              f"{'an integer' if integral else 'a floating-point'} tensor (dsjax weight {path})")


def _plan_experts(index: _Index, src: Source, spec: ParamSpec, path: str):
    """Check a routed-expert weight's tensors; return a reader of the stacked [E, ...] array."""
    names = src.candidates(spec.shape[0])
    per_expert, fused = names[:-1], names[-1]
    if any(index.has(n) for n in per_expert):
        missing = [n for n in per_expert if not index.has(n)]
        if missing:
            raise CheckpointError(f"{len(missing)} routed-expert tensor(s) missing for dsjax weight {path}: "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for n in per_expert:
            _check(index, n, spec.shape[1:], spec, path)
        return per_expert, lambda: np.stack([index.read(n) for n in per_expert])
    if not index.has(fused):
        raise CheckpointError(f"tensor '{per_expert[0]}' (or the fused '{fused}') is missing "
                              f"(dsjax weight {path})")
    if src.expert == "w2":
        _check(index, fused, spec.shape, spec, path)
        return [fused], lambda: np.array(index.read(fused))
    e, i, d = spec.shape
    _check(index, fused, (e, 2 * i, d), spec, path)
    half = 0 if src.expert == "w1" else 1
    return [fused], lambda: np.array(index.read(fused)[:, half * i:(half + 1) * i])


def load_checkpoint(directory: str | Path, cfg: ModelConfig, specs) -> object:
    """Read every weight of `specs` (a dsjax spec tree) from the checkpoint in `directory`.
    All names, shapes and types are checked before the first byte of data is read."""
    files = CheckpointFiles(directory)
    try:
        index = _Index(files)
        table = weight_names(cfg)
        missing = [s.name for s in table.values() if s.expert is None and not index.has(s.name)]
        if missing:
            raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing: {missing[:10]}"
                                  + (" ..." if len(missing) > 10 else ""))

        consumed: set[str] = set()

        def plan(path, spec):
            name = path_str(path)
            src = table[name]
            if src.expert is not None:
                names, reader = _plan_experts(index, src, spec, name)
            else:
                _check(index, src.name, spec.shape, spec, name)
                names, reader = [src.name], (lambda: np.array(index.read(src.name)))
            consumed.update(names)
            return lambda: jnp.asarray(reader(), dtype=spec.dtype)  # np.array copies: files close below

        readers = jax.tree_util.tree_map_with_path(plan, specs, is_leaf=is_spec)
        unexpected = sorted(c for c in index.stored if c not in consumed and not c.startswith(IGNORED_PREFIXES))
        if unexpected:
            where = [index.where(c) for c in unexpected[:8]]
            raise CheckpointError(f"{directory}: {len(unexpected)} tensor(s) this config does not use "
                                  f"(does config.json match the weights?): {where}"
                                  + (" ..." if len(unexpected) > 8 else ""))
        return jax.tree.map(lambda read: read(), readers)
    finally:
        files.close()
