"""The public entry points notebooks and tests use: `load_model` and `Model`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import code_memory
from dsjax.checkpoint import load_checkpoint, orbax_io
from dsjax.checkpoint.engram_tables import EngramStore
from dsjax.checkpoint.loader import checkpoint_format, has_mtp
from dsjax.checkpoint.quant import QuantFormat
from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.compile_cache import setup_compile_cache
from dsjax.config import ModelConfig, RuntimeOptions, load_config
from dsjax.layers.quantized import Bf16Weight, resident_specs
from dsjax.engine.spec_options import check_draft_vocab
from dsjax.engine.requests import check_prompt
from dsjax.memory import device_memory, show_bytes
from dsjax.model.family import family_of
from dsjax.model.forward_pass import forward
from dsjax.model.interface import with_sequence_rows
from dsjax.kernels.dispatch import resolve_kernels
from dsjax.param_count import count_params
from dsjax.params import abstract_params, init_params, spec_leaves
from dsjax.sharding.distributed import to_host
from dsjax.sharding.rules import axis_size, batch_sharding, bytes_per_device, make_mesh, shardings_for
from dsjax.weights import DEFAULT_MODEL
from dsjax.weights import resolve as resolve_bundled

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}


def resolve_dtype(dtype) -> jnp.dtype:
    """"bfloat16" / "float32" (or the jnp dtypes), or "auto": float32 on CPU (XLA:CPU's bf16
    matmuls run several times slower than its fp32 ones), bfloat16 on GPU / TPU."""
    if isinstance(dtype, str) and dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['auto']}, got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


def _amount(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


SMALLEST_SEQUENCE = 16  # `Model.logits` pads shorter sequences to this many tokens


def padded_size(n: int, smallest: int) -> int:
    """n rounded up to a size of the few `Model.logits` compiles programs for: `smallest` at
    least, then four sizes an octave (16, 20, 24, 28, 32, 40, 48, ...; under 8 every size),
    so at most a quarter more than n."""
    if n <= smallest:
        return smallest
    step = 1 << max((n - 1).bit_length() - 3, 0)
    return -(-n // step) * step


@dataclasses.dataclass
class Model:
    """A config and its weights (and the mesh they are sharded over, if any), with the
    options it runs under (kernels, MoE capacity). Everything that runs is a pure function
    of these."""

    config: ModelConfig
    params: Any  # the generation's parameter tree (V4: ModelParams; V4.1: ModelParamsV41)
    dtype: jnp.dtype
    mesh: jax.sharding.Mesh | None = None
    mtp: Any = None  # the drafter's parameters (MTPParams; V4.1: DSparkParams), when loaded
    options: RuntimeOptions = RuntimeOptions()
    draft_vocab: np.ndarray | None = None  # [|D|] int32: the ids the drafter proposes from (draft_vocab.json)

    def __repr__(self) -> str:  # the dataclass default would print every weight array
        counts, family = count_params(self.config, self.dtype), family_of(self.config)
        drafter = family.drafter_name
        mtp = f" (+ {drafter} drafter: {_amount(counts['total_with_mtp'] - counts['total'])})" if self.mtp is not None \
            else ""
        if self.mtp is not None and self.draft_vocab is not None:
            mtp = mtp[:-1] + f", drafting from {len(self.draft_vocab)} tokens)"
        mesh = "one device" if self.mesh is None else ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        tables = getattr(self.params, "engram_tables", None)
        engram = "" if tables is None else (f"\n  engram      {len(tables.tables)} host tables, "
                                            f"{_amount(family.host_table_values(self.config))} values ({tables.source})")
        return (f"dsjax.Model {self.config.name!r}\n"
                f"  dtype       {jnp.dtype(self.dtype).name}\n"
                f"  parameters  {_amount(counts['total'])}, {_amount(counts['active'])} active per token{mtp}\n"
                f"  mesh        {mesh}\n"
                f"  kernels     {self.options.kernels} (quantized weights: {self.options.quantized}){engram}")

    def replace(self, **changes) -> "Model":
        """A copy with fields replaced, e.g. `model.replace(options=model.options.replace(kernels="pallas"))`."""
        return dataclasses.replace(self, **changes)

    def mesh_context(self):
        """`with model.mesh_context():` runs code under this model's mesh (no-op without one)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def sequence_params(self, ids: np.ndarray):
        """The params for one whole-sequence forward over host ids [B, S]: V4.1's Engram rows
        fetched before the call (`with_sequence_rows`: a program without a host callback, which
        JAX's persistent cache keeps), on a mesh split over its batch axes as the ids are."""
        return with_sequence_rows(self.params, ids, self.config, put=self._on_batch_shards)

    def _on_batch_shards(self, a: np.ndarray) -> jax.Array:
        """A batch-major host array on the device, or split over the mesh's batch axes."""
        return jnp.asarray(a) if self.mesh is None else jax.device_put(a, batch_sharding(self.mesh, a.ndim))

    def batch_shards(self) -> int:
        with self.mesh_context():
            return axis_size("batch")

    def logits(self, token_ids) -> np.ndarray:
        """Full causal forward, no cache: token_ids [B, S] -> logits [B, S, vocab] (fp32).

        It runs the program of a padded shape (`padded_size`: B and S rounded up by at most a
        quarter, S to at least 16; token 0 after each row, extra rows), so that many lengths
        share a few compiled programs instead of compiling one each. The padding comes after
        every position (the forward is causal), so the logits are those of the unpadded
        forward (`dsjax.inspect.forward`) up to float rounding: XLA sums in an order that
        depends on the shape (differences of ~5e-7 measured on the tiny model)."""
        ids = np.asarray(token_ids)
        if ids.ndim == 1:
            raise ValueError(f"token_ids must be [batch, seq]; got a 1-D array of length {ids.shape[0]} "
                             f"(wrap a single sequence in a list)")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [batch, seq] array, got shape {ids.shape}")
        for i, row in enumerate(ids):
            check_prompt(row, self.config.vocab_size, f"token_ids[{i}]")
        b, s = ids.shape
        rows = padded_size(b, 1)
        rows += -rows % self.batch_shards()  # the batch splits evenly over the mesh's batch axes
        ids = np.pad(ids.astype(np.int32), ((0, rows - b), (0, padded_size(s, SMALLEST_SEQUENCE) - s)))
        code_memory.relieve()  # a program per shape: past most of the limit on code mappings, drop the old ones
        params = self.sequence_params(ids)
        with self.mesh_context():
            x = self._on_batch_shards(ids)
            return to_host(forward(params, x, self.config, opts=self.options)[0])[:b, :s]


