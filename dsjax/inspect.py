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

from dsjax import code_memory
from dsjax.api import Model
from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.layers import taps
from dsjax.layers.taps import EDITS, Add, Replace, describe
from dsjax.model.forward_pass import forward_traced
from dsjax.model.interface import draft_block_limit, drafter_for
from dsjax.sharding.rules import batch_sharding

__all__ = ["Add", "Replace", "ablate", "at_positions", "forward", "force_experts", "mask_entries", "names", "patch",
           "steer"]


DRAFTS = ("drafter.tokens", "drafter.logits")  # a model with its drafter: its greedy drafts after each position


def forward(model: Model, tokens, capture=(), edits: dict | None = None, *,
            draft_tokens: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """tokens [B, S] (a whole sequence from position 0) -> (logits [B, S, V] fp32, trace: name ->
    captured array). capture: a name or an iterable of names / fnmatch patterns, each matching at
    least one point; edits: name -> `Replace` | `Add` (or merged dicts of the helpers below).
    On a mesh the tokens are split over the batch axes as `Model.logits` splits them (B a multiple
    of the batch shards) and the captured arrays keep the shardings the program gives them.
    Drafts (`drafter.tokens` [B, S - 1, k] int32, `drafter.logits` [B, S - 1, k, V] fp32, a model
    loaded with its drafter): at each position t < S - 1, the k greedy drafts the drafter makes
    once the target has run positions 0..t and emitted token t + 1 (as the engine drafts after
    a step), i.e. its guesses for tokens t + 2 .. t + k + 1, with the logits each was the
    first maximum of (V4.1: Markov-corrected). draft_tokens: k (default: DSpark's block, MTP 1)."""
    capture = (capture,) if isinstance(capture, str) else tuple(sorted(set(capture)))
    edits = dict(edits or {})
    for name, edit in edits.items():
        if not isinstance(edit, EDITS):
            raise TypeError(f"edit of {name}: {type(edit).__name__}, not one of {[e.__name__ for e in EDITS]}")
    ids = np.asarray(tokens, np.int32)
    if ids.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {ids.shape}")
    drafts = _drafts_asked(model, capture, draft_tokens)
    code_memory.relieve()  # a program per shape and edit set: past most of the limit on code mappings, drop old ones
    with model.mesh_context():
        shards = model.batch_shards()
        if ids.shape[0] % shards:
            raise ValueError(f"{ids.shape[0]} rows do not split over the mesh's {shards} batch shards")
        x = jnp.asarray(ids) if model.mesh is None else jax.device_put(ids, batch_sharding(model.mesh, 2))
        return _inspect(model.sequence_params(ids), x, edits, model.mtp if drafts[0] else None, cfg=model.config,
                        opts=model.options, capture=capture, drafts=drafts, dtype=jnp.dtype(model.dtype))


def _drafts_asked(model: Model, capture: tuple[str, ...], k: int | None) -> tuple[tuple[str, ...], int]:
    """(the draft points the capture patterns match, k); none without the model's drafter."""
    asked = tuple(n for n in DRAFTS if any(fnmatch.fnmatchcase(n, p) for p in capture)) if model.mtp is not None \
        else ()
    limit = draft_block_limit(model.config)
    k = (limit or 1) if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (limit is not None and k > limit):
        raise ValueError(f"draft_tokens must be an int in 1..{limit or 'any'} for this drafter, got {k!r}")
    return asked, k


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "capture", "drafts", "dtype"))
def _inspect(params, tokens, edits, drafter_weights=None, *, cfg: ModelConfig, opts: RuntimeOptions,
             capture: tuple[str, ...], drafts: tuple[tuple[str, ...], int] = ((), 1), dtype=None):
    asked, k = drafts
    drafter = drafter_for(cfg) if asked else None
    features = drafter.feature_points(cfg) if asked else ()
    with taps.session(capture + features, edits) as s:
        logits, _ = forward_traced(params, tokens, cfg, opts=opts)
    _check({**s.seen, **_draft_shapes(drafter_weights, tokens, cfg, k)}, capture, edits)
    found = {n: v for n, v in s.found.items() if any(fnmatch.fnmatchcase(n, p) for p in capture)}
    if asked:
        made = _drafts(drafter, drafter_weights, params, drafter.features_from(s.found, cfg), tokens, cfg, opts, k,
                       dtype)
        found.update({n: made[n] for n in asked})
    return logits, dict(sorted(found.items(), key=lambda kv: _order(kv[0])))


