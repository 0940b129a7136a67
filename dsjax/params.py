"""Parameters declared once: shape, dtype, logical axes, initializer.

Each mechanism file (`dsjax/layers/*.py`) declares its weights as a pytree dataclass whose
leaves are `ParamSpec`s. From that single declaration come:
  * abstract shapes (`abstract_params`), for full-size configs without allocating;
  * seeded random init (`init_params`), any config;
  * shardings (`dsjax.sharding.rules`, from the logical axes);
  * the parameter / byte counts of `dsjax params`.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight. Not a pytree node: a leaf of the spec trees."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]  # logical axis name per dim (see dsjax/sharding/rules.py)
    init: str = "normal"  # normal | zeros | ones | expert_table
    std: float = 0.02
    high: int = 0  # expert_table: number of experts

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec shape {self.shape} and axes {self.axes} differ in rank")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * jnp.dtype(self.dtype).itemsize


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _initialize(spec: ParamSpec, key: jax.Array) -> jax.Array:
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, spec.dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, spec.dtype)
    if spec.init == "normal":
        return (spec.std * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)
    if spec.init == "expert_table":
        # hash routing table [vocab, k]: k distinct experts per token
        rows, k = spec.shape
        scores = jax.random.uniform(key, (rows, spec.high))
        return jax.lax.top_k(scores, k)[1].astype(spec.dtype)
    raise ValueError(f"unknown initializer {spec.init!r}")


def path_str(path) -> str:
    return ".".join(str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))) for p in path)


def init_params(specs, key: jax.Array | int):
    """Seeded random weights for a spec tree. Each leaf's key is folded from its path, so
    a weight's values do not depend on which other weights exist."""
    if isinstance(key, int):
        key = jax.random.key(key)

    def one(path, spec):
        return _initialize(spec, jax.random.fold_in(key, zlib.crc32(path_str(path).encode())))

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)


def abstract_params(specs, shardings=None):
    """`jax.ShapeDtypeStruct` per weight; nothing is allocated."""
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs, is_leaf=is_spec)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        specs, shardings, is_leaf=is_spec)


def spec_leaves(specs) -> list[tuple[str, ParamSpec]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return [(path_str(p), s) for p, s in flat]


def check_against_specs(params, specs, where: Callable[[str], str] = lambda name: name) -> None:
    """Raise ValueError naming the first weight whose shape or dtype differs from its spec."""
    flat_p, tree_p = jax.tree_util.tree_flatten_with_path(params)
    flat_s, tree_s = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    if tree_p != tree_s:
        raise ValueError(f"parameter tree structure differs from the model's declaration:\n{tree_p}\nvs\n{tree_s}")
    for (path, arr), (_, spec) in zip(flat_p, flat_s):
        name = path_str(path)
        if tuple(arr.shape) != spec.shape:
            raise ValueError(f"{where(name)}: shape {tuple(arr.shape)}, expected {spec.shape}")
        if jnp.dtype(arr.dtype) != jnp.dtype(spec.dtype):
            raise ValueError(f"{where(name)}: dtype {arr.dtype}, expected {jnp.dtype(spec.dtype)}")
