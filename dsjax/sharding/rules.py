"""The mesh and the ONE table of logical-to-mesh axis rules.

Mesh axes: `data` (batch), `expert` (routed experts; also splits the batch outside the
MoE), `tensor` (attention heads, grouped output projection, vocabulary, shared expert).
Every weight declares logical axes (dsjax/params.py); activations and caches use the
logical `batch` axis. `RULES` maps each logical name to mesh axes; nothing else in dsjax
names a mesh axis, except the expert dispatch (dsjax/sharding/expert_dispatch.py, and
dsjax/layers/moe.py's shard_map around it).

Meshes use `AxisType.Explicit`: shardings are part of the array types, and the model code
says how an ambiguous result is sharded with `spec(...)`, which is None without a mesh (so
the single-device path is unchanged).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from dsjax.params import is_spec, spec_leaves, weight_group

MESH_AXES = ("data", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """logical axis name -> mesh axes (a name, a tuple of names, or None = replicated)."""

    table: tuple[tuple[str, str | tuple[str, ...] | None], ...]

    def mesh_axes(self, logical: str | None):
        if logical is None:
            return None
        for name, axes in self.table:
            if name == logical:
                return axes
        raise KeyError(f"no sharding rule for logical axis {logical!r}")


RULES = ShardingRules((
    # activations, caches, engine slots
    ("batch", ("data", "expert")),
    # weights
    ("layers", None),  # the stacked [repeats] axis of a layer run (dsjax/params.py `stacked`)
    ("vocab", "tensor"),
    ("embed", None),
    ("embed_out", None),
    ("q_lora", None),
    ("q_heads", "tensor"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("o_groups", "tensor"),
    ("o_group_in", None),
    ("compress_out", None),
    ("index_heads", None),
    ("index_heads_w", None),
    ("experts", "expert"),
    ("expert_mlp", None),
    ("mlp", "tensor"),
    ("hc_in", None),
))


def parse_mesh_spec(text: str) -> dict[str, int]:
    """"data=2,expert=4" -> {"data": 2, "expert": 4, "tensor": 1}."""
    sizes = {a: 1 for a in MESH_AXES}
    if not text.strip():
        return sizes
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", part)
        if not m:
            raise ValueError(f"mesh spec {text!r}: expected comma-separated axis=size, e.g. 'data=2,expert=4'")
        axis, size = m.group(1), int(m.group(2))
        if axis not in MESH_AXES:
            raise ValueError(f"mesh spec {text!r}: unknown axis {axis!r} (axes: {', '.join(MESH_AXES)})")
        if size < 1:
            raise ValueError(f"mesh spec {text!r}: axis {axis} needs a size >= 1")
        sizes[axis] = size
    return sizes


def make_mesh(spec: str | dict[str, int] = "", devices=None) -> jax.sharding.Mesh:
    """A (data, expert, tensor) mesh with explicit axes over `devices` (default: all)."""
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else {**{a: 1 for a in MESH_AXES}, **spec}
    devices = jax.devices() if devices is None else devices
    n = math.prod(sizes.values())
    if n > len(devices):
        raise ValueError(f"mesh {sizes} needs {n} devices, {len(devices)} are available "
                         f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} fakes them)")
    if jax.process_count() > 1 and n != len(devices):  # a process without a device in the mesh cannot take part
        raise ValueError(f"mesh {sizes} needs {n} devices, but a {jax.process_count()}-process job's mesh must span "
                         f"all {len(devices)} of its devices ({jax.local_device_count()} on each process)")
    devices = devices[:n]
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Explicit,) * len(MESH_AXES), devices=devices)


def current_mesh():
    """The mesh set with `jax.set_mesh` (abstract inside jit), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def spec(*logical: str | None) -> P | None:
    """PartitionSpec of logical axes under the current mesh; None without a mesh (or where
    every axis is manual)."""
    mesh = current_mesh()
    if mesh is None or AxisType.Explicit not in mesh.axis_types:
        return None
    return P(*(present_axes(RULES.mesh_axes(name), mesh) for name in logical))


