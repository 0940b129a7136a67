"""Parameters declared once: shape, dtype, logical axes, initializer.

Each mechanism file (`dsjax/layers/*.py`) declares its weights as a pytree dataclass whose
leaves are `ParamSpec`s. From that single declaration come:
  * abstract shapes (`abstract_params`), for full-size configs without allocating;
  * seeded random init (`init_params`), any config;
  * shardings (`dsjax.sharding.rules`, from the logical axes);
  * device arrays from per-shard host readers (`materialize`: random init here, checkpoint
    reads in dsjax/checkpoint/loader.py);
  * the parameter / byte counts of `dsjax params`, per weight group (`weight_group`).
"""

from __future__ import annotations

import dataclasses
import functools
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


LAYERS = "layers"  # the logical axis of weights stacked over repeated layers (never sharded)


def stacked(spec: ParamSpec, n: int) -> ParamSpec:
    """`spec` for n layers at once: a leading [n] axis named `layers`."""
    return dataclasses.replace(spec, shape=(n, *spec.shape), axes=(LAYERS, *spec.axes))


def unstacked(spec: ParamSpec) -> ParamSpec:
    """One layer's spec of a stacked weight."""
    return dataclasses.replace(spec, shape=spec.shape[1:], axes=spec.axes[1:])


def stack_specs(tree, n: int):
    """Every ParamSpec of a spec tree stacked over n layers."""
    return jax.tree.map(lambda s: stacked(s, n), tree, is_leaf=is_spec)


_BLOCK_ELEMENTS = 1 << 20


