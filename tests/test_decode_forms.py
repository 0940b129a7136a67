"""The XLA:CPU decode forms of the projections (dsjax/layers/linear.py: a matrix-vector loop
for one row, a fused multiply-reduce for a few, the GEMM beyond) and 16-bit weight storage
(`dsjax.store_weights`): each form against a float64 product, and a bf16-stored model against
the float32 model on the same bf16-rounded weights."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.api import STORED_NARROW
from dsjax.engine import Engine
from dsjax.engine.programs import decode_step
from dsjax.engine.sampler import SamplingParams
from dsjax.engine.speculative import draft_vocab
from dsjax.layers.linear import FEW_ROWS, WIDE_TILE, linear, merge_last_two, whole_weights
from dsjax.kernels import cpu as cpu_kernels
from dsjax.layers.quantized import Bf16Slice, Bf16Weight, ColumnMajor, Fp8Weight, take
from dsjax.layers.hyper_connection import HyperConnection, one_call, sublayer_input
from dsjax.layers.moe import MoE, expert_ffn_each, expert_ffn_gathered, moe_forward
from dsjax.layers.linear import stored_grouped_product
from dsjax.model import forward, init_cache, take_rows
from dsjax.model.head import one_row_head
from hlo_checks import widened_outside


@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS, FEW_ROWS + 1])
@pytest.mark.parametrize("stored", ["float32", "whole", "column", "bfloat16", "bf16-array", "fp8"])
@pytest.mark.parametrize("out", [200, 3 * WIDE_TILE + 5])  # large: bits widened in tiles and the rest, bf16 read as is
def test_linear_forms_match_a_float64_product(rows, stored, out):
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 1, 96)).astype(np.float32)
    w = rng.normal(size=(out, 96)).astype(np.float32)
    w_arg = jnp.asarray(w)
    if stored in ("bfloat16", "bf16-array"):  # bits (a layer's weight) or a plain bf16 array (the head)
        w_arg = Bf16Weight.of(w_arg) if stored == "bfloat16" else w_arg.astype(jnp.bfloat16)
        w = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))  # what it holds, exactly
    elif stored == "column":  # kept transposed (the engine's one-row head): x @ t at one row, else folded back
        w_arg = ColumnMajor(jnp.asarray(w.T))
    elif stored == "fp8":  # block-scaled: a scale per 128 rows, so not cut into WIDE_TILE-row tiles like bf16 bits
        w_arg = Fp8Weight(q=w_arg.astype(jnp.float8_e4m3fn),
                          scale_exp=jnp.asarray(rng.integers(124, 131, (-(-out // 128), 1)), jnp.uint8))
        w = np.asarray(w_arg.dense(jnp.float32))
    if stored == "whole":  # a layer-by-layer run's whole weight (`whole_weights`): w @ x at one row
        def product(x, w):
            with whole_weights():
                return linear(x, w)
    else:
        product = linear
    got = np.asarray(jax.jit(product)(jnp.asarray(x), w_arg))
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert got.shape == (rows, 1, out)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU head kernel: {cpu_kernels.status()}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_kernel_matches_a_float64_product_row_by_row(dtype):
    """The XLA:CPU vocabulary-head kernel (`cpu_kernels`, what `linear` runs for a `PackedHead`)
    against a float64 product, for a vocabulary that is not whole tiles and more rows than one
    pass holds; each row's logits bitwise those it gets with other rows or alone."""
    rng = np.random.default_rng(11)
    vocab, d = 1005, 96
    w = jnp.asarray(rng.normal(size=(vocab, d)).astype(np.float32)).astype(dtype)
    packed = cpu_kernels.pack_head(w)
    assert packed.shape == (vocab, d) and packed.tiles.shape == (-(-vocab // cpu_kernels.TILE), d, cpu_kernels.TILE)
    np.testing.assert_array_equal(np.asarray(packed.dense(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    x = jnp.asarray(rng.normal(size=(19, 1, d)).astype(np.float32))  # 19 rows: passes of 8, 8 and 3
    head = jax.jit(linear)
    assert cpu_kernels.HEAD in head.lower(x, packed).as_text()  # the kernel, not a product of `dense()`
    got = np.asarray(head(x, packed))
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    assert got.shape == (19, 1, vocab)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    for rows in (slice(0, 1), slice(5, 8), slice(3, 19)):
        np.testing.assert_array_equal(np.asarray(head(x[rows], packed)), got[rows])

    def xla_product(x, w):  # the kernel off: XLA's product on the head unpacked (`PackedHead.dense`)
        with cpu_kernels.disabled():
            return linear(x, w)
    assert cpu_kernels.HEAD not in jax.jit(xla_product).lower(x, packed).as_text()
    np.testing.assert_allclose(np.asarray(jax.jit(xla_product)(x, packed)), want, rtol=0, atol=1e-5 * np.abs(want).max())


def kernel_outputs(path: str) -> None:
    """The head and few-row kernels' outputs on fixed inputs (fp32 and bf16 weights, 1..11
    rows, inputs that are not whole vectors) saved to `path` (.npz)."""
    rng = np.random.default_rng(1)
    head, rows = jax.jit(cpu_kernels.vocab_head), jax.jit(cpu_kernels.rows_product)
    out = {}
    for dtype in ("float32", "bfloat16"):
        packed = cpu_kernels.pack_head(jnp.asarray(rng.normal(size=(1005, 256)).astype(np.float32)).astype(dtype))
        for n in (1, 3, 11):
            x = jnp.asarray(rng.normal(size=(n, 256)).astype(np.float32))
            out[f"head {dtype} {n}"] = np.asarray(head(x, packed))
        for shape in ((96, 256), (40, 100)):
            w = jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(dtype)
            for n in (1, 5):
                x = jnp.asarray(rng.normal(size=(n, shape[1])).astype(np.float32))
                out[f"rows {dtype} {shape} {n}"] = np.asarray(rows(x, w))
    np.savez(path, **out)


@pytest.mark.skipif(not cpu_kernels.available() or platform.machine() not in ("x86_64", "AMD64"),
                    reason=f"the CPU kernels on x86-64: {cpu_kernels.status()}")
def test_the_kernels_built_for_avx2_give_the_native_builds_bits(tmp_path):
    """The library built for an AVX2 + FMA machine (`DSJAX_CPU_MARCH=x86-64-v3`, GCC's generic
    vectors where the native build of an AVX-512 machine widens bf16 with its own instructions)
    gives the native build's outputs bit for bit: the same multiply-adds in the same order."""
    out = tmp_path / "avx2.npz"
    env = {**os.environ, cpu_kernels.ENV_MARCH: "x86-64-v3", cpu_kernels.ENV_CACHE: str(tmp_path / "kernels"),
           "JAX_PLATFORMS": "cpu"}
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_decode_forms as t; " \
           f"t.kernel_outputs({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernel_outputs(str(tmp_path / "native.npz"))
    avx2, native = np.load(out), np.load(tmp_path / "native.npz")
    assert sorted(avx2.files) == sorted(native.files)
    for name in native.files:
        np.testing.assert_array_equal(avx2[name], native[name], err_msg=name)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
@pytest.mark.parametrize("stored", ["bits", "bfloat16", "float32"])
def test_rows_kernel_reads_a_weight_of_a_stack_where_it_lies(stored):
    """`cpu_kernels.rows_product` (what `linear` runs for a 16-bit layer weight at few rows, and
    each assignment's expert at decode) against a float64 product: weights of a stack [L, E, O, I]
    read at (l, e) with the indices clamped as XLA's dynamic slices clamp them, an input axis that
    is not whole vectors, more rows than a pass holds; each row bitwise the same alone or with
    other rows."""
    rng = np.random.default_rng(5)
    stack = rng.normal(size=(2, 3, 37, 100)).astype(np.float32)
    exact = stack if stored == "float32" else np.asarray(jnp.asarray(stack).astype(jnp.bfloat16).astype(jnp.float32))
    w = {"bits": Bf16Weight.of(jnp.asarray(stack)).bits, "bfloat16": jnp.asarray(stack).astype(jnp.bfloat16),
         "float32": jnp.asarray(stack)}[stored]
    x = rng.normal(size=(19, 100)).astype(np.float32)  # 19 rows: passes of 4 and one of 3
    product = jax.jit(cpu_kernels.rows_product)
    for at, where in [((1, 2), (1, 2)), ((0, 0), (0, 0)), ((5, -3), (1, 0))]:
        at = jnp.asarray(at, jnp.int32)
        got = np.asarray(product(x, w, at))
        want = x.astype(np.float64) @ exact[where].T.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        for rows in (slice(0, 1), slice(5, 8), slice(3, 19)):
            np.testing.assert_array_equal(np.asarray(product(x[rows], w, at)), got[rows])


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
def test_a_16bit_layer_weight_taken_from_its_stack_is_read_in_place():
    """A scanned layer's 16-bit weight, and an expert of it, taken at traced indices (`take`, as the
    layer loop and the per-assignment experts take them) stay the whole stack and the indices
    (`Bf16Slice`): the few-row product's kernel reads the stack itself, where XLA would copy a
    slice out for a custom call; any other reader gets the slice (`bits`, `dense`)."""
    rng = np.random.default_rng(6)
    stack = Bf16Weight.of(jnp.asarray(rng.normal(size=(2, 3, 37, 96)).astype(np.float32)))
    x = jnp.asarray(rng.normal(size=(2, 1, 96)).astype(np.float32))

    def product(x, stack, layer, expert):
        w = take(take(stack, layer), expert)
        assert isinstance(w, Bf16Slice) and w.stack is stack.bits and w.shape == (37, 96)
        return linear(x, w), w.dense(jnp.float32)

    text = jax.jit(product).lower(x, stack, 1, 2).as_text()
    assert cpu_kernels.PRODUCT in text and "tensor<2x3x37x96xui16>" in text.split(cpu_kernels.PRODUCT)[1].split("\n")[0]
    got, dense = jax.jit(product)(x, stack, 1, 2)
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(Bf16Weight(stack.bits[1, 2]).dense(jnp.float32)))
    want = np.asarray(x, np.float64) @ np.asarray(dense, np.float64).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
def test_16bit_experts_read_each_chosen_expert_once_for_its_rows():
    """A decode step's routed experts with 16-bit weights (`expert_ffn_each`, scanned: one layer of
    a stack) take the library's expert kernel: rows grouped by expert (repeated and out-of-range
    experts here), each row's outputs bitwise the few-row kernel's on that row and expert alone,
    and the whole FFN the gathered XLA product's on the widened weights, to fp32 rounding."""
    rng = np.random.default_rng(8)
    n_layers, n_experts, d, inter, t, k = 2, 5, 96, 64, 4, 3
    w1, w3 = (Bf16Weight.of(jnp.asarray(rng.normal(size=(n_layers, n_experts, inter, d)).astype(np.float32)))
              for _ in range(2))
    w2 = Bf16Weight.of(jnp.asarray(rng.normal(size=(n_layers, n_experts, d, inter)).astype(np.float32)))
    x = jnp.asarray(rng.normal(size=(t, d)).astype(np.float32))
    idx = jnp.asarray([[3, 1, 3], [0, 3, 4], [4, 4, 2], [1, 0, 3]], jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)).astype(np.float32))

    def each(x, idx, weights, layer):
        layer_w = [take(w, layer) for w in (w1, w3, w2)]
        return expert_ffn_each(x, idx, *layer_w, 10.0, weights)

    assert cpu_kernels.EXPERTS in jax.jit(each).lower(x, idx, weights, 1).as_text()
    got = np.asarray(jax.jit(each)(x, idx, weights, 1))
    dense1 = [Bf16Weight(w.bits[1]).dense(jnp.float32) for w in (w1, w3, w2)]
    want = np.asarray(jax.jit(lambda *a: expert_ffn_gathered(*a, 10.0, weights))(x, idx, *dense1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())

    rows = jnp.asarray(rng.normal(size=(7, d)).astype(np.float32))
    experts = jnp.asarray([3, 1, 3, 0, 9, -2, 3], jnp.int32)
    grouped = np.asarray(jax.jit(cpu_kernels.expert_rows_product)(rows, w1.bits, experts, jnp.asarray([1], jnp.int32)))
    alone = jax.jit(cpu_kernels.rows_product)
    for a, e in enumerate(np.clip(np.asarray(experts), 0, n_experts - 1)):
        np.testing.assert_array_equal(grouped[a], np.asarray(alone(rows[a:a + 1], w1.bits, jnp.asarray([1, e])))[0])


def _bits_stack(rng, *shape) -> Bf16Weight:
    return Bf16Weight.of(jnp.asarray(rng.normal(size=shape).astype(np.float32)))


def _tiny_moe(cfg, weight, rng) -> MoE:
    """The tiny config's MoE params, each weight `weight(*shape)`; routed experts a stack of 2 layers."""
    e, i, d, si = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.shared_intermediate_size
    return MoE(router=weight(e, d), w1=weight(2, e, i, d), w3=weight(2, e, i, d), w2=weight(2, e, d, i),
               shared_w1=weight(si, d), shared_w3=weight(si, d), shared_w2=weight(d, si),
               router_bias=jnp.asarray(rng.normal(size=e).astype(np.float32)))


def _one_call_moe_against_xla(p: MoE, x, tokens, cfg):
    """MoE layer 1 of p as one library call (asserted in the program), against its XLA path
    (the library off) -> (the jitted call, its output)."""
    step = jax.jit(lambda p, x, t: moe_forward(p, x, t, cfg, layer=jnp.int32(1)))
    assert cpu_kernels.MOE in step.lower(p, x, tokens).as_text()
    got = np.asarray(step(p, x, tokens))
    with cpu_kernels.disabled():
        plain = jax.jit(lambda p, x, t: moe_forward(p, x, t, cfg, layer=jnp.int32(1)))
        assert cpu_kernels.MOE not in plain.lower(p, x, tokens).as_text()
        want = np.asarray(plain(p, x, tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    return step, got


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
def test_a_decode_steps_16bit_moe_is_one_library_call():
    """A decode step's MoE with 16-bit weights (routed experts one layer of a stack, the shared
    expert its own) runs its experts, the SwiGLU, the routing weights and the shared expert as
    one call (`cpu_kernels.moe_rows`): against the XLA:CPU path of the same step (the library
    off), routing included; each row bitwise the same beside other rows as beside these (the
    router's product at one row is XLA's, not the library's: two rows at least)."""
    cfg = dsjax.load_config("tiny")
    rng = np.random.default_rng(11)
    p = _tiny_moe(cfg, lambda *shape: _bits_stack(rng, *shape), rng)
    x = jnp.asarray(3 * rng.normal(size=(5, 1, cfg.hidden_size)).astype(np.float32))  # clamps some SwiGLU inputs
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (5, 1)), jnp.int32)
    step, got = _one_call_moe_against_xla(p, x, tokens, cfg)
    for rows in (slice(0, 2), slice(2, 5)):
        np.testing.assert_array_equal(np.asarray(step(p, x[rows], tokens[rows])), got[rows])


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
@pytest.mark.parametrize("stored", ["float32", "bits"])
def test_a_prompt_chunks_moe_is_one_library_call(stored):
    """A prompt chunk's MoE on XLA:CPU (more assignments than a decode step's; fp32 or 16-bit
    weights, routed experts one layer of a stack, read where they lie) runs its experts, SwiGLU,
    routing weights and shared expert as one call (`cpu_kernels.moe_rows`, an expert's rows 16
    to a work item): against the XLA path (the library off), and each row bitwise the same in
    another chunk; 16-bit rows also the same as a decode step's (the same call at few rows)."""
    cfg = dsjax.load_config("tiny")
    rng = np.random.default_rng(12)

    def weight(*shape):
        return _bits_stack(rng, *shape) if stored == "bits" else jnp.asarray(rng.normal(size=shape).astype(np.float32))

    p = _tiny_moe(cfg, weight, rng)
    x = jnp.asarray(3 * rng.normal(size=(1, 100, cfg.hidden_size)).astype(np.float32))  # 200 assignments: ~25 an expert
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 100)), jnp.int32)
    step, got = _one_call_moe_against_xla(p, x, tokens, cfg)
    np.testing.assert_array_equal(np.asarray(step(p, x[:, 30:60], tokens[:, 30:60])), got[:, 30:60])
    if stored == "bits":
        np.testing.assert_array_equal(np.asarray(step(p, x[:, 7:10], tokens[:, 7:10])), got[:, 7:10])


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
def test_a_sublayers_mhc_input_is_one_library_call():
    """A decode step's mHC before a sublayer (mixes, Sinkhorn, collapse, RMSNorm) as one call
    (`cpu_kernels.hc_input`), its weights one layer of a stack read in place, with its own pre or
    given collapse weights (V4.1's lag): against the ops (`hc_mixes`, `collapse`, `rms_norm`) on
    the sliced layer; each row bitwise the same alone as beside others."""
    cfg = dsjax.load_config("tiny")
    rng = np.random.default_rng(12)
    n, d = cfg.hc_mult, cfg.hidden_size
    width = (2 + n) * n
    p = HyperConnection(fn=jnp.asarray(0.1 * rng.normal(size=(3, width, n * d)).astype(np.float32)),
                        base=jnp.asarray(rng.normal(size=(3, width)).astype(np.float32)),
                        scale=jnp.asarray(rng.uniform(0.5, 2, (3, 3)).astype(np.float32)))
    norm = jnp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
    streams = jnp.asarray(rng.normal(size=(6, 1, n, d)).astype(np.float32))
    lag = jnp.asarray(rng.uniform(0.1, 1, (6, 1, n)).astype(np.float32))
    run = jax.jit(lambda p, s, w: sublayer_input(p, norm, s, cfg, w, jnp.int32(2)))
    assert one_call(streams) and cpu_kernels.HC_INPUT in run.lower(p, streams, lag).as_text()
    for weights in (None, lag):
        got = run(p, streams, weights)
        with cpu_kernels.disabled():
            assert not one_call(streams)
            want = jax.jit(lambda p, s, w: sublayer_input(p, norm, s, cfg, w, jnp.int32(2)))(p, streams, weights)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(jnp.abs(w).max()))
        for rows in (slice(0, 1), slice(1, 4)):
            part = run(p, streams[rows], None if weights is None else weights[rows])
            for g, w in zip(part, got):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[rows])


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU kernels: {cpu_kernels.status()}")
def test_a_16bit_grouped_output_projection_reads_each_block_in_place():
    """V4 attention's W_oa (block-diagonal over the output groups) with a 16-bit weight of a stack at
    a decode step's rows: each group against its block, read in place, as a float64 product."""
    rng = np.random.default_rng(13)
    g, o, i = 4, 24, 40
    w = _bits_stack(rng, 3, g * o, i)
    x = jnp.asarray(rng.normal(size=(3, 1, g, i)).astype(np.float32))
    got = np.asarray(jax.jit(lambda x, at: stored_grouped_product(x, take(w, at), g))(x, 2))
    blocks = np.asarray(Bf16Weight(w.bits[2]).dense(jnp.float32), np.float64).reshape(g, o, i)
    want = np.einsum("bsgi,goi->bsgo", np.asarray(x, np.float64), blocks)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert stored_grouped_product(jnp.zeros((17, 1, g, i)), w.bits[0], g) is None  # beyond a decode step's rows


