"""Load a V4 checkpoint directory (any of the three spellings, see names.py) into the dsjax
parameter pytree.

Every tensor is checked before anything is used: a tensor the model needs but the files
lack, a tensor the files have but the model does not use, or a shape or type that does not
fit the config is a `CheckpointError` naming the tensor, its file, and what was expected.

Stored formats: plain (F32 / BF16 / ...), FP8 E4M3 with E8M0 block scales, and MXFP4
(packed E2M1 + E8M0 per 32 inputs) — see quant.py. Each weight is either dequantized slice
by slice at load (`quantized="dequantize"`) or kept as stored on device
(`quantized="resident"`: the spec tree holds Fp8Weight / Fp4Weight containers).
Reads are lazy and per device shard: each device's slice is built from the bytes it needs.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from dsjax.checkpoint.names import (HOST_TABLE_MARK, IGNORED_PREFIXES, Source, canonical_name, mtp_weight_names,
                                    per_layer_paths, weight_names)
from dsjax.checkpoint.quant import QuantFormat, dequant_fp4, dequant_fp8, e8m0_exponents
from dsjax.checkpoint.safetensors_io import CheckpointError, CheckpointFiles
from dsjax.config import ModelConfig
from dsjax.layers.quantized import MXFP4_GROUP, Fp4Weight, Fp8Weight
from dsjax.params import ParamSpec, is_spec, materialize, path_str, unstacked

QUANT_PARTS = ("q", "scale_exp", "packed")  # leaf names inside Fp8Weight / Fp4Weight


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

    def read(self, canon: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        return self.files.read(self.stored[canon], index)

    def where(self, canon: str) -> str:
        info = self.info(canon)
        return f"tensor '{info.name}' in {info.file.name}"


def _fail_shape(index, canon, shape, expected, path):
    raise CheckpointError(f"{index.where(canon)}: shape {list(shape)}, expected {list(expected)} "
                          f"(dsjax weight {path}) for this config")


def _scale_name(canon: str) -> str:
    return canon[: -len("weight")] + "scale" if canon.endswith("weight") else canon + ".scale"


class _Tensor:
    """One stored tensor standing for a dense [out, in]-like weight: its format, checks,
    and readers of any slice (dense) or of its raw parts (resident)."""

    def __init__(self, index: _Index, canon: str, shape: tuple[int, ...], spec: ParamSpec, path: str,
                 fmt: QuantFormat, part: str | None = None):
        self.index, self.canon, self.shape, self.path = index, canon, tuple(shape), path
        info = index.info(canon)
        integral = part is None and np.issubdtype(np.dtype(spec.dtype), np.integer)
        if part is None and integral != info.dtype.startswith(("I", "U")) and not (
                info.dtype in ("I8", "U8") and not integral):
            raise CheckpointError(f"{index.where(canon)}: dtype {info.dtype}, expected "
                                  f"{'an integer' if integral else 'a floating-point'} tensor (dsjax weight {path})")
        self.kind = "plain"
        self.names = [canon]
        scale = _scale_name(canon)
        if info.dtype == "F8_E4M3" or (info.dtype in ("I8", "U8") and not integral):
            if not index.has(scale):
                raise CheckpointError(f"{index.where(canon)}: {info.dtype} weight without its scale tensor "
                                      f"'{scale}' (dsjax weight {path})")
            self.names.append(scale)
            s_shape = tuple(index.info(scale).shape)
            if info.dtype == "F8_E4M3":
                self.kind, self.block = "fp8", fmt.fp8_block
                want = (*shape[:-2], -(-shape[-2] // self.block[0]), -(-shape[-1] // self.block[1]))
            else:
                self.kind = "fp4"
                want = (*shape[:-1], shape[-1] // MXFP4_GROUP)
                packed = (*shape[:-1], shape[-1] // 2)
                if tuple(info.shape) != packed:
                    _fail_shape(index, canon, info.shape, packed, path + " (MXFP4 packed)")
            if s_shape != want:
                _fail_shape(index, scale, s_shape, want, path + f" ({self.kind} scales)")
        if self.kind != "fp4" and tuple(info.shape) != self.shape:
            _fail_shape(index, canon, info.shape, self.shape, path)
        wanted = {None: self.kind, "q": "fp8", "packed": "fp4", "scale_exp": self.kind}[part]
        if part is not None and (self.kind == "plain" or self.kind != wanted):
            raise CheckpointError(f"{index.where(canon)}: stored as {self.kind} ({info.dtype}), but the model "
                                  f"expects it {wanted}-resident (dsjax weight {path}); load with "
                                  f"quantized='dequantize'")

    def read(self, ix: tuple[slice, ...], dtype) -> np.ndarray:
        """The dense values of slice ix (dequantized if stored quantized)."""
        if self.kind == "plain":
            return self.index.read(self.canon, ix).astype(dtype)
        scale = _scale_name(self.canon)
        if self.kind == "fp8":
            (*lead, rows, cols) = ix
            b0, b1 = self.block
            s = e8m0_exponents(self.index.read(scale, (*lead, slice(rows.start // b0, -(-rows.stop // b0)),
                                                       slice(cols.start // b1, -(-cols.stop // b1)))))
            return dequant_fp8(self.index.read(self.canon, ix), s, self.block, rows, cols, dtype)
        whole_rows = ix[:-1]  # packed bytes and scales cover whole rows; crop the columns after
        values = dequant_fp4(self.index.read(self.canon, whole_rows),
                             e8m0_exponents(self.index.read(scale, whole_rows)), np.float32)
        return values[..., ix[-1]].astype(dtype)

    def read_part(self, part: str, ix: tuple[slice, ...]) -> np.ndarray:
        """The stored bytes of one part (resident mode): values or scale exponents."""
        if part == "scale_exp":
            return e8m0_exponents(self.index.read(_scale_name(self.canon), ix)).copy()
        return self.index.read(self.canon, ix)


def _expand(index, shape) -> tuple[slice, ...]:
    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    return tuple(slice(*ix.indices(n)) for ix, n in zip(index, shape))


def _plan_stacked(index: _Index, table: dict[str, Source], fmt: QuantFormat, paths: list[str], spec: ParamSpec,
                  parent_shape=None):
    """A weight stacked over layers (leading [repeats] axis): each layer's tensors planned
    as its own weight, slices stacked on read (as `read_stacked` stacks experts)."""
    one, inner = unstacked(spec), None if parent_shape is None else parent_shape[1:]
    plans = [_plan(index, table, fmt, p, one, inner) for p in paths]

    def read_layers(ix):
        return np.stack([plans[r][1](_expand(ix[1:], one.shape)) for r in range(*ix[0].indices(len(plans)))])

    return [n for names, _ in plans for n in names], read_layers


def _plan(index: _Index, table: dict[str, Source], fmt: QuantFormat, path: str, spec: ParamSpec, parent_shape=None):
    """Check one leaf's tensors; return (names consumed, reader(ix) -> np.ndarray)."""
    base, _, part = path.rpartition(".")
    if part in QUANT_PARTS and base in table:
        src, weight_shape = table[base], parent_shape
    else:
        src, part, weight_shape = table[path], None, spec.shape
    if src.expert is None:
        t = _Tensor(index, src.name, weight_shape, spec, path, fmt, part)
        if part is None:
            return t.names, lambda ix: t.read(ix, np.dtype(spec.dtype))
        return t.names, lambda ix: t.read_part(part, ix)
    # routed experts: per-expert tensors stacked over e, or HF's fused gate_up / down
    names = src.candidates(weight_shape[0])
    per_expert, fused = names[:-1], names[-1]
    if any(index.has(n) for n in per_expert):
        missing = [n for n in per_expert if not index.has(n)]
        if missing:
            raise CheckpointError(f"{len(missing)} routed-expert tensor(s) missing for dsjax weight {path}: "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
        tensors = [_Tensor(index, n, weight_shape[1:], spec, path, fmt, part) for n in per_expert]

        def read_stacked(ix):
            experts, rest = ix[0], ix[1:]
            get = (lambda t: t.read(rest, np.dtype(spec.dtype))) if part is None else (lambda t: t.read_part(part, rest))
            return np.stack([get(tensors[e]) for e in range(*experts.indices(weight_shape[0]))])

        return [n for t in tensors for n in t.names], read_stacked
    if not index.has(fused):
        raise CheckpointError(f"tensor '{per_expert[0]}' (or the fused '{fused}') is missing (dsjax weight {path})")
    if part is not None:
        raise CheckpointError(f"{index.where(fused)}: fused HF expert tensors are not stored quantized; load with "
                              f"quantized='dequantize' (dsjax weight {path})")
    if src.expert == "w2":
        t = _Tensor(index, fused, weight_shape, spec, path, fmt)
        return t.names, lambda ix: t.read(ix, np.dtype(spec.dtype))
    e, i, d = weight_shape
    t = _Tensor(index, fused, (e, 2 * i, d), spec, path, fmt)
    offset = 0 if src.expert == "w1" else i  # w1 rows, then w3 rows

    def read_half(ix):
        rows = range(*ix[1].indices(i))
        return t.read((ix[0], slice(offset + rows.start, offset + rows.stop), ix[2]), np.dtype(spec.dtype))

    return t.names, read_half


def checkpoint_format(directory: str | Path) -> QuantFormat:
    """The storage format a checkpoint's config.json declares (plain if none)."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    try:
        return QuantFormat.from_hf(raw) or QuantFormat()
    except ValueError as e:
        raise CheckpointError(f"{directory}/config.json: {e}") from None


def has_mtp(directory: str | Path) -> bool:
    """Whether the checkpoint carries the MTP layer (`mtp.0.*`)."""
    files = CheckpointFiles(directory)
    try:
        return any(canonical_name(n).startswith("mtp.0.") for n in files.tensors)
    finally:
        files.close()


def load_checkpoint(directory: str | Path, cfg: ModelConfig, specs, shardings=None, progress: bool = False,
                    check_finite: bool = False, mtp_specs=None, mtp_shardings=None):
    """Read every weight of `specs` (a dsjax spec tree; quantized leaves keep the stored
    bytes) from the checkpoint in `directory`. All names, shapes and types are checked
    before the first byte of data is read. With `shardings` (a matching tree of
    NamedShardings), each device's shard is built from only the bytes it needs.
    check_finite: scan every value as it is read; a NaN / inf is an error naming the tensor.
    mtp_specs: also read the MTP layer (`mtp.0.*`) -> returns (params, mtp_params)."""
    files = CheckpointFiles(directory)
    try:
        index = _Index(files)
        fmt = checkpoint_format(directory)
        parts = [(specs, weight_names(cfg), shardings)]
        if mtp_specs is not None:
            parts.append((mtp_specs, mtp_weight_names(cfg), mtp_shardings))
        consumed: set[str] = set()
        planned = []
        for part_specs, table, _ in parts:
            missing = [s.name for s in table.values() if s.expert is None and not index.has(s.name)]
            if missing:
                raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing: {missing[:10]}"
                                      + (" ..." if len(missing) > 10 else ""))
            flat, tree = jax.tree_util.tree_flatten_with_path(part_specs, is_leaf=is_spec)
            shapes = _dense_shapes(part_specs)
            readers = []
            for p, spec in flat:
                name = path_str(p)
                parent = shapes.get(name.rpartition(".")[0])
                layers = per_layer_paths(cfg, name)
                names, reader = (_plan(index, table, fmt, name, spec, parent) if layers is None
                                 else _plan_stacked(index, table, fmt, layers, spec, parent))
                consumed.update(names)
                readers.append(functools.partial(_read_checked, reader, spec, names, index, check_finite))
            planned.append(tree.unflatten(readers))
        ignored = IGNORED_PREFIXES if mtp_specs is None else ()
        unexpected = sorted(c for c in index.stored if c not in consumed and not c.startswith(ignored)
                            and HOST_TABLE_MARK not in c)
        if unexpected:
            where = [index.where(c) for c in unexpected[:8]]
            raise CheckpointError(f"{directory}: {len(unexpected)} tensor(s) this config does not use "
                                  f"(does config.json match the weights?): {where}"
                                  + (" ..." if len(unexpected) > 8 else ""))
        total = sum(s.nbytes for part_specs, _, _ in parts for s in jax.tree.leaves(part_specs, is_leaf=is_spec))
        with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                  file=sys.stderr, disable=not progress) as bar:
            loaded = [materialize(s, r, sh, progress=bar.update) for (s, _, sh), r in zip(parts, planned)]
        return loaded[0] if mtp_specs is None else tuple(loaded)
    finally:
        files.close()


def _read_checked(reader, spec: ParamSpec, names: list[str], index: _Index, check_finite: bool, ix) -> np.ndarray:
    arr = reader(_expand(ix, spec.shape)).astype(np.dtype(spec.dtype))
    if check_finite and _has_non_finite(arr):
        bad = next((n for n in names if index.info(n).dtype in ("F32", "F16", "BF16", "F64")
                    and _has_non_finite(np.asarray(index.read(n)))), names[0])
        raise CheckpointError(f"{index.where(bad)}: non-finite values (NaN or inf); load with check_finite=False "
                              f"to skip this scan")
    return arr


def _has_non_finite(arr: np.ndarray) -> bool:
    """Whether a floating-point array holds a NaN or inf (integer arrays: never). Scanned in
    cache-sized chunks, so the temporaries never travel to memory; bf16 is read from its
    bit pattern (exponent all ones). On by default, so it must stay cheap next to the read."""
    floating = arr.dtype.kind == "f" or arr.dtype in _ML_FLOATS
    if not floating or not arr.size:
        return False
    bf16 = arr.dtype == ml_dtypes.bfloat16
    flat = arr.reshape(-1).view(np.uint16) if bf16 else arr.reshape(-1)
    buf = np.empty(min(flat.size, _SCAN_CHUNK), np.uint16 if bf16 else bool)
    for start in range(0, flat.size, _SCAN_CHUNK):
        chunk = flat[start: start + _SCAN_CHUNK]
        out = buf[: chunk.size]
        if bf16:
            if np.bitwise_and(chunk, _BF16_EXPONENT, out=out).max() == _BF16_EXPONENT:
                return True
        elif not np.isfinite(chunk, out=out).all():
            return True
    return False


_SCAN_CHUNK = 1 << 16  # elements
_BF16_EXPONENT = np.uint16(0x7F80)
_ML_FLOATS = {np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                    ml_dtypes.float8_e8m0fnu)}


def _dense_shapes(specs) -> dict[str, tuple[int, ...]]:
    """Path of each quantized container -> the dense shape of its weight."""
    out = {}

    def visit(path, node):
        if isinstance(node, Fp8Weight):
            out[path_str(path)] = node.q.shape
        elif isinstance(node, Fp4Weight):
            out[path_str(path)] = (*node.packed.shape[:-1], 2 * node.packed.shape[-1])
        return node

    jax.tree_util.tree_map_with_path(visit, specs, is_leaf=lambda n: isinstance(n, (Fp8Weight, Fp4Weight)) or is_spec(n))
    return out
