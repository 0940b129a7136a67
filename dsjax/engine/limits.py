"""What an engine accepts, checked before anything is allocated: its arguments, the
capacity a sequence of the model can use, and whether the cache fits in device memory."""

from __future__ import annotations

import jax
import numpy as np

from dsjax.config import ModelConfig
from dsjax.engine.requests import max_capacity
from dsjax.engine.sampler import is_int
from dsjax.memory import free_memory
from dsjax.model.interface import sequence_cache_bytes


def check_engine_args(cfg: ModelConfig, *, max_slots, capacity, prefill_chunk, decode_steps, max_logprobs,
                      num_draft_tokens, overlap, batch_invariant, greedy_screen=True, logprob_width=None) -> None:
    """Each constructor argument of `Engine`, by name: ints in range, bools, a capacity that
    the compression ratios divide and the model's positions can use."""
    for name, value, lo in (("max_slots", max_slots, 1), ("capacity", capacity, 1),
                            ("prefill_chunk", prefill_chunk, 1), ("decode_steps", decode_steps, 1),
                            ("max_logprobs", max_logprobs, 0), ("num_draft_tokens", num_draft_tokens, 0)):
        if not is_int(value) or value < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    if max_logprobs > cfg.vocab_size:
        raise ValueError(f"max_logprobs must be at most the vocabulary size ({cfg.vocab_size}), got {max_logprobs}")
    if logprob_width is not None and not (is_int(logprob_width) and max_logprobs <= logprob_width <= cfg.vocab_size):
        raise ValueError(f"logprob_width must be an int from max_logprobs ({max_logprobs}) to the vocabulary size "
                         f"({cfg.vocab_size}), got {logprob_width!r}")
    for name, value in (("overlap", overlap), ("batch_invariant", batch_invariant), ("greedy_screen", greedy_screen)):
        if not (isinstance(value, (bool, np.bool_)) or (name == "batch_invariant" and value is None)):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    ratio = cfg.max_compress_ratio
    if capacity % ratio:
        raise ValueError(f"capacity {capacity} must be a multiple of {ratio} (the largest compression ratio)")
    if capacity > max_capacity(cfg):
        raise ValueError(f"capacity {capacity} exceeds {max_capacity(cfg)}, the most a sequence of this model can "
                         f"use (max_position_embeddings {cfg.max_position_embeddings}, rounded up to a context "
                         f"bucket); lower capacity (with dsjax.generate: max_new_tokens or the prompt length)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_cache_fits(model, max_slots: int, capacity: int, device_memory_bytes: int | None = None) -> None:
    """Refuse, before it is allocated, a cache of `max_slots` x `capacity` tokens (and the
    slots' token histories) that one device's share of does not fit in what the device has
    free (`device_memory_bytes`, default: what it reports)."""
    per_slot = sequence_cache_bytes(model.config, capacity, model.dtype) + capacity * 4  # + history
    if model.mesh is None:
        shards, device, sharing = 1, jax.devices()[0], 1
    else:
        shards = model.batch_shards()
        local = [d for d in model.mesh.devices.flat if d.process_index == jax.process_index()]
        device, sharing = local[0], len(local)
    need = per_slot * -(-max_slots // shards)
    have = device_memory_bytes if device_memory_bytes is not None else free_memory(device, sharing)
    if need > have:
        where = "one device" if model.mesh is None else f"each device (slots split over {shards} batch shards)"
        raise MemoryError(
            f"the engine's cache needs {_size(need)} ({need} bytes) on {where} for max_slots={max_slots} x "
            f"capacity={capacity} tokens ({per_slot} bytes a slot), but the device has {_size(have)} ({have} bytes) "
            f"free; lower max_slots or capacity (with dsjax.generate: fewer prompts at once, or a "
            f"smaller max_new_tokens / shorter prompts)")


def check_prefix_cache(cfg: ModelConfig, prefill_chunk: int, mesh) -> None:
    """Refuse a prefix cache the engine cannot serve, naming the setting: its block is the
    prefill chunk, and no compression group may straddle two blocks."""
    ratio = cfg.max_compress_ratio
    if prefill_chunk % ratio:
        raise ValueError(f"prefix_cache: prefill_chunk={prefill_chunk} must be a multiple of the largest compression "
                         f"ratio ({ratio}); it is the cache's block, and no compression group may straddle two")
    if mesh is not None:
        raise ValueError("prefix_cache is not supported on a mesh yet (use one device)")
