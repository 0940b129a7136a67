"""DeepSeek-V4.1 with the checkpoint's own bytes on device (`quantized="resident"`): the FP8
(E4M3 + UE8M0 on 32 x 32 tiles) projections and MXFP4 routed experts of the backbone, Engram's
wkv and the DSpark head stay as stored and are dequantized inside the jitted products. E4M3 x 2^k
and E2M1 x 2^k are exact in fp32, so the logits equal the dequantize-at-load model's up to the
order of fp32 operations; wo_a stays dequantized as the reference keeps it. Bad stored formats
are refused before a weight is read, naming the tensor / field / bytes."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
import v41_checkpoint
from dsjax.checkpoint import CheckpointError
from quantized_checkpoint import edit_tensors
from dsjax.config import load_config
from dsjax.layers.quantized import Fp4Weight, Fp8Weight
from dsjax.layers.moe import moe_forward
from dsjax.model.v41.dspark import dspark_draft, empty_ring

IDS = np.array([[11, 402, 7, 7, 93, 5000, 3, 61, 12], [3, 129279, 44, 12, 8, 61, 7, 7, 1]], np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = load_config("tiny-v41")
    rng = np.random.default_rng(3)
    params, dspark = v41_checkpoint.random_weights(cfg, rng)
    directory = tmp_path_factory.mktemp("v41-resident")
    v41_checkpoint.write(directory, cfg, params, dspark, rng)
    return directory


@pytest.fixture(scope="module")
def models(checkpoint):
    return (dsjax.load_model(checkpoint, dtype="float32"),
            dsjax.load_model(checkpoint, dtype="float32", quantized="resident"))


def test_stored_bytes_on_device(models):
    _, resident = models
    block = resident.params.blocks[2][0]  # an index source's run
    assert isinstance(block.attn.q_b_proj, Fp8Weight) and block.attn.q_b_proj.q.dtype == jnp.float8_e4m3fn
    assert block.attn.q_b_proj.block == (32, 32) and block.attn.q_b_proj.scale_exp.dtype == jnp.uint8
    assert isinstance(block.attn.index_queries.q_b_proj, Fp8Weight)
    assert isinstance(block.moe.shared_w2, Fp8Weight) and isinstance(block.moe.w1, Fp4Weight)
    assert isinstance(block.attn.o_a_proj, jax.Array) and block.attn.o_a_proj.dtype == jnp.float32  # as the reference
    assert all(isinstance(e.wkv, Fp8Weight) for e in resident.params.engram)
    assert isinstance(resident.mtp.main_proj, Fp8Weight) and isinstance(resident.mtp.stages.moe.w2, Fp4Weight)
    assert resident.options.quantized == "resident"
    e = resident.config.v41.engram  # the tables stay on the host as stored: a row is hd E4M3 + hd / 32 E8M0 bytes
    for table in resident.params.engram_tables.tables:
        q, scale = table.gather(np.array([[0, 7]]))
        assert table.row_bytes == e.head_dim + e.head_dim // 32 and q.dtype == jnp.float8_e4m3fn
        assert scale.dtype == np.uint8 and scale.shape == (1, 2, e.head_dim // 32)


def test_resident_logits_equal_dequantized(models):
    """With the reference's round trips (the Lin8 / Lin4 activation QDQ before each product)."""
    dense, resident = models
    assert dense.options.round_trips and resident.options.round_trips
    want = dense.logits(IDS)
    np.testing.assert_allclose(resident.logits(IDS), want, atol=2e-6 * np.abs(want).max(), rtol=0)


def test_resident_dspark_draft_equals_dequantized(models):
    """The DSpark head's FP8 / MXFP4 weights resident: the same drafts and logits."""
    cfg = models[0].config
    targets = len(cfg.v41.dspark.target_layer_ids)
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.standard_normal((2, targets * cfg.hidden_size)), jnp.float32)
    t, anchor = jnp.array([4, 6], jnp.int32), jnp.array([11, 402], jnp.int32)
    draft = jax.jit(lambda ds, main: dspark_draft(ds, main, anchor, hidden, t, empty_ring(cfg, 2, jnp.float32), cfg,
                                                  opts=models[0].options))
    (_, d_drafts, d_logits, d_conf), (_, r_drafts, r_logits, r_conf) = (draft(m.mtp, m.params) for m in models)
    np.testing.assert_array_equal(r_drafts, d_drafts)
    np.testing.assert_allclose(r_logits, d_logits, atol=2e-6 * np.abs(d_logits).max(), rtol=0)
    np.testing.assert_allclose(r_conf, d_conf, atol=1e-5, rtol=0)


