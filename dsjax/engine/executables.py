"""The runner's programs as compiled executables, kept on disk so a warm start skips tracing.

JAX's persistent compile cache (`dsjax.compile_cache`) is keyed by a program's lowered
module, so even a hit first traces and lowers the program: for the engine's programs on a
CPU that is 1-2 s each, most of a warm `dsjax serve` start. `Programs` calls each program
through an executable it looks up by what determines the program without tracing it:

    the program (module and name), its static arguments (repr), the argument pytree's
    structure and every leaf's shape, dtype, weak type and sharding,
    + the environment: dsjax's source files (hashed), jax / jaxlib versions, the backend,
      its devices, XLA_FLAGS, the jax settings that change what is traced, the host CPU

An executable is found, in order: in this runner's own table (a short key: the program,
its static arguments, the top-level arguments' shapes and types: the runner's state has
one shape for its life), in the process's table (the whole key; `jax.clear_caches()`
empties it, as it does jit's), in the store on disk (`jax.experimental.serialize_executable`,
when a command turned the store on: `compile_cache.setup_compile_cache(...,
executables=True)`), and otherwise it is lowered and compiled through JAX's persistent
cache, as jit's are, and written to the store; one-device programs only: a mesh's program
(which the store cannot keep) is found in JAX's cache by the next process. A program JAX's
cache had (dsjax's sources changed, the program did not) costs a lowering, not a compile,
and is stored as the bytes that cache held (see `_stored_form`).
A short key that stops matching (an argument of another shape inside a pytree) is caught by
the executable's own argument check and looked up again by the whole key, so a stale match
cannot run.

Programs read from the store are counted by `dsjax.command.compile_counter` as programs
built from the cache (monitoring event `EXECUTABLE_LOADED`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pickle
import platform
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

EXECUTABLE_LOADED = "/dsjax/executables/loaded"
_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable", "jax_default_prng_impl",
             "jax_numpy_dtype_promotion", "jax_dynamic_shapes")
_SOURCE_SUFFIXES = (".py", ".c", ".cc", ".h", ".json")


class _Table:
    """The process's executables by whole key; registered so that `jax.clear_caches()`
    drops them with jit's (the suite clears per module: XLA:CPU code mappings are finite)."""

    def __init__(self):
        self.entries: dict = {}

    def get(self, key):
        return self.entries.get(key)

    def __setitem__(self, key, compiled):
        self.entries[key] = compiled

    def cache_clear(self):
        self.entries.clear()

    def cache_info(self):
        return len(self.entries)

    def cache_keys(self):
        return list(self.entries)


_process_table = _Table()
try:  # private in jax: without it the table is only emptied by `clear()`
    from jax._src.util import register_cache

    register_cache(_process_table, "dsjax executables")
except ImportError:  # pragma: no cover
    pass


def clear() -> None:
    _process_table.cache_clear()


@functools.cache
def environment() -> str:
    """What, beside the program and its arguments, decides the executable (hex digest)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]  # the dsjax package
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    import jaxlib

    backend = jax.devices()[0].client
    devices = [(d.id, d.device_kind, d.process_index) for d in jax.devices()]
    settings = [(s, str(getattr(jax.config, s, None))) for s in _SETTINGS]
    for part in (jax.__version__, jaxlib.__version__, backend.platform, backend.platform_version, devices,
                 os.environ.get("XLA_FLAGS", ""), settings, platform.machine(), _cpu_flags()):
        h.update(repr(part).encode())
    return h.hexdigest()


def _cpu_flags() -> str:
    """The host CPU's features: an XLA:CPU executable is compiled for them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _leaf(x) -> str:
    if isinstance(x, jax.Array):
        return f"{x.shape}{x.dtype}{int(x.weak_type)}{x.sharding}"
    a = np.asarray(x)
    return f"{a.shape}{a.dtype}{int(isinstance(x, (int, float, complex)) and not isinstance(x, bool))}"


