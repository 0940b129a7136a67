"""Speculative decoding's engine options, checked before anything is built: how many drafts a
model's caches allow, the combinations the engine refuses, the drafter vocabulary."""

from __future__ import annotations

import numpy as np

from dsjax.config import ModelConfig
from dsjax.model.interface import draft_block_limit, drafter_takes_vocab, min_ring


def max_drafts(cfg: ModelConfig) -> int:
    """The most drafts a verify step can check: its k + 1 positions fit the smallest cache ring
    (DeepSeek-V4.1: and DSpark drafts a block of block_size)."""
    ring = min_ring(cfg) - 1
    return ring if (block := draft_block_limit(cfg)) is None else min(ring, block)


def check_speculation(num_draft_tokens: int, *, has_mtp: bool, max_drafts: int, unsupported: dict[str, bool]):
    """Refuse speculation the engine cannot run: no drafter (MTP layer / DSpark head), more
    drafts than `max_drafts`, or an engine option (name -> set) it does not combine with."""
    k = num_draft_tokens
    if not k:
        return
    if not has_mtp:
        raise ValueError("num_draft_tokens > 0 needs the model's drafter (the MTP layer; DeepSeek-V4.1: the DSpark "
                         "head): load a checkpoint with mtp.0.* tensors, or load_model(..., mtp=True)")
    if k > max_drafts:
        raise ValueError(f"num_draft_tokens={k} is too many for this model: at most {max_drafts} (a verify step's "
                         f"k + 1 positions fit its smallest cache ring; DSpark drafts a block at a time)")
    for name, bad in unsupported.items():
        if bad:
            raise ValueError(f"speculative decoding (num_draft_tokens > 0) does not support {name}")


def engine_draft_vocab(draft_vocab, model_ids, cfg: ModelConfig) -> np.ndarray | None:
    """The drafter vocabulary an Engine uses: `draft_vocab` None = the model's (`model_ids`, maybe
    None), False = the full vocabulary (None), else a list of ids, checked. DeepSeek-V4.1's
    DSpark head drafts over the whole vocabulary and takes none."""
    if draft_vocab is None:
        return None if model_ids is None else check_draft_vocab(model_ids, cfg.vocab_size, "model.draft_vocab")
    if draft_vocab is False:
        return None
    if not drafter_takes_vocab(cfg):
        raise ValueError("draft_vocab is for the MTP drafter; DeepSeek-V4.1's DSpark head drafts over the whole "
                         "vocabulary (leave draft_vocab None)")
    if draft_vocab is True:
        raise ValueError("draft_vocab must be None (the model's), False (the full vocabulary) or a list of "
                         "token ids, got True")
    return check_draft_vocab(draft_vocab, cfg.vocab_size)


def check_draft_vocab(ids, vocab_size: int, where: str = "draft_vocab") -> np.ndarray:
    """A drafter vocabulary (token ids the MTP drafter may propose) -> sorted int32 [|D|].
    Refused, naming `where`: not a 1-D list of integers, empty, out of [0, vocab_size),
    repeated ids."""
    a = np.asarray(ids)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{where} must be a 1-D list of integer token ids, got an array of shape {a.shape} "
                         f"and dtype {a.dtype}")
    if a.size == 0:
        raise ValueError(f"{where} is empty: the drafter needs at least one token id")
    bad = a[(a < 0) | (a >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary [0, {vocab_size}) "
                         f"({bad.size} such ids)")
    uniq, counts = np.unique(a, return_counts=True)
    if uniq.size != a.size:
        raise ValueError(f"{where}: token id {int(uniq[counts > 1][0])} appears more than once "
                         f"({a.size - uniq.size} repeats)")
    return uniq.astype(np.int32)