def load_model(path_or_config_name: str | Path = DEFAULT_MODEL, *, dtype="auto", seed: int = 0, mesh=None,
               device_memory_bytes: int | None = None, quantized: str = "dequantize",
               progress: bool = False, check_finite: bool = True, mtp: bool | None = None,
               kernels: str = "reference") -> Model:
    """A checkpoint directory (config.json + safetensors), a bundled model by name (the
    default, `dsjax-tiny-py`: trained weights shipped with dsjax, see dsjax/weights), or a
    named config (`tiny`, `v4-flash`, `v4-pro`) / config JSON file with seeded random weights. A path to a
    checkpoint's `config.json` loads that checkpoint (the weights beside it); a config JSON
    with no weights beside it gets seeded random weights.

    dtype: "auto" (float32 on CPU, bfloat16 on GPU / TPU), "bfloat16" or "float32".

    check_finite: scan every weight as it is read; a NaN / inf is a `CheckpointError` naming
    the tensor and file (on by default; False skips the scan).

    mesh: a mesh spec ("data=2,expert=4"), a `jax.sharding.Mesh` from
    `dsjax.sharding.rules.make_mesh`, or None (one device). Weights are created / read
    directly in their sharding. Before anything is read, each device's share is checked
    against its memory (`device_memory_bytes`, default: what the device reports).

    quantized: for FP8 / MXFP4 checkpoints, "dequantize" (to `dtype` at load) or
    "resident" (keep the stored bytes on device, dequantize inside the matmuls: about half
    the weight memory). A named config with "resident" gets seeded weights drawn on the
    device, those stored quantized in that stored form (`dsjax.model.stored.stored_format`), never through a
    bf16 copy.

    mtp: load the MTP drafter layer (`mtp.0.*`): default when the checkpoint has it; with
    True on a named config it gets seeded random weights. A checkpoint directory's
    draft_vocab.json ({"ids": [...], "source": ...}: the token ids the drafter proposes
    from, see `Engine(draft_vocab=)`) becomes `Model.draft_vocab`.

    kernels: "reference" (pure jnp), "pallas" (dsjax/kernels: Mosaic GPU kernels on a
    GPU, generic Pallas elsewhere; on CPU interpreted, slow, for checking), "mosaic_gpu" (the
    Mosaic GPU kernels even off the GPU, in GPU interpret mode), or "auto" (the Mosaic GPU
    kernels on a Hopper-or-newer NVIDIA GPU, the reference elsewhere: the generic Pallas kernels take whole key /
    expert-weight arrays as blocks, which V4-sized layers cannot fit in a TPU's VMEM)."""
    setup_compile_cache()  # once per process; keeps a cache dir the user configured in JAX
    dtype = resolve_dtype(dtype)
    check_load_args(seed=seed, device_memory_bytes=device_memory_bytes, progress=progress, check_finite=check_finite,
                    mtp=mtp)
    path = Path(resolve_bundled(path_or_config_name))
    if path.name == "config.json" and path.is_file() and has_weights(path.parent):
        path = path.parent  # a checkpoint's config.json stands for the checkpoint: its weights, not random ones
    cfg = load_config(path)
    load = _LOADERS[cfg.model_type]
    return load(path, cfg, dtype, seed=seed, mesh=mesh, device_memory_bytes=device_memory_bytes, quantized=quantized,
                progress=progress, check_finite=check_finite, mtp=mtp, kernels=kernels)


