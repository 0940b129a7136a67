"""The prefix cache: what earlier prompts left in the cache, kept across requests.

A prompt is cut into blocks of `block` tokens on the absolute grid (block = the engine's
prefill chunk, a multiple of every compression ratio, so no compression group straddles
two blocks). Block j of a prompt is keyed by a hash chain over its tokens and every block
before (`block_keys`); with speculation also over the token after it, which the drafter's
ring at the block's end has read. A cached block (`dsjax.model.interface.CacheBlock`) holds the
compressed entries and index keys its tokens completed, per layer, and the fixed-size state
at its end (window, compressor rings, Engram history, the drafter's ring).

Why the window ring is stored, not rebuilt by replaying the last window: layer l's window
keys at a token depend on layer l-1's window at the tokens before it, so replaying the last
W tokens from the stored entries gives exact windows only for the first layer; the replay
that rebuilds every layer exactly grows with depth (layers x W tokens). Each block keeps the
ring state at its end instead (for V4 per layer one window of 128 latents: most of a block's
bytes, 5.4 of V4-Flash's 7.0 MiB per 128 tokens in bf16).

On admission the longest cached chain of a prompt is put back into the request's cache row
(`PrefixPlanner.restore` decides, the runner copies), leaving at least one token to prefill
(the first output token is sampled from its logits); prefill goes on from there. The part of a prompt that matched
a cached block's tokens but ends inside it is prefilled again: `replayed` tokens, fewer than
`block` per hit. After each full prefill chunk the runner stores that block (`save_block`);
a plain decode step that ends a block stores it too once its tokens are read back (not in
batch-invariant mode: a decode step's sums are not a prefill's, and a hit must be bitwise;
nor, for V4.1 under the reference's published-key rule, a first block longer than
2 index_topk + 1: a fresh run prefills it, where its ratio-2 sources score their own keys
and not, as a decode step at an even position does, layer 20's; in a shorter one they
select every visible entry either way).

Eviction is LRU under `device_bytes`; with `host_bytes` an evicted block moves to host memory
(its copy starts at once and is collected after the next step was dispatched, so it overlaps
compute) and comes back on a hit. Dropping a block drops the blocks chained after it, which
no prompt can reach any more.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import jax
import numpy as np

from dsjax.engine.limits import check_prefix_cache
from dsjax.memory import free_memory
from dsjax.model.interface import sequence_cache_bytes

ROOT = b""


@dataclasses.dataclass(frozen=True)
class PrefixCacheOptions:
    """device_bytes: blocks kept on the device (LRU beyond); host_bytes: the host-memory tier
    evicted blocks move to (0: none, they are dropped)."""

    device_bytes: int = 1 << 30
    host_bytes: int = 0

    def __post_init__(self):
        for name in ("device_bytes", "host_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PrefixCacheOptions: {name} must be an int >= 0, got {value!r}")


def options_from_mib(device_mib: float, host_mib: float = 0) -> PrefixCacheOptions | None:
    """The CLI's `--prefix-cache-mb` / `--prefix-host-mb` (MiB): None (no prefix cache) for 0."""
    if device_mib < 0 or host_mib < 0:
        raise ValueError("--prefix-cache-mb and --prefix-host-mb must be >= 0")
    if not device_mib:
        if host_mib:
            raise ValueError("--prefix-host-mb needs --prefix-cache-mb (the device budget blocks are evicted from)")
        return None
    return PrefixCacheOptions(device_bytes=int(device_mib * 2**20), host_bytes=int(host_mib * 2**20))


AUTO_SHARE = 0.5  # of the memory left after weights and slots: the rest for activations and other processes


def auto_options(model, *, max_slots: int, capacity: int, prefill_chunk: int,
                 host_bytes: int = 0) -> tuple[PrefixCacheOptions | None, str]:
    """A server's default prefix cache (vLLM and SGLang cache by default): a budget of
    AUTO_SHARE of the device memory left once the weights (loaded) and the slots' cache (about
    to be) are allocated; blocks fill it as prompts arrive, LRU beyond. None, with the reason,
    where the engine cannot cache (a prefill chunk the compression ratios do not divide, a
    mesh) or nothing is left. Returns (options, a line saying what was chosen)."""
    try:
        check_prefix_cache(model.config, prefill_chunk, model.mesh)
    except ValueError as e:
        return None, f"prefix cache off: {e}"
    slots = max_slots * (sequence_cache_bytes(model.config, capacity, model.dtype) + capacity * 4)
    budget = int(max(free_memory(jax.devices()[0]) - slots, 0) * AUTO_SHARE)
    if budget < 2**20:
        return None, "prefix cache off: no device memory left after the weights and slots"
    return (PrefixCacheOptions(device_bytes=budget, host_bytes=host_bytes),
            f"prefix cache {budget / 2**20:.0f} MiB ({AUTO_SHARE:.0%} of the memory left; --prefix-cache-mb sets it)")


