"""The Lightning Indexer: which compressed entries each CSA query attends.

    q^I   = rope_t(W^I_qb cq)                                   # [H_I, d_I], rope on the last rd
    K^I_w = CSA-style compressed index keys at d_I              # own compressor
    score(t, w) = sum_h (W_w x)_h * H_I^-1/2 * ReLU(q^I_h . K^I_w) * d_I^-1/2
    keep  = top-min(k, visible) of the visible entries (w < (t+1) // m)

Selection is `jax.lax.top_k` on the masked scores: among equal scores the lowest index wins
(ReLU makes exact zeros common). The full-sequence and cached paths both call
`select_topk_indices`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig
from dsjax.layers.compressor import Compressor, compressor_specs
from dsjax.layers.linear import linear
from dsjax.layers.rope import apply_rope
from dsjax.kernels.index_scores import index_scores as index_scores_kernel
from dsjax.params import ParamSpec
from dsjax.sharding.rules import reshape, spec


@struct.dataclass
class Indexer:
    compressor: Compressor  # CSA-style (overlap) at index_head_dim
    q_b_proj: jax.Array  # [H_I * d_I, q_lora_rank]
    weights_proj: jax.Array  # [H_I, D]


def indexer_specs(cfg: ModelConfig, *, ratio: int, dtype) -> Indexer:
    return Indexer(
        compressor=compressor_specs(cfg, ratio=ratio, dim=cfg.index_head_dim, overlap=True, dtype=dtype),
        q_b_proj=ParamSpec((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), dtype,
                           ("index_heads", "q_lora")),
        weights_proj=ParamSpec((cfg.index_n_heads, cfg.hidden_size), dtype, ("index_heads_w", "embed")),
    )


def index_queries(p: Indexer, cq: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig):
    """cq [B, S, q_lora] -> q^I [B, S, H_I, d_I] (roped at the query positions), and the
    per-head weights from x are computed separately by `index_weights`."""
    q = linear(cq, p.q_b_proj)
    q = reshape(q, (*q.shape[:-1], cfg.index_n_heads, cfg.index_head_dim))
    return apply_rope(q, cos[..., None, :], sin[..., None, :])


def index_weights(p: Indexer, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Per-head weights [B, S, H_I] in fp32, with the 1/sqrt(H_I) scale folded in."""
    return linear(x, p.weights_proj).astype(jnp.float32) * cfg.index_n_heads ** -0.5


def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, cfg: ModelConfig,
                 kernels: str = "reference") -> jax.Array:
    """q [B, S, H, d], keys [B, T, d], weights [B, S, H] -> scores [B, S, T] fp32, through
    dsjax/kernels/index_scores.py (its reference or a kernel, per `kernels`)."""
    return index_scores_kernel(q, keys, weights, scale=cfg.index_head_dim ** -0.5, impl=kernels)


def select_topk_indices(scores: jax.Array, visible: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The selection rule: per query the top-min(k, #visible) visible entries (lowest index
    first among ties). scores / visible [B, S, T], k < T -> (indices [B, S, k], valid)."""
    _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    return idx, jnp.take_along_axis(visible, idx, axis=-1)


def select_topk(scores: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """The same selection as a boolean [B, S, T] mask."""
    if k >= scores.shape[-1]:
        return visible
    idx, valid = select_topk_indices(scores, visible, k)
    b, s = jnp.arange(scores.shape[0])[:, None, None], jnp.arange(scores.shape[1])[None, :, None]
    chosen = jnp.zeros(scores.shape, bool).at[b, s, idx].max(valid, out_sharding=spec("batch", None, None))
    return chosen & visible
