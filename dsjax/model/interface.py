"""The engine's one door into the model (and into the layers it needs): what an inference
engine runs a DeepSeek-V4 / V4.1 model with, and nothing of how the model computes it.
`dsjax.engine` imports this module and no other of `dsjax.model` / `dsjax.layers`
(tests/test_layering.py holds it to that). Modelled on tpu-inference's `ModelInterface`
(model_fn, compute_logits_fn, ...) and jax-llm-examples' single `forward`:

    forward            the one jitted forward: a whole sequence or a cached chunk -> logits, cache
    cache              init_cache, the rows a verify step writes (save / roll back), prefix blocks
                       (take / put), sizes; batch-major tree helpers (rows, tiles, batch axes)
    head               the step programs' head (`step_head_params`), the greedy screen, its product
    drafters           `Drafter` (MTP: model/v4/mtp.py, DSpark: model/v41/dspark.py), `drafter_for(cfg)`
    rules              what the model asks of the engine's scheduling (published-key rule, draft limits)
    capture            the forward with dsjax.inspect's taps recording named points per token

What differs between V4 and V4.1 is the config's `ModelFamily` (dsjax/model/family.py); the
functions here ask it, so the engine never tests which generation it runs.

The types re-exported (`Cache`, `CacheBlock`, `PackedHead`) are annotations and pytrees the
engine passes along; it reads no field of the model's parameter dataclasses.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, RuntimeOptions
from dsjax.kernels import cpu as cpu_kernels
from dsjax.layers.engram import kept_history
from dsjax.layers.linear import linear
from dsjax.kernels.cpu import PackedHead
from dsjax.layers import taps
from dsjax.model.block import DEFAULT_OPTIONS, INVARIANT_ROWS
from dsjax.model.cache import Block as CacheBlock
from dsjax.model.cache import (Cache, batch_axes, over_tiles, put_block, put_rows, restore_rows, save_rows, take_block,
                               take_rows)
from dsjax.model.cache_layout import block_layout, cache_bytes, decode_step_bytes, init_cache, min_ring
from dsjax.model.family import family_of
from dsjax.model.forward_pass import forward, forward_traced
from dsjax.model.head import head_dtype, lm_head_weight, screens, step_head_params
from dsjax.model.v41.backbone import with_sequence_rows as v41_sequence_rows
from dsjax.sharding.rules import batch_sharding

__all__ = [
    # forward
    "forward", "DEFAULT_OPTIONS", "INVARIANT_ROWS",
    # cache
    "Cache", "CacheBlock", "init_cache", "sequence_cache_bytes", "min_ring", "save_written", "roll_back",
    "block_layout", "take_block", "put_block", "batch_axes", "take_rows", "put_rows", "over_tiles",
    # head
    "PackedHead", "step_head_params", "screens", "worth_screening", "step_head", "greedy_tokens", "head_product",
    "head_rows",
    # drafters
    "Drafter", "DraftSampling", "drafter_for",
    # rules
    "reference_key_rule", "decodes_equal_prefill", "draft_block_limit", "drafter_takes_vocab",
    # capture
    "capture_points", "forward_capturing", "describe_points",
]


# ----------------------------------------------------------------------------- cache
def sequence_cache_bytes(cfg: ModelConfig, capacity: int, dtype=jnp.bfloat16) -> int:
    """Bytes of one sequence's cache at `capacity` tokens (`cache_bytes`' bytes_per_sequence)."""
    return cache_bytes(cfg, capacity, dtype)["bytes_per_sequence"]


def save_written(cache: Cache, positions: jax.Array, cfg: ModelConfig):
    """What a chunk at positions [B, n] will overwrite (each layer's rows, the Engram id history),
    for `roll_back` after a verify step."""
    return save_rows(cache, positions, cfg), cache.history, cache.length


def roll_back(params, cache: Cache, saved, positions: jax.Array, rejected: jax.Array, tokens: jax.Array,
              kept: jax.Array, cfg: ModelConfig) -> Cache:
    """The cache after a verify step over tokens [B, n] at positions [B, n] kept the first kept
    [B] of them: the rows the `rejected` [B, n] positions wrote put back (`save_written`'s), the
    length start + kept, the Engram history (V4.1) of the kept tokens only. Equal to the cache
    plain decoding of the kept tokens builds."""
    rows, history, start = saved
    cache = restore_rows(cache, rows, positions, rejected, cfg)
    cache = cache.replace(length=start + kept)
    tables = getattr(params, "engram_tables", None)
    if tables is not None:  # the Engram ids of the kept positions only
        cache = cache.replace(history=kept_history(tables.token_map, history, tokens, kept))
    return cache


def with_sequence_rows(params, tokens, cfg: ModelConfig, put=jnp.asarray):
    """params for one whole-sequence forward over host tokens [B, S]: V4.1's Engram rows fetched
    from its host tables before the call (each placed by `put`), so the program holds no host
    callback (JAX's persistent cache keeps it; `dsjax.model.v41.backbone.with_sequence_rows`);
    else params."""
    if getattr(params, "engram_tables", None) is None:
        return params
    return v41_sequence_rows(params, tokens, cfg, put)


# ----------------------------------------------------------------------------- head
def worth_screening(params, rows: int) -> bool:
    """Whether an engine of `rows` slots screens this model's head for greedy rows (`cpu_kernels`)."""
    return cpu_kernels.worth_screening(head_dtype(params), rows)


def step_head(params) -> PackedHead:
    """The vocabulary head of `step_head_params`' params (packed, with its greedy screen when
    `screens(params)`)."""
    return params.lm_head


def greedy_tokens(h: jax.Array, head: PackedHead) -> jax.Array:
    """Each row's first maximum of h [B, D] @ head.T read through the screen, -1 where a row
    needs all its logits (`cpu_kernels.greedy_tokens`)."""
    return cpu_kernels.greedy_tokens(h, head)[0]


def head_product(h: jax.Array, head) -> jax.Array:
    """The logits fp32 [B, V] of the head's input rows h [B, D]."""
    return linear(h, head, out_dtype=jnp.float32)


def head_rows(params, ids: jax.Array) -> jax.Array:
    """The vocabulary head's rows of token ids [n] -> [n, D] (a reduced draft vocabulary)."""
    return jnp.take(lm_head_weight(params), ids, axis=0)


# ----------------------------------------------------------------------------- drafters
class Model(Protocol):
    """What the engine needs of a loaded model (`dsjax.Model` is one)."""

    config: ModelConfig
    params: Any
    dtype: Any
    mesh: jax.sharding.Mesh | None
    mtp: Any
    draft_vocab: Any  # token ids the MTP drafter proposes from, or None (all)
    options: RuntimeOptions

    def mesh_context(self) -> ContextManager: ...
    def batch_shards(self) -> int: ...


class DraftSampling(Protocol):
    """How a drafter's tokens are drawn: the engine's (the requests' processed distributions,
    keys of (seed, position)). `position` is the position of the token being drafted."""

    sampled: bool  # some row samples: drafts come with the distributions q they were drawn from
    confidence: bool  # the policy reads the drafter's confidence in each draft

    def pick(self, logits: jax.Array, position: jax.Array) -> jax.Array:
        """A draft [B] (an index into logits' last axis) from logits [B, V']."""

    def choose(self, logits: jax.Array, position: jax.Array) -> tuple[jax.Array, Any, Any]:
        """`pick`, with q [B, V'] (sampled) and the confidence q(d) [B] (confidence), else None."""

    def probs(self, logits: jax.Array) -> jax.Array:
        """The processed distributions of logits [B, ..., V]."""


class Drafter(Protocol):
    """What speculative decoding needs of a drafter. `weights` are its parameters (`Model.mtp`),
    `params` the target's, `state` its batch-major state (rows along `batch_axes`). A step:

        logits, features, cache = target_chunk(...)          the target, and what the drafter reads
        state, context = commit(..., features, ...)          true positions only: a prompt chunk, or
                                                             the positions a verify step kept
        tokens, q, confidence = draft(..., context, k=...)   k drafts after the last committed one

    Since only kept positions are committed, a drafter's state needs no rollback; the target's
    cache has its own (`save_written`, `roll_back`)."""

    screens_verify: bool  # target_chunk gives the head's input (hidden=True): greedy verify reads the screen

    def init_state(self, cfg: ModelConfig, batch: int, dtype) -> Any: ...

    def target_chunk(self, params, tokens: jax.Array, cfg: ModelConfig, cache: Cache, *, opts: RuntimeOptions,
                     n_valid: jax.Array, ctx_bucket: int, last_only: bool = False,
                     hidden: bool = False) -> tuple[jax.Array, Any, Cache]:
        """The target over a chunk tokens [B, C] -> (logits fp32 [B, C, V] (last_only: [B, 1, V]
        at each row's last valid position; hidden, where `screens_verify`: the vocabulary head's
        input rows [B, C, D] instead), the drafter's features of each position, cache)."""

    def commit(self, weights, params, state, features, next_tokens: jax.Array, start: jax.Array,
               n_valid: jax.Array, cfg: ModelConfig, opts: RuntimeOptions = DEFAULT_OPTIONS) -> tuple[Any, Any]:
        """Positions start .. start+n_valid-1 (features, and the token after each [B, C]) into the
        state -> (state, the context drafting starts from)."""

    def draft(self, weights, params, state, context, cfg: ModelConfig, opts: RuntimeOptions = DEFAULT_OPTIONS, *,
              k: int, sampler: DraftSampling, vocab=None) -> tuple[jax.Array, Any, Any]:
        """k drafts -> (tokens [B, k], q [B, k, V] when sampler.sampled else None, confidence
        [B, k] when sampler.confidence else None). vocab (ids, head rows): a reduced draft
        vocabulary, where the drafter supports one."""

    def feature_points(self, cfg: ModelConfig) -> tuple[str, ...]:
        """The full forward's points (dsjax.inspect's names) its features are made of."""

    def features_from(self, found: dict[str, jax.Array], cfg: ModelConfig) -> Any:
        """Its features of each position [B, S, ...], as `target_chunk` gives them, from the
        values of `feature_points` in a full forward (dsjax.inspect's drafts)."""


def drafter_for(cfg: ModelConfig) -> Drafter:
    """The model's drafter: DeepSeek-V4's MTP layer, V4.1's DSpark head."""
    return family_of(cfg).drafter


# ----------------------------------------------------------------------------- rules
def reference_key_rule(cfg: ModelConfig, opts: RuntimeOptions) -> bool:
    """Whether cached chunks follow the reference's published-key rule (V4.1, spec
    deepseek-v41.md §2.7; `dsjax.model.v41.family.reference_key_rule`): a chunk starting at
    position s > 0 then equals one-token decodes only at positions t <= 2 s + 1, so an engine
    keeps every chunk after position 0 within that bound."""
    return family_of(cfg).reference_key_rule(cfg, opts)


def decodes_equal_prefill(cfg: ModelConfig, opts: RuntimeOptions, length: int) -> bool:
    """Whether one-token decodes of positions below `length` leave what a prefill from position 0
    leaves: always, but under `reference_key_rule` when a ratio-2 source could select fewer than
    its visible entries there (length > 2 index_topk + 1; below, it selects them all either way)."""
    return not reference_key_rule(cfg, opts) or length <= 2 * cfg.index_topk + 1


def draft_block_limit(cfg: ModelConfig) -> int | None:
    """The most tokens the model's drafter proposes in one call (V4.1's DSpark: its block), or None."""
    return family_of(cfg).draft_block_limit(cfg)


def drafter_takes_vocab(cfg: ModelConfig) -> bool:
    """Whether the model's drafter can draft from a reduced vocabulary (V4's MTP; not DSpark)."""
    return family_of(cfg).drafter_takes_vocab


# ----------------------------------------------------------------------------- capture
# Points with a value per token whose size follows the context read (a program's bucket), not
# the token: an engine does not capture them (dsjax.inspect's full forward does).
CONTEXT_SIZED = ("indexer.scores", "indexer.visible")
SELECTED = "indexer.selected"
describe_points = taps.describe


def capture_points(model: Model, capacity: int) -> dict[str, tuple]:
    """Every point the engine's cached forward can capture per token (dsjax.inspect's names: a
    layer's points with a leading [B, S]) -> (per-token shape, dtype), from an abstract trace of
    one token at the largest context, `capacity` (a CSA layer's `indexer.selected` exists once
    a query may see more compressed entries than it keeps)."""
    cfg, rows = model.config, model.batch_shards()
    opts = model.options.replace(batch_invariant=False)  # (the same points; no tile of rows to fill)

    def trace(params, tokens, cache):
        with taps.session(("layers.*",), {}) as s:  # (asked for: on an expert-parallel mesh routing then shows)
            forward_traced(params, tokens, cfg, cache, opts=opts, ctx_bucket=capacity, last_only=True)
        seen.update(s.seen)

    def placed(a, axis=0):  # batch-major on a mesh, as the engine places its state and inputs
        sharding = None if model.mesh is None else batch_sharding(model.mesh, a.ndim, axis)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    seen: dict = {}
    with model.mesh_context():
        cache = jax.eval_shape(lambda: init_cache(cfg, rows, capacity, model.dtype))
        jax.eval_shape(trace, model.params, placed(jax.ShapeDtypeStruct((rows, 1), jnp.int32)),
                       jax.tree.map(placed, cache, batch_axes(cache)))
    return {name: (shape[2:], dtype) for name, (shape, dtype) in seen.items()
            if name.startswith("layers.") and len(shape) >= 2 and shape[:2] == (rows, 1)
            and not name.endswith(CONTEXT_SIZED)}


def forward_capturing(params, tokens: jax.Array, cfg: ModelConfig, cache: Cache, *, capture: tuple[str, ...],
                      opts: RuntimeOptions, n_valid: jax.Array, ctx_bucket: int, last_only: bool = False,
                      hidden: bool = False) -> tuple[jax.Array, Cache, dict[str, jax.Array]]:
    """`forward` over a cached chunk tokens [B, C], traced inline (inside the caller's program:
    a nested jit would be traced apart from the taps) with the points named in `capture` (full
    names, from `capture_points`) recorded -> (logits, cache, name -> [B, C, ...]).
    `indexer.selected` lists the compressed entries each query attends, -1 past the visible
    ones (top-k pads with hidden entries when fewer are visible), and where this program's
    context keeps every visible entry (no selection: C's bucket / ratio <= index_topk) the
    visible ones in order."""
    start = cache.length  # [B] the chunk's first position
    selected = [n for n in capture if n.endswith(SELECTED)]
    visible = tuple(n[: -len(SELECTED)] + "indexer.visible" for n in selected)
    with taps.session(tuple(capture) + visible, {}) as s:
        logits, cache = forward_traced(params, tokens, cfg, cache, opts=opts, n_valid=n_valid, ctx_bucket=ctx_bucket,
                                       last_only=last_only, hidden=hidden)
    found = {n: s.found[n] for n in capture if n in s.found}
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)  # [B, C]
    for name, seen in zip(selected, visible):
        if name in found:
            top = found[name]
            found[name] = jnp.where(jnp.take_along_axis(s.found[seen], top, axis=-1), top, -1)
        else:  # every visible entry is attended: w < (p + 1) // ratio
            ratio = cfg.layers[int(name.split(".")[1])].compress_ratio
            entry = jnp.arange(cfg.index_topk, dtype=jnp.int32)
            found[name] = jnp.where(entry < ((positions + 1) // ratio)[..., None], entry, -1)
    return logits, cache, found


def step_bytes(cfg: ModelConfig, rows: int, context: int, dtype) -> tuple[float, float]:
    """(cache bytes, weight bytes) one decode step of `rows` rows reads at `context` cached
    tokens (`decode_step_bytes`: the routed experts its tokens are expected to pick)."""
    need = decode_step_bytes(cfg, batch=rows, context=context, dtype=dtype)
    return need["by_group"]["cache"], need["total"] - need["by_group"]["cache"]
