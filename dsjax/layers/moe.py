"""DeepSeek MoE: sqrtsoftplus routing (top-k with a selection-only bias, or a fixed hash
table), clamped SwiGLU experts, one shared expert.

    s   = sqrt(softplus(W_r x))                   fp32 [E]
    idx = topk(s + bias, K)  |  tid2eid[token]    bias selects only
    w   = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
    expert(x) = W2(silu(min(W1 x, L)) * clip(W3 x, -L, L))
    out = sum_j w_j expert_{idx_j}(x) + shared(x)

`routed_experts` is the dropless reference: assignments sorted by expert and a grouped
matmul (`jax.lax.ragged_dot_general`, or on CPU a loop over row tiles), or for a handful of
tokens (decode) a gather of the chosen experts' weights. All are exact; the expert-parallel
and Pallas paths are checked against them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import HASH_MOE, LayerSpec, ModelConfig
from dsjax.layers.linear import linear, linear_f32
from dsjax.layers.quantized import dense
from dsjax.params import ParamSpec
from dsjax.sharding.rules import reshape, spec


@struct.dataclass
class MoE:
    router: jax.Array  # [E, D]
    w1: jax.Array  # [E, I, D]   gate
    w3: jax.Array  # [E, I, D]   up
    w2: jax.Array  # [E, D, I]   down
    shared_w1: jax.Array  # [Is, D]
    shared_w3: jax.Array  # [Is, D]
    shared_w2: jax.Array  # [D, Is]
    router_bias: jax.Array | None = None  # [E] fp32, top-k layers (e_score_correction_bias)
    tid2eid: jax.Array | None = None  # [vocab, K] int32, hash layers


def moe_specs(cfg: ModelConfig, layer: LayerSpec, dtype) -> MoE:
    e, i, d, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    si = cfg.shared_intermediate_size
    is_hash = layer.mlp == HASH_MOE
    return MoE(
        router=ParamSpec((e, d), dtype, (None, "embed")),
        w1=ParamSpec((e, i, d), dtype, ("experts", "expert_mlp", "embed")),
        w3=ParamSpec((e, i, d), dtype, ("experts", "expert_mlp", "embed")),
        w2=ParamSpec((e, d, i), dtype, ("experts", "embed", "expert_mlp")),
        shared_w1=ParamSpec((si, d), dtype, ("mlp", "embed")),
        shared_w3=ParamSpec((si, d), dtype, ("mlp", "embed")),
        shared_w2=ParamSpec((d, si), dtype, ("embed", "mlp")),
        router_bias=None if is_hash else ParamSpec((e,), jnp.float32, (None,), init="zeros"),
        tid2eid=ParamSpec((cfg.vocab_size, k), jnp.int32, (None, None), init="expert_table", high=e)
        if is_hash else None,
    )


def _score(logits: jax.Array, func: str) -> jax.Array:
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


def route(p: MoE, x: jax.Array, token_ids: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, D], token_ids [T] -> (weights [T, K] fp32, expert ids [T, K] int32)."""
    scores = _score(linear_f32(x, p.router), cfg.scoring_func)  # [T, E]
    if p.tid2eid is not None:
        idx = p.tid2eid[token_ids]
    else:
        _, idx = jax.lax.top_k(scores + p.router_bias, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, L)) * clip(up, -L, L)."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def _grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of x (sorted by group) times their group's w [G, out, in] -> [M, out], fp32 acc."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    return jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes, dims,
                                      preferred_element_type=jnp.float32)


def expert_ffn(x_sorted: jax.Array, group_sizes: jax.Array, w1, w3, w2, limit: float) -> jax.Array:
    """The experts on rows already sorted by expert: [M, D] -> [M, D] fp32 (grouped matmul)."""
    h = swiglu(_grouped(x_sorted, w1, group_sizes), _grouped(x_sorted, w3, group_sizes), limit)
    return _grouped(h.astype(x_sorted.dtype), w2, group_sizes)


