"""Named taps: the points of the forward where `dsjax.inspect` reads (captures) or edits an
intermediate, by name (`layers.3.moe.experts`, `final.hidden`; docs/inspect.md lists them).

The layers call `tap(name, value)` at those points while the forward is traced. Outside an
`inspect` session (`session(...)`, opened by dsjax/inspect.py around one trace) a tap returns
its value and adds nothing to the program, so every program without a session is exactly the
one it was before taps existed. Inside a session a tap

    - applies the edits aimed at its name (`Replace`, `Add`: their arrays are traced arguments
      of the inspect program, so a sweep over edit values compiles once), then
    - records the (edited) value if a capture pattern matches its name.

A layer names its taps relative to itself (`moe.experts`); the decoder says which layer is
running with `layer(indices, at)`. Inside `lax.scan` over a run's stacked layers the layer is
one of `indices`, chosen by the traced `at`: captured values then cannot leave the scan body
as Python values, so the body opens `collect()`, returns what it collected as stacked scan
outputs, and the caller hands them back with `release(...)`, which stacks them into the
enclosing scan's outputs or, at the top, cuts them into per-layer names. Edits inside a scan
body are stacked over the run's layers ([L, ...], zeros where a layer has none) and the
layer's slice is applied where it has one. A scan that is not over layers (batch-invariant row
tiles, an engine's decode steps) traces its body as a forward of its own with `apart()`: what
the body captures comes back under full names, for the body to return among its scan outputs
and the caller to hand back, reshaped as it needs, with `found(...)`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import threading

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Replace:
    """Set the tapped value to `value` (broadcast to its shape, cast to its dtype) where `where`
    holds: a bool mask over the value's leading axes (e.g. [B, S] positions; None: everywhere)."""

    value: jax.Array
    where: jax.Array | None = None


@struct.dataclass
class Add:
    """Add `value` (broadcast from the right: a [D] steering vector, or a whole [B, S, N, D]) where
    `where` holds (as `Replace`)."""

    value: jax.Array
    where: jax.Array | None = None


EDITS = (Replace, Add)
_local = threading.local()


class _Session:
    def __init__(self, capture: tuple[str, ...], edits: dict):
        self.capture, self.edits = capture, edits
        self.seen: dict[str, tuple] = {}  # every name tapped in this trace -> (shape, dtype)
        self.found: dict[str, jax.Array] = {}
        self.layer: tuple[tuple[int, ...], object] | None = None  # (indices, at)
        self.collects: list[dict] = []  # open scan bodies, innermost last: key -> (value, levels)

    def wants(self, full: str) -> bool:
        return any(fnmatch.fnmatchcase(full, pattern) for pattern in self.capture)


def _session() -> _Session | None:
    return getattr(_local, "session", None)


def tracing() -> bool:
    """Whether a dsjax.inspect session is tracing (a layer that fuses its named points away
    takes its plain path then)."""
    return _session() is not None


def asks(*points: str) -> bool:
    """Whether the session tracing (if any) captures or edits one of these points of the layer
    running now (a layer that must take another path to expose them asks first)."""
    s = _session()
    return s is not None and any(full in s.edits or s.wants(full) for p in points for full in _names(s, p))


@contextlib.contextmanager
def session(capture: tuple[str, ...], edits: dict):
    """Trace a forward inside this block to capture names matching `capture` (fnmatch patterns)
    and apply `edits` (full name -> `Replace` / `Add`). Yields the session: `.found` (name ->
    array), `.seen` (every tapped name -> (shape, dtype))."""
    if _session() is not None:
        raise RuntimeError("an inspect session is already tracing (sessions do not nest)")
    s = _local.session = _Session(tuple(capture), dict(edits))
    try:
        yield s
    finally:
        _local.session = None