def _load_v4(path: Path, cfg: ModelConfig, dtype, *, seed, mesh, device_memory_bytes, quantized, progress,
             check_finite, mtp, kernels) -> Model:
    """load_model for a DeepSeek-V4 config: a checkpoint (safetensors or `dsjax convert`'s
    orbax), or seeded weights; the MTP drafter (`Model.mtp`) as load_model's mtp says, and
    the checkpoint's draft vocabulary."""
    family = family_of(cfg)
    draft_ids = read_draft_vocab(path, cfg) if path.is_dir() else None  # checked before any weight is read
    kernels = resolve_kernels(kernels)
    specs = family.param_specs(cfg, dtype)
    if quantized not in ("dequantize", "resident"):
        raise ValueError(f"quantized must be 'dequantize' or 'resident', got {quantized!r}")
    saved_orbax = path.is_dir() and orbax_io.is_orbax(path)
    if saved_orbax:  # stored as written by `dsjax convert`: resident weights stay resident
        marker = orbax_io.read_marker(path)
        quantized = marker["quantized"]
        if quantized == "resident":
            specs = resident_specs(specs, tuple(marker["fp8_block"]), marker["experts_fp4"])
    elif quantized == "resident" and not path.is_dir():  # a named config: seeded bytes drawn in the stored form
        fmt = family.stored_format  # as the release stores it
        specs = resident_specs(specs, fmt.fp8_block, fmt.experts_fp4)
    elif quantized == "resident":
        fmt = resident_format(path)
        specs = resident_specs(specs, fmt.fp8_block, fmt.experts_fp4)
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    shardings = None
    if mesh is not None:
        check_mesh_fits(cfg, mesh)
        shardings = shardings_for(specs, mesh)
    if saved_orbax:
        want_mtp = orbax_io.read_marker(path).get("mtp", False) if mtp is None else mtp
    elif path.is_dir():
        want_mtp = has_mtp(path) if mtp is None else mtp
    else:
        want_mtp = bool(mtp)
    m_specs = m_shardings = None
    if want_mtp:
        m_specs = family.drafter_specs(cfg, dtype)
        if quantized == "resident" and not saved_orbax:
            m_specs = resident_specs(m_specs, fmt.fp8_block, fmt.experts_fp4)
        elif saved_orbax and marker["quantized"] == "resident":
            m_specs = resident_specs(m_specs, tuple(marker["fp8_block"]), marker["experts_fp4"])
        m_shardings = shardings_for(m_specs, mesh) if mesh is not None else None
    check_memory((specs, m_specs), mesh, device_memory_bytes)  # the drafter too, before anything is read
    mtp_params = None
    if saved_orbax:
        params = orbax_io.restore(path, abstract_params(specs, shardings))
        if want_mtp:
            mtp_params = orbax_io.restore(path, abstract_params(m_specs, m_shardings), item="mtp")
    elif path.is_dir():
        loaded = load_checkpoint(path, cfg, specs, shardings, progress=progress, check_finite=check_finite,
                                 mtp_specs=m_specs, mtp_shardings=m_shardings)
        params, mtp_params = loaded if want_mtp else (loaded, None)
    else:  # resident: every weight drawn on the device (the stored ones in their bytes)
        on_device = quantized == "resident"
        params = init_params(specs, seed, shardings, device_normal=on_device)
        mtp_params = init_params(m_specs, seed + 1, m_shardings, device_normal=on_device) if want_mtp else None
    return Model(cfg, params, dtype, mesh, mtp_params, RuntimeOptions(kernels=kernels, quantized=quantized), draft_ids)


