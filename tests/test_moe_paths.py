"""The routed-expert implementations (weight gather, sorted grouped matmul via ragged_dot,
the CPU tile loop, the Pallas kernel) are the same function: compared on random, skewed and
empty routings."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.layers import qdq
from dsjax.layers.linear import gemm_only
from dsjax.layers.moe import routed_experts
from dsjax.layers.quantized import Fp4Weight
from dsjax.model import layer_block
from dsjax.kernels import grouped_matmul


@pytest.fixture(scope="module")
def tiny():
    m = dsjax.load_model("tiny", dtype="float32", seed=3)
    return m.config, layer_block(m.params, m.config, 1).moe


def _dense_reference(p, x, weights, idx, limit):
    """Per token, per chosen expert, in numpy float64."""
    x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, p.w1, p.w3, p.w2))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(idx[t])):
            g = np.minimum(w1[e] @ x[t], limit)
            u = np.clip(w3[e] @ x[t], -limit, limit)
            out[t] += float(weights[t, j]) * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    return out


ROUTINGS = {
    "random": lambda rng, t, k, e: np.stack([rng.permutation(e)[:k] for _ in range(t)]),
    "all_one_expert": lambda rng, t, k, e: np.tile(np.arange(k), (t, 1)),  # others empty
    "two_experts_skewed": lambda rng, t, k, e: np.stack([[0 if rng.random() < 0.9 else 5, 7] for _ in range(t)]),
}


def _sorted_through(ffn, cfg):
    """routed_experts' grouped path (sort by expert, grouped FFN, weight, scatter-add) around
    one named grouped-FFN implementation, whichever the dispatch would pick here."""

    def run(p, x, weights, idx):
        k = idx.shape[1]
        order = jnp.argsort(idx.reshape(-1), stable=True)
        sizes = jnp.bincount(idx.reshape(-1), length=cfg.n_routed_experts).astype(jnp.int32)
        y = ffn(x[order // k], sizes, p.w1, p.w3, p.w2, limit=cfg.swiglu_limit)
        y = y.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros(x.shape, jnp.float32).at[order // k].add(y)

    return run


def _gemm_only(fn, *args, **kwargs):
    """fn traced under linear.gemm_only: the gather path copies the chosen experts' weights and
    multiplies them in one einsum (what it does for many tokens, on a mesh, off the CPU)."""
    with gemm_only():
        return fn(*args, **kwargs)


def _implementations(cfg, tokens):
    rows = grouped_matmul.row_tile(tokens * cfg.num_experts_per_tok, cfg.n_routed_experts)
    return {
        "gather": lambda p, x, w, i: routed_experts(p, x, w, i, cfg, path="gather"),  # per assignment (CPU, <= 16)
        "gather_copies": lambda p, x, w, i: _gemm_only(routed_experts, p, x, w, i, cfg, path="gather"),
        "grouped": lambda p, x, w, i: routed_experts(p, x, w, i, cfg, path="grouped"),  # the dispatch's reference
        "pallas": lambda p, x, w, i: routed_experts(p, x, w, i, cfg, path="grouped", kernels="pallas"),
        "ragged_dot": _sorted_through(grouped_matmul.reference, cfg),
        "tiled": _sorted_through(functools.partial(grouped_matmul.tile_loop, rows=rows), cfg),
    }


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_paths_agree(tiny, routing, tokens):
    cfg, p = tiny
    rng = np.random.default_rng(tokens)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    x = jnp.asarray(rng.normal(size=(tokens, cfg.hidden_size)) * 3, jnp.float32)
    idx = jnp.asarray(ROUTINGS[routing](rng, tokens, k, e), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.5, size=(tokens, k)), jnp.float32)
    want = _dense_reference(p, x, weights, idx, cfg.swiglu_limit)
    scale = np.abs(want).max()
    for path, run in _implementations(cfg, tokens).items():
        got = jax.jit(run)(p, x, weights, idx)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale, rtol=0, err_msg=path)


def _fp4_experts(rng, n_experts, out, inn):
    """Random MXFP4 expert weights [E, out, in] (packed codes, E8M0 exponents near 1)."""
    codes = rng.integers(0, 16, (n_experts, out, inn))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)
    scale = rng.integers(122, 130, (n_experts, out, inn // 32)).astype(np.uint8)
    return Fp4Weight(packed=jnp.asarray(packed), scale_exp=jnp.asarray(scale))


@pytest.mark.parametrize("tokens", [1, 40])
def test_v41_lin4_experts_on_every_path(tiny, tokens):
    """DeepSeek-V4.1's routed experts (fp8_acts): FP8 activations into FP4 weights, the routing
    weight applied before W2 and so before W2's activation round trip (spec deepseek-v41.md §4),
    against a per-assignment computation with qdq.lin4 (the reference's exact product, checked
    against a numpy block loop in test_qdq.py): the gather path at 1 and 40 tokens, the grouped
    ones (tile loop, Pallas kernel interpreted) at 40."""
    cfg, p = tiny
    rng = np.random.default_rng(17)
    d, inter, k, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_routed_experts
    w1, w3, w2 = _fp4_experts(rng, e, inter, d), _fp4_experts(rng, e, inter, d), _fp4_experts(rng, e, d, inter)
    p = p.replace(w1=w1, w3=w3, w2=w2)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.bfloat16)
    idx = jnp.asarray(ROUTINGS["random"](rng, tokens, k, e), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.5, size=(tokens, k)), jnp.float32)

    lin4 = jax.jit(qdq.lin4)
    xk = jnp.broadcast_to(x[:, None], (tokens, k, d))
    limit = cfg.swiglu_limit
    gate = jnp.minimum(lin4(xk, w1.packed[idx], w1.scale_exp[idx]).astype(jnp.float32), limit)
    up = jnp.clip(lin4(xk, w3.packed[idx], w3.scale_exp[idx]).astype(jnp.float32), -limit, limit)
    h = jax.nn.silu(gate) * up * weights[..., None]
    want = np.asarray(lin4(h.astype(jnp.bfloat16), w2.packed[idx], w2.scale_exp[idx]), np.float64).sum(axis=1)
    scale = np.abs(want).max()

    def close(got):  # the share of outputs within a bf16 rounding (of an expert output) of the oracle
        return np.mean(np.abs(got - want) <= 2.0 ** -8 * scale)

    paths = {"gather": dict(path="gather")} | ({} if tokens == 1 else {
        "grouped": dict(path="grouped"), "pallas": dict(path="grouped", kernels="pallas")})
    for name, kw in paths.items():
        run = functools.partial(routed_experts, cfg=cfg, **kw)
        got = np.asarray(jax.jit(functools.partial(run, fp8_acts=True))(p, x, weights, idx), np.float64)
        # Products summed in another order can round a bf16 gate / up or an FP8 code the other way
        # (a step of up to 1/16 in one activation): rare, and local to a token.
        assert close(got) >= 0.97 and np.abs(got - want).max() < 0.03 * scale, (name, close(got))
        # V4's numerics on the same weights (no activation round trips, the weight after W2) are far off
        plain = np.asarray(jax.jit(run)(p, x, weights, idx), np.float64)
        assert close(plain) < 0.8, (name, close(plain))


def test_a_rows_experts_do_not_depend_on_its_neighbours(tiny):
    """The decode form (one matrix-vector product per assignment, XLA:CPU) gives a token's routed
    output bitwise the same whoever shares its batch: programs of 2, 3 and 8 tokens with other
    neighbours and routings (an engine row must not change with the other slots)."""
    cfg, p = tiny
    k, e, d = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.hidden_size
    first = np.linspace(-2, 2, d, dtype=np.float32)
    rows = []
    for tokens in (2, 3, 8):
        for seed in range(2):
            rng = np.random.default_rng(seed)
            x = rng.normal(size=(tokens, d)).astype(np.float32)
            x[0] = first
            idx = np.stack([rng.permutation(e)[:k] for _ in range(tokens)]).astype(np.int32)
            idx[0] = np.arange(k) * 3 % e
            weights = rng.uniform(0.1, 1.5, size=(tokens, k)).astype(np.float32)
            weights[0] = 0.5
            run = jax.jit(lambda p, x, w, i: routed_experts(p, x, w, i, cfg, path="gather"))
            rows.append(np.asarray(run(p, jnp.asarray(x), jnp.asarray(weights), jnp.asarray(idx)))[0])
    assert all(np.array_equal(rows[0], r) for r in rows[1:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v41_row_bits_do_not_depend_on_the_path(tiny, dtype):
    """DeepSeek-V4.1's FP8 activations (fp8_acts): row 0's routed output has the same bits on every
    path at every token count: the path `routed_experts` picks for 1, 3 and 40 tokens (the
    gathered weights; the grouped matmul's tile loop at the tile height the count gives) and each
    path forced at each count (gather, tile loop, Pallas kernel interpreted). So a row's logits
    do not depend on its batch: a product summed in another order rounds a bf16 gate / up or an
    FP8 code the other way now and then (an 8e-3 step in one output). FP4 experts in fp32, bf16 ones in bf16. K = 4, so the
    sum over a token's experts has an order to keep. (grouped_matmul.reference's ragged_dot, the
    accelerators' path, sums in XLA's order: not part of this.)"""
    cfg, p = tiny
    k, e, d, inter = 4, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(5)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        p = p.replace(w1=_fp4_experts(rng, e, inter, d), w3=_fp4_experts(rng, e, inter, d),
                      w2=_fp4_experts(rng, e, d, inter))
    else:
        p = p.replace(w1=p.w1.astype(dtype), w3=p.w3.astype(dtype), w2=p.w2.astype(dtype))
    first = rng.normal(size=d) * 3
    runs = {(path, kernels): jax.jit(functools.partial(routed_experts, cfg=cfg, path=path, kernels=kernels,
                                                       fp8_acts=True))
            for path, kernels in ((None, "reference"), ("gather", "reference"), ("grouped", "reference"),
                                  ("grouped", "pallas"))}
    rows = []
    for tokens in (1, 3, 40):
        x = rng.normal(size=(tokens, d)) * 3
        x[0] = first
        idx = np.stack([rng.permutation(e)[:k] for _ in range(tokens)]).astype(np.int32)
        idx[0] = [6, 1, 4, 3]  # not in ascending order: the sum must not follow the list
        weights = rng.uniform(0.1, 1.5, size=(tokens, k)).astype(np.float32)
        weights[0] = [0.9, 0.3, 0.6, 1.2]
        args = (jnp.asarray(x, dtype), jnp.asarray(weights), jnp.asarray(idx))
        rows += [np.asarray(run(p, *args))[0] for run in runs.values()]
        rows.append(np.asarray(jax.jit(lambda p, x, w, i: _gemm_only(
            routed_experts, p, x, w, i, cfg, path="gather", fp8_acts=True))(p, *args))[0])
    assert np.abs(rows[0]).max() > 0
    for i, row in enumerate(rows[1:], 1):
        np.testing.assert_array_equal(row, rows[0], err_msg=f"run {i}")
