"""Engines kept warm between calls of the library's one-shot functions (`dsjax.generate`,
`dsjax.score`, `Chat.send`), so a notebook's repeated calls pay for their tokens only.

Building an `Engine` allocates its cache and, on one CPU device, packs the vocabulary head
for the head kernel: on the built-in model that set-up cost a 128-token prompt's first token
three times the prefill itself. `warm_engine(model, **settings)` hands out the engine it
built for the same model and the same settings last time instead:

    with warm_engine(model, max_slots=4, capacity=256) as engine:
        ... engine.add_request(...); engine.run() ...

Same settings means the same engine shape (slots, capacity bucket, decode steps, drafts,
logprobs), so a call's tokens are the ones a fresh engine would give, bitwise: the programs
and their inputs' shapes are the same, and each request's cache rows are rewritten from its
first prompt chunk on (tests/test_warm_engine.py). A model keeps at most one warm engine:
another shape class replaces it, releasing the old engine's cache before the new one is
allocated. An engine is handed out to one caller at a time (a concurrent caller gets a
fresh engine of its own), and is dropped, not kept, when a call ends with an exception
(requests may still be in flight on it). `release(model)` drops a model's engine (its
cache memory) now; replacing the model's params, drafter, options or mesh does too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Iterator

from dsjax import code_memory
from dsjax.engine.engine import Engine


@dataclasses.dataclass
class _Warm:
    model: weakref.ref
    fields: tuple  # the model's fields the engine was built from (`_fields`)
    settings: tuple
    engine: Engine
    busy: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_warm: dict[int, _Warm] = {}  # by id(model); an entry leaves when its model is collected
_lock = threading.RLock()


def _fields(model) -> tuple:
    """What an engine takes from its model at construction, compared by identity (weights) or
    value (config, options): a model whose params were replaced gets a new engine."""
    return (model.params, model.mtp, model.mesh, model.draft_vocab, model.config, model.dtype, model.options)


def _same(a: tuple, b: tuple) -> bool:
    return all(x is y for x, y in zip(a[:4], b[:4])) and a[4:] == b[4:]


def _entry(model, settings: tuple) -> _Warm | None:
    entry = _warm.get(id(model))
    if entry is not None and entry.model() is model and _same(entry.fields, _fields(model)) \
            and entry.settings == settings:
        return entry
    return None


@contextlib.contextmanager
def warm_engine(model, **settings: Any) -> Iterator[Engine]:
    """An idle `Engine(model, **settings)`: the one kept from the last call with the same
    model and settings, else a new one (kept for the next call). Settings must be hashable."""
    key = tuple(sorted(settings.items()))
    with _lock:
        entry = _entry(model, key)
        if entry is None:
            release(model)  # the old shape class's cache goes before the new one is allocated
        elif not entry.busy.acquire(blocking=False):
            entry = None  # another caller holds it: this call gets an engine of its own
            key = None
    if entry is None:
        engine = Engine(model, **settings)
        if key is None:
            yield engine
            return
        entry = _Warm(weakref.ref(model, lambda _, i=id(model): _warm.pop(i, None)), _fields(model), key, engine)
        entry.busy.acquire()
        with _lock:
            _warm[id(model)] = entry
    try:
        yield entry.engine
    except BaseException:
        release(model, entry)
        raise
    finally:
        engine = entry.engine
        for request_id in list(engine.requests):
            engine.forget(request_id)
        if engine.has_work() or engine.requests:  # left mid-run (a generator closed early): not reusable
            release(model, entry)
        entry.busy.release()


def release(model, entry: _Warm | None = None) -> None:
    """Drop `model`'s warm engine (only `entry`, when given), freeing its cache."""
    with _lock:
        if entry is None or _warm.get(id(model)) is entry:
            _warm.pop(id(model), None)


def release_all() -> None:
    """Drop every model's warm engine (their caches and compiled programs)."""
    with _lock:
        _warm.clear()


code_memory.on_release(release_all)  # when the process nears the limit on code mappings