def _rounded(model):
    """The float32 model whose stored-narrow weights are rounded to bf16 (and back)."""
    def r(path, leaf):
        name = str(getattr(path[-1], "name", getattr(path[-1], "key", "")))
        return leaf.astype(jnp.bfloat16).astype(jnp.float32) if name in STORED_NARROW else leaf
    return jax.tree_util.tree_map_with_path(r, model.params)


def test_stored_bf16_weights_are_the_float32_model_on_rounded_weights():
    model = dsjax.load_model("tiny", dtype="float32", seed=3)
    stored = dsjax.store_weights(model)
    cfg = model.config
    assert isinstance(stored.params.blocks[0][0].attn.q_b_proj, Bf16Weight)
    assert stored.params.lm_head.dtype == jnp.bfloat16 and stored.params.embed.dtype == jnp.float32
    assert one_row_head(stored.params, jnp.float32) is stored.params  # a bf16 head is read as stored
    narrow = sum(leaf.nbytes for leaf in jax.tree.leaves(stored.params))
    assert narrow < 0.75 * sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    rounded = _rounded(model)
    ids = jnp.asarray([3, 40, 41, cfg.vocab_size - 1])  # the drafter's reduced vocabulary gathers head rows
    np.testing.assert_array_equal(np.asarray(draft_vocab(stored.params, ids).head.astype(jnp.float32)),
                                  np.asarray(rounded.lm_head)[np.asarray(ids)])
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (3, 24)), jnp.int32)

    @jax.jit(static_argnums=1)
    def run(params, cast):
        opts = model.options.replace(compute_dtype="float32" if cast else None)
        cache = init_cache(cfg, 3, 128, jnp.float32)
        prefill, cache = forward(params, tokens[:, :20], cfg, cache, opts=opts, ctx_bucket=128)
        one, _ = forward(params, tokens[:1, 20:21], cfg, take_rows(cache, 0), opts=opts,
                         ctx_bucket=128)  # one row: the matrix-vector form
        few, _ = forward(params, tokens[:, 20:21], cfg, cache, opts=opts, ctx_bucket=128)  # three: multiply-reduce
        return prefill, one, few

    for got, want in zip(run(stored.params, True), run(rounded, False)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5 * float(jnp.abs(want).max()))