def store_weights(model: Model, dtype="bfloat16") -> Model:
    """`model` with its projection matrices (attention, compressor and indexer projections,
    router, experts, vocabulary head) stored in bf16 and everything else (activations, cache,
    norms, mHC mixes, biases, the embedding) left in model.dtype: under a float32 model,
    16-bit weights with fp32 compute, half the bytes a CPU decode step reads. Each product
    widens its weight where it reads it (exact: the results are the float32 model's on the
    bf16-rounded weights). Quantized (resident) weights stay as stored.

    The layers' matrices are kept as `Bf16Weight` bits (XLA:CPU would widen a bf16 array cut
    from a scanned stack or gathered, whole, outside the loop); the vocabulary head, never cut
    or gathered in a program, is a plain bf16 array: XLA:CPU's fused multiply-reduce of a few
    rows reads it as it is, where the bits would first be widened into a fp32 copy of the
    whole head (docs/cpu-decode.md, "16-bit weights")."""
    if resolve_dtype(dtype) != jnp.bfloat16 or jnp.dtype(model.dtype) != jnp.float32:
        raise ValueError(f"store_weights stores bfloat16 weights under a float32 model, not {dtype!r} weights "
                         f"under {jnp.dtype(model.dtype).name}; a bfloat16 model already is one (load_model(dtype=))")

    def narrow(path, leaf):
        name = str(getattr(path[-1], "name", getattr(path[-1], "key", "")))
        if isinstance(leaf, jax.Array) and leaf.dtype == jnp.float32 and name in STORED_NARROW:
            return leaf.astype(jnp.bfloat16) if name == "lm_head" else Bf16Weight.of(leaf)
        return leaf

    params = jax.tree_util.tree_map_with_path(narrow, model.params)
    mtp = None if model.mtp is None else jax.tree_util.tree_map_with_path(narrow, model.mtp)
    return dataclasses.replace(model, params=params, mtp=mtp, options=model.options.replace(compute_dtype="float32"))