def batch_major(x: jax.Array) -> jax.Array:
    """x laid out with its leading axis over the batch shards (as a layer's outputs are), so a
    freshly made array can start a scan carry; unchanged without a mesh."""
    s = spec("batch", *([None] * (x.ndim - 1)))
    return x if s is None else jax.sharding.reshard(x, s)


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids]: entries of a (replicated) table [V, ...] for batch-major ids [B, ...] ->
    [B, ..., ...], batch-major under a mesh (the gather's output sharding is not implied by
    its operands)."""
    s = spec("batch", *([None] * (ids.ndim + table.ndim - 2)))
    return table[ids] if s is None else table.at[ids].get(out_sharding=s)


def present_axes(axes, mesh):
    """Drop mesh axes of size 1 (they shard nothing and only complicate types) and axes
    that are manual here (inside shard_map each device already holds its own rows)."""
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, str) else axes
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    kept = tuple(a for a in axes if mesh.shape[a] > 1 and types[a] == AxisType.Explicit)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def rows(x: jax.Array) -> P | None:
    """Spec of a batch-major array (caches, per-slot state): rows over the batch axes."""
    return spec("batch", *([None] * (x.ndim - 1)))


def per_row(f):
    """Run a row-independent function of batch-major arrays (sampling, slot bookkeeping) on
    each device's own rows: `shard_map` over the batch axes under a mesh, `f` itself without."""

    def wrapped(*args):
        mesh = current_mesh()
        if mesh is None:
            return f(*args)
        axes = P(present_axes(RULES.mesh_axes("batch"), mesh))
        return jax.shard_map(f, in_specs=axes, out_specs=axes)(*args)

    return wrapped


def reshape(x: jax.Array, shape) -> jax.Array:
    """`x.reshape(shape)` that keeps the sharding: under a mesh, each group of dims that
    merges or splits carries the sharding of its leading input dim onto its leading output
    dim (explicit mode asks for this whenever a reshape touches a sharded array)."""
    shape = tuple(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    if current_mesh() is None:
        return x.reshape(shape)
    in_spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    out = [None] * len(shape)
    i = j = 0
    while i < x.ndim and j < len(shape):
        pi, pj, ii, jj = x.shape[i], shape[j], i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi, ii = pi * x.shape[ii], ii + 1
            else:
                pj, jj = pj * shape[jj], jj + 1
        out[j] = in_spec[i]
        i, j = ii, jj
    return jax.lax.reshape(x, shape, out_sharding=P(*out))


def axis_size(logical: str) -> int:
    """How many shards a logical axis has under the current mesh (1 without one)."""
    mesh = current_mesh()
    if mesh is None:
        return 1
    axes = RULES.mesh_axes(logical)
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def param_sharding(param_spec, mesh) -> NamedSharding:
    """Sharding of one declared weight. A dim its mesh axes do not divide is replicated
    (e.g. 4 query heads on tensor=8)."""
    parts = []
    for dim, name in zip(param_spec.shape, param_spec.axes):
        axes = present_axes(RULES.mesh_axes(name), mesh)
        size = 1 if axes is None else math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        parts.append(axes if size > 1 and dim % size == 0 else None)
    return NamedSharding(mesh, P(*parts))


def batch_sharding(mesh, ndim: int, axis: int = 0) -> NamedSharding:
    """Axis `axis` (default the leading one) over the batch axes, the rest replicated
    (caches, slot state; a stacked cache leaf [R, B, ...] has its batch at axis 1)."""
    axes = present_axes(RULES.mesh_axes("batch"), mesh)
    parts = [None] * ndim
    parts[axis] = axes
    return NamedSharding(mesh, P(*parts))


def shardings_for(specs, mesh):
    """A tree of NamedShardings matching a spec tree."""
    return jax.tree.map(lambda s: param_sharding(s, mesh), specs, is_leaf=is_spec)


def bytes_per_device(specs, mesh) -> dict[str, int]:
    """Bytes each device holds per weight group (abstract; `mesh` may be a dict of axis
    sizes, no devices needed): the memory report and the too-big-for-the-mesh check."""
    if isinstance(mesh, dict):
        sizes = {**{a: 1 for a in MESH_AXES}, **mesh}
        mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                                         axis_types=(AxisType.Explicit,) * len(MESH_AXES))
    out: dict[str, int] = {}
    for path, s in spec_leaves(specs):
        sh = param_sharding(s, mesh)
        local = sh.shard_shape(s.shape)
        nbytes = int(np.prod(local, dtype=np.int64)) * np.dtype(s.dtype).itemsize
        out[weight_group(path)] = out.get(weight_group(path), 0) + nbytes
    return out