def _draft_shapes(weights, tokens, cfg: ModelConfig, k: int) -> dict[str, tuple]:
    b, s = tokens.shape
    return {} if weights is None else {"drafter.tokens": ((b, s - 1, k), jnp.int32),
                                       "drafter.logits": ((b, s - 1, k, cfg.vocab_size), jnp.float32)}


class _GreedyLogits:
    """A `DraftSampling` that drafts greedily (the first maximum) and hands back the logits it
    drafted from as the drafts' "distributions"."""

    sampled, confidence = True, False

    def pick(self, logits, position):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def choose(self, logits, position):
        return self.pick(logits, position), logits, None

    def probs(self, logits):
        return logits


def _drafts(drafter, weights, params, features, tokens, cfg, opts, k: int, dtype) -> dict[str, jax.Array]:
    """At each position t < S - 1: commit positions 0..t (each with the token after it) into an
    empty drafter state, then draft k tokens, as the engine does after the step that ran t
    (`dsjax.model.interface.Drafter`); one position at a time (memory: one state)."""
    b, s = tokens.shape
    after = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # the token after each position (last: unused)
    start = jnp.zeros((b,), jnp.int32)

    def at(t):
        state, context = drafter.commit(weights, params, drafter.init_state(cfg, b, dtype), features, after, start,
                                        jnp.full((b,), t + 1, jnp.int32), cfg, opts)
        drafted, logits, _ = drafter.draft(weights, params, state, context, cfg, opts, k=k, sampler=_GreedyLogits())
        return drafted, logits.astype(jnp.float32)

    drafted, logits = jax.lax.map(at, jnp.arange(s - 1, dtype=jnp.int32))  # [S - 1, B, k, ...]
    return {"drafter.tokens": jnp.moveaxis(drafted, 0, 1), "drafter.logits": jnp.moveaxis(logits, 0, 1)}


def _order(name: str):
    """Layers in order, then the rest (`final.*`)."""
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    return (0, int(m.group(1)), m.group(2)) if m else (1, 0, name)


def _check(seen: dict, capture: tuple[str, ...], edits: dict) -> None:
    unknown = [p for p in capture if not any(fnmatch.fnmatchcase(n, p) for n in seen)]
    if unknown:
        raise ValueError(f"capture {unknown} matches no point of this forward; its points are:\n{describe(seen)}"
                         + ("" if "drafter.tokens" in seen else
                            "\n(a model loaded with its drafter also has drafter.tokens and drafter.logits)"))
    unknown = [n for n in edits if n not in seen]
    if unknown:
        raise ValueError(f"edits of {unknown}: no such point in this forward (edits name one point each); "
                         f"its points are:\n{describe(seen)}")


def names(model: Model, batch: int = 1, seq: int = 16) -> dict[str, tuple]:
    """Every point the forward taps for tokens [batch, seq] -> name -> (shape, dtype), without
    running it (an abstract trace). Which points exist can depend on seq: a CSA layer's indexer
    selects (`indexer.*`) only once a query sees more compressed entries than it keeps. With the
    model's drafter: its drafts too (`forward`'s default draft_tokens)."""
    def trace(params, tokens):
        with taps.session((), {}) as s:
            forward_traced(params, tokens, model.config, opts=model.options)
        found.update(s.seen)

    found: dict = {}
    with model.mesh_context():
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        jax.eval_shape(trace, model.params, tokens)
    found.update(_draft_shapes(model.mtp, tokens, model.config, _drafts_asked(model, (), None)[1]))
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