@contextlib.contextmanager
def layer(indices, at=None):
    """The layer running inside this block: one of `indices` (a run's stacked layers), the
    `at`-th (None: the first; an int: static; traced: inside a scan over them)."""
    s = _session()
    if s is None:
        yield
        return
    indices = (indices,) if isinstance(indices, int) else tuple(indices)
    if at is None or isinstance(at, int):
        indices, at = (indices[at or 0],), None
    outer, s.layer = s.layer, (indices, at)
    try:
        yield
    finally:
        s.layer = outer


def _names(s: _Session, name: str) -> list[str]:
    if s.layer is None:
        return [name]
    return [f"layers.{i}.{name}" for i in s.layer[0]]


def _broadcasts(shape: tuple, to: tuple) -> bool:
    try:
        return jnp.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def _apply(edit, value: jax.Array, full: str) -> jax.Array:
    shape = value.shape
    new = jnp.asarray(edit.value)
    if not _broadcasts(new.shape, shape):
        raise ValueError(f"edit of {full}: value shape {new.shape} does not broadcast to the tapped shape {shape}")
    new = (new + value if isinstance(edit, Add) else jnp.broadcast_to(new, shape)).astype(value.dtype)
    if edit.where is None:
        return new
    where = jnp.asarray(edit.where, bool)
    if where.ndim > len(shape) or not _broadcasts(where.shape, shape[:where.ndim]):
        raise ValueError(f"edit of {full}: `where` shape {where.shape} must broadcast to the tapped value's leading "
                         f"axes {shape[:where.ndim]} (tapped shape {shape})")
    return jnp.where(where.reshape(*where.shape, *(1,) * (len(shape) - where.ndim)), new, value)


def _edited(s: _Session, names: list[str], value: jax.Array) -> jax.Array:
    hits = [n for n, full in enumerate(names) if full in s.edits]
    if not hits:
        return value
    if s.layer is None or s.layer[1] is None:
        return _apply(s.edits[names[0]], value, names[0])
    # inside a scan over the run's layers: stack the edits over them, apply this layer's slice
    kinds = {type(s.edits[names[n]]) for n in hits}
    if len(kinds) > 1:
        raise ValueError(f"edits of {[names[n] for n in hits]}: layers stacked in one run take one kind of edit "
                         f"at a name ({sorted(k.__name__ for k in kinds)})")
    first = s.edits[names[hits[0]]]
    leaves = [s.edits[names[n]] if n in hits else None for n in range(len(names))]
    try:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[e if e is not None else jax.tree.map(jnp.zeros_like, first)
                                                          for e in leaves])
    except ValueError as err:
        raise ValueError(f"edits of {[names[n] for n in hits]}: layers stacked in one run need edits of one shape "
                         f"({err})") from None
    at = s.layer[1]
    mine = jax.tree.map(lambda a: a[at], stacked)
    on = jnp.asarray([e is not None for e in leaves])[at]
    return jnp.where(on, _apply(mine, value, names[hits[0]]), value)


def tap(name: str, value: jax.Array, shape: tuple[int, ...] | None = None) -> jax.Array:
    """A named point: `value` edited and recorded as the session asks (as is without one).
    shape: view the value as this shape for the edits and the capture (e.g. [T, K] routing
    rows as [B, S, K]); the result comes back in the value's own shape."""
    s = _session()
    if s is None:
        return value
    names = _names(s, name)
    own = value.shape
    for full in names:
        s.seen[full] = (own if shape is None else tuple(shape), value.dtype)
    if not any(full in s.edits or s.wants(full) for full in names):
        return value  # not asked for: the program stays the plain forward's
    if shape is not None:
        value = value.reshape(shape)
    value = _edited(s, names, value)
    if any(s.wants(full) for full in names):
        if s.layer is not None and s.layer[1] is not None:  # inside a scan body: leaves as a scan output
            if not s.collects:
                raise RuntimeError(f"tap {name} inside a scan over layers {s.layer[0]} without `collect()`")
            s.collects[-1][(s.layer[0], name)] = (value, 0)
        elif s.collects:
            raise NotImplementedError(f"capture of {names[0]} inside a scan that is not over layers "
                                      "(open its body with `apart()`): inspect the full-sequence forward")
        else:
            s.found[names[0]] = value
    return value.reshape(own)


