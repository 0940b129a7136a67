"""Expert parallelism's exchange: each assignment's row to the device that holds its expert,
through the local experts, and back. Runs per device inside `jax.shard_map` over the `expert`
mesh axis (dsjax/layers/moe.py `dispatch_combine` calls it); the math of the experts is the
caller's `ffn`, so this file is only about where rows go.

Both forms take the local assignments sorted by global expert id (so by owner device, and
by expert within it) and return, row for row, what the experts made of them:

    padded   send buffer [ep, C, D], one all_to_all there and one back. C is static:
             dropless C = A (all of a device's A assignments may go to one owner), or
             capped by a capacity factor (rows past it dropped). Every device sends ep * C
             rows whatever the routing: padding rows carry expert -1 and are not computed.
    ragged   `jax.lax.ragged_all_to_all`: each device sends exactly its rows, no padding.
             The counts go first (an all_gather of each device's [E] expert counts, E
             integers each), from which every device knows what it sends, what it receives
             and where each block lands; the rows follow, and come back the same way.

XLA:CPU (jax 0.10.2) has no ragged-all-to-all ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"). On CPU `ragged_all_to_all` is emulated with the same
semantics by a padded all_to_all (`emulated_ragged_all_to_all`), chosen at lowering by
`jax.lax.platform_dependent`, so the ragged bookkeeping (counts, offsets, the receive
layout, the way back) is checked numerically on fake CPU devices, and a program exported
for TPU or GPU carries the real collective.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

AXIS = "expert"  # the one mesh axis named outside dsjax/sharding/rules.py


def _varying(x: jax.Array) -> frozenset:
    """The manual mesh axes x varies over inside shard_map."""
    return jax.typeof(x).manual_axis_type.varying


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def padded_dispatch(rows: jax.Array, experts: jax.Array, scale: jax.Array | None, ffn, *, n_experts: int,
                    cap: int) -> jax.Array:
    """rows [A, D] sorted by their global expert ids `experts` [A]; scale [A] fp32 or None
    (travels with the rows, for `ffn`); ffn(rows [M, D] sorted by local expert, group_sizes
    [E / ep], scale [M] | None) -> [M, D]. -> [A, D] in rows.dtype, each row's expert output,
    0 where the row was dropped (rank past `cap` in its send block)."""
    ep = jax.lax.axis_size(AXIS)
    local_n = n_experts // ep
    a, d = rows.shape
    dest = experts // local_n
    counts = jnp.bincount(dest, length=ep)
    rank = jnp.arange(a) - _exclusive_cumsum(counts)[dest]  # position in its send block
    slot = jnp.where(rank < cap, dest * cap + rank, ep * cap)  # ep * cap: dropped

    def there(v: jax.Array, fill) -> jax.Array:  # [A, ...] -> the receiver's [ep * C, ...]
        send = jnp.full((ep * cap, *v.shape[1:]), fill, v.dtype).at[slot].set(v, mode="drop")
        return jax.lax.all_to_all(send.reshape(ep, cap, *v.shape[1:]), AXIS, 0, 0).reshape(send.shape)

    recv_x, recv_e = there(rows, 0), there(experts % local_n, -1)
    key = jnp.where(recv_e >= 0, recv_e, local_n)  # padding rows sort last and fall outside every group
    by_expert = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=local_n + 1)[:local_n].astype(jnp.int32)
    recv_s = None if scale is None else there(scale, 0)[by_expert]
    y = jnp.zeros((ep * cap, d), jnp.float32).at[by_expert].set(ffn(recv_x[by_expert], group_sizes, recv_s))
    back = jax.lax.all_to_all(y.astype(rows.dtype).reshape(ep, cap, d), AXIS, 0, 0).reshape(ep * cap, d)
    return jnp.where((slot < ep * cap)[:, None], back[jnp.minimum(slot, ep * cap - 1)], 0)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` with one slice per device, for backends without it (XLA:CPU):
    each slice padded to operand's row count and sent with all_to_all, then written where
    the real collective writes it. Same arguments and result; checks, not speed."""
    ep, n = jax.lax.axis_size(axis_name), operand.shape[0]
    r = jnp.arange(n)
    tail = (1,) * (operand.ndim - 1)
    take = jnp.minimum(input_offsets[:, None] + r, n - 1)  # [ep, n]
    send = jnp.where((r < send_sizes[:, None]).reshape(ep, n, *tail), operand[take], 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)  # [ep (source), n, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's slice lands here
    dst = jnp.where(r < recv_sizes[:, None], at[:, None] + r, output.shape[0])  # past the end: not written
    return output.at[dst.reshape(-1)].set(recv.reshape(ep * n, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """Over the `expert` axis: the collective itself where XLA implements it, the emulation on CPU."""
    # the result varies over the axes its inputs vary over (the emulation's would; the collective's
    # type is `output`'s), so both branches have one type
    vary = set().union(*map(_varying, (operand, input_offsets, send_sizes, output_offsets, recv_sizes)))
    output = jax.lax.pcast(output, tuple(sorted(vary - _varying(output))), to="varying")
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return jax.lax.platform_dependent(*args, cpu=functools.partial(emulated_ragged_all_to_all, axis_name=AXIS),
                                      default=functools.partial(jax.lax.ragged_all_to_all, axis_name=AXIS))


def ragged_dispatch(rows: jax.Array, experts: jax.Array, scale: jax.Array | None, ffn, *,
                    n_experts: int) -> jax.Array:
    """`padded_dispatch`'s arguments and result (nothing dropped), each row sent once."""
    ep = jax.lax.axis_size(AXIS)
    local_n = n_experts // ep
    me = jax.lax.axis_index(AXIS)
    a, d = rows.shape
    # counts[s, e]: rows device s sends to global expert e; E integers from each device
    counts = jax.lax.all_gather(jnp.bincount(experts, length=n_experts).astype(jnp.int32), AXIS)  # [ep, E]
    flows = counts.reshape(ep, ep, local_n).sum(-1)  # [source, owner]: rows source sends owner
    sent_at = _exclusive_cumsum(flows, axis=1)  # [s, o]: where s's block for o starts in s's send buffer
    lands_at = _exclusive_cumsum(flows, axis=0)  # [s, o]: where s's block lands in o's receive buffer
    # The receive buffer's static bound: every assignment of all ep devices in this expert
    # group may route to experts of this one device (skewed or forced routing), and dropless
    # means none is lost, so ep * A rows. Only the rows sent travel (the exchange is sized by
    # the counts); the bound costs memory, not traffic. (A tighter bound, ep * T * min(K, E/ep)
    # from K distinct experts per token, fails under forced routing that repeats an expert.)
    bound = ep * a
    there = lambda v: ragged_all_to_all(  # noqa: E731  [A, ...] -> [bound, ...] in (source, local expert) order
        v, jnp.zeros((bound, *v.shape[1:]), v.dtype), sent_at[me], flows[me], lands_at[me], flows[:, me])
    recv_x = there(rows)
    # each received row's local expert, from the counts: segments (source, local expert) in order
    segments = jax.lax.dynamic_slice_in_dim(counts, me * local_n, local_n, axis=1)  # [ep, E / ep]
    seg = jnp.searchsorted(jnp.cumsum(segments.reshape(-1)), jnp.arange(bound), side="right")
    key = jnp.where(seg < ep * local_n, seg % local_n, local_n)  # past the rows received: last, not computed
    by_expert = jnp.argsort(key, stable=True)
    recv_s = None if scale is None else there(scale)[by_expert]
    y = jnp.zeros((bound, d), jnp.float32).at[by_expert].set(
        ffn(recv_x[by_expert], segments.sum(0).astype(jnp.int32), recv_s))
    # back: the block from source s returns to where s sent it from
    return ragged_all_to_all(y.astype(rows.dtype), jnp.zeros_like(rows), lands_at[:, me], flows[:, me],
                             sent_at[:, me], flows[me])
