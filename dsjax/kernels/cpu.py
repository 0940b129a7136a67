"""The vocabulary head and 16-bit layer weights on XLA:CPU as small C++ kernels (XLA FFI custom calls).

XLA:CPU runs a decode step's head product for 2..16 rows at a third of the FMA rate and
half the memory rate, in every form it offers (its GEMM, a fused multiply-reduce, batched or
tiled). `csrc/cpu_kernels.cc` reads the head once for up to 8 rows from a tiled layout
(`PackedHead`) with 16 vector accumulators. At one row both read at the memory rate (XLA's
product on the transposed head measured a little faster in the engine, so a one-slot fp32
engine keeps it: `dsjax.model.head.one_row_head`). Measurements: docs/cpu-decode.md and
benchmarks/head_kernel.py.

The kernel is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`,
`g++`, `clang++`; a few seconds, once) into ~/.cache/dsjax/kernels (`$XDG_CACHE_HOME`;
`DSJAX_KERNEL_CACHE=DIR` elsewhere), for this CPU (`-march=native`, or `DSJAX_CPU_MARCH=x86-64-v3` say, for a fleet of
mixed machines: the file name carries a hash of the source, compiler, flags, jaxlib and CPU
flags); jaxlib ships the FFI headers. Where the target has AVX-512 the kernels widen 16-bit
weights with one instruction and split bf16 head tiles without shuffles; elsewhere the same
multiply-adds in GCC's generic vectors (the results are the same bits where the target has
FMA: tests/test_kernels.py builds an AVX2 library beside the native one). Without a
compiler, or with `DSJAX_CPU_KERNELS=off`, the head stays XLA's product (`available()` is
False, with the reason in `status()`), and nothing else changes.

Each logit is the sequential multiply-add over the hidden size (fused where the CPU has FMA):
a row's logits do not depend on the other rows, their number, or the threads, so batch
invariance holds (an engine in batch-invariant mode runs the GEMM throughout anyway).

The same library reads a decode step's 16-bit layer weights (`rows_product`, `expert_rows_product`:
2..16 rows against a weight kept [out, in] as bf16 bits, where it lies in its layer stack, each
chosen expert once for all the rows routed to it); XLA:CPU's own products of 2..16 rows widen
the bits in element loops (docs/cpu-decode.md, "16-bit layer weights"). `DSJAX_CPU_ROWS_KERNEL=off`
leaves those products to XLA (to compare).

A decode step's sublayer pieces are one call each there too (`layer_calls_available`): a
sublayer's mHC input (`hc_input`: the mixes, the Sinkhorn, the collapse and the norm, ~20 XLA
thunks a sublayer), a 16-bit MoE (`moe_rows`: the chosen experts, the SwiGLU, the routing
weights and the shared expert) and a 16-bit W_oa (`expert_rows_product`, its groups as experts);
so is a prompt chunk's MoE, fp32 or 16-bit (`moe_rows`, each expert read in its layer stack
where XLA's tile loop copied it out). `DSJAX_CPU_LAYER_CALLS=off` leaves them to XLA's ops (to
compare).

The same library holds `dsjax_host_call` (`host_call`, below): a host function called by a
number the program holds, so that a program calling back into Python stays one JAX's
persistent cache can keep (V4.1's Engram lookup on one CPU device).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flax import struct

TILE = 32  # vocabulary rows a tile (csrc/cpu_kernels.cc kTile)
HEAD = "dsjax_vocab_head"
GREEDY = "dsjax_greedy_head"
HOST = "dsjax_host_call"
PRODUCT = "dsjax_rows_product"
EXPERTS = "dsjax_expert_rows_product"
MOE = "dsjax_moe_rows"
HC_INPUT = "dsjax_hc_input"
ENV_OFF = "DSJAX_CPU_KERNELS"
ENV_CACHE = "DSJAX_KERNEL_CACHE"
ENV_ROWS_OFF = "DSJAX_CPU_ROWS_KERNEL"  # =off: the few-row product alone stays XLA's (to compare)
ENV_LAYER_OFF = "DSJAX_CPU_LAYER_CALLS"  # =off: mHC inputs, 16-bit MoE and W_oa stay XLA's ops (to compare)
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cc"
ENV_MARCH = "DSJAX_CPU_MARCH"  # the compiler's -march target (default native: this CPU's features)
FLAGS = ["-O3", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w"]

log = logging.getLogger("dsjax")
_lock = threading.Lock()
_status: str | None = None  # None: not tried yet; "ready (<library>)"; else why not
_screen_dot = False  # the library's greedy screen multiplies bf16 pairs (AVX512-BF16)
SCREEN_ROWS, SCREEN_DOT_ROWS = 4, 16  # `screen_rows`


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags() -> list[str]:
    return [f"-march={os.environ.get(ENV_MARCH) or 'native'}", *FLAGS]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsjax" / "kernels"


def _library(cxx: str) -> Path:
    """Where the library for this source, compiler, jaxlib and CPU lives in the cache."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(_flags()), version, jax.__version__,
                                    _jaxlib_version(), _cpu_flags()]).encode()).hexdigest()[:16]
    return _cache_dir() / f"libdsjax_cpu_kernels_{key}.so"


