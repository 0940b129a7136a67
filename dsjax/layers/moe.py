"""DeepSeek MoE: sqrtsoftplus routing (top-k with a selection-only bias, or a fixed hash
table), clamped SwiGLU experts, one shared expert; on a mesh, expert parallelism.

    s   = sqrt(softplus(W_r x))                   fp32 [E]
    idx = topk(s + bias, K)  |  tid2eid[token]    bias selects only
    w   = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
    expert(x) = W2(silu(min(W1 x, L)) * clip(W3 x, -L, L))
    out = sum_j w_j expert_{idx_j}(x) + shared(x)

`routed_experts` is the dropless reference: assignments sorted by expert through the grouped
matmul (dsjax/kernels/grouped_matmul.py `grouped_ffn`: ragged_dot, the CPU tile loop
or a kernel), or for a handful of tokens (decode) a gather of the chosen experts' weights; on
XLA:CPU up to 16 assignments take a matrix-vector product each, reading the expert in place
(`expert_ffn_each`), except under DeepSeek-V4.1's FP8 activations, whose exact products widen
each expert to fp32 anyway. All are exact; the expert-parallel path is checked against them.

Expert parallelism (`routed_experts_sharded`): the routed experts are sharded over the
`expert` mesh axis, and tokens go to the devices that hold their experts and back.
Inside `jax.shard_map` each device has its own tokens (the batch is split over `data` and
`expert`) and E / ep experts. Per device (`dispatch_combine`):

    route locally                         -> (weight, expert) per assignment
    sort assignments by expert            -> rows grouped by owner device
    exchange over `expert`                -> the rows this device's experts must process
    grouped matmul over local experts     (grouped_ffn)
    exchange back, weight, scatter-add    -> [T_local, D]

The exchange (dsjax/sharding/expert_dispatch.py) is `jax.lax.ragged_all_to_all` on TPU / GPU
(each row sent once, counts exchanged first) and a padded all_to_all on XLA:CPU, which has
no ragged one: send buffers [ep, C, D] with C = T_local * K, enough for every assignment to
go to one device (skewed routing stays correct). Both are dropless by default.
`capacity_factor` (padded form) caps C at ceil(T_local * K / ep * cf) and drops assignments
past it: an explicit option, never the default.

Runtime options (`kernels`, `capacity_factor`, `ep_dispatch`) are keyword arguments, not config fields.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from dsjax.config import HASH_MOE, LayerSpec, ModelConfig
from dsjax.layers.linear import (cpu_forms, cpu_library_forms, linear, linear_f32, stored_experts,
                                 stored_experts_product, stored_moe_product, stored_rows)
from dsjax.layers.quantized import dense, stored_form, take
from dsjax.layers.qdq import qdq_fp8
from dsjax.layers import taps
from dsjax.kernels import cpu as cpu_kernels
from dsjax.kernels.dispatch import kernel_choice
from dsjax.kernels.grouped_matmul import exact_products, expert_product, grouped_ffn, hidden, swiglu
from dsjax.kernels.stored_matmul import mgpu_stored_grouped_ffn
from dsjax.params import ParamSpec
from dsjax.sharding.expert_dispatch import padded_dispatch, ragged_dispatch
from dsjax.sharding.rules import RULES, current_mesh, lookup, present_axes, reshape, spec


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
    router_bias_vl: jax.Array | None = None  # [E] fp32, V4.1: the selection bias of image-span tokens


def moe_specs(cfg: ModelConfig, layer: LayerSpec, dtype, *, image_bias: bool = False) -> MoE:
    """image_bias: a second selection bias for image-span tokens (DeepSeek-V4.1's `gate.bias_vl`)."""
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
        router_bias_vl=ParamSpec((e,), jnp.float32, (None,), init="zeros") if image_bias else None,
    )


def _score(logits: jax.Array, func: str) -> jax.Array:
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


ROUTING_POINTS = ("moe.scores", "moe.experts", "moe.weights", "moe.expert_gain")  # dsjax.inspect's names