def test_store_weights_refuses_what_it_cannot_do():
    model = dsjax.load_model("tiny", dtype="bfloat16", seed=0)
    with pytest.raises(ValueError, match="bfloat16 weights under a float32 model"):
        dsjax.store_weights(model)


@pytest.mark.parametrize("rows", [1, 3])
def test_merged_vector_is_the_reshape_and_its_own_buffer_at_one_row(rows):
    """merge_last_two: the values of the reshape; at one row on XLA:CPU built by concatenation
    (a buffer of its own for the matrix-vector loop), otherwise the reshape itself."""
    x = jnp.asarray(np.random.default_rng(rows).normal(size=(rows, 1, 4, 24)).astype(np.float32))
    got = jax.jit(merge_last_two)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x).reshape(rows, 1, 96))
    prims = {e.primitive.name for e in jax.make_jaxpr(merge_last_two)(x).eqns}
    assert ("concatenate" in prims) == (rows == 1)


def test_a_multi_step_decode_reads_a_stored_head_as_stored():
    """decode_steps=4 runs the steps in a device-side loop, where XLA hoists a loop-invariant
    widening of the bf16 head (`store_weights`) out of the loop, into a new fp32 buffer of the
    whole head each dispatch (4-5x slower; `dsjax.model.head.rows_logits` keeps it in
    place). Its compiled program holds no such buffer, and it samples the tokens one step a
    dispatch does, also in a dispatch's last step after every row has finished (5 and 7
    tokens: the head's other branch). Two slots: the head's multiply-reduce (one slot's
    matrix-vector loop was hoisted alike, and is kept in place alike)."""
    slots = 2
    model = dsjax.store_weights(dsjax.load_model("tiny", dtype="float32", seed=5))
    vocab, hidden = model.params.lm_head.shape
    rng = np.random.default_rng(slots)
    prompts = [rng.integers(3, vocab, 9 + 4 * i).tolist() for i in range(slots)]
    params = [SamplingParams(max_tokens=5 + 2 * i, temperature=0.8, seed=i, ignore_eos=True) for i in range(slots)]
    tokens = {}
    for steps in (1, 4):
        engine = Engine(model, max_slots=slots, capacity=64, prefill_chunk=16, decode_steps=steps)
        tokens[steps] = engine.generate(prompts, params)
        if steps == 4:
            compiled = decode_step.lower(engine.step_params, engine.cache, engine.slots, jnp.zeros(slots, bool),
                                         cfg=engine.cfg, opts=engine.opts, ctx_bucket=engine.scheduler.bucket(1),
                                         n_logprobs=0, n_steps=steps).compile()
            widened = widened_outside(compiled, (vocab, hidden))
            assert not widened, widened
    assert tokens[4] == tokens[1] and [len(t) for t in tokens[1]] == [p.max_tokens for p in params]