def _build(cxx: str) -> Path:
    """The compiled library (built if missing)."""
    out = _library(cxx)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then move in whole
        lib = Path(tmp) / out.name
        done = subprocess.run([cxx, *_flags(), f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(lib)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, out)
    return out


def _off(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("off", "0", "false", "no")


def _disabled() -> bool:
    return _off(ENV_OFF)


def _load() -> str:
    if _disabled():
        return f"off ({ENV_OFF})"
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"not built for {platform.machine()}"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found (set CXX)"
    try:
        lib = _build(cxx)
        library = ctypes.cdll.LoadLibrary(str(lib))
        global _screen_dot
        _screen_dot = bool(library.DsjaxScreenDot())
        jax.ffi.register_ffi_target(HEAD, jax.ffi.pycapsule(library.DsjaxVocabHead), platform="cpu")
        jax.ffi.register_ffi_target(GREEDY, jax.ffi.pycapsule(library.DsjaxGreedyHead), platform="cpu")
        jax.ffi.register_ffi_target(HOST, jax.ffi.pycapsule(library.DsjaxHostCall), platform="cpu")
        jax.ffi.register_ffi_target(PRODUCT, jax.ffi.pycapsule(library.DsjaxRowsProduct), platform="cpu")
        jax.ffi.register_ffi_target(EXPERTS, jax.ffi.pycapsule(library.DsjaxExpertRowsProduct), platform="cpu")
        jax.ffi.register_ffi_target(HC_INPUT, jax.ffi.pycapsule(library.DsjaxHcInput), platform="cpu")
        jax.ffi.register_ffi_target(MOE, jax.ffi.pycapsule(library.DsjaxMoeRows), platform="cpu")
        library.DsjaxSetHostFunction(_trampoline)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        return f"build failed: {e}"
    return f"ready ({lib})"


def needs_build() -> bool:
    """Whether using the kernel would compile it first (a few seconds, once per machine): the
    CLI says so before it happens."""
    if _status is not None or _disabled() or jax.default_backend() != "cpu" or _compiler() is None:
        return False
    try:
        return not _library(_compiler()).exists()
    except (OSError, subprocess.SubprocessError):
        return False


def status() -> str:
    """'ready (<library>)', or why the kernel is not used (built and registered on the first call)."""
    global _status
    with _lock:
        if _status is None:
            _status = _load()
            if not _status.startswith(("ready", "off")):
                log.warning("dsjax: the CPU vocabulary-head kernel is not used (%s); the head runs as XLA's "
                            "product, slower at 2-16 rows", _status)
    return _status


_OFF = contextvars.ContextVar("dsjax_cpu_kernels_off", default=False)


@contextlib.contextmanager
def disabled():
    """While tracing inside: the head stays XLA's product (`available()` is False), e.g. to compare."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def available() -> bool:
    """Whether the kernel runs here: the default backend is the CPU, it is built, and not
    `disabled()`."""
    return not _OFF.get() and host_calls()


# ---------------------------------------------------------------- host functions by number
# `dsjax_host_call` (csrc/cpu_kernels.cc) calls back into Python by a number that the program
# holds as an attribute: unlike `jax.pure_callback`, whose program holds Python objects of the
# process that compiled it (JAX's persistent cache cannot keep it), such a program is kept, and
# runs in any process that registered a function under that number before running it: the
# caller derives the number from what the function computes (an Engram store: its tables'
# files or bytes), so equal numbers mean functions with equal results, in any process.
_HOST_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64))
_host_functions: dict[int, list[Callable]] = {}  # key -> [() -> a function (None: its object is gone)]
_host_lock = threading.Lock()
_DTYPES = {2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint8, 7: np.uint16, 8: np.uint32,
           9: np.uint64, 11: np.float32, 12: np.float64}  # XLA's element types (xla_data.proto)


def register_host_function(key: int, fn) -> None:
    """`host_call(key, ...)` calls fn(*arrays) -> a tuple of arrays. Functions registered under
    one key must give equal results (any live one is called). A bound method is held weakly
    (its object's life is its owner's); another function for the life of the process."""
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
    with _host_lock:
        alive = [r for r in _host_functions.get(int(key), []) if r() is not None]
        _host_functions[int(key)] = alive + [ref]


def _host_function(key: int):
    return next((fn for fn in (r() for r in _host_functions.get(key, [])) if fn is not None), None)


@_HOST_FUNCTION
def _trampoline(key, n_args, n_rets, buffers, meta):
    try:
        fn = _host_function(key)
        if fn is None:
            raise RuntimeError(f"no host function registered under {key} in this process")
        arrays, at = [], 0
        for i in range(n_args + n_rets):
            dtype, rank = np.dtype(_DTYPES[meta[at]]), meta[at + 1]
            shape = tuple(meta[at + 2: at + 2 + rank])
            at += 2 + rank
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            view = np.frombuffer((ctypes.c_char * size).from_address(buffers[i]), dtype) if size else np.empty(0, dtype)
            arrays.append(view.reshape(shape))
        outs = fn(*arrays[:n_args])
        if len(outs) != n_rets:
            raise RuntimeError(f"host function {key} returned {len(outs)} arrays for {n_rets} results")
        for target, out in zip(arrays[n_args:], outs):
            target[...] = np.asarray(out).reshape(target.shape)
        return 0
    except Exception:  # the program's error says to look here
        log.exception("dsjax: host function %d failed", key)
        return 1


def host_calls() -> bool:
    """Whether the library runs here (`host_call`, and the head kernel unless `disabled()`): the
    default backend is the CPU and the library is built."""
    return jax.default_backend() == "cpu" and status().startswith("ready")


def host_call(key: int, out, *args):
    """The function registered under `key`, on the host, inside a program: out (ShapeDtypeStructs)
    as `jax.ffi.ffi_call`'s. A CPU program only (`host_calls()`), one device."""
    return jax.ffi.ffi_call(HOST, out, vmap_method="sequential")(*args, key=np.int64(key))


def describe() -> str:
    """For `dsjax info`: the kernel's state on this backend."""
    return status() if jax.default_backend() == "cpu" else f"not used (backend {jax.default_backend()})"


@struct.dataclass
class PackedHead:
    """A vocabulary head [V, D] (fp32 or bf16) kept in tiles [ceil(V / 32), D, 32] of 32
    vocabulary rows, each k's 32 weights contiguous: the layout the XLA:CPU vocabulary-head
    kernel reads in one sequential stream (this module; an engine on one CPU
    device keeps its head so, `dsjax.model.head.cpu_head_params`). Rows past V are zeros.
    `dense()` is the [V, D] head back. An fp32 head may also carry a bf16 copy of its tiles
    and its rows' norms (`screen`, `norms`), from which the kernel finds greedy tokens
    reading half the bytes (`greedy_tokens`)."""

    tiles: jax.Array  # [ceil(V / 32), D, 32]
    vocab: int = struct.field(pytree_node=False)
    screen: jax.Array | None = None  # [ceil(V / 32), D, 32] bf16: the tiles rounded to nearest
    norms: jax.Array | None = None  # [ceil(V / 32) * 32] fp32: ||w_j||_2 rounded up (0 past V)

    @property
    def shape(self):
        return (self.vocab, self.tiles.shape[1])

    @property
    def dtype(self):
        return self.tiles.dtype

    def dense(self, dtype) -> jax.Array:
        w = jnp.transpose(self.tiles, (0, 2, 1)).reshape(-1, self.tiles.shape[1])
        return w[:self.vocab].astype(dtype)


def pack_head(w, *, screen: bool = False) -> PackedHead:
    """A [V, D] fp32 or bf16 head -> `PackedHead` (cut on the host; rows past V zero). screen:
    an fp32 head also keeps a bf16 copy of its tiles and its rows' norms, from which
    `greedy_tokens` finds greedy tokens reading half the bytes; a bf16 head is its own screen
    (its rows' norms only) where the screen multiplies bf16 pairs (`screen_rows`: then it
    saves multiply-adds). Not for a head with a non-finite weight or a non-zero row of norm
    under 2^-30, whose logits its bound does not cover."""
    a = np.asarray(w)
    v, d = a.shape
    nt = -(-v // TILE)
    if nt * TILE != v:
        a = np.concatenate([a, np.zeros((nt * TILE - v, d), a.dtype)])
    tiles = np.ascontiguousarray(a.reshape(nt, TILE, d).transpose(0, 2, 1))
    put = jax.device_put  # (jnp.asarray would compile a program per shape)
    own = a.dtype == jnp.bfloat16  # its own screen
    norms = (np.sqrt(np.square(a, dtype=np.float64).sum(axis=1))
             if screen and (a.dtype == np.float32 or own and _screen_dot) else None)
    if norms is None or not (np.isfinite(norms).all() and ((norms == 0) | (norms >= 2.0**-30)).all()):
        return PackedHead(put(tiles), v)
    rounded = norms.astype(np.float32)  # rounded up: the screen's bounds need n_j >= ||w_j||
    rounded = np.where(rounded < norms, np.nextafter(rounded, np.float32(np.inf)), rounded)
    packed = put(tiles)
    return PackedHead(packed, v, screen=packed if own else put(tiles.astype(jnp.bfloat16)), norms=put(rounded))


def vocab_head(x: jax.Array, w: PackedHead) -> jax.Array:
    """x [..., D] @ w.T -> fp32 logits [..., V] through the kernel (any row count; `available()`)."""
    rows = int(np.prod(x.shape[:-1]))
    flat = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows, w.tiles.shape[0] * TILE), jnp.float32)
    y = jax.ffi.ffi_call(HEAD, out, vmap_method="sequential")(flat, w.tiles)
    if y.shape[1] != w.vocab:
        y = y[:, :w.vocab]
    return y.reshape(*x.shape[:-1], w.vocab)


def rows_available() -> bool:
    """Whether a 16-bit layer weight's few-row products take `rows_product` (`available()`, and
    not `DSJAX_CPU_ROWS_KERNEL=off`, which leaves them to XLA, e.g. to compare)."""
    return available() and not _off(ENV_ROWS_OFF)


def layer_calls_available() -> bool:
    """Whether a decode step's sublayer pieces run as one library call each (`hc_input`: a
    sublayer's mHC input; `moe_rows`: a 16-bit MoE, and a prompt chunk's fp32 or 16-bit MoE;
    the 16-bit W_oa through `expert_rows_product`): `available()`, and not
    `DSJAX_CPU_LAYER_CALLS=off`, which leaves them to XLA's ops (e.g. to compare)."""
    return available() and not _off(ENV_LAYER_OFF)


def _place(at) -> jax.Array:
    """A weight's place in its stack as the kernels take it: int32 [len(lead)] (none: [0])."""
    return jnp.zeros((0,), jnp.int32) if at is None else jnp.asarray(at, jnp.int32).reshape(-1)


def _rows_out(x: jax.Array, w: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), jnp.float32)