def route(p: MoE, x: jax.Array, token_ids: jax.Array, cfg: ModelConfig,
          lead: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, D], token_ids [T] -> (weights [T, K] fp32, expert ids [T, K] int32).
    lead: the tokens' [B, S], the shape dsjax.inspect's taps show them in (`moe.scores` [B, S, E],
    `moe.experts` (editable: forced routing takes the forced experts' scores) and `moe.weights`)."""
    rows = (lambda n: None) if lead is None else (lambda n: (*lead, n))  # noqa: E731
    scores = taps.tap("moe.scores", _score(linear_f32(x, p.router), cfg.scoring_func), rows(cfg.n_routed_experts))
    if p.tid2eid is not None:  # asked for on a mesh, route runs in the global view: `lookup` says how the rows lie
        idx = lookup(p.tid2eid, token_ids) if taps.asks(*ROUTING_POINTS) else p.tid2eid[token_ids]
    else:
        _, idx = jax.lax.top_k(scores + p.router_bias, cfg.num_experts_per_tok)
    idx = taps.tap("moe.experts", idx.astype(jnp.int32), rows(cfg.num_experts_per_tok))
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return taps.tap("moe.weights", w * cfg.routed_scaling_factor, rows(cfg.num_experts_per_tok)), idx


def gained(weights: jax.Array, idx: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The routing weights the experts' outputs are scaled by: dsjax.inspect's `moe.expert_gain`
    [E] (0: that expert's output ablated, its routing weight kept) where an edit sets it."""
    gain = taps.optional_tap("moe.expert_gain", lambda: jnp.ones((cfg.n_routed_experts,), jnp.float32))
    return weights if gain is None else weights * lookup(gain, idx)


def lin4_down_input(h: jax.Array, weights: jax.Array) -> jax.Array:
    """DeepSeek-V4.1's routed-expert W2 input (spec deepseek-v41.md §4): the fp32 SwiGLU h [..., I]
    times its routing weight [...] (before W2, not after), in bf16, through the FP8 round trip per
    32 that Lin4 gives its activation -> bf16. Module-level: the kernels take it as a static argument."""
    return qdq_fp8(h * weights[..., None])


def lin4(x: jax.Array, weights: jax.Array, on: bool):
    """The routed experts' activations -> (x, the weights applied to their outputs, W2's `down`).
    Off (V4): x as is, the routing weights scale the outputs. On (DeepSeek-V4.1's Lin4): x makes
    the FP8 round trip per 32 (row-wise, so before dispatch equals after) and the routing weights
    apply before W2, inside `lin4_down_input`."""
    if not on:
        return x, weights, None
    return qdq_fp8(x).astype(x.dtype), jnp.ones_like(weights), lin4_down_input


def expert_ffn_gathered(x: jax.Array, idx: jax.Array, w1, w3, w2, limit: float, weights=None, down=None
                        ) -> jax.Array:
    """The experts for few tokens: gather each assignment's weights. x [T, D], idx [T, K]
    -> [T, K, D] fp32. Reads exactly the chosen experts, like a decode kernel would.
    weights [T, K] / down: W2's input is `down(h, weights)` (`lin4_down_input`)."""
    gathered = lambda w: dense(take(w, idx), x.dtype)
    if exact_products(down):  # one row per product, in the grouped paths' form (`expert_product`)
        rows = jnp.broadcast_to(x[:, None, None, :], (*idx.shape, 1, x.shape[-1]))  # [T, K, 1, D]
        gate, up = (expert_product(rows, gathered(w), True)[..., 0, :] for w in (w1, w3))
        h = hidden(gate, up, limit, x.dtype, weights, down)
        return expert_product(h[..., None, :], gathered(w2), True)[..., 0, :]
    gate = jnp.einsum("td,tkid->tki", x, gathered(w1), preferred_element_type=jnp.float32)
    up = jnp.einsum("td,tkid->tki", x, gathered(w3), preferred_element_type=jnp.float32)
    h = hidden(gate, up, limit, x.dtype, weights, down)
    return jnp.einsum("tki,tkdi->tkd", h, gathered(w2), preferred_element_type=jnp.float32)


def expert_ffn_each(x: jax.Array, idx: jax.Array, w1, w3, w2, limit: float, weights=None, down=None) -> jax.Array:
    """The experts for a handful of assignments on XLA:CPU (`linear.cpu_forms`): per assignment
    three matrix-vector products, each reading its expert's rows where they lie (a 16-bit or
    quantized weight widened as it is read) instead of a gathered copy, which XLA:CPU reads
    far slower at a few rows. Same arguments and result as `expert_ffn_gathered`.
    Unrolled (at most linear.FEW_ROWS assignments): a loop over them ran several times slower
    (docs/cpu-decode.md). Not for `exact_products` (DeepSeek-V4.1's FP8 activations): their
    two-row fp32 form widens each expert into a buffer either way, so the one gathered product
    runs as fast, with the same bits, in a fraction of the program (the unrolled one was a third
    of a tiny-v41 prefill's compile). 16-bit experts (`linear.stored_experts`): three calls of
    the library's expert kernel instead, the assignments grouped by expert so that each chosen
    expert is read once for all its rows."""
    t, k = idx.shape
    if exact_products(down):
        raise ValueError("expert_ffn_each: exact products (FP8 activations on XLA:CPU) take expert_ffn_gathered")
    if stored_experts(w1, w3, w2):  # 16-bit experts: the library's kernel reads each chosen expert once
        rows, flat = jnp.repeat(x.astype(jnp.float32), k, axis=0), idx.reshape(-1)
        gate, up = (stored_experts_product(rows, w, flat).reshape(t, k, -1) for w in (w1, w3))
        h = hidden(gate, up, limit, x.dtype, weights, down)
        return stored_experts_product(h.reshape(t * k, -1), w2, flat).reshape(t, k, -1)

    def one(i: int, j: int) -> jax.Array:
        product = lambda a, w: expert_product(a, dense(take(w, idx[i, j]), jnp.float32))  # noqa: E731
        row = x[i][None]
        h = hidden(product(row, w1), product(row, w3), limit, x.dtype, None if weights is None else weights[i, j][None],
                   down)
        return product(h, w2)[0]

    return jnp.stack([jnp.stack([one(i, j) for j in range(k)]) for i in range(t)])


def sum_by_expert(y: jax.Array, idx: jax.Array) -> jax.Array:
    """y [T, K, D] fp32, one row per assignment, idx [T, K] -> [T, D]: the sum over a token's
    experts in ascending expert order from 0, one fp32 add at a time, as the reference's loop
    over experts adds them (spec deepseek-v41.md §4); the one order for every path under
    DeepSeek-V4.1's FP8 activations (XLA keeps the order of a chain of adds)."""
    y = jnp.take_along_axis(y, jnp.argsort(idx, axis=1, stable=True)[..., None], axis=1)
    out = jnp.zeros_like(y[:, 0])
    for j in range(y.shape[1]):  # K: a handful
        out = out + y[:, j]
    return out


def moe_path(tokens: int, k: int, n_experts: int) -> str:
    """Which exact path suits this many tokens: "gather" (each assignment's expert weights
    gathered: a handful of tokens, decode) or "grouped" (assignments sorted by expert
    through `grouped_ffn`)."""
    return "gather" if tokens * k <= max(k, n_experts // 8) else "grouped"


def expert_layer(p: MoE, layer: jax.Array | None) -> MoE:
    """p with its routed-expert weights cut to layer `layer` of a stacked run (None: as is)."""
    if layer is None:
        return p
    return p.replace(w1=take(p.w1, layer), w3=take(p.w3, layer), w2=take(p.w2, layer))


def stored_kernel(p: MoE, kernels: str) -> bool:
    """Whether the routed experts run a kernel that reads their stored bytes: kept as stored,
    all three in one format, and `kernels` resolving to Mosaic GPU or Mosaic TPU (MXFP4, or
    FP8 per expert; dsjax/kernels/dispatch.py). Otherwise they are dequantized first."""
    forms = [stored_form(w) for w in (p.w1, p.w3, p.w2)]
    return (forms[0] is not None and all(f is not None and f[:2] == forms[0][:2] for f in forms)
            and kernel_choice(kernels)[0] in ("mosaic_gpu", "mosaic_tpu"))


def stored_ffn(p: MoE, kernels: str, limit: float, down=None):
    """The grouped FFN over p's routed experts as stored (`stored_kernel` holds): ffn(rows [M, D]
    sorted by expert, group_sizes [E], scale [M]) -> [M, D], the kernel handed each weight's
    (bytes, E8M0 exponents): Mosaic TPU's dequantizes a tile in VMEM, Mosaic GPU's in shared
    memory. The same call on one device and per device in the expert-parallel step (p there
    holds the device's E / ep experts). down: DeepSeek-V4.1's Lin4 (`lin4`)."""
    (fmt, block, w1), w3, w2 = stored_form(p.w1), stored_form(p.w3)[2], stored_form(p.w2)[2]
    kind, interpret = kernel_choice(kernels)
    if kind == "mosaic_tpu":
        return lambda r, sizes, s: grouped_ffn(r, sizes, w1, w3, w2, limit=limit, impl=kernels,  # noqa: E731
                                               block=block, scale=s, down=down)
    return lambda r, sizes, s: mgpu_stored_grouped_ffn(r, sizes, w1, w3, w2, fmt=fmt, block=block,  # noqa: E731
                                                       limit=limit, interpret=interpret, scale=s, down=down)


def routed_experts(p: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array, cfg: ModelConfig,
                   path: str | None = None, *, kernels: str = "reference", layer: jax.Array | None = None,
                   rows: int | None = None, fp8_acts: bool = False) -> jax.Array:
    """Dropless routed experts: x [T, D], weights/idx [T, K] -> [T, D] fp32. Exact paths
    (see `moe_path`): per-assignment weight gather, or assignments sorted by expert through
    the grouped matmul (`kernels` picks its implementation).
    layer: p's routed-expert weights are stacked over a layer run ([R, E, ...]) and this is
    layer `layer`; the grouped matmul reads its experts from the stack, not from a copy.
    fp8_acts: DeepSeek-V4.1's Lin4 (`lin4`)."""
    t, k = idx.shape
    x, after, down = lin4(x, weights, fp8_acts)
    stored = stored_kernel(p, kernels)
    matvecs = cpu_forms(x, t * k)  # a decode step on XLA:CPU: each assignment's expert read in place
    # stored experts under the Mosaic GPU kernels: grouped at any token count, the kernel reads the bytes
    path = path or ("grouped" if stored else "gather" if matvecs else moe_path(t, k, cfg.n_routed_experts))
    if layer is not None and (path == "gather" or not all(isinstance(w, jax.Array) for w in (p.w1, p.w3, p.w2))):
        p, layer = expert_layer(p, layer), None  # a gather reads only its experts anyway; quantized: dequantize one layer
    if path == "gather":  # each chosen expert's weight is read (and dequantized / widened) where it lies
        each = matvecs and not exact_products(down)  # see expert_ffn_each
        ffn = expert_ffn_each if each else expert_ffn_gathered
        y = ffn(x, idx, p.w1, p.w3, p.w2, cfg.swiglu_limit, weights, down).astype(x.dtype).astype(jnp.float32)
        return sum_by_expert(y, idx) if fp8_acts else jnp.sum(y * after[..., None], axis=1)
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # assignments grouped by expert
    group_sizes = jnp.bincount(flat_e, length=cfg.n_routed_experts).astype(jnp.int32)
    scale = weights.reshape(-1)[order]
    if stored:
        y = stored_ffn(p, kernels, cfg.swiglu_limit, down)(x[order // k], group_sizes, scale)
    else:
        p = p.replace(w1=dense(p.w1, x.dtype), w3=dense(p.w3, x.dtype), w2=dense(p.w2, x.dtype))  # FP4/FP8-resident
        y = grouped_ffn(x[order // k], group_sizes, p.w1, p.w3, p.w2, limit=cfg.swiglu_limit, impl=kernels,
                        layer=layer, rows=rows, scale=scale, down=down)
    y = y.astype(x.dtype).astype(jnp.float32) * after.reshape(-1)[order][:, None]
    if fp8_acts:  # back to assignment order [T, K], then the one summation order
        return sum_by_expert(jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1), idx)
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[order // k].add(y)


# ----------------------------------------------------------------------------- expert parallel
def _routed_only(p: MoE) -> MoE:
    """The routed part of the MoE params (the shared expert runs outside, tensor-parallel)."""
    return p.replace(shared_w1=None, shared_w3=None, shared_w2=None)


def _moe_in_specs(p: MoE, ep: int) -> MoE:
    experts = P("expert", None, None) if ep > 1 else P()
    return MoE(router=P(), w1=experts, w3=experts, w2=experts, shared_w1=None, shared_w3=None, shared_w2=None,
               router_bias=None if p.router_bias is None else P(), tid2eid=None if p.tid2eid is None else P())


def dispatch_combine(p: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array, cfg: ModelConfig, ep: int,
                     capacity_factor: float | None, *, kernels: str = "reference", rows: int | None = None,
                     fp8_acts: bool = False, ep_dispatch: str = "auto") -> jax.Array:
    """Per device (inside shard_map): x [T, D] local tokens, idx/weights [T, K] global
    expert ids; p.w1/w3/w2 hold this device's E / ep experts. -> [T, D] fp32.
    ep_dispatch: how rows travel (dsjax/sharding/expert_dispatch.py: "padded", "ragged", or
    "auto": ragged on TPU / GPU, padded on CPU); a capacity factor takes the padded form.
    fp8_acts: DeepSeek-V4.1's Lin4 (`lin4`): the weights travel with the rows, to apply before W2."""
    t, k = idx.shape
    x, after, down = lin4(x, weights, fp8_acts)
    d = x.shape[-1]
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # by device, and by expert within: a token's outputs are summed
    # in ascending expert order, as `routed_experts` sums them, on any expert-parallel layout
    # the local experts' stored bytes straight to the Mosaic TPU kernel. Under Mosaic GPU the local
    # experts are still dequantized: GPU interpret mode stalls on fake devices inside this shard_map
    # (already with the kernel on dequantized experts: "Barrier remains allocated"), so a stored-bytes
    # step there would go unchecked
    if stored_kernel(p, kernels) and kernel_choice(kernels)[0] == "mosaic_tpu":
        ffn = stored_ffn(p, kernels, cfg.swiglu_limit, down)
    else:
        w1, w3, w2 = (dense(w, x.dtype) for w in (p.w1, p.w3, p.w2))  # FP4/FP8-resident experts
        ffn = lambda r, sizes, s: grouped_ffn(r, sizes, w1, w3, w2, limit=cfg.swiglu_limit,  # noqa: E731
                                              impl=kernels, rows=rows, scale=s, down=down)
    args = (x[order // k], flat_e[order], None if down is None else weights.reshape(-1)[order], ffn)
    cap = t * k if capacity_factor is None else max(1, math.ceil(t * k / ep * capacity_factor))
    padded = lambda: padded_dispatch(*args, n_experts=cfg.n_routed_experts, cap=cap)  # noqa: E731
    ragged = lambda: ragged_dispatch(*args, n_experts=cfg.n_routed_experts)  # noqa: E731
    if capacity_factor is not None or ep_dispatch == "padded":
        back = padded()
    elif ep_dispatch == "ragged":
        back = ragged()
    else:  # chosen when the program is lowered for its platform (both traced, one lowered)
        back = jax.lax.platform_dependent(cpu=padded, default=ragged)
    contrib = back.astype(jnp.float32) * after.reshape(-1)[order][:, None]  # [T * K, D], dropped rows 0
    if fp8_acts:  # the single-device paths' summation order (`sum_by_expert`)
        return sum_by_expert(jnp.zeros_like(contrib).at[order].set(contrib).reshape(t, k, d), idx)
    return jnp.zeros((t, d), jnp.float32).at[order // k].add(contrib)


def routed_experts_sharded(p: MoE, x: jax.Array, token_ids: jax.Array, cfg: ModelConfig, *,
                           kernels: str = "reference", capacity_factor: float | None = None,
                           rows: int | None = None, fp8_acts: bool = False,
                           lead: tuple[int, ...] | None = None, ep_dispatch: str = "auto") -> jax.Array:
    """x [T, D] and token_ids [T] batch-sharded under the current mesh -> routed-expert
    output [T, D] fp32, same sharding. lead: as `route`'s; ep_dispatch: `dispatch_combine`'s."""
    mesh = current_mesh()
    ep = mesh.shape["expert"]
    if cfg.n_routed_experts % ep:
        raise ValueError(f"{cfg.n_routed_experts} routed experts cannot be split over expert={ep} devices")
    batch = P(present_axes(RULES.mesh_axes("batch"), mesh))
    in_specs = (_moe_in_specs(p, ep), P(*batch, None), batch)

    def dispatch(p, x, weights, idx):
        if ep == 1:
            return routed_experts(p, x, weights, idx, cfg, None if rows is None else "grouped", kernels=kernels,
                                  rows=rows, fp8_acts=fp8_acts)
        return dispatch_combine(p, x, weights, idx, cfg, ep, capacity_factor, kernels=kernels, rows=rows,
                                fp8_acts=fp8_acts, ep_dispatch=ep_dispatch)

    def local(p, x, ids):
        return dispatch(p, x, *route(p, x, ids, cfg))

    if taps.asks(*ROUTING_POINTS):  # dsjax.inspect: route in the global view, where its taps can read and edit it
        weights, idx = route(p, x, token_ids, cfg, lead)
        routed = jax.shard_map(dispatch, in_specs=(*in_specs[:2], P(*batch, None), P(*batch, None)),
                               out_specs=P(*batch, None))
        return routed(_routed_only(p), x, gained(weights, idx, cfg), idx)
    return jax.shard_map(local, in_specs=in_specs, out_specs=P(*batch, None))(_routed_only(p), x, token_ids)


# ----------------------------------------------------------------------------- the layer
def one_call_ffn(p: MoE, x: jax.Array, idx: jax.Array, kernels: str) -> bool:
    """Whether a step's routed and shared experts run as one call of the XLA:CPU library
    (`linear.stored_moe_product`): the library's layer calls on
    (`cpu_kernels.layer_calls_available`), no kernel that reads stored bytes instead, and either
    a decode step's few assignments (`cpu_forms`) with every expert weight 16-bit where the
    library reads it (p's routed experts cut to their layer), or a prompt chunk
    (`cpu_library_forms`) with 16-bit or fp32 weights and the reference kernels asked for
    (XLA's tile loop copies each tile's expert out of its stack before the GEMM)."""
    if not cpu_kernels.layer_calls_available() or stored_kernel(p, kernels):
        return False
    shared = (p.shared_w1, p.shared_w3, p.shared_w2)
    sixteen = stored_experts(p.w1, p.w3, p.w2) and all(stored_rows(w) for w in shared)
    if cpu_forms(x, idx.size):
        return sixteen
    fp32 = all(isinstance(w, jax.Array) and w.dtype == jnp.float32 for w in (p.w1, p.w3, p.w2, *shared))
    return cpu_library_forms(x) and (sixteen or fp32) and kernel_choice(kernels)[0] == "reference"


def _derivatives_through(xla, library):
    """library, a call XLA cannot differentiate (an FFI call), with the derivatives of xla, the
    same function in XLA's ops (jax.grad through a prompt's forward on XLA:CPU)."""
    f = jax.custom_jvp(library)

    @f.defjvp
    def jvp(primals, tangents):
        return library(*primals), jax.jvp(xla, primals, tangents)[1]

    return f


def _experts_in_place(p: MoE, layer: jax.Array | None) -> tuple:
    """The routed experts of layer `layer` as `stored_moe_product` reads them: fp32 stacks of a
    layer run as (stack, [layer]) (no copy of the layer's experts), else `expert_layer`'s."""
    if layer is not None and all(isinstance(w, jax.Array) for w in (p.w1, p.w3, p.w2)):
        return tuple((w, jnp.reshape(layer, (1,))) for w in (p.w1, p.w3, p.w2))
    layer_p = expert_layer(p, layer)
    return layer_p.w1, layer_p.w3, layer_p.w2


def shared_expert(p: MoE, x: jax.Array, cfg: ModelConfig, fp8_acts: bool = False) -> jax.Array:
    """fp8_acts: DeepSeek-V4.1's Lin8 for all three products."""
    h = swiglu(linear(x, p.shared_w1, fp8_act=fp8_acts), linear(x, p.shared_w3, fp8_act=fp8_acts), cfg.swiglu_limit)
    return linear(h, p.shared_w2, out_sharding=spec("batch", None), fp8_act=fp8_acts)


@jax.named_scope("moe")  # a profile's op group (benchmarks/decode_trace.py)
def moe_forward(p: MoE, x: jax.Array, token_ids: jax.Array, cfg: ModelConfig, *, kernels: str = "reference",
                capacity_factor: float | None = None, layer: jax.Array | None = None,
                rows: int | None = None, fp8_acts: bool = False, ep_dispatch: str = "auto") -> jax.Array:
    """x [B, S, D] (normed), token_ids [B, S] -> [B, S, D]. Under a mesh the routed experts
    run expert-parallel (`routed_experts_sharded`; `capacity_factor` caps its send buffers,
    `ep_dispatch` picks padded or ragged all-to-all).
    `kernels` picks the grouped matmul's implementation (dsjax/kernels/dispatch.py).
    layer: the routed-expert weights w1 / w3 / w2 are stacked over a scanned layer run and
    this is layer `layer` of them (the other weights are this layer's own).
    rows (batch-invariant mode): the grouped path at any token count, in tiles of this many
    rows, so a token's expert products do not depend on the others.
    fp8_acts: DeepSeek-V4.1's FP8 activations (Lin8 shared expert, Lin4 routed experts with the
    routing weight before W2; spec deepseek-v41.md §4), with its quantisation round trips.
    A decode step with 16-bit weights, or a prompt chunk, on XLA:CPU routes as here, then runs the
    routed and shared experts as one library call (`one_call_ffn`)."""
    flat = reshape(x, (-1, x.shape[-1]))
    if current_mesh() is not None:
        p = expert_layer(p, layer)
        routed = routed_experts_sharded(p, flat, reshape(token_ids, (-1,)), cfg, kernels=kernels,
                                        capacity_factor=capacity_factor, rows=rows, fp8_acts=fp8_acts,
                                        lead=x.shape[:-1], ep_dispatch=ep_dispatch)
    else:
        weights, idx = route(p, flat, token_ids.reshape(-1), cfg, x.shape[:-1])

        def xla(p, flat, weights, idx, layer):
            routed = routed_experts(p, flat, weights, idx, cfg, None if rows is None else "grouped", kernels=kernels,
                                    layer=layer, rows=rows, fp8_acts=fp8_acts)
            return routed.astype(flat.dtype) + shared_expert(p, flat, cfg, fp8_acts)

        def library(p, flat, weights, idx, layer):
            shared = (p.shared_w1, p.shared_w3, p.shared_w2)
            y = stored_moe_product(flat, weights, idx, _experts_in_place(p, layer), shared, cfg.swiglu_limit)
            return y.astype(flat.dtype)

        args = (p, flat, gained(weights, idx, cfg), idx, layer)
        one_call = rows is None and not fp8_acts and one_call_ffn(expert_layer(p, layer), flat, idx, kernels)
        return reshape(_derivatives_through(xla, library)(*args) if one_call else xla(*args), x.shape)
    routed = routed.astype(x.dtype)
    return reshape(routed + shared_expert(p, flat, cfg, fp8_acts), x.shape)
