"""Batch jobs on many model replicas with Ray Data (the optional extra: pip install 'dsjax[ray]').

    ds = ray.data.read_json("in.jsonl")       # or read_text("in.jsonl"): one JSON line per row
    out = ds.map_batches(RayPredictor, fn_constructor_kwargs={"model": "tiny", "batch_invariant": True},
                         concurrency=2, batch_size=16, batch_format="pyarrow")
    # rows: {"line", "id", "output"}: "output" is the line `dsjax batch` writes, as JSON text

    dsjax batch --input in.jsonl --output out.jsonl --ray 2   # the same, with the crash-safe output file

Each replica (a Ray actor) loads the model once and runs its batches with `run_items`, the
one-process runner. A record's tokens do not depend on its replica or batch neighbours when
its seed does not (records without one get `derived_seed(run seed, id)`) and, bitwise, with
batch_invariant=True. Ray itself is imported only by `ray_cluster` / `dispatch`, so
`import dsjax.batch` works without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Any, Iterator

from dsjax.api import load_model
from dsjax.batch.runner import run_items
from dsjax.tokenizer import load_tokenizer

INSTALL_HINT = "pip install 'dsjax[ray]'"


def _plain(value):
    """An Arrow / pandas / numpy value as JSON's Python value; null fields are left out
    (Arrow gives every row every column of the file, null where a line lacks it)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not _null(v)}
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _plain(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _null(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _rows(batch) -> list[dict]:
    """A Ray batch (pyarrow Table, pandas DataFrame or dict of numpy columns) as row dicts."""
    if hasattr(batch, "to_pylist"):
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):
        return batch.to_dict("records")
    n = len(next(iter(batch.values()))) if batch else 0
    return [{k: col[i] for k, col in batch.items()} for i in range(n)]


def items(batch) -> list[tuple[int, Any, str | None]]:
    """check's items from a batch. A row is a record (read_json), or {"text": one JSON line}
    (read_text), either with an optional "line": its line number in the whole input (what
    error lines report; without it, rows are numbered from 1 within the batch)."""
    out = []
    for n, row in enumerate(_rows(batch), 1):
        row = _plain(row)
        line = row.pop("line", n)
        if set(row) == {"text"}:
            try:
                out.append((line, json.loads(row["text"]), None))
            except ValueError as e:
                out.append((line, None, f"not valid JSON: {e}"))
        else:
            out.append((line, row, None))
    return out


class RayPredictor:
    """A model replica for `Dataset.map_batches`: loads the model once (`load_model(model,
    dtype=, seed=, mesh=, kernels=)`), then runs each batch of input records and returns
    {"line": [...], "id": [...], "output": [...]}: the line number, the record's id as JSON
    text (ids may be strings or integers), and its output line (a result or an error) as
    JSON text, byte for byte what `dsjax batch` writes. The rest are `run_items`'s settings
    (name: the model name OpenAI bodies may give, default the config's);
    `capacity`: the whole job's engine capacity (batches of one job then compile the same
    shapes and, with batch_invariant, give the one-process tokens bitwise)."""

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0, mesh: str | None = None,
                 kernels: str = "reference", name: str | None = None, max_new_tokens: int = 256,
                 max_slots: int = 8, batch_invariant: bool | None = None, decode_steps: int = 4,
                 prefill_chunk: int = 256, capacity: int | None = None, num_draft_tokens: int = 0,
                 record_routing: bool = False):
        self.model = load_model(model, dtype=dtype, seed=seed, mesh=mesh or None, kernels=kernels,
                                **({"mtp": True} if num_draft_tokens else {}))
        self.tokenizer = load_tokenizer(model)
        self.settings = dict(seed=seed, name=name,
                             max_new_tokens=max_new_tokens, max_slots=max_slots, batch_invariant=batch_invariant,
                             decode_steps=decode_steps, prefill_chunk=prefill_chunk, capacity=capacity,
                             num_draft_tokens=num_draft_tokens, record_routing=record_routing)

    def __call__(self, batch) -> dict[str, list]:
        work = items(batch)
        results = run_items(self.model, work, tokenizer=self.tokenizer, **self.settings)
        return {"line": [line for line, _, _ in work], "id": [json.dumps(r["id"]) for r in results],
                "output": [json.dumps(r, ensure_ascii=False) for r in results]}


def require_ray():
    """The ray module, or an ImportError that says how to install it."""
    try:
        import ray  # the optional extra
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"Ray is not installed ({e}): {INSTALL_HINT}") from None
    return ray


@contextlib.contextmanager
def ray_cluster(replicas: int = 1, quiet: bool = False):
    """The Ray cluster this process is connected to; else the one at RAY_ADDRESS; else a
    local one, shut down on exit."""
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    settings = dict(include_dashboard=False, log_to_driver=False,
                    logging_level=logging.ERROR if quiet else logging.INFO)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**settings)  # ray.init reads RAY_ADDRESS itself
    else:  # logical CPUs: each replica holds one, and Ray Data's own tasks need one more
        ray.init(num_cpus=max(os.cpu_count() or 1, replicas + 1), **settings)
    try:
        yield ray
    finally:
        ray.shutdown()


def dispatch(lines: list[tuple[int, str]], *, replicas: int, batch_size: int, predictor: dict,
             num_cpus: float = 1, num_gpus: float = 0, quiet: bool = False) -> Iterator[tuple[int, str, str]]:
    """Run (line number, JSON line) pairs on `replicas` RayPredictor actors, `batch_size`
    lines a batch; yields (line, id JSON, output JSON) as batches finish (any order).
    `predictor`: RayPredictor's keyword arguments. quiet: Ray's progress and INFO logs off."""
    with ray_cluster(replicas, quiet) as ray, _quiet(ray, quiet):
        ds = ray.data.from_items([{"line": n, "text": text} for n, text in lines])
        ds = ds.map_batches(RayPredictor, fn_constructor_kwargs=predictor, concurrency=replicas,
                            batch_size=batch_size, batch_format="pyarrow", num_cpus=num_cpus, num_gpus=num_gpus)
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            yield from zip(*(batch.column(c).to_pylist() for c in ("line", "id", "output")))


@contextlib.contextmanager
def _quiet(ray, quiet: bool):
    if not quiet:
        yield
        return
    ctx = ray.data.DataContext.get_current()
    loggers = [logging.getLogger(n) for n in ("ray", "ray.data")]
    before = ctx.enable_progress_bars, [lg.level for lg in loggers]
    ctx.enable_progress_bars = False
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.enable_progress_bars = before[0]
        for lg, level in zip(loggers, before[1]):
            lg.setLevel(level)