def rows_product(x: jax.Array, w: jax.Array, at: jax.Array | None = None) -> jax.Array:
    """x [R, I] fp32 @ w[O, I].T -> [R, O] fp32 through the library's few-row product, w as
    stored: fp32, bf16, or bf16's uint16 bits (`Bf16Weight`), widened exactly as it is read
    (`available()`). at: w is a stack [*lead, O, I] and the weight is w[at] (int32 [len(lead)],
    each clamped into its axis), read where it lies. Each output is four sums of 16 lanes over
    the input axis, then fixed sums of those and of the lanes (csrc/cpu_kernels.cc), the same for
    every row, so a row's outputs do not depend on the other rows or their number."""
    return jax.ffi.ffi_call(PRODUCT, _rows_out(x, w), vmap_method="sequential")(x.astype(jnp.float32), w, _place(at))


def expert_rows_product(x: jax.Array, w: jax.Array, experts: jax.Array, at: jax.Array | None = None) -> jax.Array:
    """Each assignment's row x[a] [A, I] fp32 @ w[experts[a]].T -> [A, O] fp32, w [E, O, I] as
    `rows_product` reads it (or a stack [*lead, E, O, I] and `at` the experts' place in it); experts
    clamped into [0, E). Rows are grouped by expert so that each expert is read once; a row's
    outputs are bitwise `rows_product`'s on that row and expert alone."""
    return jax.ffi.ffi_call(EXPERTS, _rows_out(x, w), vmap_method="sequential")(
        x.astype(jnp.float32), w, _place(at), experts.astype(jnp.int32).reshape(-1))


