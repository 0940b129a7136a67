"""Manifold-constrained hyper-connections (mHC).

The residual is N = hc_mult parallel streams X [B, S, N, D]. Around each sublayer f:

    mix  = (fn @ flatten(X)) * rsqrt(mean(flatten(X)^2) + eps)       # [(2+N)*N], fp32
    pre  = sigmoid(mix[:N]  * scale0 + base[:N])  + hc_eps           # collapse weights
    post = 2 sigmoid(mix[N:2N] * scale1 + base[N:2N])                # expand weights
    C    = sinkhorn(softmax_rows(mix[2N:] * scale2 + base[2N:]) + hc_eps)   # N x N, doubly stochastic
    y    = f(Norm(sum_i pre_i X_i))
    X'_k = post_k * y + sum_j C[j, k] X_j                            # C^T X; C is not symmetric

After the last block, the head collapse uses only a `pre` (no Sinkhorn).
V4.1 collapses each sublayer with the *previous* sublayer's `pre` (the lag); `hc_mixes`
returns `pre` rather than applying it, so the caller decides which one to use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from dsjax.config import ModelConfig
from dsjax.kernels import cpu as cpu_kernels
from dsjax.layers import taps
from dsjax.layers.linear import cpu_forms, linear_f32, merge_last_two
from dsjax.layers.norms import rms_norm
from dsjax.params import ParamSpec
from dsjax.sharding.rules import reshape


@struct.dataclass
class HyperConnection:
    fn: jax.Array  # [(2+N)*N, N*D] fp32
    base: jax.Array  # [(2+N)*N] fp32
    scale: jax.Array  # [3] fp32


@struct.dataclass
class HyperHead:
    fn: jax.Array  # [N, N*D] fp32
    base: jax.Array  # [N]
    scale: jax.Array  # [1]


def hyper_connection_specs(cfg: ModelConfig) -> HyperConnection:
    n, width = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    f32 = jnp.float32
    return HyperConnection(
        fn=ParamSpec((width, n * cfg.hidden_size), f32, (None, "hc_in")),
        base=ParamSpec((width,), f32, (None,), init="zeros"),
        scale=ParamSpec((3,), f32, (None,), init="ones"),
    )


def hyper_head_specs(cfg: ModelConfig) -> HyperHead:
    n, f32 = cfg.hc_mult, jnp.float32
    return HyperHead(
        fn=ParamSpec((n, n * cfg.hidden_size), f32, (None, "hc_in")),
        base=ParamSpec((n,), f32, (None,), init="zeros"),
        scale=ParamSpec((1,), f32, (None,), init="ones"),
    )


def _normalized_mix(fn: jax.Array, streams: jax.Array, eps: float) -> jax.Array:
    """(fn @ v) * rsqrt(mean(v^2) + eps) with v = flatten(streams) in fp32."""
    v = merge_last_two(streams.astype(jnp.float32))
    inv_rms = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    return linear_f32(v, fn) * inv_rms


def sinkhorn(logits: jax.Array, iters: int, eps: float, rolled: bool | None = None) -> jax.Array:
    """Row softmax, then alternate column / row normalisation (fp32) [..., N, N].
    rolled: the iterations as a device loop (default on XLA:CPU, where that is cheapest) or
    written out (default elsewhere: on a GPU each loop iteration costs a fixed loop overhead
    far above its 16 numbers a row of arithmetic; benchmarks/sinkhorn_forms.py, figures in
    docs/kernels.md and benchmarks/REPORT.md)."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def row_then_col(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    if rolled is None:
        rolled = jax.default_backend() == "cpu"
    if rolled:
        return jax.lax.fori_loop(0, iters - 1, row_then_col, c)
    for i in range(iters - 1):
        c = row_then_col(i, c)
    return c


