"""The vocabulary head both generations share: its weight (its own or the tied embedding),
the forms an engine on one XLA:CPU device runs its steps with (transposed for one row, packed
for the CPU head kernel, with a greedy screen), V4's head collapse, the logits of a step's
rows. `params` here is either generation's parameter tree: the head reads `embed`, `lm_head`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from dsjax.kernels import cpu as cpu_kernels
from dsjax.kernels.cpu import PackedHead
from dsjax.layers.hyper_connection import HyperHead, head_collapse
from dsjax.layers.linear import few_rows, linear
from dsjax.layers.norms import rms_norm
from dsjax.layers.quantized import ColumnMajor
from dsjax.sharding.rules import batch_major, current_mesh


def lm_head_weight(params) -> jax.Array:
    return params.embed if params.lm_head is None else params.lm_head


COLUMN_HEAD_MAX_IN = 1024  # the hidden sizes measured faster with the head transposed: 128..1024


def one_row_head(params, dtype):
    """The params a one-row decode on XLA:CPU (one device, not batch-invariant: the caller
    says so) runs with: a float32 head (its own, or the tied embedding's copy: the lookup
    keeps `embed`) with a short hidden size kept transposed (`ColumnMajor`), which XLA:CPU
    reads faster at one row: a vector-matrix loop streaming whole rows, against each row
    reduced on its own (docs/cpu-decode.md; benchmarks/head_layout.py). A copy of the head, held by the caller (an
    `Engine`); a bf16 or quantized head, a bf16 model, a wider hidden size and other
    backends keep `params` (a bf16 head transposed is widened whole before the product)."""
    w = lm_head_weight(params)
    if (not fp32_one_row(dtype) or not isinstance(w, jax.Array) or w.dtype != jnp.float32
            or w.shape[1] > COLUMN_HEAD_MAX_IN):
        return params
    return params.replace(lm_head=ColumnMajor(jnp.transpose(w)))


def cpu_head_params(params, dtype, *, screen: bool = False):
    """The params an engine on one XLA:CPU device (not batch-invariant: the caller says so)
    runs with when the vocabulary-head kernel is built (`dsjax.kernels.cpu`): an fp32
    model's plain fp32 or bf16 head (its own, or the tied embedding's copy: the lookup keeps
    `embed`) packed in tiles (`PackedHead`), which the kernel reads for any row count, faster
    than any form of XLA's product from 2 rows up (docs/cpu-decode.md); at one row XLA's
    product on the transposed head measured a little faster, so a one-slot fp32 engine keeps
    that: `one_row_head`). A copy of the head, held by the caller; else
    `params` (a quantized head, a bf16 model, no kernel). V4 and V4.1 params alike. screen: an
    fp32 head also keeps a bf16 copy and its rows' norms (half its bytes again), from which
    the decode step finds greedy tokens reading half the bytes (`cpu_kernels.greedy_tokens`;
    a bf16 head is its own screen where that saves multiply-adds: `cpu_kernels.pack_head`)."""
    w = lm_head_weight(params)
    if (jnp.dtype(dtype) != jnp.float32 or not isinstance(w, jax.Array)
            or w.dtype not in (jnp.float32, jnp.bfloat16) or not cpu_kernels.available()):
        return params
    return params.replace(lm_head=cpu_kernels.pack_head(w, screen=screen))


def head_dtype(params):
    """The vocabulary head's stored dtype (None for a quantized or other stored head)."""
    w = lm_head_weight(params)
    return w.dtype if isinstance(w, jax.Array) else None


def screens(params) -> bool:
    """Whether `params`' vocabulary head carries a greedy screen (`cpu_kernels.greedy_tokens`)."""
    return isinstance(params.lm_head, PackedHead) and params.lm_head.screen is not None