def optional_tap(name: str, make) -> jax.Array | None:
    """A point computed only when asked for: `make()`'s value, tapped, when an edit is aimed at it
    or it is captured, else None (nothing is added to the program). For points that exist to be
    edited (`moe.expert_gain`) or cost work of their own (`final.hidden`)."""
    s = _session()
    if s is None:
        return None
    names = _names(s, name)
    if not any(full in s.edits or s.wants(full) for full in names):
        made = jax.eval_shape(make)
        for full in names:
            s.seen.setdefault(full, (made.shape, made.dtype))
        return None
    return tap(name, make())


class Apart:
    """What a scan body opened with `apart()` captured: `values` (full name -> array)."""

    def __init__(self):
        self.values: dict[str, jax.Array] = {}


@contextlib.contextmanager
def apart():
    """Open the body of a scan that is not over layers (row tiles, decode steps): inside, taps
    capture as at the top of a forward; after the block the yielded `Apart` holds what they
    captured (full names), to return among the scan's outputs and pass, stacked and reshaped, to
    `found`. Without a session it holds nothing and adds no output."""
    out = Apart()
    s = _session()
    if s is None:
        yield out
        return
    if s.collects or s.layer is not None:
        raise NotImplementedError("a scan that is not over layers inside a layer's own scan")
    outer, s.found = s.found, {}
    try:
        yield out
    finally:
        out.values, s.found = s.found, outer


def found(values: dict) -> None:
    """Hand what `apart()` bodies captured (stacked by their scan, reshaped by the caller) to the
    session as if captured here."""
    s = _session()
    if s is not None:
        s.found.update(values)


def describe(seen) -> str:
    """The names a forward taps, one line per point with the layers that have it."""
    points: dict[str, list[int]] = {}
    for name in seen:
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        points.setdefault(f"layers.{{i}}.{m.group(2)}" if m else name, []).append(int(m.group(1)) if m else -1)
    lines = []
    for point, layers in sorted(points.items()):
        where = "" if layers == [-1] else f"  i in {sorted(set(layers))}"
        lines.append(f"  {point}{where}")
    return "\n".join(lines)


class Collected:
    """What a scan body captured: `values` (key -> array, the body's extra scan outputs) and the
    static nesting `levels` of each (how many scans it is already stacked over)."""

    def __init__(self):
        self.values: dict = {}
        self.levels: dict = {}


@contextlib.contextmanager
def collect():
    """Open a scan body: yields a `Collected` that, after the block, holds what was captured
    inside; return its `.values` among the scan's outputs and pass the stacked result to `release`."""
    out = Collected()
    s = _session()
    if s is None:
        yield out
        return
    s.collects.append({})
    try:
        yield out
    finally:
        found = s.collects.pop()
        out.values = {k: v for k, (v, _) in found.items()}
        out.levels = {k: lv for k, (_, lv) in found.items()}


def release(stacked: dict, body: Collected) -> None:
    """Hand a scan's stacked outputs of `collect()` (`stacked`; `body`: what the body's
    `collect()` yielded, for the static levels) to the enclosing scan body or, at the top, to the
    session under per-layer names."""
    s = _session()
    if s is None or not stacked:
        return
    for key, value in stacked.items():
        level = body.levels[key] + 1
        if s.collects:
            s.collects[-1][key] = (value, level)
            continue
        indices, name = key
        per_layer = value.reshape(len(indices), *value.shape[level:])
        for n, i in enumerate(indices):
            if s.wants(f"layers.{i}.{name}"):
                s.found[f"layers.{i}.{name}"] = per_layer[n]
