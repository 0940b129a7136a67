"""V4.1 selection: indexer scores, L20's candidate blocks and the top-k entry lists (spec
deepseek-v41.md §2.6-2.8). The sparse attention that reads them (§2.9) is
dsjax/kernels/sink_attention.py with `round_p`.

Scores (§2.6), in the reference's bf16 buffers. With q^I [H, d], keys k_j [d], ω [H]:

    dot_{h,j} = bf16( q_h . k_j )                    # fp32 accumulation inside the dot
    term_{h,j} = bf16( ReLU(dot_{h,j}) * ω_h )       # exact fp32 product, one rounding
    s_j       = bf16( Σ_h term_{h,j} )               # fp32 sum over h = 0, 1, .., H-1
    ω         = bf16( (W_wp x) * (d H)^-1/2 )        # = 2^-6 at d = 128, H = 32

so scores are bf16 and ties are common. Visibility: query position t sees entries
j < vis_t = floor((t + 1) / r).

Candidate blocks (§2.8, layer 20) over the causally masked scores, entries padded with -inf to
a multiple of 8:

    β_b = max_{j in block b} s_j,  β_{b*} = +inf for b* = floor((vis_t - 1) / 8)
    keep the top-min(k_blocks, n_blocks) blocks by β, then drop kept blocks with β = -inf
    cand_j = block(j) kept

Top-k lists (§2.8, every index source): s_j = -inf where j is not visible (and, at the
restricted sources 24/28/32/36, where ¬cand_j); take the k largest, sort the chosen entry
indices ascending, and map j -> j + off if j < vis_t, else -1 (off = the number of window rows
in front of the compressed rows: S in prefill, 128 in decode).

Ties (β and s alike) are broken by (score desc, index asc): `jax.lax.top_k` keeps the lower
index first among equal values, and -0.0 is folded into +0.0 first because top_k orders -0.0
below +0.0 while the rule compares values. The reference's own tie order is implementation
defined (an unsorted torch top-k), so this is a choice, not a port.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.sharding.rules import reshape


def _expect_shape(name: str, x: jax.Array, shape: tuple) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _canonical_zero(x: jax.Array) -> jax.Array:
    """-0.0 -> +0.0, so that top_k's ordering (which puts -0.0 below +0.0) ranks by value."""
    return jnp.where(x == 0, jnp.zeros_like(x), x)