def whole_key(fn, args: tuple, static: dict) -> str | None:
    """The program's key (hex), or None where a static argument's repr names an object's
    address or the program is a lambda / local function (compiled per runner, never stored)."""
    leaves, tree = jax.tree.flatten(args)
    text = repr((fn.__module__, fn.__qualname__, sorted(static.items())))
    if " at 0x" in text or "<" in fn.__qualname__:  # a lambda or local function: its name is not its identity
        return None
    h = hashlib.sha256(text.encode())
    h.update(str(tree).encode())
    for x in leaves:
        h.update(_leaf(x).encode())
    return h.hexdigest()


class Store:
    """Serialized one-device executables in `directory`/<environment>/<key>.exe (written
    whole, then renamed: processes may share the directory)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory) / environment()[:32]

    def load(self, key: str):
        path = self.directory / f"{key}.exe"
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            serialized, in_tree, out_tree, device = pickle.loads(blob)
            compiled = deserialize_and_load(serialized, in_tree, out_tree,
                                            execution_devices=[d for d in jax.devices() if d.id == device])
        except Exception:  # a torn or foreign file costs a compile, nothing else
            return None
        jax.monitoring.record_event(EXECUTABLE_LOADED)
        return compiled

    def save(self, key: str, compiled, cached: bytes | None = None) -> None:
        """cached: the executable's bytes as JAX's persistent cache held them, when it was read
        from there (`_stored_form`)."""
        devices = {d for s in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
                   for d in s.device_set}
        if len(devices) != 1:  # kept for one device (a mesh's programs are compiled per process)
            return
        try:
            blob = pickle.dumps((*_stored_form(compiled, cached), devices.pop().id))
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.directory / f"{key}.exe")
        except Exception:  # not serializable (a host callback: V4.1's Engram fetch), no room: per process only
            pass


_cache_reads = threading.local()  # .serialized: what JAX's cache gave this thread's last compile


def _watch_cache_reads() -> bool:
    """Keep the bytes JAX's persistent cache gives a compile (its entry's executable), per
    thread (private function; where it has moved: False, and a program read from that cache
    is not stored)."""
    try:
        from jax._src import compilation_cache as cc

        extract = cc.extract_executable_and_time
    except (ImportError, AttributeError):  # pragma: no cover
        return False
    if not getattr(extract, "dsjax_watch", False):
        def watched(entry):
            serialized, compile_time = extract(entry)
            _cache_reads.serialized = serialized
            return serialized, compile_time

        watched.dsjax_watch = True
        cc.extract_executable_and_time = watched
    return True


def _compile_through_cache(lowered) -> tuple[Any, bool, bytes | None]:
    """(the executable, whether the store may keep it, the bytes JAX's persistent cache gave
    it: None for a fresh compile). Compiles run side by side (`Programs.ahead`): a cache read
    is told per thread; only where it cannot be watched does any cache hit meanwhile make the
    executable one not to keep."""
    _cache_reads.serialized = None
    if _watch_cache_reads():
        compiled = lowered.compile()
        return compiled, True, _cache_reads.serialized
    hits = []  # pragma: no cover (a jax without the watched function)
    listener = lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None  # noqa: E731
    jax.monitoring.register_event_listener(listener)
    try:
        compiled = lowered.compile()
    finally:
        jax.monitoring.unregister_event_listener(listener)
    return compiled, not hits, None


def _stored_form(compiled, cached: bytes | None) -> tuple:
    """`serialize_executable.serialize(compiled)`, but with `cached` as the executable's bytes
    where given: XLA:CPU (jax 0.10) serializes an executable read from JAX's cache without
    some of its functions, which then fail at run time ("Function copy_bitcast_fusion not
    found"), while the bytes it was read from load whole (private pickler; where it has
    moved, ValueError and the program is not stored)."""
    from jax.experimental import serialize_executable as se

    if cached is None:
        return se.serialize(compiled)
    base = getattr(se, "_JaxPjrtPickler", None)
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if base is None or unloaded is None:  # pragma: no cover
        raise ValueError("this jax cannot store an executable read from its cache")

    class Pickler(base):
        def persistent_id(self, obj):
            return ("exec", cached) if isinstance(obj, se.xc.LoadedExecutable) else super().persistent_id(obj)

    leaves, in_tree = jax.tree.flatten(compiled.args_info)
    with io.BytesIO() as f:
        Pickler(f).dump((unloaded, leaves, compiled._no_kwargs))
        return f.getvalue(), in_tree, compiled.out_tree


def host_callbacks(lowered) -> bool:
    """Whether the program calls back into Python (V4.1's Engram fetch): such an executable
    cannot be serialized, so it is compiled as jit would, through JAX's cache (private
    attribute; where it has moved, the store's save fails quietly instead)."""
    try:
        return bool(lowered._lowering.compile_args.get("host_callbacks"))
    except AttributeError:  # pragma: no cover
        return False


def num_devices(lowered) -> int:
    """The devices the program runs on (private attribute; where it has moved: 1, and the
    store's save leaves a mesh's program out by its shardings)."""
    try:
        return int(lowered._lowering.compile_args["num_devices"])
    except (AttributeError, KeyError, TypeError):  # pragma: no cover
        return 1


def _short(a) -> Any:
    shape = getattr(a, "shape", None)
    return type(a) if shape is None else (shape, getattr(a, "dtype", None))


class Deferred(Exception):
    """Raised by a call inside `Programs.ahead` whose program was not compiled yet: its
    compile has started in the background and nothing ran."""


class Programs:
    """Calls the runner's jitted programs through their executables: `programs(fn, *args,
    **static)` == `fn(*args, **static)` (dynamic arguments positional, static ones by name)."""

    def __init__(self, store: Store | None = None):
        self.store = store
        self.table: dict = {}
        self.pending: dict = {}  # short key -> future executable (`ahead`)
        self._pool: ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def ahead(self, threads: int):
        """Compile in the background: inside, a call whose program is not compiled yet lowers
        it (tracing holds Python's lock), starts its compile on one of `threads` threads (XLA
        compiles without that lock) and raises `Deferred`; a call whose compile is under way
        waits for it and runs. A warm-up that meets every program once, then runs again what
        was deferred, compiles them side by side."""
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="dsjax-compile") as pool:
            self._pool = pool
            try:
                yield
            finally:
                self._pool = None

    def __call__(self, fn: Callable, *args, **static):
        short = (fn, *static.items(), *map(_short, args))
        compiled = self.table.get(short)
        if compiled is not None:
            try:
                return compiled(*args)
            except (TypeError, ValueError):  # raised by the argument check, before anything runs
                pass
        future = self.pending.pop(short, None)
        compiled = self.table[short] = future.result() if future is not None else self._find(fn, args, static, short)
        return compiled(*args)

    def _find(self, fn, args, static, short):
        key = whole_key(fn, args, static)
        compiled = _process_table.get(key) if key else None
        if compiled is None:
            compiled = self.store.load(key) if self.store and key else None
            if compiled is None:
                lowered = fn.lower(*args, **static)
                if self._pool is not None:
                    self.pending[short] = self._pool.submit(self._compile, key, lowered)
                    raise Deferred(fn.__name__)
                compiled = self._compile(key, lowered)
            elif key:
                _process_table[key] = compiled
        return compiled

    def _compile(self, key: str | None, lowered):
        # what the store cannot keep (a mesh's program, one calling back into Python) is found in
        # JAX's cache by the next process
        if self.store and key and not host_callbacks(lowered) and num_devices(lowered) == 1:
            compiled, storable, cached = _compile_through_cache(lowered)
            if storable:
                self.store.save(key, compiled, cached)
        else:
            compiled = lowered.compile()
        if key:
            _process_table[key] = compiled
        return compiled