def step_head_params(params, dtype, *, one_row: bool, screen: bool = False):
    """The head an engine on one XLA:CPU device (not batch-invariant: the caller says so) runs
    its steps with. screen (an engine whose decode steps verify no drafts; a step with a row
    asking for logprobs reads the fp32 head): an fp32 or bf16 head packed with its greedy
    screen where it gets one (`cpu_head_params`).
    Else at one row the transposed head where `one_row_head` keeps one (XLA's product there
    measured a little faster than the kernel), else the packed head, else `params`."""
    packed = cpu_head_params(params, dtype, screen=True) if screen else None
    if packed is not None and screens(packed):
        return packed
    if one_row:
        transposed = one_row_head(params, dtype)
        if transposed is not params:
            return transposed
    return packed if packed is not None else cpu_head_params(params, dtype)  # (packed without a screen)


def fp32_one_row(dtype) -> bool:
    """An fp32 model's one-row products on XLA:CPU (`linear`'s decode forms)."""
    return jnp.dtype(dtype) == jnp.float32 and few_rows(1)


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def head_input(hc_head: HyperHead, norm: jax.Array, streams: jax.Array, cfg: ModelConfig) -> jax.Array:
    """N streams [..., N, D] -> the vocabulary projection's input [..., D]: collapse, norm."""
    return rms_norm(head_collapse(hc_head, streams, cfg), norm, cfg.rms_norm_eps)


@jax.named_scope("head")  # a profile's op group (benchmarks/decode_trace.py)
def head_logits(hc_head: HyperHead, norm: jax.Array, weight: jax.Array, streams: jax.Array,
                cfg: ModelConfig) -> jax.Array:
    """N streams [..., N, D] -> logits [..., V] fp32: head collapse, norm, vocabulary
    projection. The main model and the MTP drafter each have their own collapse and norm
    and share the projection `weight` ([V, D])."""
    h = head_input(hc_head, norm, streams, cfg)
    logits = linear(h, weight, out_dtype=jnp.float32)  # vocab-parallel under a mesh
    return batch_major(logits)  # gather the vocabulary


def last_valid(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """x [B, C, ...] -> [B, 1, ...] at each row's last valid position (n_valid [B])."""
    last = jnp.maximum(n_valid - 1, 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, last, axis=1)


def rows_logits(compute, weight, n_valid: jax.Array | None, dtype) -> jax.Array:
    """compute() -> the logits of a step's rows, read from the vocabulary projection `weight`,
    or zeros of their shape when no row has a token (n_valid [B] all 0: a step of a
    multi-step decode whose slots have all finished), where `weight` is stored narrower than
    the activations' `dtype` (a bf16 head under fp32, `dsjax.store_weights`; a quantized one).
    Such a product widens the head in an op of its own, which XLA hoists out of an enclosing
    loop as loop-invariant: the engine's multi-step decode (`decode_steps` > 1) then widened
    the whole head into a new fp32 buffer per dispatch and read that each step (several times
    slower than one step a dispatch: docs/cpu-decode.md), and so did a speculative step for
    its MTP drafter's loop. XLA
    leaves a conditional's branch in place, so inside the `lax.cond` the product reads the
    head as a single step does. Only for XLA:CPU's few-row decode forms, which read the
    stored head inside the product (`linear`): plain heads, the GEMM (more rows,
    batch-invariant mode, other backends: it widens the head outside the product whatever
    the loop, and once a dispatch beats once a loop step) and any head on a mesh (whose
    branches would have to agree on the logits' sharding) are read as they are."""
    plain = (isinstance(weight, PackedHead)  # the kernel reads its tiles as stored
             or isinstance(weight, (jax.Array, ColumnMajor)) and jnp.dtype(weight.dtype) == jnp.dtype(dtype))
    if n_valid is None or plain or current_mesh() is not None:
        return compute()
    out = jax.eval_shape(compute)
    if not few_rows(int(np.prod(out.shape[:-1]))):
        return compute()
    return jax.lax.cond(jnp.any(n_valid > 0), compute, lambda: jnp.zeros(out.shape, out.dtype))
