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


def _expand(index, shape) -> tuple[slice, ...]:
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    return tuple(slice(*ix.indices(n)) for ix, n in zip(index, shape))


def _plan_experts(index: _Index, src: Source, spec: ParamSpec, path: str):
    """Check a routed-expert weight's tensors; return a reader of any slice of the stacked
    [E, ...] array that touches only the experts (and rows) in the slice."""
    names = src.candidates(spec.shape[0])
    per_expert, fused = names[:-1], names[-1]
    if any(index.has(n) for n in per_expert):
        missing = [n for n in per_expert if not index.has(n)]
        if missing:
            raise CheckpointError(f"{len(missing)} routed-expert tensor(s) missing for dsjax weight {path}: "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for n in per_expert:
            _check(index, n, spec.shape[1:], spec, path)

        def read_stacked(ix):
            experts, rest = ix[0], ix[1:]
            return np.stack([np.array(index.read(per_expert[e])[rest]) for e in range(*experts.indices(spec.shape[0]))])

        return per_expert, read_stacked
    if not index.has(fused):
        raise CheckpointError(f"tensor '{per_expert[0]}' (or the fused '{fused}') is missing "
                              f"(dsjax weight {path})")
    if src.expert == "w2":
        _check(index, fused, spec.shape, spec, path)
        return [fused], lambda ix: np.array(index.read(fused)[ix])
    e, i, d = spec.shape
    _check(index, fused, (e, 2 * i, d), spec, path)
    offset = 0 if src.expert == "w1" else i  # w1 rows, then w3 rows

    def read_half(ix):
        rows = range(*ix[1].indices(i))
        return np.array(index.read(fused)[ix[0], offset + rows.start: offset + rows.stop: rows.step, ix[2]])

    return [fused], read_half


def load_checkpoint(directory: str | Path, cfg: ModelConfig, specs, shardings=None) -> object:
    """Read every weight of `specs` (a dsjax spec tree) from the checkpoint in `directory`.
    All names, shapes and types are checked before the first byte of data is read. With
    `shardings` (a matching tree of NamedShardings), each device's shard is built from only
    the bytes it needs (`jax.make_array_from_callback`); no full replica is made."""
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
                names, reader = [src.name], (lambda ix, n=src.name: np.array(index.read(n)[ix]))
            consumed.update(names)
            return lambda ix: reader(_expand(ix, spec.shape)).astype(np.dtype(spec.dtype))

        readers = jax.tree_util.tree_map_with_path(plan, specs, is_leaf=is_spec)
        unexpected = sorted(c for c in index.stored if c not in consumed and not c.startswith(IGNORED_PREFIXES))
        if unexpected:
            where = [index.where(c) for c in unexpected[:8]]
            raise CheckpointError(f"{directory}: {len(unexpected)} tensor(s) this config does not use "
                                  f"(does config.json match the weights?): {where}"
                                  + (" ..." if len(unexpected) > 8 else ""))
        return materialize(specs, readers, shardings)
    finally:
        files.close()


def materialize(specs, readers, shardings=None):
    """Device arrays from per-weight readers `read(index) -> np.ndarray` (index: a tuple of
    slices), each device's shard from its own slice."""
    flat_specs, tree = jax.tree.flatten(specs, is_leaf=is_spec)
    flat_readers = tree.flatten_up_to(readers)
    if shardings is None:
        arrays = [jnp.asarray(read(())) for read in flat_readers]
    else:
        flat_shardings = tree.flatten_up_to(shardings)
        arrays = [jax.make_array_from_callback(s.shape, sh, read)
                  for s, sh, read in zip(flat_specs, flat_shardings, flat_readers)]
    return tree.unflatten(arrays)
