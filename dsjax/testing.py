"""Golden files for users' own tests: record generated tokens once, assert them later.

    from dsjax.testing import assert_golden

    def test_my_prompts():
        out = dsjax.generate(model, prompts, 16)            # ids (or text) per prompt
        assert_golden("tests/golden/my_prompts.json", out)  # first run: writes the file

The first run writes the file (and passes, with a warning); later runs compare and fail
with a readable diff: which entries differ, the first position where each does, the tokens
around it on both sides, and their text when a tokenizer is given. `update=True` or the
environment variable DSJAX_UPDATE_GOLDEN=1 rewrites the file. The file records where it was
made (dsjax / jax / jaxlib versions, backend, devices): a diff names what differs there too, since
tokens are only promised equal on the same setup (see docs/numerics.md).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from dsjax.batch.manifest import environment  # where results were made: versions, backend, devices

UPDATE_ENV = "DSJAX_UPDATE_GOLDEN"
CONTEXT = 4  # tokens shown on each side of the first difference


def _entries(results: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """A list (keyed by index) or a mapping of results -> {key: JSON value}."""
    items = results.items() if isinstance(results, Mapping) else enumerate(results)
    out = {}
    for k, v in items:
        if hasattr(v, "tolist"):  # numpy / jax arrays
            v = v.tolist()
        try:
            json.dumps(v)
        except TypeError:
            raise TypeError(f"assert_golden: entry {k!r} is a {type(v).__name__}, not token ids, text or other "
                            f"JSON data") from None
        out[str(k)] = v
    return out


def _show(tokens: list, at: int, tokenizer) -> str:
    part = tokens[max(0, at - CONTEXT): at + CONTEXT + 1]
    text = f" {tokenizer.decode(part)!r}" if tokenizer is not None and all(isinstance(t, int) for t in part) else ""
    return f"[{'...' if at > CONTEXT else ''}{', '.join(map(repr, part))}{'...' if at + CONTEXT + 1 < len(tokens) else ''}]{text}"


def _difference(key: str, want, got, tokenizer) -> str:
    if isinstance(want, list) and isinstance(got, list):
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        return (f"  {key}: differs at position {at} (golden {len(want)} long, got {len(got)})\n"
                f"    golden {_show(want, at, tokenizer)}\n    got    {_show(got, at, tokenizer)}")
    if isinstance(want, str) and isinstance(got, str):
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        return (f"  {key}: differs at character {at}\n    golden {want[max(0, at - 20): at + 20]!r}\n"
                f"    got    {got[max(0, at - 20): at + 20]!r}")
    return f"  {key}: golden {json.dumps(want)[:120]}, got {json.dumps(got)[:120]}"


def assert_golden(path: str | Path, results: Sequence[Any] | Mapping[str, Any], *, tokenizer=None,
                  update: bool | None = None) -> None:
    """Compare `results` (a list or a mapping of token id lists, texts or other JSON values)
    with the golden file at `path`; write it when it does not exist or when updating
    (`update=True`, or DSJAX_UPDATE_GOLDEN=1). Raises AssertionError with a diff of the
    entries that differ. tokenizer (e.g. `dsjax.load_tokenizer()`): show ids as text too."""
    path = Path(path)
    got = _entries(results)
    update = os.environ.get(UPDATE_ENV, "") not in ("", "0") if update is None else update
    if update or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": environment(), "results": got}, indent=1) + "\n")
        if not update:
            warnings.warn(f"{path}: golden file written (it did not exist); later runs compare against it",
                          stacklevel=2)
        return
    try:
        golden = json.loads(path.read_text())
        want, made = golden["results"], golden["environment"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a golden file written by dsjax.testing ({e}); delete it or set "
                         f"{UPDATE_ENV}=1 to rewrite it") from None
    lines = [_difference(k, want[k], got[k], tokenizer) for k in want if k in got and want[k] != got[k]]
    lines += [f"  {k}: in the golden file, not in the results" for k in want if k not in got]
    lines += [f"  {k}: in the results, not in the golden file" for k in got if k not in want]
    if lines:
        now = environment()
        changed = [f"{k} {made.get(k)} -> {now[k]}" for k in now if made.get(k) != now[k]]
        where = f"\n  made elsewhere: {'; '.join(changed)}" if changed else ""
        raise AssertionError(f"{path}: {len(lines)} of {len(want)} entries differ from the golden file "
                             f"(set {UPDATE_ENV}=1 to accept the new results){where}\n" + "\n".join(lines))
