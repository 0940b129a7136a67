"""Capture and edit the intermediates of the forward, under `jax.jit` (docs/inspect.md).

    logits, trace = inspect.forward(model, tokens, capture={"layers.*.moe.experts", "final.hidden"},
                                    edits=inspect.ablate(model.config, layer=2, experts=[5]))

`forward` traces the model's one full-sequence forward (`dsjax.model.forward_pass.forward_traced`)
inside a taps session (dsjax/layers/taps.py): the layers' named points (`layers.{i}.moe.experts`,
`layers.{i}.mhc.streams_out`, ...) are edited and recorded there, and the captured values come
back as the program's outputs, so nothing runs outside the compiled program and nothing is
computed twice. The capture set is static (a new set compiles a new program); the edits are a
pytree argument, so a sweep over edit values with the same names and shapes compiles once.
Without captures and edits the program is `dsjax.model.forward`'s, op for op.

Names: `names(model, batch, seq)` lists those of a model at a shape, with shapes and dtypes; a
capture pattern is an `fnmatch` pattern over them ("layers.*.moe.*"); an edit names one point.
"""

from __future__ import annotations

import fnmatch
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.api import Model
from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers import taps
from dsjax.layers.taps import EDITS, Add, Replace
from dsjax.model.forward_pass import forward_traced
from dsjax.sharding.rules import batch_sharding

__all__ = ["Add", "Replace", "ablate", "at_positions", "forward", "force_experts", "mask_entries", "names", "patch",
           "steer"]


def forward(model: Model, tokens, capture=(), edits: dict | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """tokens [B, S] (a whole sequence from position 0) -> (logits [B, S, V] fp32, trace: name ->
    captured array). capture: a name or an iterable of names / fnmatch patterns, each matching at
    least one point; edits: name -> `Replace` | `Add` (or merged dicts of the helpers below).
    On a mesh the tokens are split over the batch axes as `Model.logits` splits them (B a multiple
    of the batch shards) and the captured arrays keep the shardings the program gives them."""
    capture = (capture,) if isinstance(capture, str) else tuple(sorted(set(capture)))
    edits = dict(edits or {})
    for name, edit in edits.items():
        if not isinstance(edit, EDITS):
            raise TypeError(f"edit of {name}: {type(edit).__name__}, not one of {[e.__name__ for e in EDITS]}")
    ids = np.asarray(tokens, np.int32)
    if ids.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {ids.shape}")
    with model.mesh_context():
        shards = model.batch_shards()
        if ids.shape[0] % shards:
            raise ValueError(f"{ids.shape[0]} rows do not split over the mesh's {shards} batch shards")
        x = jnp.asarray(ids) if model.mesh is None else jax.device_put(ids, batch_sharding(model.mesh, 2))
        return _inspect(model.params, x, edits, cfg=model.config, opts=model.options, capture=capture)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "capture"))
def _inspect(params, tokens, edits, cfg: ModelConfig, opts: RuntimeOptions, capture: tuple[str, ...]):
    with taps.session(capture, edits) as s:
        logits, _ = forward_traced(params, tokens, cfg, opts=opts)
    _check(s.seen, capture, edits)
    return logits, dict(sorted(s.found.items(), key=lambda kv: _order(kv[0])))


def _order(name: str):
    """Layers in order, then the rest (`final.*`)."""
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    return (0, int(m.group(1)), m.group(2)) if m else (1, 0, name)


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


def _check(seen: dict, capture: tuple[str, ...], edits: dict) -> None:
    unknown = [p for p in capture if not any(fnmatch.fnmatchcase(n, p) for n in seen)]
    if unknown:
        raise ValueError(f"capture {unknown} matches no point of this forward; its points are:\n{describe(seen)}")
    unknown = [n for n in edits if n not in seen]
    if unknown:
        raise ValueError(f"edits of {unknown}: no such point in this forward (edits name one point each); "
                         f"its points are:\n{describe(seen)}")


def names(model: Model, batch: int = 1, seq: int = 16) -> dict[str, tuple]:
    """Every point the forward taps for tokens [batch, seq] -> name -> (shape, dtype), without
    running it (an abstract trace). Which points exist can depend on seq: a CSA layer's indexer
    selects (`indexer.*`) only once a query sees more compressed entries than it keeps."""
    def trace(params, tokens):
        with taps.session((), {}) as s:
            forward_traced(params, tokens, model.config, opts=model.options)
        found.update(s.seen)

    found: dict = {}
    with model.mesh_context():
        jax.eval_shape(trace, model.params, jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    return {n: found[n] for n in sorted(found, key=_order)}


# ----------------------------------------------------------------------------- edit helpers
def at_positions(seq: int, positions) -> np.ndarray:
    """A `where` mask [1, S] that holds at the given positions (an int, a list, or a slice)."""
    mask = np.zeros((1, seq), bool)
    mask[0, positions] = True
    return mask


def ablate(cfg: ModelConfig, layer: int, experts) -> dict:
    """Zero the output of routed experts at a layer, their routing weights kept (the other
    experts' weights are not renormalised): `layers.{layer}.moe.expert_gain` [E] set to 0 there."""
    gain = np.ones(cfg.n_routed_experts, np.float32)
    gain[np.asarray(experts, int)] = 0.0
    return {f"layers.{layer}.moe.expert_gain": Replace(gain)}


def force_experts(layer: int, experts, where=None) -> dict:
    """Route the tokens of a layer to the given experts ([B, S, K] or broadcastable, e.g. [K]);
    their weights are then the router's scores of those experts, normalised as usual."""
    return {f"layers.{layer}.moe.experts": Replace(np.asarray(experts, np.int32), where)}


def patch(name: str, value, where=None) -> dict:
    """Activation patching: set a point (e.g. `layers.{l}.mhc.streams_in`) to `value` where `where`
    holds (`at_positions`; None: everywhere)."""
    return {name: Replace(value, where)}


def steer(name: str, vector, where=None) -> dict:
    """Add a steering vector ([D] for streams: to every stream) to a point where `where` holds."""
    return {name: Add(vector, where)}


def mask_entries(layer: int, hidden) -> dict:
    """Hide compressed entries from a CSA layer's indexer: `hidden` [B, S, T] bool (or
    broadcastable, e.g. [T]) marks entries no query may select (`layers.{layer}.indexer.visible`)."""
    hidden = np.asarray(hidden, bool)
    return {f"layers.{layer}.indexer.visible": Replace(np.zeros((), bool), _full_mask(hidden))}


def _full_mask(hidden: np.ndarray) -> np.ndarray:
    """A mask over the last axis broadcast up to [1, 1, T] (a `where` covers the leading axes)."""
    return hidden.reshape((1,) * (3 - hidden.ndim) + hidden.shape) if hidden.ndim < 3 else hidden
