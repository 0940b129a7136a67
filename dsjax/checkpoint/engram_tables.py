"""Engram's host-side storage: the token -> compressed-id map and the memory-mapped row tables.

Token map (§5.1). For each id 0..129279, decode the single token (raw Rust tokenizer, specials kept).
If the text holds U+FFFD (a partial UTF-8 byte token) the key is the raw token string; else

    key = N(text) or text,   N = NFKC → NFD → StripAccents → Lowercase → [ \\t\\r\\n]+ ↦ " "
                                 → (exactly " ") ↦ U+E000 → Strip → U+E000 ↦ " "

and class ids are given in first-occurrence order over ascending ids: 99092 classes. The map
depends on the `tokenizers` Unicode tables, so dsjax ships it as a constant file (gzip'd int32
LE, data/engram_token_map_v41.i32.gz) checked against the spec's sha256 at load;
`build_engram_token_map` is how that file was made.

Tables (§5.5). Per Engram layer one safetensors file (or shard) holds

    engram.embed.weight  F8_E4M3 [rows, 256]      engram.embed.scale  F8_E8M0 [rows, 8]

(one scale per 32 values; 264 B a row; 101 GB a layer at V4.1 size). `EngramTable` maps the file
and copies out only the rows a batch hashes to: the page cache, not the process, holds the hot
rows, and the traffic is Zipfian. Dequantisation happens on the device (dsjax/layers/engram.py).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from dsjax.checkpoint.names import canonical_name, engram_table_name
from dsjax.checkpoint.safetensors_io import CheckpointError, CheckpointFiles, SafetensorsFile
from dsjax.kernels import cpu as cpu_kernels
from dsjax.layers.engram import compressed_ids, engram_layout, initial_history, next_history, ngram_row_ids

TOKEN_MAP_FILE = Path(__file__).resolve().parent / "data" / "engram_token_map_v41.i32.gz"
TOKEN_MAP_SHA256 = "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"  # of the int32 LE bytes
TOKEN_MAP_SIZE = 129280
_SENTINEL = "\ue000"  # stands in for a lone space so that Strip leaves it alone


# ----------------------------------------------------------------------------- token map
def build_engram_token_map(tokenizer_json_path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """int32 [vocab_size] compressed class of each token id (§5.1). vocab_size defaults to the
    tokenizer's size with added tokens (129280 for DeepSeek-V4 / V4.1)."""
    from tokenizers import Regex, Tokenizer, normalizers  # only needed to rebuild the shipped map

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])
    n = tok.get_vocab_size(with_added_tokens=True) if vocab_size is None else vocab_size
    classes: dict[str, int] = {}
    out = np.empty(n, np.int32)
    for i in range(n):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out[i] = classes.setdefault(key, len(classes))
    return out


def save_engram_token_map(token_map: np.ndarray, path: str | Path = TOKEN_MAP_FILE) -> None:
    """Write the map as gzip'd int32 LE (mtime 0, so the same map gives the same bytes)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(gzip.compress(np.asarray(token_map).astype("<i4").tobytes(), mtime=0))


@functools.lru_cache(maxsize=None)
def engram_token_map(path: str | Path = TOKEN_MAP_FILE) -> np.ndarray:
    """The shipped 129280-entry map (read-only int32), checked against the spec's sha256."""
    try:
        raw = gzip.decompress(Path(path).read_bytes())
    except (OSError, EOFError) as e:
        raise CheckpointError(f"{path}: cannot read the Engram token map ({e})") from None
    if len(raw) != 4 * TOKEN_MAP_SIZE:
        raise CheckpointError(f"{path}: Engram token map holds {len(raw)} bytes, expected {4 * TOKEN_MAP_SIZE} "
                              f"({TOKEN_MAP_SIZE} int32)")
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TOKEN_MAP_SHA256:
        raise CheckpointError(f"{path}: Engram token map sha256 {digest} differs from the spec's {TOKEN_MAP_SHA256}")
    out = np.frombuffer(raw, "<i4").astype(np.int32)
    out.setflags(write=False)
    return out


# ----------------------------------------------------------------------------- row tables
WEIGHT_DTYPE, SCALE_DTYPE = "F8_E4M3", "F8_E8M0"


IDENTITY_BYTES = 64 << 20  # table files up to this size are known by their bytes (`_file_identity`)


