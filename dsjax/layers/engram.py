"""Engram conditional memory (DeepSeek-V4.1, layers 1 and 14): hashed n-gram rows fused into the streams.

Host side (numpy int64; JAX runs with x64 off). Token ids x_p become compressed ids κ_p (a fixed
129280 -> 99092 class map, dsjax/checkpoint/engram_tables.py), or DEAD = -1 for image-span tokens.
For a query position t and shift s = 0..3, τ_s = κ_{t-s}, replaced by pad once the shift is blocked:
t < s, or any of κ_t .. κ_{t-s} is DEAD (blocking is cumulative). With odd multipliers m (§5.3):

    R_1 = τ_0 m_0 ⊕ τ_1 m_1,   R_2 = R_1 ⊕ τ_2 m_2,   R_3 = R_2 ⊕ τ_3 m_3          (⊕ = xor, int64)
    id_{k,c} = (R_{n-1} mod p_{k,c}) + off_{k,c},    c = n_heads (n-2) + head,  n = 2..max_ngram

p_{k,c} are distinct primes just above vocab_start (§5.2); off is their exclusive cumsum within a layer,
so each layer's table has Σ_c p_{k,c} rows. τ < 99092 and m < 2^63 / 99092, so products never wrap.

Device side, per token (§5.6), with rows r_c = dequant(table[id_{k,c}]) in bf16:

    ε   = concat_c r_c                                  [n_hash * head_dim]
    κv  = Lin(W_e, ε)                                   [(N+1) D]: K_j = κv[jD:(j+1)D], V = κv[ND:]
    w_j = q_weight_j ⊙ k_weight_j                       (fp32; only the product is used)
    δ_j = (Σ_d X_jd w_jd K_jd) · rms(X_j)^-1 · rms(K_j)^-1 / √D,   rms(y) = (mean(y²) + ε_n)^½
    g_j = sigmoid( sign(δ_j) √max(|δ_j|, 1e-6) ),   sign(+0) = +
    X_j ← bf16(X_j + g_j V)                             (image-span tokens: unchanged)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsjax.layers.linear import linear
from dsjax.layers.taps import tap
from dsjax.params import ParamSpec
from dsjax.sharding.rules import lookup

DEAD = -1  # compressed id of an image-span token: blocks every shift that reaches it
BEFORE_START = -2  # history slot before position 0: blocks like DEAD (the "t < s" rule)
HASH_SEED_STRIDE = 10007  # numpy default_rng(10007 * layer_id) (§5.3)
GATE_FLOOR = 1e-6  # |δ| is clamped here before the signed square root
# §5.3, V4.1's (layer id, compressed vocab) -> multipliers; above 2^53, so never via a JSON double
RELEASED_MULTIPLIERS = {
    (1, 99092): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (14, 99092): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}


# ----------------------------------------------------------------------------- layout (host)
def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: these 12 bases are exact for every n < 3.3e24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for b in bases:
        if n % b == 0:
            return n == b
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(layer_ids, max_ngram: int, n_heads: int, vocab_start: int) -> np.ndarray:
    """int64 [n_layers, (max_ngram-1) n_heads]: the table size of each hash column (§5.2).

    For each layer (in the given order) and each n = 2..max_ngram, the search restarts at
    c = vocab_start - 1; each head takes the smallest prime > c not used by any earlier column
    (of any layer), and c moves to it. Column c = n_heads (n-2) + head."""
    if max_ngram < 2 or n_heads < 1:
        raise ValueError(f"engram: max_ngram must be >= 2 and n_heads >= 1, got {max_ngram} / {n_heads}")
    used: set[int] = set()
    out = np.zeros((len(layer_ids), (max_ngram - 1) * n_heads), np.int64)
    for k in range(len(layer_ids)):
        for n in range(2, max_ngram + 1):
            c = vocab_start - 1
            for head in range(n_heads):
                c += 1
                while c in used or not _is_prime(c):
                    c += 1
                used.add(c)
                out[k, n_heads * (n - 2) + head] = c
    return out


def bucket_offsets(primes: np.ndarray) -> np.ndarray:
    """Exclusive cumsum of the primes within each layer: every layer's table starts at row 0."""
    primes = np.asarray(primes, np.int64)
    return np.cumsum(primes, axis=-1) - primes