@jax.named_scope("mhc")  # a profile's op group (benchmarks/decode_trace.py)
def hc_mixes(p: HyperConnection, streams: jax.Array, cfg: ModelConfig):
    """streams [..., N, D] -> pre [..., N], post [..., N], comb [..., N, N] (all fp32)."""
    n = cfg.hc_mult
    mix = _normalized_mix(p.fn, streams, cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(mix[..., :n] * p.scale[0] + p.base[:n]) + cfg.hc_eps
    post = 2.0 * jax.nn.sigmoid(mix[..., n:2 * n] * p.scale[1] + p.base[n:2 * n])
    comb_logits = mix[..., 2 * n:] * p.scale[2] + p.base[2 * n:]
    comb = sinkhorn(reshape(comb_logits, (*comb_logits.shape[:-1], n, n)), cfg.hc_sinkhorn_iters, cfg.hc_eps)
    return pre, post, comb


@jax.named_scope("mhc")  # a profile's op group (benchmarks/decode_trace.py)
def collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """sum_i pre_i X_i -> [..., D] in the streams' dtype (fp32 products)."""
    return jnp.einsum("...n,...nd->...d", pre, streams.astype(jnp.float32)).astype(streams.dtype)


@jax.named_scope("mhc")  # a profile's op group (benchmarks/decode_trace.py)
def expand(y: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k y + sum_j C[j, k] X_j, computed in the activation dtype as the reference does."""
    dtype = streams.dtype
    mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(dtype), streams, preferred_element_type=jnp.float32)
    return (post.astype(dtype)[..., None] * y[..., None, :] + mixed.astype(dtype)).astype(dtype)


def one_call(streams: jax.Array) -> bool:
    """Whether a sublayer's mHC input runs as one call of the XLA:CPU library (`sublayer_input`):
    a decode step's few fp32 rows on one CPU device (`linear.cpu_forms`), the library's layer
    calls on (`cpu_kernels.layer_calls_available`), and no dsjax.inspect session tracing (its
    points sit between the ops)."""
    rows = math.prod(streams.shape[:-2])
    return (streams.ndim >= 3 and cpu_forms(streams, rows) and streams.shape[-2] <= 16
            and cpu_kernels.layer_calls_available() and not taps.tracing())


MIXES = ("pre", "post", "comb")  # the mHC mixes of a sublayer, as dsjax.inspect names them


@jax.named_scope("mhc")  # a profile's op group (benchmarks/decode_trace.py)
def sublayer_input(p: HyperConnection, norm: jax.Array, streams: jax.Array, cfg: ModelConfig,
                   weights: jax.Array | None = None, at: jax.Array | None = None, name: str | None = None):
    """streams [..., N, D] -> (the sublayer's input RMSNorm(collapse(streams, w)) * norm [..., D],
    pre, post, comb) with w = pre, or `weights` [..., N] (DeepSeek-V4.1's lag): `hc_mixes`,
    `collapse` and `rms_norm`, in one call of the library where `one_call` says so.
    at: p's leaves are stacked over a scanned layer run and this is layer `at` (the library reads
    them where they lie; a slice of a stack handed to a call would be copied first).
    name: the mixes are dsjax.inspect's points `{name}.pre` / `.post` / `.comb` (tapped, so edited
    as a session asks, before the collapse uses pre; a session takes the ops, not the call)."""
    if one_call(streams):
        lead, (n, d) = streams.shape[:-2], streams.shape[-2:]
        h, pre, post, comb = cpu_kernels.hc_input(
            streams.reshape(-1, n, d), p.fn, p.base, p.scale, norm, None if weights is None else weights.reshape(-1, n),
            at, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
        return h.reshape(*lead, d).astype(streams.dtype), pre.reshape(*lead, n), post.reshape(*lead, n), \
            comb.reshape(*lead, n, n)
    pre, post, comb = hc_mixes(layer_of(p, at), streams, cfg)
    if name is not None:
        pre, post, comb = (taps.tap(f"{name}.{k}", m) for k, m in zip(MIXES, (pre, post, comb)))
    return rms_norm(collapse(streams, pre if weights is None else weights), norm, cfg.rms_norm_eps), pre, post, comb


def layer_of(p: HyperConnection, at: jax.Array | None) -> HyperConnection:
    """p's layer `at` of a stacked run (None: p is one layer's)."""
    return p if at is None else jax.tree.map(lambda a: a[at], p)


def head_collapse(p: HyperHead, streams: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final N -> 1 collapse before the output norm (no post, no Sinkhorn)."""
    mix = _normalized_mix(p.fn, streams, cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(mix * p.scale[0] + p.base) + cfg.hc_eps
    return collapse(streams, pre)