def _file_identity(path: Path) -> tuple:
    """A table file as `EngramStore.key` knows it: one of at most IDENTITY_BYTES by the sha256 of
    its bytes (a checkpoint copied or written again is the same one, so the steps compiled for it
    are found in JAX's persistent cache), a larger one by its path, size and modification time
    (hashing gigabytes would cost every load seconds)."""
    stat = os.stat(path)
    if stat.st_size <= IDENTITY_BYTES:
        with open(path, "rb") as f:
            return "sha256", hashlib.file_digest(f, "sha256").hexdigest(), stat.st_size
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


class EngramTable:
    """One Engram layer's table, memory-mapped; `gather` copies out only the requested rows.

    `bytes_read` counts the table bytes gathered so far (264 a row at V4.1 size)."""

    def __init__(self, path: str | Path, prefix: str = "engram.embed", rows: int | None = None,
                 head_dim: int = 256, group: int = 32, scale_path: str | Path | None = None):
        """path: the file holding `{prefix}.weight`; scale_path: the one holding `{prefix}.scale`
        (default: the same; a sharded checkpoint may split them)."""
        self.path = Path(path)
        paths = {"weight": self.path, "scale": Path(scale_path) if scale_path is not None else self.path}
        names = {"weight": f"{prefix}.weight", "scale": f"{prefix}.scale"}
        want = {"weight": (WEIGHT_DTYPE, head_dim), "scale": (SCALE_DTYPE, head_dim // group)}
        self.names = names
        files = {path: _file_identity(path) for path in set(paths.values())}
        self.identity = tuple((names[part], *files[paths[part]]) for part in names)  # the bytes it reads
        self._maps, views = [], {}
        for part, name in names.items():
            header = SafetensorsFile(paths[part])  # parses and size-checks the header; reads no tensor data
            info = header.tensors.get(name)
            if info is None:
                raise CheckpointError(f"{paths[part]}: no tensor '{name}' (holds {sorted(header.tensors)[:8]})")
            dtype, width = want[part]
            if info.dtype != dtype:
                raise CheckpointError(f"{paths[part]}: tensor '{name}': dtype {info.dtype}, expected {dtype}")
            if len(info.shape) != 2 or info.shape[1] != width or (rows is not None and info.shape[0] != rows):
                expect = f"[{rows if rows is not None else 'rows'}, {width}]"
                raise CheckpointError(f"{paths[part]}: tensor '{name}': shape {list(info.shape)}, expected {expect}")
            with open(paths[part], "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):  # row lookups are scattered: read-ahead would pull in unused rows
                mapped.madvise(mmap.MADV_RANDOM)
            self._maps.append(mapped)
            views[part] = np.frombuffer(mapped, np.uint8, count=info.end - info.begin,
                                        offset=header.data_start + info.begin).reshape(info.shape[0], -1)
        if views["weight"].shape[0] != views["scale"].shape[0]:
            raise CheckpointError(f"{self.path}: tensor '{names['scale']}' has {views['scale'].shape[0]} rows but "
                                  f"'{names['weight']}' has {views['weight'].shape[0]}")
        self.rows = views["weight"].shape[0]
        self.bytes_read = 0
        self._weight = views["weight"]  # [rows, 256] e4m3 bytes, nothing read yet
        self._scale = views["scale"]  # [rows, 8] e8m0 exponent bytes

    @property
    def row_bytes(self) -> int:
        return self._weight.shape[1] + self._scale.shape[1]

    def gather(self, row_ids) -> tuple[np.ndarray, np.ndarray]:
        """(q float8_e4m3fn [..., 256], scale exponent bytes uint8 [..., 8]) of rows `row_ids` (any shape)."""
        ids = np.asarray(row_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise CheckpointError(f"{self.path}: tensor '{self.names['weight']}' has {self.rows} rows; "
                                  f"row ids {ids.min()}..{ids.max()} are out of range")
        flat = ids.reshape(-1)
        q = np.take(self._weight, flat, axis=0).view(ml_dtypes.float8_e4m3fn)
        scale = np.take(self._scale, flat, axis=0)
        self.bytes_read += flat.size * self.row_bytes
        return q.reshape(*ids.shape, -1), scale.reshape(*ids.shape, -1)

    def close(self) -> None:
        self._weight = self._scale = None  # views must go before the maps can close
        for mapped in self._maps:
            mapped.close()

    def __enter__(self) -> "EngramTable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HeldTable(EngramTable):
    """A table held in memory (uint8 E4M3 bytes [rows, hd], E8M0 exponent bytes [rows, hd / 32]):
    the seeded tables of a named config with random weights; reads like a mapped one."""

    def __init__(self, weight: np.ndarray, scale: np.ndarray, name: str = "engram.embed"):
        self.path, self.names, self._maps = Path(f"<seeded {name}>"), {"weight": f"{name}.weight"}, []
        self._weight, self._scale = weight, scale
        self.rows, self.bytes_read = weight.shape[0], 0
        self.identity = (name, hashlib.sha256(np.ascontiguousarray(weight)).hexdigest(),
                         hashlib.sha256(np.ascontiguousarray(scale)).hexdigest())


def write_engram_table(path: str | Path, weight_e4m3: np.ndarray, scale_e8m0: np.ndarray,
                       prefix: str = "engram.embed", rows: int | None = None, row_ids=None) -> None:
    """Write a table file (tests, tools). With `row_ids`, the arrays hold only those rows of a
    `rows`-row table: the file is sized first (a sparse file; the rest reads as zero bytes) and
    only those rows are written, so a test can make a table far larger than it ever holds."""
    weight = np.ascontiguousarray(weight_e4m3).view(np.uint8)
    scale = np.ascontiguousarray(scale_e8m0).view(np.uint8)
    if weight.ndim != 2 or scale.ndim != 2 or weight.shape[0] != scale.shape[0]:
        raise ValueError(f"write_engram_table: weight {weight.shape} and scale {scale.shape} must be [n, W], [n, G]")
    n_rows = weight.shape[0] if rows is None else rows
    if row_ids is not None:
        ids = np.asarray(row_ids).reshape(-1)
        if len(ids) != weight.shape[0] or (len(ids) and (ids.min() < 0 or ids.max() >= n_rows)):
            raise ValueError(f"write_engram_table: row_ids must give one row in [0, {n_rows}) per row of weight")
    w_bytes, s_bytes = n_rows * weight.shape[1], n_rows * scale.shape[1]
    header = {
        f"{prefix}.weight": {"dtype": WEIGHT_DTYPE, "shape": [n_rows, weight.shape[1]], "data_offsets": [0, w_bytes]},
        f"{prefix}.scale": {"dtype": SCALE_DTYPE, "shape": [n_rows, scale.shape[1]],
                            "data_offsets": [w_bytes, w_bytes + s_bytes]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if row_ids is None:
            f.write(weight.tobytes())
            f.write(scale.tobytes())
            return
        f.truncate(start + w_bytes + s_bytes)
        fd = f.fileno()
        for i, r in enumerate(ids):
            os.pwrite(fd, weight[i].tobytes(), start + int(r) * weight.shape[1])
            os.pwrite(fd, scale[i].tobytes(), start + w_bytes + int(r) * scale.shape[1])


# ----------------------------------------------------------------------------- a checkpoint's tables
def _layout(e):
    """The `EngramLayout` of an `EngramConfig`."""
    return engram_layout(e.layer_ids, e.max_ngram_size, e.n_heads, e.head_dim, e.vocab_size, e.compressed_vocab_size,
                         e.pad_id)


class EngramStore:
    """A V4.1 checkpoint's Engram tables (memory-mapped) with the layout, token map and
    per-sequence history that turn token ids into the table rows a chunk reads (§5.4-5.5,
    §5.7): `rows(tokens, history)` -> ((q, scale) per Engram layer, new history). Only those
    rows are copied out of the map; dequantisation is the device's (`engram_fuse`'s caller).

        store = EngramStore.from_checkpoint(directory, cfg)
        rows, history = store.rows(tokens, store.initial_history(batch))"""

    def __init__(self, tables, layout, token_map: np.ndarray):
        self.tables, self.layout, self.token_map = tuple(tables), layout, token_map
        self.source = "seeded, in memory" if any(isinstance(t, HeldTable) for t in self.tables) else "memory-mapped"
        for k, table in enumerate(self.tables):
            if table.rows != layout.table_rows(k):
                raise CheckpointError(f"{table.path}: Engram table of layer {layout.layer_ids[k]} has {table.rows} "
                                      f"rows; its bucket primes need {layout.table_rows(k)} (engram_num_embeddings)")
        # What the lookup reads (layout, token map, each table's files or bytes), as the number a
        # CPU step calls `fetch` by (`engram_fetch`): the same in every process that holds a store
        # of the same tables, so JAX's persistent cache serves its steps there.
        h = hashlib.sha256(repr((layout, [t.identity for t in self.tables])).encode())
        h.update(np.ascontiguousarray(token_map, np.int64).tobytes())
        self.key = int.from_bytes(h.digest()[:8], "little") & (2**63 - 1)
        cpu_kernels.register_host_function(self.key, self.fetch)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, cfg, token_map: np.ndarray | None = None) -> "EngramStore":
        e = cfg.engram
        if e is None:
            raise CheckpointError(f"config {cfg.name!r} has no Engram layers")
        layout = _layout(e)
        files = CheckpointFiles(directory)
        try:
            stored = {canonical_name(n): info for n, info in files.tensors.items()}
        finally:
            files.close()
        tables = []
        for layer in e.layer_ids:
            weight, scale = (stored.get(engram_table_name(layer) + part) for part in (".weight", ".scale"))
            if weight is None or scale is None:
                raise CheckpointError(f"{directory}: no Engram table '{engram_table_name(layer)}.weight / .scale' "
                                      f"for layer {layer}")
            if scale.name != weight.name[: -len("weight")] + "scale":
                raise CheckpointError(f"{directory}: Engram table tensors '{weight.name}' / '{scale.name}' are "
                                      f"spelled differently")
            tables.append(EngramTable(weight.file, prefix=weight.name[: -len(".weight")], head_dim=e.head_dim,
                                      scale_path=scale.file))
        return cls(tables, layout, engram_token_map() if token_map is None else token_map)

    @classmethod
    def seeded(cls, cfg, seed: int = 0, std: float = 0.02, token_map: np.ndarray | None = None) -> "EngramStore":
        """Random tables in memory for a config without a checkpoint: N(0, std) values stored as
        E4M3 with unit scales (E8M0 exponent 127)."""
        e = cfg.engram
        layout = _layout(e)
        rng = np.random.default_rng(seed)
        tables = []
        for k, layer in enumerate(e.layer_ids):
            values = (std * rng.standard_normal((layout.table_rows(k), e.head_dim))).astype(ml_dtypes.float8_e4m3fn)
            scale = np.full((layout.table_rows(k), e.head_dim // 32), 127, np.uint8)
            tables.append(HeldTable(values.view(np.uint8), scale, f"layers.{layer}.engram.embed"))
        return cls(tables, layout, engram_token_map() if token_map is None else token_map)

    def initial_history(self, batch: int) -> np.ndarray:
        return initial_history(batch, self.layout.max_ngram)

    def rows(self, tokens: np.ndarray, history: np.ndarray, dead: np.ndarray | None = None):
        """tokens [B, S] (dead [B, S]: image-span tokens) after `history` -> ([(q e4m3 [B, S, n_hash, hd],
        scale exponents [B, S, n_hash, hd / 32]) per Engram layer], the history after the chunk)."""
        out, kappa = self._lookup(tokens, history, dead)
        return out, next_history(history, kappa)

    def _lookup(self, tokens, history, dead=None):
        """-> ([(q, scale) per Engram layer], the chunk's compressed ids)."""
        kappa = compressed_ids(self.token_map, tokens, dead)
        rows = [table.gather(ngram_row_ids(self.layout, k, kappa, history)) for k, table in enumerate(self.tables)]
        return rows, kappa

    def fetch(self, tokens, history, n_valid):
        """The host side of a step's Engram lookup (`dsjax.model.v41.backbone.engram_fetch`): tokens
        [B, C], history [B, h], n_valid [B] -> (E4M3 bytes, E8M0 bytes) per layer as uint8, then
        the history after each row's n_valid tokens (int32). Rows of padding positions are
        read too (their ids are valid): the chunk's shape is fixed."""
        tokens = np.clip(np.asarray(tokens), 0, len(self.token_map) - 1)  # padding rows may hold any id
        history = np.asarray(history, np.int64)
        rows, kappa = self._lookup(tokens, history)
        out = []
        for q, scale in rows:
            out += [q.view(np.uint8), scale.astype(np.uint8)]
        return (*out, next_history(history, kappa, np.asarray(n_valid, np.int64)).astype(np.int32))

    @property
    def bytes_read(self) -> int:
        return sum(t.bytes_read for t in self.tables)

    def close(self) -> None:
        for t in self.tables:
            t.close()
