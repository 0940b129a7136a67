"""The durable output of a batch job.

- Each finished record is appended as one complete line (a single write of the whole line),
  flushed and fsync'd, as it finishes: a crash loses at most the records still running.
- A re-run reads the output back: a trailing partial line (the crash hit mid-write) is cut
  off, finished ids are skipped, the rest runs. The manifest must match (manifest.py).
- When every record is done, the output is rewritten in input order (error lines in their
  places) atomically, and the manifest says complete. A finished job's output therefore does
  not depend on how often it was interrupted (given batch invariance: see docs/batch-invariance.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dsjax.batch.manifest import replace_atomically
from dsjax.batch.runner import Checked


class JobRefused(Exception):
    """The job will not run as asked (settings differ from the output's, bad records with
    --on-error fail): the message says why; exit status 1."""


def encode(result: dict) -> bytes:
    """One output line, without its newline. Fixed key order from the dict; floats by repr."""
    return json.dumps(result, ensure_ascii=False).encode()


def key(record_id) -> str:
    return json.dumps(record_id)


def finished(data: bytes, path: Path) -> dict[str, bytes]:
    """{id key: line bytes} of the result lines among complete lines (not error lines)."""
    done = {}
    for n, raw in enumerate(data.split(b"\n")[:-1], 1):
        try:
            obj = json.loads(raw)
        except ValueError:
            raise JobRefused(f"{path} line {n} is not JSON: the file was not written by dsjax batch "
                             f"(move it away, or choose another --output)") from None
        if isinstance(obj, dict) and "error" not in obj and "id" in obj:
            done[key(obj["id"])] = bytes(raw)
    return done


class Output:
    """The output file, appended durably; `recover()` reads back what a previous run finished."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None

    def recover(self) -> dict[str, bytes]:
        """{id key: line bytes} of the finished records in the file (error lines are not
        kept: they are made again from the input); a partial last line is truncated."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a crash mid-line: what follows the last newline is incomplete
            os.truncate(self.path, end)
        return finished(data[:end], self.path)

    def append(self, line: bytes) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = line + b"\n"
        while data:  # one write for a line in practice; a short write is continued, never interleaved
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def finalize(self, checked: Checked, done: dict[str, bytes]) -> int:
        """Rewrite the output in input order: each line's result or its error. Returns the
        number of lines written."""
        self.close()
        by_line = {r.line: done[key(r.id)] for r in checked.records}
        by_line.update({n: encode(e) for n, e in checked.errors.items()})
        lines = [by_line[n] for n in sorted(by_line)]
        replace_atomically(self.path, b"".join(line + b"\n" for line in lines))
        return len(lines)