def block_keys(prompt: list[int], block: int, n: int, lookahead: bool, known: list[bytes] = ()) -> list[bytes]:
    """The chain keys of a prompt's first n blocks: key j covers tokens 0 .. (j+1)*block
    (and with `lookahead` the token after them). known: the first keys, already made (the
    chain goes on from them)."""
    tokens = np.asarray(prompt, np.int64)
    keys = list(known[:n])
    key = keys[-1] if keys else ROOT
    for j in range(len(keys), n):
        h = hashlib.blake2b(key, digest_size=16)
        h.update(tokens[j * block: (j + 1) * block + lookahead].tobytes())
        key = h.digest()
        keys.append(key)
    return keys


@dataclasses.dataclass(eq=False)
class _Entry:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    block: object  # a Block of device arrays, or of numpy arrays on the host tier
    nbytes: int
    tier: str = "device"  # device | host
    children: set = dataclasses.field(default_factory=set)


class PrefixCache:
    """Host-side index of the cached blocks of one engine (its device arrays are the
    engine's cache rows' copies)."""

    def __init__(self, options: PrefixCacheOptions, block: int, lookahead: bool):
        self.options, self.block, self.lookahead = options, block, lookahead
        self.entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # LRU first
        self.children: dict[bytes, set[bytes]] = collections.defaultdict(set)  # ROOT's too
        self.device_bytes = self.host_bytes = 0
        self._moving: list[_Entry] = []  # evicted to the host, copies in flight
        self.counts = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.options.device_bytes > 0

    def cached_blocks(self, keys: list[bytes], usable_tokens: int) -> int:
        """How many blocks of a prompt's chain are cached (nothing counted, nothing touched)."""
        n = 0
        for key in keys[: usable_tokens // self.block]:
            if key not in self.entries:
                break
            n += 1
        return n

    def lookup(self, prompt: list[int], keys: list[bytes], usable_tokens: int) -> tuple[list[_Entry], int]:
        """The longest cached chain of `keys` within `usable_tokens`, and how many prompt
        tokens after it a cached block also holds (those are prefilled again: `replayed`).
        Counts the lookup; touches the chain (most recent last, the chain's head after its
        tail, so eviction takes tails first)."""
        chain, parent = [], ROOT
        for key in keys[: usable_tokens // self.block]:
            entry = self.entries.get(key)
            if entry is None:
                break
            chain.append(entry)
            parent = key
        start = len(chain) * self.block
        rest = prompt[start: start + self.block]
        replayed = max((_common(rest, self.entries[k].tokens) for k in self.children.get(parent, ())), default=0)
        replayed = min(replayed, max(len(prompt) - 1 - start, 0))
        for entry in reversed(chain):
            self.entries.move_to_end(entry.key)
        self.counts["lookups"] += 1
        self.counts["hits"] += bool(chain)
        self.counts["hit_tokens"] += start
        self.counts["replayed_tokens"] += replayed
        self.counts["lookup_tokens"] += len(prompt)
        return chain, replayed

    def device_block(self, entry: _Entry):
        """The block's arrays on the device (a host-tier block is sent back: device_put is
        asynchronous, the restore program waits for it)."""
        if entry.tier == "host":
            self.counts["host_to_device_blocks"] += 1
            self.counts["host_to_device_bytes"] += entry.nbytes
            return jax.device_put(entry.block)
        return entry.block

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def keep(self, key: bytes, parent: bytes, tokens, copy) -> None:
        """A prompt block just prefilled: touched if an earlier prompt stored it, else
        `copy()` (the runner's copy of it out of its row) is inserted."""
        if key in self.entries:
            self.touch(key)
        else:
            self.insert(key, parent, tokens, copy())

    def insert_generated(self, key: bytes, parent: bytes, tokens, block) -> None:
        """A block of generated tokens (`PrefixPlanner.key_generated`), kept if no prompt
        stored it and a prompt can reach it (its parent is kept)."""
        if key not in self.entries and (parent == ROOT or parent in self.entries):
            self.insert(key, parent, tokens, block)
            self.counts["generated_blocks"] += 1

    def insert(self, key: bytes, parent: bytes, tokens, block) -> None:
        """Keep a block the engine just computed (device arrays); evicts over the budget."""
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(block))
        entry = _Entry(key, parent, tuple(int(t) for t in tokens), block, nbytes)
        self.entries[key] = entry
        self.children[parent].add(key)
        self.device_bytes += nbytes
        self.counts["stored_blocks"] += 1
        self._evict()

    def _evict(self) -> None:
        for entry in list(self.entries.values()):  # least recently used first
            if self.device_bytes <= self.options.device_bytes:
                break
            if entry.tier != "device" or entry.key not in self.entries:
                continue
            self.device_bytes -= entry.nbytes
            if entry.nbytes <= self.options.host_bytes:
                for leaf in jax.tree.leaves(entry.block):
                    leaf.copy_to_host_async()
                entry.tier = "host"
                self.host_bytes += entry.nbytes
                self._moving.append(entry)
                self.counts["device_to_host_blocks"] += 1
                self.counts["device_to_host_bytes"] += entry.nbytes
            else:
                self._drop(entry, counted=False)
        for entry in list(self.entries.values()):
            if self.host_bytes <= self.options.host_bytes:
                break
            if entry.tier == "host" and entry.key in self.entries:
                self._drop(entry)

    def _drop(self, entry: _Entry, counted: bool = True) -> None:
        """Forget a block and the blocks chained after it."""
        for child in list(self.children.pop(entry.key, ())):
            if child in self.entries:
                self._drop(self.entries[child])
        del self.entries[entry.key]
        self.children[entry.parent].discard(entry.key)
        if entry.tier == "host":
            self.host_bytes -= entry.nbytes
        elif counted:
            self.device_bytes -= entry.nbytes
        self.counts["evicted_blocks"] += 1

    def settle(self) -> None:
        """Finish the host copies started by evictions (called after a step was dispatched)."""
        for entry in self._moving:
            if entry.tier == "host" and entry.key in self.entries:
                entry.block = jax.tree.map(np.asarray, entry.block)
        self._moving.clear()

    def metrics(self) -> dict:
        c = self.counts
        return {"lookups": c["lookups"], "hits": c["hits"],
                "hit_rate": c["hits"] / c["lookups"] if c["lookups"] else 0.0,
                "prefill_tokens_saved": c["hit_tokens"],
                "token_hit_rate": c["hit_tokens"] / c["lookup_tokens"] if c["lookup_tokens"] else 0.0,
                "replayed_tokens": c["replayed_tokens"], "stored_blocks": c["stored_blocks"],
                "generated_blocks": c["generated_blocks"],
                "evicted_blocks": c["evicted_blocks"],
                "blocks_on_device": sum(e.tier == "device" for e in self.entries.values()),
                "blocks_on_host": sum(e.tier == "host" for e in self.entries.values()),
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
                **{k: c[k] for k in ("device_to_host_blocks", "device_to_host_bytes", "host_to_device_blocks",
                                     "host_to_device_bytes")}}


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------- the scheduler's side
@dataclasses.dataclass
class BlockSave:
    """Copy block j of row `slot` out and keep it under `key` (chained after `parent`), unless
    the pool holds that key by then (then it is touched): the runner does the copy."""

    slot: int
    j: int
    key: bytes
    parent: bytes
    tokens: list[int]


@dataclasses.dataclass
class Restore:
    """Put the cached `blocks` (pool entries, a prompt's chain from block 0: handles whose
    arrays the scheduler never reads) into row `slot`, the first admitting `request`: the
    runner does the copies."""

    slot: int
    request: object
    blocks: list


class PrefixPlanner:
    """The scheduler's half of prefix caching: which request to admit next, which blocks a
    request restores at admission and which a prefill call or a decode step leaves to save.
    Host decisions only, against the pool's index; the runner copies the blocks."""

    def __init__(self, pool: PrefixCache, *, keeps_generated: bool, first_generated: bool):
        self.pool = pool
        # blocks of generated tokens: one decode step per dispatch, no speculation (each step moves a
        # row by one token, so a block's end is the state after a known step); not in batch-invariant
        # mode, where a hit must be bitwise a prefill's and a decode step's numerics are not
        self.keeps_generated = keeps_generated
        # a decoded first block equals a fresh run's (a prefill) unless V4.1's key rule changes a selection
        self.first_generated = first_generated
        self._generated: list = []  # (request, block index, the runner's copy) keyed once its tokens are read

    def _keys(self, req) -> list[bytes]:
        if req.block_keys is None:  # every whole block whose end state a later prompt may take
            n = (len(req.prompt) - self.pool.lookahead) // self.pool.block
            req.block_keys = block_keys(req.prompt, self.pool.block, n, self.pool.lookahead)
        return req.block_keys

    @staticmethod
    def _usable(req) -> int:
        """Prompt tokens a request may take from the cache: all but one (its logits give the
        first token), all but a constrained request's last (its first decode step takes it)."""
        return req.prefill_len if req.constraint is not None else len(req.prompt) - 1

    def take_next(self, waiting, owners):
        """The waiting request to admit next (removed from `waiting`), or None: the first in
        line whose next prompt block no admitted request (`owners`) is prefilling now. The
        others wait for that block to be stored, so a prefix shared by requests arriving
        together is computed once."""
        if not waiting:
            return None
        busy = set()  # keys of the blocks admitted requests are prefilling and will store
        for r in owners:
            if r is not None and r.state == "prefilling" and self.pool.enabled:
                busy.update(self._keys(r)[r.prefilled // self.pool.block:])
        for req in waiting:
            keys = self._keys(req)
            n = self.pool.cached_blocks(keys, self._usable(req))
            if not (n < self._usable(req) // self.pool.block and keys[n] in busy):
                waiting.remove(req)
                return req
        return None

    def restore(self, req) -> Restore | None:
        """A request just given a slot: its longest cached prefix goes into the slot's row (the
        first block admits it) and its prefill starts after it. At least one prompt token is
        left to prefill (its logits give the first token), all but a constrained request's
        last, which its first decode step takes."""
        if req.params.prompt_logprobs is not None:  # its prompt is scored: every token through the head, so
            return None                             # recomputed, not restored (its blocks are still stored)
        chain, req.replayed_tokens = self.pool.lookup(req.prompt, self._keys(req), self._usable(req))
        req.prefilled = req.dispatched = req.cached_tokens = len(chain) * self.pool.block
        if not chain:
            return None
        req.admitted = True
        return Restore(req.slot, req, chain)

    def saves(self, reqs) -> list[BlockSave]:
        """After a prefill call: each request whose chunk ended a whole block stores it (if no
        earlier prompt did)."""
        b, out = self.pool.block, []
        for req in reqs:
            j = req.prefilled // b - 1
            if req.prefilled % b or not 0 <= j < len(self._keys(req)):
                continue
            out.append(BlockSave(req.slot, j, req.block_keys[j], req.block_keys[j - 1] if j else ROOT,
                                 req.prompt[j * b: (j + 1) * b]))
        return out

    def after_decode(self, decoding) -> list[tuple]:
        """After a plain decode step: (request, row, j) of each row whose cache would now end
        block j inside its generated tokens, to copy out (the next step moves its rings on).
        Whether the row was still decoding, and the block's tokens, are known when its outputs
        are read back (`key_generated`)."""
        if not self.keeps_generated:
            return []
        b, out = self.pool.block, []
        for r in decoding:
            ends = r.dispatched % b == 0 and r.dispatched > len(r.prompt)
            if ends and (r.dispatched > b or self.first_generated):
                out.append((r, r.slot, r.dispatched // b - 1))
        return out

    def copied(self, blocks) -> None:
        """The runner's copies of `after_decode`'s blocks: (request, j, block)."""
        self._generated += blocks

    def key_generated(self) -> list[tuple]:
        """The generated-token blocks whose rows had the block's last position cached by a
        decoding step (the token after it was generated), as (key, parent, tokens, block) to
        store where still reachable (`PrefixCache.insert_generated`); drop those of requests
        that ended before; keep the rest for later."""
        b, waiting, stores = self.pool.block, [], []
        for r, j, blk in self._generated:
            tokens = r.prompt + r.tokens
            if len(tokens) > (j + 1) * b:  # the chain goes on from the prompt's keys (and earlier replies')
                keys = block_keys(tokens, b, j + 1, False, known=self._keys(r))
                r.block_keys = max(keys, r.block_keys, key=len)
                stores.append((keys[j], keys[j - 1] if j else ROOT, tokens[j * b: (j + 1) * b], blk))
            elif not r.done:
                waiting.append((r, j, blk))
        self._generated = waiting
        return stores