def expert_ffn_gathered(x: jax.Array, idx: jax.Array, w1, w3, w2, limit: float) -> jax.Array:
    """The experts for few tokens: gather each assignment's weights. x [T, D], idx [T, K]
    -> [T, K, D] fp32. Reads exactly the chosen experts, like a decode kernel would."""
    gate = jnp.einsum("td,tkid->tki", x, w1[idx].astype(x.dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum("td,tkid->tki", x, w3[idx].astype(x.dtype), preferred_element_type=jnp.float32)
    h = swiglu(gate, up, limit).astype(x.dtype)
    return jnp.einsum("tki,tkdi->tkd", h, w2[idx].astype(x.dtype), preferred_element_type=jnp.float32)


def expert_ffn_tiled(x_sorted: jax.Array, group_sizes: jax.Array, w1, w3, w2, limit: float,
                     rows: int) -> jax.Array:
    """The grouped matmul as a loop over row tiles: each tile holds `rows` rows of one
    expert (a group's last tile is partial; its extra rows are overwritten by the next
    group's tiles). At most ceil(M / rows) + E tiles. -> [M, D] fp32.

    The tile table (expert, first row) is the metadata a Pallas grouped-matmul kernel
    takes; this pure-JAX loop is what runs fast on CPU, where ragged_dot does not."""
    m, d = x_sorted.shape
    n_experts = group_sizes.shape[0]
    n_tiles = -(-m // rows) + n_experts
    tiles = -(-group_sizes // rows)  # per expert
    tile_end = jnp.cumsum(tiles)
    j = jnp.arange(n_tiles)
    expert = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), n_experts - 1)
    first_row = (jnp.cumsum(group_sizes) - group_sizes)[expert] + (j - tile_end[expert] + tiles[expert]) * rows
    used = j < tile_end[-1]
    x_padded = jnp.concatenate([x_sorted, jnp.zeros((rows, d), x_sorted.dtype)])

    def tile(i, out):
        def compute(out):
            xt = jax.lax.dynamic_slice_in_dim(x_padded, first_row[i], rows)
            e = expert[i]
            gate = jnp.einsum("rd,id->ri", xt, w1[e].astype(xt.dtype), preferred_element_type=jnp.float32)
            up = jnp.einsum("rd,id->ri", xt, w3[e].astype(xt.dtype), preferred_element_type=jnp.float32)
            h = swiglu(gate, up, limit).astype(xt.dtype)
            y = jnp.einsum("ri,di->rd", h, w2[e].astype(xt.dtype), preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(out, y, first_row[i], 0)

        return jax.lax.cond(used[i], compute, lambda o: o, out)

    # zeros_like(x_padded): inside shard_map the carry must vary over the same mesh axes as x
    return jax.lax.fori_loop(0, n_tiles, tile, jnp.zeros_like(x_padded, dtype=jnp.float32))[:m]


def grouped_ffn(x_sorted: jax.Array, group_sizes: jax.Array, w1, w3, w2, limit: float,
                impl: str = "reference") -> jax.Array:
    """The experts on rows sorted by expert (rows past sum(group_sizes) are not computed and
    come out 0) -> [M, D] fp32: a Pallas kernel (impl="pallas": Mosaic GPU's on a GPU, the
    generic one elsewhere; impl="mosaic_gpu": Mosaic GPU's, interpreted off the GPU), else
    ragged_dot, or the tile loop on CPU."""
    m, n_experts = x_sorted.shape[0], group_sizes.shape[0]
    rows = int(min(128, max(8, pl2(m / n_experts))))
    if impl != "reference":
        from dsjax.pallas_kernels.grouped_matmul import mgpu_grouped_ffn, pallas_grouped_ffn
        from dsjax.pallas_kernels.dispatch import kernel_choice

        kind, interpret = kernel_choice(impl)
        if kind == "mosaic_gpu":
            return mgpu_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, limit=limit, interpret=interpret)
        return pallas_grouped_ffn(x_sorted, group_sizes, w1, w3, w2, limit=limit, rows=rows, interpret=interpret)
    if jax.default_backend() != "cpu":
        return expert_ffn(x_sorted, group_sizes, w1, w3, w2, limit)
    return expert_ffn_tiled(x_sorted, group_sizes, w1, w3, w2, limit, rows)


def moe_path(tokens: int, k: int, n_experts: int, kernels: str = "reference") -> str:
    """Which exact implementation of the routed experts suits this many tokens here.

    XLA's CPU backend lowers ragged_dot to roughly a masked dense product (measured 4-30x
    slower than the tile loop), so CPU runs the tile loop; accelerators run ragged_dot."""
    if tokens * k <= max(k, n_experts // 8):
        return "gather"
    if kernels != "reference":
        return "pallas"
    return "tiled" if jax.default_backend() == "cpu" else "grouped"


def routed_experts(p: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array, cfg: ModelConfig,
                   path: str | None = None) -> jax.Array:
    """Dropless routed experts: x [T, D], weights/idx [T, K] -> [T, D] fp32. Exact paths
    (see `moe_path`): per-assignment weight gather (decode), or assignments sorted by expert
    through a grouped matmul (ragged_dot, or the tile loop on CPU)."""
    t, k = idx.shape
    path = path or moe_path(t, k, cfg.n_routed_experts, cfg.kernels)
    p = p.replace(w1=dense(p.w1, x.dtype), w3=dense(p.w3, x.dtype), w2=dense(p.w2, x.dtype))  # FP4/FP8-resident
    if path == "gather":
        y = expert_ffn_gathered(x, idx, p.w1, p.w3, p.w2, cfg.swiglu_limit)
        return jnp.sum(y.astype(x.dtype).astype(jnp.float32) * weights[..., None], axis=1)
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # assignments grouped by expert
    group_sizes = jnp.bincount(flat_e, length=cfg.n_routed_experts).astype(jnp.int32)
    if path == "tiled":
        rows = int(min(128, max(8, pl2(t * k / cfg.n_routed_experts))))
        y = expert_ffn_tiled(x[order // k], group_sizes, p.w1, p.w3, p.w2, cfg.swiglu_limit, rows)
    elif path == "pallas" or cfg.kernels != "reference":
        impl = cfg.kernels if cfg.kernels != "reference" else "pallas"
        y = grouped_ffn(x[order // k], group_sizes, p.w1, p.w3, p.w2, cfg.swiglu_limit, impl=impl)
    else:
        y = expert_ffn(x[order // k], group_sizes, p.w1, p.w3, p.w2, cfg.swiglu_limit)
    y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[order // k].add(y)


def pl2(x: float) -> int:
    """The next power of two >= x."""
    n = 1
    while n < x:
        n *= 2
    return n


def shared_expert(p: MoE, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    h = swiglu(linear(x, p.shared_w1), linear(x, p.shared_w3), cfg.swiglu_limit)
    return linear(h, p.shared_w2, out_sharding=spec("batch", None))


def moe_forward(p: MoE, x: jax.Array, token_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [B, S, D] (normed), token_ids [B, S] -> [B, S, D]. Under a mesh the routed experts
    run expert-parallel (dsjax/sharding/expert_parallel.py)."""
    from dsjax.sharding.expert_parallel import routed_experts_sharded
    from dsjax.sharding.rules import current_mesh

    flat = reshape(x, (-1, x.shape[-1]))
    if current_mesh() is not None:
        routed = routed_experts_sharded(p, flat, reshape(token_ids, (-1,)), cfg, cfg.moe_capacity_factor)
    else:
        weights, idx = route(p, flat, token_ids.reshape(-1), cfg)
        routed = routed_experts(p, flat, weights, idx, cfg)
    routed = routed.astype(x.dtype)
    return reshape(routed + shared_expert(p, flat, cfg), x.shape)