@pytest.mark.parametrize("name", ["tiny", "tiny-v41"])
def test_decode_program_ops_carry_the_profile_groups(name):
    """benchmarks/decode_trace.py splits a traced decode step by the named scopes the model
    puts its ops in (the outermost known one): every group must reach the decode program, each
    attention kind under its own name, a V4 scanned run's weight slices as layer_weights and
    V4.1's Engram as engram (lowered only: the scopes are op metadata)."""
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from decode_trace import GROUPS, group_of

    cfg = dsjax.load_config(name)
    if name == "tiny":  # a scanned run, whose weights are sliced
        cfg = cfg.replace(num_hidden_layers=6, layer_types=cfg.layer_types + cfg.layer_types[2:],
                          mlp_layer_types=cfg.mlp_layer_types + cfg.mlp_layer_types[2:])
    assert any(run.repeats > 1 for run in cfg.layer_runs)
    model = dsjax.load_model(name, dtype="float32") if cfg.v41 else dsjax.Model(
        cfg, dsjax.params.init_params(dsjax.model.model_specs(cfg, jnp.float32), 0), jnp.float32, None)
    engine = Engine(model, max_slots=2, capacity=256, prefill_chunk=32)
    lowered = decode_step.lower(engine.step_params, engine.cache, engine.slots, jnp.zeros(engine.rows, bool),
                                cfg=cfg, opts=engine.opts, ctx_bucket=256, n_logprobs=0)
    found = {group_of(loc) for loc in re.findall(r'loc\("([^"]*)"', lowered.as_text(debug_info=True))}
    expected = {g for g in GROUPS if g != ("layer_weights" if cfg.v41 else "engram")}
    expected -= {kind for kind in ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
                 if kind not in cfg.layer_types}
    assert found >= expected, expected - found
    assert group_of("jit(decode_step)/head/mhc/dot_general") == "head"  # the outermost scope names the group


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"the CPU head kernel: {cpu_kernels.status()}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_screen_is_the_first_maximum_of_the_fp32_logits(dtype):
    """`cpu_kernels.greedy_tokens` (an engine's greedy decode with an fp32 head): each decided
    row's token is the first maximum of the fp32 kernel's logits (`vocab_head`), found from
    the bf16 screen and the fp32 tiles of a few candidates: rows at many scales, an exact tie
    (two equal head rows: the first wins), a near tie (rows 2^-12 apart, equal in bf16), a vocabulary
    that is not whole tiles, 1 / 8 / 19 rows. The screen's logits are each within the bound
    the screen relies on (csrc/cpu_kernels.cc: 2^-7 of ||x|| ||w_j|| plus the fp32 sums'
    error) of the fp32 logit. Rows it cannot bound (zero, NaN, inf) come back -1, for the
    caller's full product; a head with a tiny non-zero row gets no screen. A bf16 head (16-bit
    weights) is its own screen where the screen multiplies bf16 pairs (AVX512-BF16): the same
    against its kernel logits (x in fp32)."""
    rng = np.random.default_rng(21)
    vocab, d = 3013, 64
    w = rng.normal(size=(vocab, d)).astype(np.float32)
    w[2500] = w[40]  # an exact tie for rows near w[40]
    w[1700] = np.asarray(jnp.asarray(w[1700]).astype(jnp.bfloat16).astype(jnp.float32))
    w[1701] = w[1700] * np.float32(1 + 2**-12)  # the same bf16 row: only the fp32 tiles tell them apart
    if dtype == "bfloat16":  # then an exact tie, and x rounded to bf16 is the screen's only rounding
        w = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))
    head = cpu_kernels.pack_head(jnp.asarray(w).astype(dtype), screen=True)
    if dtype == "bfloat16":
        if cpu_kernels.screen_rows() == cpu_kernels.SCREEN_ROWS:
            assert head.screen is None  # a bf16 screen of a bf16 head would save nothing
            return
        assert head.screen is head.tiles
    assert head.screen is not None and cpu_kernels.pack_head(w).screen is None
    tiny = w.copy()
    tiny[7] = 2.0**-40
    assert cpu_kernels.pack_head(tiny, screen=True).screen is None
    norms = np.linalg.norm(w.astype(np.float64), axis=1)
    gamma = 2 * d * 2.0**-24 / (1 - 2 * d * 2.0**-24)
    c = 2.0**-7 + 2.0**-16 + (2 + 2.0**-6) * gamma + 2.0**-20  # x and w rounded to bf16, fp32 sums, subnormals
    screened = jax.jit(lambda x: (cpu_kernels.greedy_tokens(x, head), cpu_kernels.vocab_head(x, head)))
    from dsjax.engine.sampler import argmax_first
    for rows in (1, 8, 19):
        x = rng.normal(size=(rows, d)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4, (rows, 1))
        x[rows // 2] = w[40] * np.float32(3)
        if rows > 1:
            x[-1] = w[1700] + rng.normal(size=d).astype(np.float32) * np.float32(1e-3)
        tokens, approx, exact = (np.asarray(a) for a in jax.tree.leaves(screened(jnp.asarray(x))))
        bound = c * np.linalg.norm(x.astype(np.float64), axis=1)[:, None] * norms[None]
        assert (np.abs(approx.astype(np.float64) - exact) <= bound).all()
        assert (tokens >= 0).all()  # nothing here needs the full product
        np.testing.assert_array_equal(tokens, np.asarray(argmax_first(jnp.asarray(exact))))
        assert tokens[rows // 2] == 40
        if rows > 1 and dtype == "float32":  # the screen's logits tie, the first of them is not the maximum
            assert approx[-1, 1700] == approx[-1, 1701] and exact[-1, 1701] > exact[-1, 1700]
            assert tokens[-1] == 1701
    x = rng.normal(size=(4, d)).astype(np.float32)
    x[0], x[1, 5], x[2, 7] = 0, np.nan, np.inf
    tokens, _ = jax.jit(cpu_kernels.greedy_tokens)(jnp.asarray(x), head)
    np.testing.assert_array_equal(np.asarray(tokens)[:3], [-1, -1, -1])
    assert np.asarray(tokens)[3] == np.asarray(argmax_first(cpu_kernels.vocab_head(jnp.asarray(x[3:]), head)))[0]
