"""How a `dsjax` command runs (dsjax/cli.py holds the commands and their arguments).

Every command runs in a worker thread while the main thread waits for it, so Ctrl-C is
answered at once - even in the middle of an XLA compile - with one line and exit status 130
(the process ends with os._exit: tearing JAX down under a running compile crashes). Errors a
user can fix print one line `dsjax: error: ...` and exit 2; anything else prints one line and
where the full report went, and exits 1 (`--debug`: the traceback instead).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
import traceback

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
    if isinstance(e, (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                      PermissionError, MemoryError)):
        return True
    return type(e).__name__ == "ConversionError" and type(e).__module__.startswith(("deepseek_recipe", "_native"))


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