def moe_rows(x: jax.Array, weights: jax.Array, idx: jax.Array, experts, shared, limit: float) -> jax.Array:
    """A step's MoE FFN in one call: x [T, D] fp32, each row through its experts idx [T, K]
    weighted by weights [T, K], plus the shared expert -> [T, D] fp32 (the experts' SwiGLU
    clamped at `limit`). experts: (w1 [E, I, D], w3 [E, I, D], w2 [E, D, I]) and shared: (w1
    [Is, D], w3 [Is, D], w2 [D, Is]), each as (stack, at) that `rows_product` reads (at None:
    the stack is the weight), all fp32 or all 16-bit. Each chosen expert is read once for up
    to 16 of its rows; every product is `rows_product`'s, so a row's outputs do not depend on
    the other rows."""
    pairs = [a for stack, at in (*experts, *shared) for a in (stack, _place(at))]
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call(MOE, out, vmap_method="sequential")(
        x.astype(jnp.float32), weights.astype(jnp.float32), idx.astype(jnp.int32), *pairs, limit=np.float32(limit))


def hc_input(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, norm: jax.Array,
             weights: jax.Array | None, at: jax.Array | None = None, *, eps: float, hc_eps: float, iters: int):
    """A sublayer's mHC input in one call, row by row: streams [R, N, D] fp32 -> (h [R, D]: the
    RMS-normed collapse, times `norm`; pre [R, N], post [R, N], comb [R, N, N]), as
    `dsjax.layers.hyper_connection` computes them (fn [(2+N)N, ND], base, scale [3]; or stacks
    [*lead, ...] of them and `at` [len(lead)] the layer's place: read where they lie). weights
    [R, N]: collapse with these instead of pre (DeepSeek-V4.1's lag)."""
    r, n, d = streams.shape
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((r, d), f32), jax.ShapeDtypeStruct((r, n), f32), jax.ShapeDtypeStruct((r, n), f32),
           jax.ShapeDtypeStruct((r, n, n), f32))
    with_ = jnp.zeros((0,), f32) if weights is None else weights.astype(f32)
    return jax.ffi.ffi_call(HC_INPUT, out, vmap_method="sequential")(
        streams.astype(f32), fn, base, scale, _place(at), norm.astype(f32), with_, eps=np.float32(eps),
        hc_eps=np.float32(hc_eps), iters=np.int64(iters))