STORED_NARROW = frozenset(("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "gate_proj", "weights_proj",
                           "router", "w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3", "lm_head", "e_proj",
                           "h_proj"))  # the matrices every product reads through `dense`


SEEDED_ENGRAM_BYTES = 1 << 30  # a named V4.1 config gets seeded Engram tables in memory up to this size


def _load_v41(path: Path, cfg: ModelConfig, dtype, *, seed, mesh, device_memory_bytes, quantized, progress,
              check_finite, mtp, kernels) -> Model:
    """load_model for a DeepSeek-V4.1 config: the backbone read from the checkpoint (or seeded)
    and its Engram tables memory-mapped from it (a named config: seeded tables held in memory,
    up to SEEDED_ENGRAM_BYTES; larger ones are left out, and so is the Engram update). The
    DSpark head (`Model.mtp`, the engine's drafter) loads as load_model's mtp says."""
    family = family_of(cfg)
    if quantized not in ("dequantize", "resident"):
        raise ValueError(f"quantized must be 'dequantize' or 'resident', got {quantized!r}")
    if path.is_dir() and orbax_io.is_orbax(path):
        raise ValueError(f"{path}: a `dsjax convert` (orbax) directory of a DeepSeek-V4.1 model cannot be loaded yet; "
                         f"load the original checkpoint")
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    specs = family.param_specs(cfg, dtype)
    mtp = (has_mtp(path) if path.is_dir() else False) if mtp is None else mtp
    m_specs = family.drafter_specs(cfg, dtype) if mtp else None
    if mtp and m_specs is None:
        raise ValueError(f"mtp=True: config {cfg.name!r} has no DSpark drafter (num_nextn_predict_layers / dspark)")
    if quantized == "resident":  # FP8 on 32 x 32 tiles and MXFP4 experts, kept as stored (spec §7.3, §7.4)
        fmt = resident_format(path, family.stored_format.fp8_block) if path.is_dir() else family.stored_format
        keep = functools.partial(resident_specs, block=fmt.fp8_block, experts_fp4=fmt.experts_fp4,
                                 fp8_linears=family.stored_format.fp8_linears)
        specs, m_specs = keep(specs), None if m_specs is None else keep(m_specs)
    shardings = m_shardings = None
    if mesh is not None:
        check_mesh_fits(cfg, mesh)
        shardings = shardings_for(specs, mesh)
        m_shardings = shardings_for(m_specs, mesh) if m_specs is not None else None
    check_memory((specs, m_specs), mesh, device_memory_bytes)
    e = cfg.engram
    if path.is_dir():  # the tables are mapped (and checked) first: a bad one is refused before any weight is read
        tables = EngramStore.from_checkpoint(path, cfg) if e is not None else None
        loaded = load_checkpoint(path, cfg, specs, shardings, progress=progress, check_finite=check_finite,
                                 mtp_specs=m_specs, mtp_shardings=m_shardings)
        params, drafter = loaded if m_specs is not None else (loaded, None)
    else:
        on_device = quantized == "resident"  # every weight drawn on the device, the stored ones in their bytes
        params = init_params(specs, seed, shardings, device_normal=on_device)
        drafter = init_params(m_specs, seed + 1, m_shardings, device_normal=on_device) if m_specs is not None else None
        small = e is not None and family.host_table_values(cfg) * (1 + 1 / 32) <= SEEDED_ENGRAM_BYTES
        tables = EngramStore.seeded(cfg, seed + 2) if small else None
    params = params.replace(engram_tables=tables)
    options = RuntimeOptions(kernels=resolve_kernels(kernels), quantized=quantized)
    return Model(cfg, params, dtype, mesh, drafter, options)


_LOADERS = {"deepseek_v4": _load_v4, "deepseek_v41": _load_v41}  # by the config's model_type


