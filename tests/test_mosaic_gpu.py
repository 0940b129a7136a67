"""The Mosaic GPU (Hopper) kernels, checked without a GPU in two ways:

* GPU interpret mode (Pallas simulates shared memory, barriers, TMA copies and wgmma on the
  CPU): each kernel against its pure-jnp reference over the shape sweep of test_kernels.py;
* lowering for CUDA at V4-Flash / V4-Pro shapes: Mosaic GPU's own checks of wgmma shapes,
  operand layouts / swizzles and the 227 KiB shared-memory budget of sm90 run at lowering
  time (only ptxas needs the GPU).

Tolerances: the kernels take bf16 operands (fp32 accumulation), so the references get the
same bf16-rounded inputs; what remains is the rounding of the kernel's own bf16
intermediates (P, or h between the two MoE matmuls) and of its bf16 output: <= 2 bf16 ulps
of the output's scale.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import CASES, GROUPS, INDEX_CASES, _attention_case, index_case, rising_max_case

from dsjax.kernels import grouped_matmul, index_scores, sink_attention
from dsjax.kernels.mgpu import lower_for_cuda

BF16_ULP = 2.0 ** -8


def _bf16(x):
    return None if x is None or x.dtype != jnp.float32 else x.astype(jnp.bfloat16).astype(jnp.float32)


def _rounded(args):
    return tuple(_bf16(a) if a is not None and a.dtype == jnp.float32 else a for a in args)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_kernel_interpreted(case):
    rng = np.random.default_rng(100 + case)
    args = _attention_case(rng, *CASES[case], jnp.float32)
    got = np.asarray(sink_attention.mgpu_sink_attention(*args, interpret=True))
    want = np.asarray(sink_attention.reference(*_rounded(args)))
    chex.assert_shape(got, want.shape)
    assert np.abs(got - want).max() <= 2 * BF16_ULP * np.abs(want).max()


def test_attention_kernel_interpreted_two_output_halves():
    """D = 512 (V4's head dim): the output is split over two programs, Q over two chunks."""
    rng = np.random.default_rng(7)
    args = _attention_case(rng, 1, 1, 64, 512, 8, 5, 4, [30], 4, jnp.float32)
    got = np.asarray(sink_attention.mgpu_sink_attention(*args, interpret=True))
    want = np.asarray(sink_attention.reference(*_rounded(args)))
    assert np.abs(got - want).max() <= 2 * BF16_ULP * np.abs(want).max()


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_kernel_interpreted_decode_splits(splits):
    """Decode: the row's top-k keys join the shared keys and the keys are split over 3
    programs (flash-decoding), merged by log-sum-exp with the sink. Row 0 sits at position 37,
    so its later splits see no key at all."""
    rng = np.random.default_rng(11)
    args = _attention_case(rng, 2, 1, 4, 64, 16, 300, 4, [37, 1200], 20, jnp.float32)
    got = np.asarray(sink_attention.mgpu_sink_attention(*args, splits=splits, interpret=True))
    want = np.asarray(sink_attention.reference(*_rounded(args)))
    assert np.abs(got - want).max() <= 2 * BF16_ULP * np.abs(want).max()


def test_attention_kernel_interpreted_rounds_p_against_the_running_max():
    """V4.1 (§2.9): the kernel's 64-key tiles are the vendor's blocks and it stages P in bf16
    against its running max, so over > 64 keys whose max rises in a later tile its bf16 output
    is the reference's (round_p: the same running-max form) rounded to bf16, bit for bit (the
    overall-max form: ~10% of outputs one ulp off)."""
    args = rising_max_case()
    got = np.asarray(sink_attention.mgpu_sink_attention(*args, interpret=True, round_p=True)).astype(np.float32)
    want = np.asarray(sink_attention.reference(*args, round_p=True))
    assert np.abs(got - want).max() <= BF16_ULP * np.abs(want).max()
    assert (got == want.astype(jnp.bfloat16).astype(np.float32)).mean() >= 0.99


def test_decode_splits_fill_the_gpu():
    assert sink_attention.num_splits(programs=2, key_blocks=1026, sms=132) == 66  # batch 1, V4 D=512
    assert sink_attention.num_splits(programs=64, key_blocks=66, sms=132) == 2
    assert sink_attention.num_splits(programs=256, key_blocks=4000, sms=132) == 1  # grid already full
    assert sink_attention.num_splits(programs=2, key_blocks=3, sms=132) == 1  # too few keys to split


@pytest.mark.parametrize("groups", list(GROUPS))
def test_grouped_ffn_kernel_interpreted(groups):
    rng = np.random.default_rng(len(groups))
    sizes = jnp.asarray(GROUPS[groups], jnp.int32)
    m, e, i, d = int(sizes.sum()) + 3, 8, 72, 48  # padding rows; I and D off the block sizes
    # limit 3: the clamps of gate and up both engage (15% of |gate|, |up| are above 3 here)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.normal(size=(e, i, d)) * 0.3, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(e, d, i)) * 0.3, jnp.float32)
    got = np.asarray(grouped_matmul.mgpu_grouped_ffn(x, sizes, w1, w3, w2, limit=3.0, block_n=64, interpret=True))
    want = np.asarray(grouped_matmul.reference(_bf16(x), sizes, *map(_bf16, (w1, w3, w2)), limit=3.0))
    chex.assert_shape(got, (m, d))
    assert np.abs(got - want).max() <= 2 * BF16_ULP * np.abs(want).max()
    assert not got[-3:].any()  # rows past the groups are not computed


def test_grouped_ffn_kernel_interpreted_v41_lin4():
    """DeepSeek-V4.1's Lin4 (`down`: the routing weight, then W2's FP8 round trip) rounds where
    `hidden` does: gate and up to bf16, h kept fp32 until `down`. Rows whose FP8 codes all
    agree with the reference differ by the products' summation order only; a bf16 h rounded
    before `down` would move ~1 in 30 codes, i.e. nearly every row."""
    from dsjax.layers.moe import lin4_down_input

    rng = np.random.default_rng(3)
    sizes = jnp.asarray(GROUPS["ragged"], jnp.int32)
    m, e, i, d = int(sizes.sum()), 8, 128, 64
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.bfloat16)
    w1, w3 = (jnp.asarray(rng.normal(size=(e, i, d)) * 0.3, jnp.bfloat16) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(e, d, i)) * 0.3, jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.1, 1.5, size=m), jnp.float32)
    lin4 = dict(limit=3.0, scale=scale, down=lin4_down_input)
    got = np.asarray(grouped_matmul.mgpu_grouped_ffn(x, sizes, w1, w3, w2, block_n=64, interpret=True, **lin4))
    want = np.asarray(grouped_matmul.reference(x, sizes, w1, w3, w2, **lin4))
    row_err = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert np.mean(row_err <= 1e-5) >= 0.9, np.sort(row_err)[::-1][:8]

