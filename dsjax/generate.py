"""`dsjax.generate`: batched sampling from a Model.

This first version recomputes the full causal forward each step on a fixed-size token
buffer (one compile per buffer bucket). It is simple and exactly the model; the engine
replaces its insides with cached prefill/decode, keeping the signature.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.api import Model, check_token_ids
from dsjax.config import ModelConfig
from dsjax.model import forward
from dsjax.sampling import sample

_BUCKET = 64


def _per_prompt(value, n: int, name: str, kind=float) -> np.ndarray:
    if np.ndim(value) == 0:
        return np.full((n,), value, dtype=np.dtype(kind))
    arr = np.asarray(value, dtype=np.dtype(kind))
    if arr.shape != (n,):
        raise ValueError(f"{name}: expected one value or one per prompt ({n}), got shape {arr.shape}")
    return arr


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("tokens",))
def _step(params, tokens, lengths, active, temperature, top_k, top_p, seeds, cfg: ModelConfig):
    logits = forward(params, tokens, cfg)  # [B, L, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    nxt = sample(last, temperature, top_k, top_p, seeds, lengths)
    nxt = jnp.where(active, nxt, 0)
    rows = jnp.arange(tokens.shape[0])
    tokens = tokens.at[rows, jnp.minimum(lengths, tokens.shape[1] - 1)].set(
        jnp.where(active, nxt, tokens[rows, jnp.minimum(lengths, tokens.shape[1] - 1)]))
    return tokens, nxt


def generate(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature=0.0,
             top_p=1.0, top_k=0, seed=0) -> list[list[int]]:
    """New tokens for each prompt (stopping after an EOS token or max_new_tokens).

    temperature / top_p / top_k / seed: one value, or one per prompt. temperature 0 is greedy.
    A request's tokens depend only on its prompt, its settings and its seed."""
    cfg = model.config
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    n = len(prompts)
    temperature = _per_prompt(temperature, n, "temperature", np.float32)
    top_p = _per_prompt(top_p, n, "top_p", np.float32)
    top_k = _per_prompt(top_k, n, "top_k", np.int32)
    seeds = _per_prompt(seed, n, "seed", np.int64)
    if (temperature < 0).any() or not ((top_p > 0) & (top_p <= 1)).all() or (top_k < 0).any():
        raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
    if (seeds < 0).any() or (seeds >= 2**32).any():
        raise ValueError("seed must be in [0, 2**32)")
    for p in prompts:
        check_token_ids(np.asarray(p), cfg.vocab_size)

    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(-(-(lengths.max() + max_new_tokens) // _BUCKET) * _BUCKET)
    tokens = np.zeros((n, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    tokens = jnp.asarray(tokens)
    eos = np.array(cfg.eos_token_ids, np.int32)
    active = np.ones(n, bool)
    out: list[list[int]] = [[] for _ in range(n)]
    args = (jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(seeds.astype(np.uint32)))
    for _ in range(max_new_tokens):
        if not active.any():
            break
        tokens, nxt = _step(model.params, tokens, jnp.asarray(lengths), jnp.asarray(active), *args, cfg=cfg)
        nxt = np.asarray(nxt)
        stepped = active.copy()
        for i in np.flatnonzero(stepped):
            out[i].append(int(nxt[i]))
        lengths = lengths + stepped.astype(np.int32)
        active = stepped & ~np.isin(nxt, eos)
    return out