def resident_format(path: Path, block: tuple[int, int] | None = None) -> QuantFormat:
    """The stored format of the checkpoint `quantized="resident"` keeps on device; refused
    (naming the field) without a quantization_config, or with another weight_block_size than
    `block`, the one the model's format has (None: any whose scales fit the weights)."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()) or "quantization_config" not in json.loads(config.read_text()):
        raise ValueError(f"quantized='resident' needs an FP8 / MXFP4 checkpoint; {path} declares no "
                         f"quantization_config")
    fmt = checkpoint_format(path)
    if block is not None and tuple(fmt.fp8_block) != tuple(block):
        raise CheckpointError(f"{config}: quantization_config.weight_block_size {list(fmt.fp8_block)}, but this model "
                              f"stores FP8 on {list(block)} tiles; quantized='resident' keeps the stored tiles, so "
                              f"load with quantized='dequantize'")
    return fmt


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(directory: Path, cfg: ModelConfig) -> np.ndarray | None:
    """A checkpoint's draft_vocab.json -> its checked ids (sorted int32), or None without one."""
    f = Path(directory) / DRAFT_VOCAB_FILE
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("ids"), list):
        raise ValueError(f"{f}: expected an object with a list \"ids\" of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in record["ids"]):
        raise ValueError(f"{f}: \"ids\" must hold integer token ids only")
    return check_draft_vocab(np.asarray(record["ids"], np.int64), cfg.vocab_size, f"{f} \"ids\"")


def has_weights(directory: Path) -> bool:
    """Whether a directory holds a checkpoint's weights (safetensors, an index, or orbax)."""
    return (orbax_io.is_orbax(directory) or (directory / "model.safetensors.index.json").is_file()
            or any(directory.glob("*.safetensors")))


def check_load_args(*, seed, device_memory_bytes, progress, check_finite, mtp) -> None:
    """load_model's plain arguments, each refused by name before anything is read."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if device_memory_bytes is not None and (not isinstance(device_memory_bytes, (int, np.integer))
                                            or isinstance(device_memory_bytes, bool) or device_memory_bytes <= 0):
        raise ValueError(f"device_memory_bytes must be a positive int or None, got {device_memory_bytes!r}")
    for name, value in (("progress", progress), ("check_finite", check_finite), ("mtp", mtp)):
        if not (isinstance(value, (bool, np.bool_)) or (name == "mtp" and value is None)):
            raise ValueError(f"{name} must be a bool{' or None' if name == 'mtp' else ''}, got {value!r}")


def check_mesh_fits(cfg: ModelConfig, mesh) -> None:
    """The mesh must split what it shards evenly (experts, head groups)."""
    ep, tp = mesh.shape["expert"], mesh.shape["tensor"]
    if cfg.n_routed_experts % ep:
        raise ValueError(f"mesh expert={ep} does not divide n_routed_experts={cfg.n_routed_experts}")
    if tp > 1 and (cfg.o_groups % tp or cfg.num_attention_heads % tp):
        raise ValueError(f"mesh tensor={tp} must divide o_groups={cfg.o_groups} and "
                         f"num_attention_heads={cfg.num_attention_heads}")


def check_memory(specs, mesh, device_memory_bytes: int | None) -> None:
    """Fail before reading anything if one device's share of the weights (`specs`: any tree of
    specs, the drafter's included; stored-format leaves count their stored bytes) does not fit."""
    if mesh is None:
        need = sum(s.nbytes for _, s in spec_leaves(specs))
        device = jax.devices()[0]
    else:
        need = sum(bytes_per_device(specs, mesh).values())
        device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    have = device_memory_bytes if device_memory_bytes is not None else device_memory(device)
    if need > have:
        where = "one device" if mesh is None else f"each device of mesh {dict(mesh.shape)}"
        raise MemoryError(f"the weights need {show_bytes(need)} ({need} B) on {where}, but a device holds "
                          f"{show_bytes(have)} ({have} B); use a larger mesh (more expert / tensor shards)")