def test_resident_decode_moe_equals_dequantized(models):
    """A decode step's MoE (one and three tokens: the assignments' MXFP4 experts gathered and
    widened, `expert_ffn_gathered`; the FP8 shared expert through Lin8) equals the dequantized block's."""
    cfg = models[0].config
    d_block, r_block = (jax.tree.map(lambda a: a[0], m.params.blocks[0][0].moe) for m in models)
    assert isinstance(r_block.w2, Fp4Weight) and isinstance(r_block.shared_w1, Fp8Weight)
    rng = np.random.default_rng(2)
    for tokens in (1, 3):
        x = jnp.asarray(rng.standard_normal((1, tokens, cfg.hidden_size)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, tokens)), jnp.int32)
        step = jax.jit(lambda p: moe_forward(p, x, ids, cfg, fp8_acts=True))
        want = step(d_block)
        np.testing.assert_allclose(step(r_block), want, atol=2e-6 * np.abs(want).max(), rtol=0)


def test_resident_on_a_mesh(checkpoint, models):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    want = models[0].logits(IDS)
    got = dsjax.load_model(checkpoint, dtype="float32", quantized="resident", mesh="data=2,expert=4").logits(IDS)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


# ----------------------------------------------------------------------------- refusals
@pytest.fixture
def copy(checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_scale_is_refused(copy):
    name = "mtp.0.main_proj.scale"
    edit_tensors(copy, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"'mtp\.0\.main_proj\.weight' in model-\S+: F8_E4M3 weight without its "
                                              r"scale tensor 'mtp\.0\.main_proj\.scale'"):
        dsjax.load_model(copy, dtype="float32", quantized="resident")


def test_misshaped_scale_is_refused(copy):
    name = "layers.12.attn.indexer.wq_b.scale"  # [64, 32] on 32 x 32 tiles: [2, 1]

    def edit(t):
        t[name] = np.concatenate([t[name]] * 2, axis=1)

    fname = edit_tensors(copy, name, edit)
    for mode in ("dequantize", "resident"):
        with pytest.raises(CheckpointError, match=rf"'{name}' in {fname}: shape \[2, 2\], expected \[2, 1\]"):
            dsjax.load_model(copy, dtype="float32", quantized=mode)


def test_misshaped_mxfp4_expert_is_refused(copy):
    name = "layers.0.ffn.experts.5.w2.scale"  # [64, 32 / 32]

    def edit(t):
        t[name] = t[name][:-1]

    fname = edit_tensors(copy, name, edit)
    with pytest.raises(CheckpointError, match=rf"'{name}' in {fname}: shape \[63, 1\], expected \[64, 1\]"):
        dsjax.load_model(copy, dtype="float32", quantized="resident")


def test_another_block_size_is_refused(copy):
    """A V4.1 checkpoint declaring 128 x 128 tiles: its 32 x 32 scales no longer fit (either mode),
    and resident mode refuses the block size itself (the device keeps the stored tiles)."""
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_block_size \[128, 128\], but this model stores FP8 on "
                                              r"\[32, 32\]"):
        dsjax.load_model(copy, dtype="float32", quantized="resident")
    with pytest.raises(CheckpointError, match=r"scale' in .*: shape \[\d+, \d+\], expected"):
        dsjax.load_model(copy, dtype="float32")


def test_engram_table_without_scale_is_refused(copy):
    name = "layers.1.engram.embed.scale"
    edit_tensors(copy, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"no Engram table 'layers\.1\.engram\.embed\.weight / \.scale'"):
        dsjax.load_model(copy, dtype="float32", quantized="resident")


def test_too_big_for_the_device_is_refused(checkpoint):
    """Refused with the bytes needed (backbone + DSpark head, as stored) and those available."""
    with pytest.raises(MemoryError, match=r"the weights need \d+\.\d+ MiB \(\d+ B\) on one device, but a device "
                                          r"holds 0\.50 MiB \(524288 B\)"):
        dsjax.load_model(checkpoint, dtype="float32", quantized="resident", device_memory_bytes=1 << 19)
