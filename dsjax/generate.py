"""`dsjax.generate`: batched generation from a Model, on the engine."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from dsjax.api import Model
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams

MAX_SLOTS = 32


def _per_prompt(value, n: int, name: str) -> list:
    if np.ndim(value) == 0:
        return [value] * n
    values = list(np.asarray(value).tolist())
    if len(values) != n:
        raise ValueError(f"{name}: expected one value or one per prompt ({n}), got {len(values)}")
    return values


def engine_capacity(longest: int, model: Model) -> int:
    """A power-of-two cache capacity (>= 256) that is a multiple of the compression ratios."""
    ratio = max(model.config.compress_rate_csa, model.config.compress_rate_hca)
    capacity = 256
    while capacity < longest:
        capacity *= 2
    return -(-capacity // ratio) * ratio


def generate(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature=0.0,
             top_p=1.0, top_k=0, seed=0, num_draft_tokens: int = 0, spec_policy: str = "confidence"
             ) -> list[list[int]]:
    """New tokens for each prompt, stopping after an EOS token or max_new_tokens.

    temperature / top_p / top_k / seed: one value, or one per prompt; temperature 0 is
    greedy. A request's tokens depend only on its prompt, its settings and its seed.
    num_draft_tokens > 0: speculative decoding with the model's MTP layer (greedy output is
    unchanged; sampled output keeps its distribution), spec_policy "confidence" | "fixed"."""
    engine, params = generation_engine(model, prompts, max_new_tokens, temperature, top_p, top_k, seed,
                                       num_draft_tokens, spec_policy)
    if engine is None:
        return [[] for _ in prompts]
    return engine.generate([list(p) for p in prompts], params)


def generation_engine(model: Model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                      num_draft_tokens: int = 0, spec_policy: str = "confidence"):
    """The engine and per-prompt settings `generate` runs (None when there is nothing to
    generate); for callers that also want the engine's counters."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be an int >= 0, got {num_draft_tokens!r}")
    n = len(prompts)
    params = [SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), seed=int(s),
                             max_tokens=int(max_new_tokens))
              for t, p, k, s in zip(_per_prompt(temperature, n, "temperature"), _per_prompt(top_p, n, "top_p"),
                                    _per_prompt(top_k, n, "top_k"), _per_prompt(seed, n, "seed"))]
    if max_new_tokens == 0:
        return None, params
    longest = max(len(p) for p in prompts) + max_new_tokens + num_draft_tokens
    shards = model.batch_shards()  # under a mesh, slots split evenly over the batch axes
    slots = -(-min(n, MAX_SLOTS) // shards) * shards
    engine = Engine(model, max_slots=slots, capacity=engine_capacity(longest, model),
                    decode_steps=1 if num_draft_tokens else 4, num_draft_tokens=int(num_draft_tokens),
                    spec_policy=spec_policy)
    return engine, params


def generate_distributed(model, local_prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """Each process passes its own prompts (any number, maybe none) and gets back the new
    tokens of exactly those. All processes run one engine over the union of the prompts."""
    counts = multihost_utils.process_allgather(np.array([len(local_prompts)], np.int32))
    counts = np.asarray(counts).reshape(-1)
    longest = int(np.asarray(multihost_utils.process_allgather(
        np.array([max((len(p) for p in local_prompts), default=0)], np.int32))).max())
    padded = np.full((max(1, int(counts.max())), max(1, longest) + 1), -1, np.int32)
    for i, p in enumerate(local_prompts):
        padded[i, 0], padded[i, 1: len(p) + 1] = len(p), p
    every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, max count, longest + 1]
    prompts = [row[1: row[0] + 1].tolist() for proc, n in enumerate(counts) for row in every[proc][:n]]
    results = generate(model, prompts, max_new_tokens, **kw)
    start = int(counts[: jax.process_index()].sum())
    return results[start: start + len(local_prompts)]
