"""A batch job's manifest, `<output>.manifest.json`: what its results depend on.

    {"format": "dsjax-batch/1", "complete": false, "input": "/abs/in.jsonl", "records": 16, ...,
     "settings": {"model", "config_hash", "weights", "dtype", "mesh", "kernels", "batch_invariant",
                  "seed", "max_new_tokens", "max_slots", "decode_steps", "prefill_chunk", "input_sha256",
                  "num_draft_tokens" (only when speculating)},
     "environment": {"dsjax", "jax", "jaxlib", "backend", "devices"}}

A resumed run, and `dsjax verify`, compare "settings" and "environment" with their own and
refuse on any difference, naming the fields: each may change a token (but for max_slots
in batch-invariant mode, where a job may resume at another batch size). The file is replaced
atomically (tmp + fsync + os.replace), so it is always one whole version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import jaxlib
import numpy as np

import dsjax
from dsjax.api import Model
from dsjax.weights import resolve as resolve_bundled

FORMAT = "dsjax-batch/1"


def manifest_path(output: str | Path) -> Path:
    return Path(str(output) + ".manifest.json")


def environment() -> dict:
    devices = jax.devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    return {"dsjax": dsjax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "devices": f"{len(devices)} x {kinds}"}


def config_hash(model: Model) -> str:
    text = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsjax" / "weight_hashes.json"


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, remembered by (path, size, mtime) so a 100 GB checkpoint is
    read once, not on every run (a cache that cannot be written only costs time)."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = _cache_file()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    cache[key] = h.hexdigest()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=0))
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return cache[key]


def weights_fingerprint(model: Model, name_or_path: str) -> str:
    """A checkpoint: sha256 over its config and weight files' hashes; a named config
    (random weights): sha256 of the parameter arrays themselves."""
    where = Path(resolve_bundled(name_or_path))
    h = hashlib.sha256()
    if where.is_dir():
        files = sorted(p for p in where.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
        for p in files:
            h.update(f"{p.name}:{file_sha256(p)}\n".encode())
        return "files:" + h.hexdigest()
    for leaf in jax.tree.leaves(model.params):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return "params:" + h.hexdigest()


def model_name(name_or_path: str) -> str:
    """A path as an absolute path (the job may be resumed from another directory); a name as is."""
    p = Path(name_or_path)
    return str(p.resolve()) if p.exists() else name_or_path


def differences(recorded: dict, current: dict) -> list[str]:
    """`field: recorded -> current` for every setting or environment field that differs;
    max_slots only outside batch-invariant mode (in it, results do not depend on it)."""
    out = []
    for part in ("settings", "environment"):
        a, b = recorded.get(part, {}), current.get(part, {})
        invariant = part == "settings" and a.get("batch_invariant") is True and b.get("batch_invariant") is True
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k) and not (invariant and k == "max_slots"):
                out.append(f"{k}: {json.dumps(a.get(k))} -> {json.dumps(b.get(k))}")
    return out


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: bytes) -> None:
    """Write data to path so that a crash leaves the old file or the new one, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write(path: Path, manifest: dict) -> None:
    replace_atomically(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def read(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not a dsjax batch manifest (not JSON: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dsjax batch manifest (format {FORMAT!r} expected)")
    return manifest
