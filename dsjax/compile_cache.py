"""JAX's persistent compilation cache, on by default for dsjax.

Compiling a model's programs is most of a first run's wall time (docs/cli.md has the
figures). JAX can keep compiled executables on disk; dsjax turns that
on once per process (`load_model` and the CLI call `setup_compile_cache`):

    setting                              where compiled programs go
    (nothing)                            $XDG_CACHE_HOME/dsjax/jax, else ~/.cache/dsjax/jax
    DSJAX_COMPILE_CACHE=/some/dir        /some/dir
    DSJAX_COMPILE_CACHE=off              nowhere (also: 0, false, no, none)
    a cache dir configured in JAX        left alone (JAX_COMPILATION_CACHE_DIR, jax.config.update)
    CLI --compile-cache DIR / --no-compile-cache, or setup_compile_cache(DIR | "off"): as asked

Small CPU programs compile in well under JAX's default 1 s threshold, so dsjax caches
every program (`jax_persistent_cache_min_compile_time_secs` = 0) unless that threshold was
set by the user. The cache is trusted code: do not share its directory with users you do
not trust (JAX's own warning).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

ENV = "DSJAX_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "none", "")
MIN_COMPILE_SECS = 0.0  # cache every program: tiny CPU programs take 0.1-2 s each, dozens per run
_JAX_DEFAULT_MIN_COMPILE_SECS = 1.0


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """Where compiled programs are kept (None: nowhere) and who said so."""

    directory: str | None
    source: str  # "default" | "DSJAX_COMPILE_CACHE" | "argument" | "jax config" | "unavailable: <why>"

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def describe(self) -> str:
        if not self.enabled:
            return f"off ({self.source})"
        return f"{self.directory} ({self.source})"


_chosen: CompileCache | None = None  # the process's setting: jax's cache config is process-wide too
_keep_executables = False
EXECUTABLES_SUBDIR = "dsjax-executables"


def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsjax" / "jax"


def current() -> CompileCache:
    """What JAX will do now (whoever configured it)."""
    directory = jax.config.jax_compilation_cache_dir
    if directory and jax.config.jax_enable_compilation_cache:
        return CompileCache(str(directory), _chosen.source if _chosen and _chosen.directory == directory
                            else "jax config")
    return _chosen if _chosen is not None and not _chosen.enabled else CompileCache(None, "not set up")


def setup_compile_cache(setting: str | os.PathLike | None = None, *, executables: bool | None = None) -> CompileCache:
    """Turn JAX's persistent compilation cache on (or off) for this process.

    setting: a directory, "off", or None (the environment / default, see the module doc).
    With None, a cache already configured in JAX - or by an earlier call - is kept, so
    calling this again (every `load_model` does) changes nothing.
    executables: also keep the engine's compiled programs as executables beside the cache
    (`dsjax.engine.executables`: a warm start then skips tracing and lowering them); the
    commands (`dsjax serve`, `run`, `batch`) turn it on, None leaves it as it was."""
    global _chosen, _keep_executables
    if executables is not None:
        _keep_executables = executables
    explicit = setting is not None
    if not explicit:
        if _chosen is not None:
            return current()
        if jax.config.jax_compilation_cache_dir:
            _chosen = CompileCache(str(jax.config.jax_compilation_cache_dir), "jax config")
            return current()
        env = os.environ.get(ENV)
        setting, source = (env, ENV) if env is not None else (str(default_directory()), "default")
    else:
        source = "argument"
    setting = os.fspath(setting)
    if setting.strip().lower() in OFF:
        if explicit or jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_enable_compilation_cache", False)
        _chosen = CompileCache(None, f"{source} says off")
        return _chosen
    directory = Path(setting).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run: it only costs compile time
        _chosen = CompileCache(None, f"unavailable: cannot create {directory} ({e.strerror})")
        return _chosen
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    _chosen = CompileCache(str(directory), source)
    return _chosen


def executable_directory() -> Path | None:
    """Where the engine keeps executables (`dsjax.engine.executables`): beside the compile
    cache, when a command asked for it and the cache is on; else None."""
    cache = current()
    if not _keep_executables or not cache.enabled:
        return None
    return Path(cache.directory) / EXECUTABLES_SUBDIR
