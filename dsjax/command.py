"""What every `dsjax` command shares, wherever it is defined (dsjax/cli/, serving/command.py,
batch/command.py): how it runs, its parser, the flags all commands take, loading a model with
them, the compile cache. It lies below the front ends, so `python -m dsjax.serving` runs
`dsjax serve` without importing the CLI.

Every command runs in a worker thread while the main thread waits for it, so Ctrl-C is
answered at once - even in the middle of an XLA compile - with one line and exit status 130
(the process ends with os._exit: tearing JAX down under a running compile crashes). Errors a
user can fix print one line `dsjax: error: ...` and exit 2; anything else prints one line and
where the full report went, and exits 1 (`--debug`: the traceback instead). Imports of dsjax
and JAX are deferred into the helpers: `dsjax --help` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

EXIT_INTERNAL, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(Exception):
    """A command line the parser (or a command's own check) refuses."""


class Status:
    """What the command is doing, on stderr, as it happens (nothing with --quiet)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"dsjax: {message}", file=sys.stderr, flush=True)


def is_user_error(e: BaseException) -> bool:
    """Errors whose message tells the user what to change: bad input, config, checkpoint,
    missing files, a model that does not fit, a request the protocol library refuses."""
    if isinstance(e, ValueError) and _raised_inside_jax(e):  # JAX refusing what dsjax asked of it: dsjax's bug
        return False
    if isinstance(e, (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                      PermissionError, MemoryError)):
        return True
    return type(e).__name__ == "ConversionError" and type(e).__module__.startswith(("deepseek_recipe", "_native"))


def _raised_inside_jax(e: BaseException) -> bool:
    """Whether the innermost frame of e's traceback is in a jax or jaxlib module (by module
    name, not file path: a checkout under a folder named jax is still dsjax's)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module.split(".")[0] in ("jax", "jaxlib")


def report_crash(e: BaseException, argv) -> str:
    """Write the traceback where the user can attach it to an issue; return the path."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    text = (f"dsjax {' '.join(argv)}\npython {sys.version.split()[0]}\n\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    for directory in (os.path.join(base, "dsjax", "crash"), tempfile.gettempdir()):
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"dsjax-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
            with open(path, "w") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return "(could not be written)"


_graceful: dict = {}  # the running command's own stop (dsjax serve drains its requests)


def on_interrupt(stop) -> None:
    """Let the running command stop itself on the first SIGINT / SIGTERM: stop(signum) runs
    in a thread of its own while the command finishes; a second signal exits at once."""
    _graceful["stop"] = stop


def interrupted(signum, frame):
    """Ctrl-C (or SIGTERM): one line, status 128 + signal (130 for Ctrl-C), now, unless the
    command asked to stop itself (`on_interrupt`). os._exit skips interpreter teardown,
    which would otherwise run while the worker thread is inside XLA (the source of the old
    SIGSEGV)."""
    stop = _graceful.pop("stop", None)
    if stop is not None:
        threading.Thread(target=stop, args=(signum,), name="dsjax-stop", daemon=True).start()
        return
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    os.write(2, b"\ndsjax: interrupted\n" if sys.stderr.isatty() else b"dsjax: interrupted\n")
    os._exit(128 + signum)


def run_in_worker(func, args, say):
    """Run the command in a thread so that the main thread can take Ctrl-C at once."""
    box: dict = {}

    def target():
        try:
            box["rc"] = func(args, say)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    worker = threading.Thread(target=target, name="dsjax-command", daemon=True)
    on_main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(s, interrupted) for s in signals] if on_main else None
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
    finally:
        _graceful.clear()
        if on_main:
            for s, handler in zip(signals, previous):
                signal.signal(s, handler)
    if "error" in box:
        raise box["error"]
    return box.get("rc", 0)


def run_command(build_parser, argv: list[str]) -> int:
    """Parse argv and run its command in a worker thread -> the exit status."""
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return run_in_worker(args.func, args, Status(args.quiet))
    except KeyboardInterrupt:
        print("dsjax: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:  # --help
        raise
    except BaseException as e:  # noqa: BLE001 - the one place errors meet the user
        if debug:
            raise
        if is_user_error(e):
            print(f"dsjax: error: {' '.join(str(e).split())}", file=sys.stderr)
            return EXIT_USAGE
        path = report_crash(e, argv)
        print(f"dsjax: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"(full report: {path}; rerun with --debug to see it here)", file=sys.stderr)
        return EXIT_INTERNAL


# --------------------------------------------------------------------------- parsers and helpers
class CommandParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage block and exit 2 itself
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def common_flags() -> CommandParser:
    """The flags every command takes (a parent parser)."""
    common = CommandParser(add_help=False)
    common.add_argument("--quiet", "-q", action="store_true", help="no progress messages on stderr")
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    common.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="keep compiled programs in DIR (default: $DSJAX_COMPILE_CACHE, else "
                             "~/.cache/dsjax/jax; a cache dir set in JAX is kept)")
    common.add_argument("--no-compile-cache", action="store_true", help="do not read or write compiled programs")
    return common


def add_prefix_cache_args(parser, auto: bool = False) -> None:
    """--prefix-cache-mb / --prefix-host-mb (dsjax serve, with an automatic default; dsjax batch)."""
    parser.add_argument("--prefix-cache-mb", type=float, default=None if auto else 0, metavar="MIB",
                        help="keep prompts' cache blocks across requests in up to MIB of device memory (0: off"
                        + ("; default: half the memory left after the weights and slots" if auto else "")
                        + "). A block is --prefill-chunk "
                        "tokens, which must be a multiple of the largest compression ratio (128 for V4)")
    parser.add_argument("--prefix-host-mb", type=float, default=0, metavar="MIB", help="host-memory tier for the "
                        "blocks the device budget evicts (0: they are dropped)")


@contextlib.contextmanager
def compile_counter():
    """Counts of programs built (compiled or read from the persistent cache) and read from the cache meanwhile."""
    import jax

    from dsjax.engine.executables import EXECUTABLE_LOADED

    counts = {"programs": 0, "cached": 0}

    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            counts["programs"] += 1

    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            counts["cached"] += 1
        elif event == EXECUTABLE_LOADED:  # an engine program read whole from disk: built from the cache
            counts["programs"] += 1
            counts["cached"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def setup_cache(args):
    from dsjax.compile_cache import setup_compile_cache

    return setup_compile_cache("off" if args.no_compile_cache else args.compile_cache, executables=True)


WEIGHT_DTYPE_HELP = ("bfloat16: the projection matrices stored in bf16 under float32 activations (half the bytes a "
                     "CPU decode step reads; dsjax.store_weights). Default: as --dtype")


def load(args, say, **kw):
    """load_model with the command's flags, saying what it loads."""
    import dsjax
    from dsjax.api import resolve_dtype
    from dsjax.weights import bundled_path

    dtype = resolve_dtype(args.dtype).name
    narrow = getattr(args, "weight_dtype", None)
    if narrow is not None and dtype != "float32":
        raise ValueError(f"--weight-dtype {narrow} stores weights under float32 activations; --dtype is {dtype}")
    if Path(args.model).exists():
        what = f"{args.model} ({dtype})"
    elif bundled_path(args.model) is not None:
        what = f"{args.model} (trained weights shipped with dsjax, {dtype})"
    else:
        what = f"{args.model} (random weights, seed {args.seed}, {dtype})"
    say(f"loading {what} ...")
    t = time.perf_counter()
    model = dsjax.load_model(args.model, dtype=args.dtype, seed=args.seed, mesh=args.mesh or None,
                             kernels=args.kernels, progress=not args.quiet and Path(args.model).is_dir(), **kw)
    say(f"loaded in {time.perf_counter() - t:.1f} s")
    if narrow is not None:
        model = dsjax.store_weights(model, narrow)
        say(f"projection weights stored as {narrow}, activations float32")
    return model


def compiling(say, cache) -> None:
    from dsjax.kernels import cpu as cpu_kernels

    if cpu_kernels.needs_build():
        say("building the CPU vocabulary-head kernel (once on this machine) ...")
        say(f"CPU head kernel: {cpu_kernels.status()}")
    if cache.enabled:
        say(f"compiling (programs compiled before are read from the cache in {cache.directory}) ...")
    else:
        say("compiling (compile cache off) ...")