def index_head_weights(x_proj: jax.Array, *, head_dim: int = 128) -> jax.Array:
    """ω = bf16(x_proj * (head_dim * H)^-1/2), x_proj = Lin16(W_wp, x) [..., H] (H from the last axis).

    At V4.1's d = 128, H = 32 the scale is 2^-6 and the product is exact; other sizes round
    once, as torch does for a bf16 tensor times a Python float (fp32 op math)."""
    scale = (head_dim * x_proj.shape[-1]) ** -0.5
    return (x_proj.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def index_scores_bf16(q: jax.Array, keys: jax.Array, w: jax.Array) -> jax.Array:
    """q [B, S, H, d], keys [B, T, d], w [B, S, H] (ω, scale included) -> scores bf16 [B, S, T], unmasked.

    The head sum runs h = 0..H-1 in fp32 from +0.0. The reference sums a bf16 tensor with
    torch (fp32 accumulation, order implementation defined); fixing the order makes the
    result the same on every backend. The inner dots need no such rule in practice: FP4-QDQ'd
    q and k have 2-bit mantissas, so their fp32 dot is exact in any order."""
    b, s, h, d = q.shape
    _expect_shape("keys", keys, (b, keys.shape[1], d))
    _expect_shape("w", w, (b, s, h))
    dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # [B, S, H, T]
    terms = (jax.nn.relu(dots).astype(jnp.float32) * w.astype(jnp.float32)[..., None]).astype(jnp.bfloat16)
    total = jnp.zeros((b, s, keys.shape[1]), jnp.float32)
    for head in range(h):  # unrolled: XLA keeps the order of a chain of fp32 adds
        total = total + terms[:, :, head, :].astype(jnp.float32)
    return total.astype(jnp.bfloat16)


def visible_entries(q_pos: jax.Array, n_entries: int, ratio: int) -> jax.Array:
    """q_pos [B, S] (absolute positions; -1 marks a padding query) -> bool [B, S, n_entries]:
    entry j is visible iff j < floor((t + 1) / ratio), i.e. its group's last token is <= t."""
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1 (compressed layers only), got {ratio}")
    vis = jnp.floor_divide(q_pos.astype(jnp.int32) + 1, ratio)
    return jnp.arange(n_entries, dtype=jnp.int32) < vis[..., None]


def candidate_mask(scores: jax.Array, visible: jax.Array, *, k_blocks: int, block: int = 8,
                   beta: jax.Array | None = None) -> jax.Array:
    """Layer 20's candidate blocks. scores / visible [B, S, T] -> bool [B, S, T]. beta: the
    blocks' maxima of the visible scores [B, S, ceil(T / block)] where a kernel has taken them
    (dsjax/kernels/tpu_candidate_scores.py), else computed here.

    The newest visible entry is the last True of `visible` (entry vis_t - 1 for the prefix
    masks of `visible_entries`); a row with nothing visible (a padding query) pins no block
    and gets an all-False mask. The mask is block-wide: the pinned block also marks entries
    past vis_t, which every consumer masks causally anyway."""
    _expect_shape("visible", visible, scores.shape)
    if k_blocks < 1 or block < 1:
        raise ValueError(f"k_blocks and block must be >= 1, got k_blocks={k_blocks}, block={block}")
    b, s, t = scores.shape
    n_blocks = -(-t // block)
    if n_blocks == 0:  # no entries yet (§2.5: the indexer is skipped)
        return jnp.zeros(scores.shape, bool)
    if beta is None:
        masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
        masked = jnp.pad(masked, [(0, 0), (0, 0), (0, n_blocks * block - t)], constant_values=-jnp.inf)
        beta = jnp.max(reshape(masked, (b, s, n_blocks, block)), axis=-1)  # [B, S, n_blocks]
    _expect_shape("beta", beta, (b, s, n_blocks))
    newest = jnp.max(jnp.where(visible, jnp.arange(t, dtype=jnp.int32), -1), axis=-1)  # [B, S]
    pinned = (jnp.arange(n_blocks, dtype=jnp.int32) == newest[..., None] // block) & (newest[..., None] >= 0)
    beta = _canonical_zero(jnp.where(pinned, jnp.inf, beta))
    # The top-kb blocks by (β desc, index asc), as a mask without a scatter (which a batch-sharded
    # mesh cannot place): every block above the kb-th largest β, then the lowest-index blocks tied
    # with it until kb are taken.
    kb = min(k_blocks, n_blocks)
    kth = jax.lax.top_k(beta, kb)[0][..., kb - 1:]  # [B, S, 1]
    tied = beta == kth
    places = kb - jnp.sum(beta > kth, axis=-1, keepdims=True)
    kept = (beta > kth) | (tied & (jnp.cumsum(tied, axis=-1) <= places))
    kept = kept & (beta > -jnp.inf)  # nothing visible in it, or only -inf scores: dropped
    return jnp.repeat(kept, block, axis=-1)[..., :t]


def topk_entry_list(scores: jax.Array, visible: jax.Array, k: int, offset, candidates: jax.Array | None = None
                    ) -> jax.Array:
    """The mapped top-k list. scores / visible [B, S, T], static k <= T -> int32 [B, S, k].

    k = min(index_topk, floor(end_pos / r)) is the same for every row of a call, so a row that
    sees fewer than k entries picks some invisible ones (-inf); they map to -1. `offset` is an
    int or an int array broadcastable to [B, S] (e.g. [B, 1] per sequence). `candidates`
    (bool [B, S, T], the restricted sources 24/28/32/36) sets s = -inf where ¬cand before the
    top-k. §2.8's quirk is kept: such an entry, if picked (fewer than k finite scores), is
    visible and so maps to j + offset, not -1. Validity is `visible[j]`, which for the prefix
    masks of `visible_entries` is the spec's j < vis_t."""
    _expect_shape("visible", visible, scores.shape)
    t = scores.shape[-1]
    if not 0 <= k <= t:
        raise ValueError(f"k = {k} must lie in [0, {t}] (the entry axis of scores)")
    masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    if candidates is not None:
        _expect_shape("candidates", candidates, scores.shape)
        masked = jnp.where(candidates, masked, -jnp.inf)
    if k == 0:
        return jnp.zeros((*scores.shape[:2], 0), jnp.int32)
    _, chosen = jax.lax.top_k(_canonical_zero(masked), k)
    chosen = jnp.sort(chosen, axis=-1)  # the score order is discarded
    valid = jnp.take_along_axis(visible, chosen, axis=-1)
    off = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), scores.shape[:2])[..., None]
    return jnp.where(valid, chosen + off, -1).astype(jnp.int32)
