"""A lazy safetensors reader: parse the JSON header, read only the bytes a slice needs.

Written here rather than taken from `safetensors.safe_open(framework="np")` because V4
checkpoints store F8_E4M3 / F8_E8M0 / BF16 tensors, which the numpy backend rejects, and
the sharded loader needs byte-range reads of one tensor without touching the others.
Reads use pread into fresh buffers (not a memory map), so host memory holds only what is
being read: a mapped file's touched pages would count against the process until closed.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, corrupt, or does not fit the config."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the data section
    end: int
    file: Path


class SafetensorsFile:
    """One .safetensors file: header parsed at open, tensors read lazily through mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{self.path}: corrupt header (claims {header_len} bytes, file has {size})")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt header ({e})") from None
        self.data_start = 8 + header_len
        self.metadata = header.pop("__metadata__", {}) or {}
        self.tensors: dict[str, TensorInfo] = {}
        data_size = size - self.data_start
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor '{name}': malformed header entry {entry!r}") from None
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor '{name}': unsupported dtype {dtype}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
            if end - begin != nbytes:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}': header says {end - begin} bytes, {dtype}{list(shape)} needs {nbytes}")
            if end > data_size:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}' ends at byte {end} but the file holds {data_size} data bytes "
                    f"(truncated file?)")
            self.tensors[name] = TensorInfo(name, dtype, shape, begin, end, self.path)
        self._fd = None

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor, or its slice `index` (a tuple of slices): only the rows of the leading
        axis that the slice covers are read from disk."""
        info = self.tensors[name]
        dtype = np.dtype(DTYPES[info.dtype])
        shape = info.shape
        index = tuple(index or ())
        rows = range(shape[0]) if not shape else range(*(index[0] if index else slice(None)).indices(shape[0]))
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        first, last = (rows.start, rows.stop) if len(rows) else (0, 0)
        if rows.step != 1 and len(rows):
            first, last = min(rows), max(rows) + 1
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        n = (last - first) * row_bytes
        buf = np.empty(n, np.uint8)
        got = os.preadv(self._fd, [buf], self.data_start + info.begin + first * row_bytes) if n else 0
        if got != n:
            raise CheckpointError(f"{self.path}: tensor '{name}': short read ({got} of {n} bytes)")
        arr = buf.view(dtype)
        if not shape:
            return arr.reshape(())
        arr = arr.reshape((last - first, *shape[1:]))
        local = (slice(0, last - first, rows.step),) + index[1:] if index else ()
        return arr[local] if local else arr

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write numpy arrays (any dtype in DTYPES, ml_dtypes included) as a safetensors file."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[name] = {"dtype": DTYPE_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


class CheckpointFiles:
    """All tensors of a checkpoint directory: `model.safetensors`, or the shards named by
    `model.safetensors.index.json`, or (no index) every `*.safetensors` file."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        else:
            weight_map = None
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no model.safetensors, shards, or index found")
        self.files = {f: SafetensorsFile(self.directory / f) for f in files}
        self.tensors: dict[str, TensorInfo] = {}
        for fname, sf in self.files.items():
            for name, info in sf.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor '{name}' appears in both {self.tensors[name].file.name} and {fname}")
                self.tensors[name] = info
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.tensors:
                    raise CheckpointError(f"{index}: tensor '{name}' is listed in {fname} but that file lacks it")
                if self.tensors[name].file.name != fname:
                    raise CheckpointError(f"{index}: tensor '{name}' is listed in {fname} but stored in "
                                          f"{self.tensors[name].file.name}")

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        info = self.tensors[name]
        return self.files[info.file.name].read(name, index)

    def close(self):
        for sf in self.files.values():
            sf.close()