def init_values(spec: ParamSpec, seed: int, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Host (numpy) values of one weight, or of the slice `index` of it.

    Values are generated in blocks of leading-axis rows, each block from its own seed
    (seed, crc32(name), block), so any slice - one device's shard - can be built without
    the rest of the tensor, and the values never depend on how the weight is sharded.
    Host generation also avoids compiling one random-number kernel per weight (XLA's CPU
    compile time for ~100 threefry draws runs to tens of seconds)."""
    shape = spec.shape
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    if spec.axes and spec.axes[0] == LAYERS:  # stacked layers: each layer seeded on its own
        layers = range(*index[0].indices(shape[0]))
        sub = tuple(len(range(*ix.indices(n))) for ix, n in zip(index[1:], shape[1:]))
        out = np.empty((len(layers), *sub), np.dtype(spec.dtype))
        for k, r in enumerate(layers):
            out[k] = init_values(unstacked(spec), seed, f"{name}.{r}", index[1:])
        return out
    if spec.init in ("zeros", "ones"):
        sub = tuple(len(range(*ix.indices(n))) for ix, n in zip(index, shape))
        return np.full(sub, 0 if spec.init == "zeros" else 1, dtype=np.dtype(spec.dtype))
    rows_total = shape[0] if shape else 1
    row_shape = shape[1:] if shape else ()
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, int(np.prod(row_shape, dtype=np.int64))))
    rows = range(*index[0].indices(rows_total)) if shape else range(1)
    if len(rows) == 0:
        return np.zeros((0,) + tuple(len(range(*ix.indices(n))) for ix, n in zip(index[1:], row_shape)),
                        np.dtype(spec.dtype))
    first, last = min(rows), max(rows)
    blocks = []
    for b in range(first // rows_per_block, last // rows_per_block + 1):
        n = min(rows_per_block, rows_total - b * rows_per_block)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), b])
        if spec.init == "normal":
            blocks.append(rng.standard_normal((n, *row_shape), dtype=np.float32) * np.float32(spec.std))
        elif spec.init == "expert_table":  # hash routing table [vocab, k]: k distinct experts per token
            blocks.append(np.argsort(rng.random((n, spec.high)), axis=1)[:, : row_shape[0]])
        else:
            raise ValueError(f"unknown initializer {spec.init!r}")
    full = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    offset = (first // rows_per_block) * rows_per_block
    local = (slice(rows.start - offset, rows.stop - offset if rows.stop >= 0 else None, rows.step),) + index[1:]
    out = full[local] if shape else full.reshape(())
    return np.asarray(out).astype(np.dtype(spec.dtype))


def path_str(path) -> str:
    return ".".join(str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))) for p in path)


def materialize(specs, readers, shardings=None, progress: Callable[[int], Any] | None = None):
    """Device arrays from per-weight readers `read(index) -> np.ndarray` (index: a tuple of
    slices), each device's shard from its own slice. Host memory holds one shard at a time.
    progress: called with each weight's byte count once it is on device."""
    flat_specs, tree = jax.tree.flatten(specs, is_leaf=is_spec)
    flat_readers = tree.flatten_up_to(readers)
    flat_shardings = tree.flatten_up_to(shardings) if shardings is not None else [None] * len(flat_specs)
    arrays = []
    for s, sh, read in zip(flat_specs, flat_shardings, flat_readers):
        arrays.append(_from_reader(s, sh, read))
        if progress is not None:
            progress(s.nbytes)
    return tree.unflatten(arrays)


def _from_reader(spec: ParamSpec, sharding, read) -> jax.Array:
    return jnp.asarray(read(())) if sharding is None else jax.make_array_from_callback(spec.shape, sharding, read)


def is_stored(x) -> bool:
    """A stored-format container of specs (`dsjax.layers.quantized`: an Fp8Weight / Fp4Weight
    of ParamSpecs), which draws its own bytes (`seeded`): duck-typed, as params sits below layers."""
    return not is_spec(x) and callable(getattr(x, "seeded", None))


def init_params(specs, seed: int, shardings=None, device_normal: bool = False):
    """Seeded random weights for a spec tree (see `init_values`); with `shardings`, each
    device's shard is generated where it lives, never a full replica first. Stored-format
    weights (FP8 / MXFP4 containers of a resident spec tree) are drawn on the device in their
    stored bytes (`dsjax.layers.quantized.seeded_stored`), never as a host copy.
    device_normal: draw the N(0, std) weights with jax.random on the device too (other
    values than the host's, as seeded): a full-size model's embedding, head and the rest
    would take numpy tens of seconds."""
    flat, tree = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: is_spec(x) or is_stored(x))
    flat_shardings = tree.flatten_up_to(shardings) if shardings is not None else [None] * len(flat)
    arrays = []
    for (path, s), sh in zip(flat, flat_shardings):
        name = path_str(path)
        if is_stored(s):
            arrays.append(s.seeded(seed, name, sh))
        elif device_normal and s.init == "normal":
            arrays.append(_normal_program(s.shape, jnp.dtype(s.dtype), float(s.std), sh)(name_key(seed, name)))
        else:
            arrays.append(_from_reader(s, sh, lambda ix, s=s, n=name: init_values(s, seed, n, ix)))
    return tree.unflatten(arrays)


def name_key(seed: int, name: str) -> jax.Array:
    """The jax.random key of one weight drawn on the device: (seed, crc32 of its path)."""
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


@functools.lru_cache(maxsize=None)
def _normal_program(shape, dtype, std, sharding):
    return jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype),
                   out_shardings=sharding)


def abstract_params(specs, shardings=None):
    """`jax.ShapeDtypeStruct` per weight; nothing is allocated."""
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs, is_leaf=is_spec)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        specs, shardings, is_leaf=is_spec)


def weight_group(path: str) -> str:
    """The group a weight (by its path, e.g. "blocks.3.moe.w1") is counted in: routed_experts,
    shared_expert, router, attention, embed, lm_head, engram (V4.1's device-side Engram weights)
    or mhc_and_norms."""
    if ".moe.w" in path:
        return "routed_experts"
    if ".moe.shared_" in path:
        return "shared_expert"
    if ".moe." in path:
        return "router"
    if ".attn." in path:
        return "attention"
    if path.startswith(("embed", "lm_head", "engram")):
        return path.split(".")[0]
    return "mhc_and_norms"


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
