"""The one kernel-choice rule every kernel file's dispatch follows.

    impl          here                              runs
    "reference"   anywhere                          the kernel file's pure-jnp reference
    "pallas"      Hopper+ NVIDIA GPU                the Mosaic GPU kernel (compiled)
                  TPU                               the Mosaic TPU kernel (compiled)
                  elsewhere                         the generic Pallas kernel (interpreted on CPU)
    "mosaic_gpu"  Hopper+ NVIDIA GPU                the Mosaic GPU kernel (compiled)
                  elsewhere                         the Mosaic GPU kernel in GPU interpret mode
    "mosaic_tpu"  TPU                               the Mosaic TPU kernel (compiled)
                  elsewhere                         the Mosaic TPU kernel in TPU interpret mode

`resolve_kernels` turns the user's choice, which may also be "auto", into one of these.
`on_batch_shards` is how a kernel meets a mesh: each device runs it on its own rows.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, PartitionSpec as P

from dsjax.config import KERNELS  # the allowed values, declared once with the run options
from dsjax.kernels.tpu_blocks import tpu_available


def mosaic_gpu_available() -> bool:
    """Mosaic GPU targets NVIDIA Hopper and newer (compute capability >= 9.0)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)  # CUDA devices only
    return device.platform == "gpu" and capability is not None and float(capability) >= 9.0


def kernel_choice(impl: str) -> tuple[str, bool]:
    """impl -> (which implementation: "reference" | "pallas" (the generic kernel) |
    "mosaic_gpu" | "mosaic_tpu", run it in interpret mode?), per the table above."""
    if impl == "reference":
        return "reference", False
    if impl not in KERNELS:
        raise ValueError(f"kernel impl must be one of {KERNELS}, got {impl!r}")
    tpu = tpu_available()
    if impl == "mosaic_tpu" or (impl == "pallas" and tpu):
        return "mosaic_tpu", not tpu
    hopper = mosaic_gpu_available()
    if impl == "mosaic_gpu" or hopper:
        return "mosaic_gpu", not hopper
    return "pallas", jax.default_backend() == "cpu"


def resolve_kernels(kernels: str) -> str:
    """The user's kernel choice -> one of KERNELS. "auto": the Mosaic GPU or Mosaic TPU
    kernels (through "pallas") on a Hopper-or-newer NVIDIA GPU or a TPU, the reference
    elsewhere (the generic Pallas kernels take whole key / expert-weight arrays as blocks:
    for checking, not for speed)."""
    if kernels == "auto":
        return "pallas" if mosaic_gpu_available() or tpu_available() else "reference"
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {(*KERNELS, 'auto')}, got {kernels!r}")
    return kernels


def on_batch_shards(fn, batched: tuple, shared: tuple = ()):
    """fn(*batched, *shared) for a kernel whose rows are independent along axis 0 of `batched`
    (and of its output), under the current mesh. Pallas kernels see whole arrays as blocks, so
    on an explicit mesh each device runs the kernel on its own rows: a `jax.shard_map` over
    the mesh axes that split batched[0]'s rows, other axes gathered first, `shared` arrays
    whole (no `batched`: every device runs the whole call). Without a mesh, or inside a
    shard_map (manual axes), fn runs as it is. None arguments pass through."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return fn(*batched, *shared)
    spec = jax.typeof(batched[0]).sharding.spec if batched else ()
    rows = spec[0] if len(spec) else None
    args = [None if a is None else jax.reshard(a, P(rows, *[None] * (a.ndim - 1))) for a in batched]
    args += [jax.tree.map(lambda a: jax.reshard(a, P()), a) for a in shared]  # a tree: an MXFP4 (bytes, exponents)
    present = [i for i, a in enumerate(args) if a is not None]
    specs = tuple(P(rows) if i < len(batched) else P() for i in present)

    def local(*given):
        full = [None] * len(args)
        for i, a in zip(present, given):
            full[i] = a
        return fn(*full)

    # check_vma off: a pallas_call's outputs carry no varying-axes type. A replicated call runs
    # in a shard_map too, so that every device meets a kernel the same way (TPU interpret mode
    # keeps one simulated machine for all devices of a call).
    return jax.shard_map(local, in_specs=specs, out_specs=P(rows), check_vma=False)(*[args[i] for i in present])


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A Pallas kernel output's type: inside a shard_map (the MoE's expert-parallel step) it
    varies over the mesh axes `like` varies over, which a shard_map checking types needs stated."""
    mat = getattr(jax.typeof(like), "mat", None)
    return jax.ShapeDtypeStruct(shape, dtype) if mat is None else jax.ShapeDtypeStruct(shape, dtype,
                                                                                        manual_axis_type=mat)
