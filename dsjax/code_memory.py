"""Compiled code's memory mappings, and the kernel's limit on them.

Every XLA:CPU executable keeps its machine code in memory mappings of its own, a few hundred
a program (~400 for a whole-sequence forward of the built-in model, ~600 for an engine step of
the tiny one), and Linux allows a process `vm.max_map_count` of them (65530 by default). JAX
keeps every program it compiled for as long as the jitted function lives, so a process that
compiles many shapes (`Model.logits` over prompts of ~150 different lengths, a notebook's
many engines and inspect edits) reaches the limit, and XLA's next mapping fails wherever it
happens: an abort or a segfault, not an exception.

dsjax watches for that. After a compile (a JAX monitoring event) it reads the process's
mappings, at most every `CHECK_EVERY_S`; past `PRESSURE` of the limit it marks the process,
and its entry points (`Model.logits`, `dsjax.inspect.forward`, each engine step) then drop
compiled programs before going on (`relieve`), warning once: jit's caches and dsjax's
executable table (`jax.clear_caches()`), the library's warm engines (`on_release` hooks), then
a collection. Live engines keep their own programs; what was dropped is compiled again when
next used, or read back from JAX's persistent cache (`dsjax.compile_cache`). Off Linux (no
/proc) nothing is watched.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import warnings
from typing import Callable

import jax
from jax import monitoring

PRESSURE = 0.75  # of vm.max_map_count: leaves room for an engine's warm-up (~8 programs, ~5k mappings)
CHECK_EVERY_S = 0.5  # reading /proc/self/maps takes a few ms at tens of thousands of lines
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_hooks: list[Callable[[], None]] = []
_state = {"pressed": False, "checked": 0.0, "warned": False}
_lock = threading.Lock()


@functools.cache
def limit() -> int:
    """The kernel's limit on a process's memory mappings (vm.max_map_count), 0 off Linux."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def mappings() -> int:
    """This process's memory mappings now, 0 off Linux."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def on_release(hook: Callable[[], None]) -> None:
    """Call hook() whenever compiled programs are dropped (a holder of engines drops them)."""
    _hooks.append(hook)


def release() -> None:
    """Drop what holds compiled executables: the registered holders (the library's warm
    engines), jit's caches and dsjax's executable table (one `jax.clear_caches()`), then collect."""
    for hook in _hooks:
        hook()
    jax.clear_caches()
    gc.collect()
    _state["pressed"] = False


def under_pressure() -> bool:
    """Whether a compile left the process past PRESSURE of the limit since the last release."""
    return _state["pressed"]


def relieve() -> bool:
    """At an entry point, before it compiles or runs: if the process is under pressure, drop
    compiled programs (`release`; a warning the first time). -> whether it released."""
    if not _state["pressed"]:
        return False
    with _lock:
        if not _state["pressed"]:
            return False
        n, cap = mappings(), limit()
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(
                f"dsjax: this process holds {n} memory mappings, near the kernel's limit of {cap} "
                f"(vm.max_map_count): XLA:CPU keeps a few hundred for each compiled program, and past the "
                f"limit it crashes. Dropping compiled programs; they compile again (or load from the compile "
                f"cache) when next used. Fewer distinct shapes (prompts padded to a few lengths) avoid this; "
                f"so does a higher vm.max_map_count.", RuntimeWarning, stacklevel=3)
        release()
    return True


def _after_compile(event: str, _secs: float, **_kw) -> None:
    if event != _COMPILE_EVENT or _state["pressed"] or not limit():
        return
    now = time.monotonic()
    if now - _state["checked"] < CHECK_EVERY_S:
        return
    _state["checked"] = now
    if mappings() > PRESSURE * limit():
        _state["pressed"] = True


monitoring.register_event_duration_secs_listener(_after_compile)