@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_scores_kernel_interpreted(case):
    """bf16 operands that are exact in bf16: products are exact in fp32, only the summation
    order differs from the reference."""
    q, keys, w = index_case(np.random.default_rng(sum(case)), *case, dtype=jnp.bfloat16)
    scale = case[3] ** -0.5
    want = np.asarray(index_scores.reference(q, keys, w, scale=scale))
    got = np.asarray(index_scores.mgpu_index_scores(q, keys, w, scale=scale, interpret=True))
    chex.assert_trees_all_close(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


S = jax.ShapeDtypeStruct


def _attention_avals(b, s, h, t, d, k):
    avals = [S((b, s, h, d), jnp.bfloat16), S((b, t, d), jnp.bfloat16), S((b, t), jnp.int32),
             S((b, t), jnp.int32), S((b, s), jnp.int32), S((h,), jnp.float32)]
    return avals + ([S((b, s, k, d), jnp.bfloat16), S((b, s, k), jnp.bool_)] if k else [])


@pytest.mark.parametrize("shape", [
    (32, 1, 64, 4096 + 128, 512, 0),  # V4-Flash decode, HCA layer: ring + 4096 entries
    (1, 1, 64, 8192 + 128, 512, 0),  # batch-1 decode at 1M tokens (HCA): keys split over 66 programs
    (32, 1, 64, 129, 512, 512),  # V4-Flash decode, CSA layer: ring + top-512 entries
    (2, 256, 64, 384, 512, 512),  # V4-Flash prefill chunk, CSA
    (4, 1, 128, 300, 512, 1024),  # V4-Pro: 128 heads (two head blocks), top-1024
])
def test_attention_kernel_lowers_for_hopper(shape):
    assert "mosaic_gpu" in lower_for_cuda(sink_attention.mgpu_sink_attention, *_attention_avals(*shape))


def test_attention_kernel_shared_memory_budget_is_checked():
    """128-key tiles at D = 512 would need ~340 KiB of shared memory: refused at lowering."""
    with pytest.raises(Exception, match="exceeds available shared memory"):
        lower_for_cuda(functools.partial(sink_attention.mgpu_sink_attention, block_k=128),
                       *_attention_avals(32, 1, 64, 4096, 512, 0))


@pytest.mark.parametrize("b,s,t", [(32, 1, 65536), (2, 256, 2048)])
def test_index_scores_kernel_lowers_for_hopper(b, s, t):
    """V4-Flash's indexer (64 heads x 128): decode at 256k tokens of context, a prefill chunk."""
    avals = [S((b, s, 64, 128), jnp.bfloat16), S((b, t, 128), jnp.bfloat16), S((b, s, 64), jnp.float32)]
    assert "mosaic_gpu" in lower_for_cuda(lambda *a: index_scores.mgpu_index_scores(*a, scale=128 ** -0.5), *avals)


@pytest.mark.parametrize("m,e,i,d", [(8192, 256, 2048, 4096), (96, 256, 2048, 4096), (4096, 384, 3072, 7168)])
def test_grouped_ffn_kernel_lowers_for_hopper(m, e, i, d):
    """V4-Flash prefill / decode-sized batches, V4-Pro's expert shapes."""
    avals = [S((m, d), jnp.bfloat16), S((e,), jnp.int32), S((e, i, d), jnp.bfloat16), S((e, i, d), jnp.bfloat16),
             S((e, d, i), jnp.bfloat16)]
    text = lower_for_cuda(lambda *a: grouped_matmul.mgpu_grouped_ffn(*a, limit=10.0), *avals)
    assert text.count("mosaic_gpu") >= 2  # both kernels


def test_model_logits_with_mosaic_gpu_kernels(rng):
    """The whole tiny model (window, CSA with the top-k gather at 72 tokens, HCA; hash and
    top-k MoE) through the Mosaic GPU kernels in GPU interpret mode. The kernels' bf16
    operands put an fp32 model's logits no further from the fp32 reference than the bf16
    model is (the oracle for "bf16 noise" here), and not exactly on it (they ran)."""
    import dsjax

    ids = rng.integers(0, 5000, (1, 72))
    want = np.asarray(dsjax.load_model("tiny", dtype="float32").logits(ids))
    bf16_err = np.abs(np.asarray(dsjax.load_model("tiny", dtype="bfloat16").logits(ids), np.float32) - want)
    model = dsjax.load_model("tiny", dtype="float32", kernels="mosaic_gpu")
    assert model.options.kernels == "mosaic_gpu"
    err = np.abs(np.asarray(model.logits(ids)) - want)
    assert 0 < err.mean() <= bf16_err.mean() and err.max() <= bf16_err.max()


def test_gpu_check_script_dry_run(tmp_path):
    """benchmarks/gpu_check.py is what a GPU session runs first, on scarce device minutes:
    its --smoke mode (small shapes, kernels interpreted) must produce a passing row for every
    Mosaic GPU kernel case here (the generic kernels' rows are opt-in, --with-generic)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": root}  # this checkout's dsjax, not an installed one
    subprocess.run([sys.executable, "gpu_check.py", "--smoke", "--out", str(out)], cwd=os.path.join(root, "benchmarks"),
                   check=True, capture_output=True, timeout=600, env=env)
    rows = json.loads(out.read_text())["kernels"]
    assert len(rows) == 14 and all(row["ok"] and "/mosaic_gpu/" in k for k, row in rows.items()), rows


def _events(jaxpr, out):
    """The kernel's primitives in program order (sub-jaxprs inlined where they sit; a loop
    body is entered once), with a marker at the end of each loop body and of each run_state
    (which returns its refs' final values: a wgmma accumulator is read there)."""
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    _events(sub, out)
                    if eqn.primitive.name in ("while", "scan"):
                        out.append("end of loop body")
                    elif eqn.primitive.name == "run_state":
                        out.append("end of run_state")
    return out


def _unwaited_wgmma(fn, *avals) -> list[str]:
    """wgmma is asynchronous: its operands in shared memory must not be refilled before it has
    finished. Interpret mode runs it synchronously, so only this check (or a GPU) sees a
    missing wait. Returns the primitive that came first after an un-waited wgmma, per breach:
    a TMA copy into shared memory, or a loop body's end (whose next step copies)."""
    events = _events(jax.make_jaxpr(fn)(*avals).jaxpr, [])
    breaches, pending = [], False
    for name in events:
        if name == "wgmma_ref":
            pending = True
        elif name in ("wgmma_wait", "wgmma_accumulator_deref_p", "end of run_state"):
            pending = False
        elif pending and name in ("copy_gmem_to_smem", "end of loop body"):
            breaches.append(name)
            pending = False
    assert "wgmma_ref" in events  # the kernels were traced for the GPU, not interpret mode
    return breaches


@pytest.mark.parametrize("kernel", ["attention", "attention_topk", "index_scores", "grouped_ffn"])
def test_mosaic_gpu_kernels_wait_for_wgmma_before_refilling_its_operands(kernel):
    """The first GPU run found the grouped FFN's pipelined steps issuing wgmma and returning,
    so emit_pipeline refilled the operands under it (wrong rows on the H200, right ones in
    interpret mode). Every Mosaic GPU kernel must wait (wgmma_wait, or reading the
    accumulator) before the next copy into shared memory."""
    fn, avals = {
        "attention": (sink_attention.mgpu_sink_attention, _attention_avals(2, 1, 64, 300, 128, 0)),
        "attention_topk": (sink_attention.mgpu_sink_attention, _attention_avals(2, 4, 64, 200, 128, 64)),
        "index_scores": (lambda *a: index_scores.mgpu_index_scores(*a, scale=0.1),
                         [S((2, 1, 64, 128), jnp.bfloat16), S((2, 300, 128), jnp.bfloat16),
                          S((2, 1, 64), jnp.float32)]),
        "grouped_ffn": (lambda *a: grouped_matmul.mgpu_grouped_ffn(*a, limit=10.0),
                        [S((128, 256), jnp.bfloat16), S((2,), jnp.int32), S((2, 256, 256), jnp.bfloat16),
                         S((2, 256, 256), jnp.bfloat16), S((2, 256, 256), jnp.bfloat16)]),
    }[kernel]
    assert _unwaited_wgmma(fn, *avals) == []
