"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens sent to
the devices that hold their experts and back with `all_to_all`.

Inside `jax.shard_map` each device has its own tokens (the batch is split over `data` and
`expert`) and E / ep experts. Per device:

    route locally                         -> (weight, expert) per assignment
    bucket assignments by owner device    -> send buffer [ep, C, D] (+ local expert ids)
    all_to_all over `expert`              -> the rows this device's experts must process
    grouped matmul over local experts     (dsjax.pallas_kernels.grouped_matmul.grouped_ffn)
    all_to_all back, weight, scatter-add  -> [T_local, D]

Dropless by default: C = T_local * K, enough for every assignment to go to one device
(skewed routing stays correct). `capacity_factor` caps C at ceil(T_local * K / ep * cf)
and drops assignments past it: an explicit option, never the default. XLA:CPU has no
ragged all-to-all, so buffers are padded to C; padding rows carry expert id -1 and are not
computed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsjax.config import ModelConfig
from dsjax.layers.moe import MoE, route, routed_experts
from dsjax.layers.quantized import dense
from dsjax.pallas_kernels.grouped_matmul import grouped_ffn
from dsjax.sharding.rules import RULES, _present, current_mesh


def _routed_only(p: MoE) -> MoE:
    """The routed part of the MoE params (the shared expert runs outside, tensor-parallel)."""
    return p.replace(shared_w1=None, shared_w3=None, shared_w2=None)


def _moe_in_specs(p: MoE, ep: int) -> MoE:
    experts = P("expert", None, None) if ep > 1 else P()
    return MoE(router=P(), w1=experts, w3=experts, w2=experts, shared_w1=None, shared_w3=None, shared_w2=None,
               router_bias=None if p.router_bias is None else P(), tid2eid=None if p.tid2eid is None else P())


def dispatch_combine(p: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array, cfg: ModelConfig, ep: int,
                     capacity_factor: float | None) -> jax.Array:
    """Per device (inside shard_map): x [T, D] local tokens, idx/weights [T, K] global
    expert ids; p.w1/w3/w2 hold this device's E / ep experts. -> [T, D] fp32."""
    t, k = idx.shape
    d = x.shape[-1]
    local_n = cfg.n_routed_experts // ep
    a = t * k
    cap = a if capacity_factor is None else max(1, math.ceil(a / ep * capacity_factor))
    flat_e = idx.reshape(-1)
    dest = flat_e // local_n
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=ep)
    rank = jnp.arange(a) - (jnp.cumsum(counts) - counts)[dest[order]]  # position in its send block
    slot = jnp.where(rank < cap, dest[order] * cap + rank, ep * cap)  # ep * cap: dropped
    send_x = jnp.zeros((ep * cap, d), x.dtype).at[slot].set(x[order // k], mode="drop")
    send_e = jnp.full((ep * cap,), -1, jnp.int32).at[slot].set((flat_e % local_n)[order], mode="drop")
    recv_x = jax.lax.all_to_all(send_x.reshape(ep, cap, d), "expert", 0, 0).reshape(ep * cap, d)
    recv_e = jax.lax.all_to_all(send_e.reshape(ep, cap), "expert", 0, 0).reshape(ep * cap)
    # local grouped matmul: valid rows sorted by local expert, padding rows last (not computed)
    key = jnp.where(recv_e >= 0, recv_e, local_n)
    by_expert = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=local_n + 1)[:local_n].astype(jnp.int32)
    w1, w3, w2 = (dense(w, x.dtype) for w in (p.w1, p.w3, p.w2))  # FP4/FP8-resident experts
    y_sorted = grouped_ffn(recv_x[by_expert], group_sizes, w1, w3, w2, limit=cfg.swiglu_limit, impl=cfg.kernels)
    y = jnp.zeros((ep * cap, d), jnp.float32).at[by_expert].set(y_sorted).astype(x.dtype)
    back = jax.lax.all_to_all(y.reshape(ep, cap, d), "expert", 0, 0).reshape(ep * cap, d)
    per_assignment = jnp.where((slot < ep * cap)[:, None], back[jnp.minimum(slot, ep * cap - 1)], 0)
    contrib = per_assignment.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, d), jnp.float32).at[order // k].add(contrib)


def routed_experts_sharded(p: MoE, x: jax.Array, token_ids: jax.Array, cfg: ModelConfig,
                           capacity_factor: float | None = None) -> jax.Array:
    """x [T, D] and token_ids [T] batch-sharded under the current mesh -> routed-expert
    output [T, D] fp32, same sharding."""
    mesh = current_mesh()
    ep = mesh.shape["expert"]
    if cfg.n_routed_experts % ep:
        raise ValueError(f"{cfg.n_routed_experts} routed experts cannot be split over expert={ep} devices")
    rows = P(_present(RULES.mesh_axes("batch"), mesh))
    in_specs = (_moe_in_specs(p, ep), P(*rows, None), rows)

    def local(p, x, ids):
        weights, idx = route(p, x, ids, cfg)
        if ep == 1:
            return routed_experts(p, x, weights, idx, cfg, kernels=cfg.kernels)
        return dispatch_combine(p, x, weights, idx, cfg, ep, capacity_factor)

    return jax.shard_map(local, in_specs=in_specs, out_specs=P(*rows, None))(_routed_only(p), x, token_ids)