def screen_rows() -> int:
    """The most rows a greedy screen is worth it for: 16 with AVX512-BF16 pairs, else 4. Without
    the pairs (bf16 widened, fp32 multiply-adds) the pass over 8 rows is bound by its
    multiply-adds, not the bytes, and the screen stops paying past 4 rows (the timings:
    docs/cpu-decode.md)."""
    return SCREEN_DOT_ROWS if available() and _screen_dot else SCREEN_ROWS


def worth_screening(dtype, rows: int) -> bool:
    """Whether an engine of `rows` slots screens a head of `dtype` for greedy rows: an fp32 head
    up to `screen_rows()`; a bf16 head (its own screen: it saves multiply-adds, not bytes) from
    4 rows up to 16, with AVX512-BF16 pairs only (at one row it measured slower than no screen:
    docs/cpu-decode.md)."""
    if dtype is None:  # a quantized head
        return False
    if jnp.dtype(dtype) == jnp.float32:
        return rows <= screen_rows()
    return jnp.dtype(dtype) == jnp.bfloat16 and screen_rows() > SCREEN_ROWS and SCREEN_ROWS <= rows <= screen_rows()


def greedy_tokens(x: jax.Array, w: PackedHead) -> tuple[jax.Array, jax.Array]:
    """The first maximum of each row's logits x [R, D] @ w.T (those `vocab_head` computes, bitwise)
    from a screened head (`pack_head(screen=True)`): bf16 logits from the screen (x rounded to
    bf16 too where the CPU has AVX512-BF16 dot products) bound every fp32 logit (the roundings
    and fp32 sums bounded through the rows' norms, Cauchy-Schwarz) and only the tiles of 32 rows
    that can hold a maximum are computed in fp32 (csrc/cpu_kernels.cc has the argument).
    -> (tokens [R] int32, -1 where a row needs all its logits instead: non-finite values,
    ||x|| under 2^-30, or more than 64 candidate tiles; the screen's logits [R, V])."""
    rows = x.shape[0]
    nt = w.tiles.shape[0]
    out = (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows, nt * TILE), jnp.float32))
    tokens, approx = jax.ffi.ffi_call(GREEDY, out, vmap_method="sequential")(
        x.astype(jnp.float32), w.screen, w.tiles, w.norms, vocab=np.int64(w.vocab))
    return tokens, approx[:, :w.vocab]