def hash_multipliers(layer_id: int, compressed_vocab: int, max_ngram: int) -> np.ndarray:
    """int64 [max_ngram] odd multipliers (§5.3): 2 v + 1 with v ~ default_rng(10007 ℓ).integers(0, bound).

    bound = ⌊⌊(2^63-1) / compressed_vocab⌋ / 2⌋ keeps every τ·m below 2^63. numpy does not promise
    that Generator streams never change, so the released values are also hard-coded and checked."""
    bound = max(1, ((2**63 - 1) // compressed_vocab) // 2)
    v = np.random.default_rng(HASH_SEED_STRIDE * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64)
    m = 2 * v + 1
    known = RELEASED_MULTIPLIERS.get((layer_id, compressed_vocab))
    if known is not None and tuple(m[: len(known)].tolist()) != known[: len(m)]:
        raise RuntimeError(f"engram: numpy {np.__version__} draws hash multipliers {m.tolist()} for layer "
                           f"{layer_id}, not the released {list(known)}: every Engram row id would be wrong")
    return m


@dataclasses.dataclass(frozen=True)
class EngramLayout:
    """Everything the host hashing needs, as tuples so a layout can be a static jit argument."""

    layer_ids: tuple[int, ...]
    primes: tuple[tuple[int, ...], ...]  # [n_layers][n_hash]
    offsets: tuple[tuple[int, ...], ...]  # [n_layers][n_hash]
    multipliers: tuple[tuple[int, ...], ...]  # [n_layers][max_ngram]
    n_heads: int
    head_dim: int
    max_ngram: int
    pad_id: int
    compressed_vocab: int

    @property
    def n_hash(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def table_rows(self, k: int) -> int:
        """Rows of Engram layer k's table (= engram_num_embeddings[k])."""
        return sum(self.primes[k])


def engram_layout(layer_ids=(1, 14), max_ngram: int = 4, n_heads: int = 8, head_dim: int = 256,
                  vocab_start: int = 16000000, compressed_vocab: int = 99092, pad_id: int = 2) -> EngramLayout:
    """The layout from the config values (defaults: DeepSeek-V4.1-Flash, §1.1)."""
    if not 0 <= pad_id < compressed_vocab:
        raise ValueError(f"engram_pad_id {pad_id} is outside the compressed vocabulary [0, {compressed_vocab})")
    primes = bucket_primes(layer_ids, max_ngram, n_heads, vocab_start)
    offsets = bucket_offsets(primes)
    as_tuples = lambda a: tuple(tuple(int(v) for v in row) for row in a)  # noqa: E731
    return EngramLayout(
        layer_ids=tuple(int(x) for x in layer_ids), primes=as_tuples(primes), offsets=as_tuples(offsets),
        multipliers=as_tuples([hash_multipliers(int(x), compressed_vocab, max_ngram) for x in layer_ids]),
        n_heads=n_heads, head_dim=head_dim, max_ngram=max_ngram, pad_id=pad_id, compressed_vocab=compressed_vocab)


# ----------------------------------------------------------------------------- hashing (host)
def compressed_ids(token_map: np.ndarray, tokens: np.ndarray, dead: np.ndarray | None = None) -> np.ndarray:
    """κ = token_map[tokens] as int64, DEAD where `dead` (image-span tokens) is set."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= len(token_map)):
        raise ValueError(f"engram: token ids must lie in [0, {len(token_map)}), got {tokens.min()}..{tokens.max()}")
    kappa = np.asarray(token_map, np.int64)[tokens]
    return kappa if dead is None else np.where(np.asarray(dead, bool), DEAD, kappa)


def initial_history(batch: int, max_ngram: int = 4) -> np.ndarray:
    """int64 [B, max_ngram-1] history of sequences that start at position 0."""
    return np.full((batch, max_ngram - 1), BEFORE_START, np.int64)


def _check_ids(layout: EngramLayout, kappa: np.ndarray, history: np.ndarray) -> None:
    if kappa.ndim != 2:
        raise ValueError(f"engram: kappa must be [B, S], got shape {kappa.shape}")
    if history.shape != (kappa.shape[0], layout.max_ngram - 1):
        raise ValueError(f"engram: history must be [B, {layout.max_ngram - 1}] = "
                         f"{(kappa.shape[0], layout.max_ngram - 1)}, got {history.shape}")
    if kappa.size and (kappa.min() < DEAD or kappa.max() >= layout.compressed_vocab):
        raise ValueError(f"engram: kappa holds {kappa.min()}..{kappa.max()}; compressed ids lie in "
                         f"[0, {layout.compressed_vocab}) or are DEAD ({DEAD})")
    if history.size and (history.min() < BEFORE_START or history.max() >= layout.compressed_vocab):
        raise ValueError(f"engram: history holds {history.min()}..{history.max()}; expected compressed ids, "
                         f"DEAD ({DEAD}) or BEFORE_START ({BEFORE_START})")
    # BEFORE_START may only lead a history (a sequence has no tokens before its start)
    started = np.maximum.accumulate(history != BEFORE_START, axis=1)
    if np.any(started & (history == BEFORE_START)):
        raise ValueError("engram: history has BEFORE_START after a token; it may only fill the oldest slots")


def ngram_row_ids(layout: EngramLayout, layer_k: int, kappa: np.ndarray, history: np.ndarray) -> np.ndarray:
    """int64 [B, S, n_hash]: table rows of Engram layer `layer_k` (an index into layout.layer_ids)
    for a chunk of compressed ids `kappa` [B, S], given `history` [B, max_ngram-1], the previous
    ids of each sequence, oldest first (BEFORE_START where the sequence had not begun). Hashing
    a sequence in chunks, each with the history left by the one before, equals hashing it whole."""
    if not 0 <= layer_k < len(layout.layer_ids):
        raise ValueError(f"engram: layer_k {layer_k} is not an index into layer_ids {layout.layer_ids}")
    kappa, history = np.asarray(kappa, np.int64), np.asarray(history, np.int64)
    _check_ids(layout, kappa, history)
    h, s_len = history.shape[1], kappa.shape[1]
    ext = np.concatenate([history, kappa], axis=1)  # [B, h + S]: position t of the chunk is ext[:, h + t]
    m = layout.multipliers[layer_k]
    open_ = np.ones(kappa.shape, bool)
    hashes = []  # R_1 .. R_{max_ngram-1}, each [B, S]
    r = None
    for s in range(layout.max_ngram):
        tok = ext[:, h - s: h - s + s_len]
        open_ &= tok >= 0  # DEAD and BEFORE_START both block this shift and every longer one
        term = np.where(open_, tok, layout.pad_id) * np.int64(m[s])
        r = term if r is None else r ^ term
        if s >= 1:
            hashes.append(r)
    cols = np.repeat(np.arange(layout.max_ngram - 1), layout.n_heads)  # column c hashes R_{n-1}, n = 2 + c // heads
    rsel = np.stack(hashes, axis=-1)[..., cols]  # [B, S, n_hash]
    return rsel % np.asarray(layout.primes[layer_k], np.int64) + np.asarray(layout.offsets[layer_k], np.int64)


def kept_history(token_map: np.ndarray, history: jax.Array, tokens: jax.Array, kept: jax.Array) -> jax.Array:
    """On the device: the history [B, h] int32 after the first kept [B] of tokens [B, C] (a
    speculative step keeps the accepted prefix of its chunk; `next_history`'s rule)."""
    kappa = lookup(jnp.asarray(token_map, jnp.int32), jnp.clip(tokens, 0, len(token_map) - 1))
    ext = jnp.concatenate([history, kappa], axis=1)
    return jnp.take_along_axis(ext, kept[:, None] + jnp.arange(history.shape[1]), axis=1)


def next_history(history: np.ndarray, kappa: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """The history after a chunk: the last max_ngram-1 ids of concat(history, kappa[:, :lengths]).

    `lengths` [B] (default: the whole chunk) commits only a prefix of each row, e.g. the accepted
    tokens after speculative verification, so a rejected draft never enters the history."""
    history, kappa = np.asarray(history, np.int64), np.asarray(kappa, np.int64)
    h = history.shape[1]
    ext = np.concatenate([history, kappa], axis=1)
    if lengths is None:
        return ext[:, ext.shape[1] - h:].copy()
    lengths = np.asarray(lengths, np.int64)
    if lengths.shape != (kappa.shape[0],) or lengths.min(initial=0) < 0 or lengths.max(initial=0) > kappa.shape[1]:
        raise ValueError(f"engram: lengths must be [B] = [{kappa.shape[0]}] in [0, {kappa.shape[1]}], got {lengths}")
    idx = lengths[:, None] + np.arange(h)[None, :]  # ext[b, L_b : L_b + h]
    return np.take_along_axis(ext, idx, axis=1)


# ----------------------------------------------------------------------------- device
@struct.dataclass
class Engram:
    wkv: jax.Array  # [(N+1) D, n_hash head_dim]: K for each stream, then the shared V
    q_weight: jax.Array  # [N, D]
    k_weight: jax.Array  # [N, D]


def engram_specs(hc_mult: int, dim: int, n_hash: int, head_dim: int, dtype=jnp.bfloat16) -> Engram:
    """One Engram layer's device weights. The table itself stays on the host (engram_tables.py)."""
    return Engram(
        # replicated: 157 M values at V4.1 size, read once per token batch
        wkv=ParamSpec(((hc_mult + 1) * dim, n_hash * head_dim), dtype, ("embed_out", None)),
        q_weight=ParamSpec((hc_mult, dim), jnp.bfloat16, (None, "embed"), init="ones"),
        k_weight=ParamSpec((hc_mult, dim), jnp.bfloat16, (None, "embed"), init="ones"),
    )


def dequant_rows(q_e4m3: jax.Array, scale_e8m0: jax.Array) -> jax.Array:
    """bf16 [..., W] = e4m3[..., d] · 2^(e[..., d // G] - 127), G = W / scale width (32 in V4.1).

    `scale_e8m0` is the exponent byte (uint8) or float8_e8m0fnu; e = 255 is NaN. The fp32 product
    is exact (4 significant bits), so the one rounding is to bf16."""
    width, groups = q_e4m3.shape[-1], scale_e8m0.shape[-1]
    if q_e4m3.shape[:-1] != scale_e8m0.shape[:-1] or groups == 0 or width % groups:
        raise ValueError(f"engram rows: q {q_e4m3.shape} and scale {scale_e8m0.shape} do not tile "
                         f"(one scale per {width}/{groups} values)")
    if scale_e8m0.dtype == jnp.uint8:
        e = scale_e8m0.astype(jnp.float32)
        s = jnp.where(e == 255, jnp.nan, jnp.exp2(e - 127.0))
    else:
        s = scale_e8m0.astype(jnp.float32)
    s = jnp.repeat(s, width // groups, axis=-1)
    return (q_e4m3.astype(jnp.float32) * s).astype(jnp.bfloat16)


def engram_gate(w: jax.Array, streams: jax.Array, keys: jax.Array, eps: float = 1e-20) -> jax.Array:
    """fp32 [..., N] gate g_j of §5.6 from w = q_weight ⊙ k_weight [N, D], streams X and keys K [..., N, D]."""
    x, k = streams.astype(jnp.float32), keys.astype(jnp.float32)
    d = x.shape[-1]
    dot = jnp.sum(x * w.astype(jnp.float32) * k, axis=-1)
    inv_rms_x = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)
    inv_rms_k = jax.lax.rsqrt(jnp.mean(k * k, axis=-1) + eps)
    delta = dot * inv_rms_x * inv_rms_k / math.sqrt(d)
    sign = jnp.where(delta >= 0, 1.0, -1.0)  # sign(0) = + (jnp.sign would give 0 and gate 1/2)
    return jax.nn.sigmoid(sign * jnp.sqrt(jnp.maximum(jnp.abs(delta), GATE_FLOOR)))


def engram_fuse(p: Engram, streams: jax.Array, rows: jax.Array, image_mask: jax.Array | None = None,
                eps: float = 1e-20, project: Callable[[jax.Array, jax.Array], jax.Array] = linear) -> jax.Array:
    """streams [B, S, N, D] <- bf16(X_j + g_j V) for rows [B, S, n_hash, head_dim] (dequantized; taken in
    the streams' dtype, bf16 as the reference runs, fp32 in fp32 checks).

    `project(x, w) -> bf16` is the `wkv` product (x @ w.T): a plain dense GEMM (fp32 accumulate) by default;
    the reference's Lin8 (FP8 weight, activation QDQ per 32) plugs in here. Tokens where
    `image_mask` [B, S] is set pass unchanged (their gate is 0)."""
    *lead, n, d = streams.shape
    if p.q_weight.shape != (n, d) or p.k_weight.shape != (n, d):
        raise ValueError(f"engram: q_weight {p.q_weight.shape} / k_weight {p.k_weight.shape} must be [N, D] = "
                         f"{(n, d)} for streams {streams.shape}")
    if tuple(rows.shape[:-2]) != tuple(lead):
        raise ValueError(f"engram: rows {rows.shape} and streams {streams.shape} differ in [B, S]")
    width = rows.shape[-2] * rows.shape[-1]
    if tuple(p.wkv.shape) != ((n + 1) * d, width):
        raise ValueError(f"engram: wkv {tuple(p.wkv.shape)} must be [(N+1) D, n_hash head_dim] = "
                         f"{((n + 1) * d, width)}")
    rows = tap("engram.rows", rows)  # a dsjax.inspect point (inert otherwise)
    kv = project(rows.reshape(*lead, width).astype(streams.dtype), p.wkv)  # [B, S, (N+1) D] (bf16 in the model)
    keys = kv[..., : n * d].reshape(*lead, n, d)
    value = kv[..., n * d:].astype(jnp.float32)  # [B, S, D], shared by all streams
    gate = tap("engram.gate", engram_gate(p.q_weight.astype(jnp.float32) * p.k_weight.astype(jnp.float32), streams,
                                          keys, eps))
    out = (streams.astype(jnp.float32) + gate[..., None] * value[..., None, :]).astype(streams.dtype)
    if image_mask is None:
        return out
    # select rather than zero the gate: 0 * V would turn an inf / nan V into nan
    return jnp.where(image_mask[..., None, None], streams, out)
