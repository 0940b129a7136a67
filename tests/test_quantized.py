"""FP8 / MXFP4 checkpoints in DeepSeek's original naming, sharded with an index: dsjax
logits equal HF run on the dequantized weights; FP8-resident mode; corruption cases."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch

import dsjax
import hf_oracle
import quantized_checkpoint
from dsjax.checkpoint import CheckpointError, SafetensorsFile
from quantized_checkpoint import edit_tensors
from dsjax.layers.quantized import Fp4Weight, Fp8Weight
from dsjax.model import layer_block


def layer_blocks(model):
    return [layer_block(model.params, model.config, i) for i in range(model.config.num_hidden_layers)]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(directory, HF model carrying the dequantized weights)."""
    hf_model = hf_oracle.build("mixed")
    directory = tmp_path_factory.mktemp("fp8_fp4")
    cfg = dsjax.config.from_hf_dict(hf_model.config.to_dict())
    dequantized = quantized_checkpoint.write(hf_model, directory, block=32, shards=3, mtp_cfg=cfg)
    hf_model.load_state_dict({k: torch.as_tensor(v) for k, v in dequantized.items() if not k.startswith("mtp.")})
    hf_model.mtp_reference = {k: v for k, v in dequantized.items() if k.startswith("mtp.")}
    return directory, hf_model


def test_layout_is_original_sharded_quantized(quantized):
    directory, _ = quantized
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    def dtype(name):
        return SafetensorsFile(directory / index[name]).tensors[name].dtype

    assert dtype("layers.1.attn.wq_b.weight") == "F8_E4M3" and dtype("layers.1.attn.wq_b.scale") == "F8_E8M0"
    assert dtype("layers.1.ffn.experts.3.w1.weight") == "I8"
    assert dtype("layers.1.ffn.experts.3.w1.scale") == "F8_E8M0"


def test_dequantized_logits_match_hf(quantized, rng):
    directory, hf_model = quantized
    ids = rng.integers(0, 512, (2, 37))
    got = dsjax.load_model(directory, dtype="float32").logits(ids)
    np.testing.assert_allclose(got, hf_oracle.hf_logits(hf_model, ids).numpy(), atol=1e-4, rtol=0)


def test_resident_mode_same_logits_fewer_bytes(quantized, rng):
    """E4M3 x 2^k and E2M1 x 2^k are exact in fp32, so dequantizing inside the matmul gives
    the very weights dequantize-at-load gives; only the op order may differ (1e-5: on XLA:CPU
    the dense model's prompt MoE is the library's call, the resident one's XLA's products)."""
    directory, _ = quantized
    ids = rng.integers(0, 512, (2, 29))
    resident = dsjax.load_model(directory, dtype="float32", quantized="resident")
    dense = dsjax.load_model(directory, dtype="float32")
    np.testing.assert_allclose(resident.logits(ids), dense.logits(ids), atol=1e-5, rtol=0)
    bf16 = dsjax.load_model(directory, dtype="bfloat16")

    def stored_bytes(kind):
        leaves = jax.tree.leaves(resident.params, is_leaf=lambda x: isinstance(x, (Fp8Weight, Fp4Weight)))
        return sum(sum(a.nbytes for a in jax.tree.leaves(x)) for x in leaves if isinstance(x, kind))

    def bf16_bytes(names):
        total = 0
        for block in layer_blocks(bf16):
            for part, attrs in names:
                obj = getattr(block, part)
                total += sum(getattr(obj, a).nbytes for a in attrs if getattr(obj, a) is not None)
            if block.attn.indexer is not None:
                total += block.attn.indexer.q_b_proj.nbytes if ("attn", ()) in names else 0
        return total

    fp8_dense = bf16_bytes([("attn", ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")),
                            ("moe", ("shared_w1", "shared_w2", "shared_w3"))])
    fp8_dense += sum(b.attn.indexer.q_b_proj.nbytes for b in layer_blocks(bf16) if b.attn.indexer is not None)
    assert 0.5 <= stored_bytes(Fp8Weight) / fp8_dense < 0.52  # 1 byte + a scale byte per 32x32 block
    fp4_dense = bf16_bytes([("moe", ("w1", "w2", "w3"))])
    assert 0.25 <= stored_bytes(Fp4Weight) / fp4_dense < 0.27  # half a byte + a scale byte per 32
    block = layer_block(resident.params, resident.config, 1)
    assert isinstance(block.attn.q_b_proj, Fp8Weight) and block.attn.q_b_proj.q.dtype == np.dtype("float8_e4m3fn")
    assert isinstance(block.moe.w1, Fp4Weight) and block.moe.w1.packed.dtype == np.int8


def test_resident_logits_through_the_stored_weight_kernels(quantized, rng, monkeypatch):
    """kernels="mosaic_gpu" (GPU interpret mode here): the routed experts (MXFP4) and every FP8
    projection run the kernels that read the stored bytes (counted), not dense(). Their bf16
    operands put the fp32 model's logits no further from the reference path's (the same resident
    weights, dequantized) than a bf16 model is (the oracle for bf16 noise), and not on them."""
    from dsjax.layers import linear, moe

    calls = {"experts": 0, "fp8": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(moe, "mgpu_stored_grouped_ffn", counted("experts", moe.mgpu_stored_grouped_ffn))
    monkeypatch.setattr(linear, "mgpu_fp8_linear", counted("fp8", linear.mgpu_fp8_linear))
    directory, _ = quantized
    ids = rng.integers(0, 512, (1, 19))
    want = np.asarray(dsjax.load_model(directory, dtype="float32", quantized="resident").logits(ids))
    assert calls == {"experts": 0, "fp8": 0}  # the reference path dequantizes
    bf16 = dsjax.load_model(directory, dtype="bfloat16", quantized="resident").logits(ids)
    bf16_err = np.abs(np.asarray(bf16, np.float32) - want)
    got = dsjax.load_model(directory, dtype="float32", quantized="resident", kernels="mosaic_gpu").logits(ids)
    # 4 layers: their routed experts, and at least W_qa, W_qb, W_kv, W_ob and the shared expert's three each
    assert calls["experts"] == 4 and calls["fp8"] >= 4 * 7
    err = np.abs(np.asarray(got) - want)
    assert 0 < err.mean() <= bf16_err.mean() and err.max() <= bf16_err.max()


def test_resident_on_a_mesh(quantized, rng):
    directory, _ = quantized
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    ids = rng.integers(0, 512, (8, 21))
    want = dsjax.load_model(directory, dtype="float32").logits(ids)
    got = dsjax.load_model(directory, dtype="float32", quantized="resident", mesh="data=2,expert=4").logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)


@pytest.fixture
def copy(quantized, tmp_path):
    shutil.copytree(quantized[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_fp8_weight_without_scale(copy):
    fname = edit_tensors(copy, "layers.2.attn.wo_b.scale", lambda t: t.pop("layers.2.attn.wo_b.scale"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wo_b\.weight' in .*: F8_E4M3 weight without its scale"):
        dsjax.load_model(copy, dtype="float32")
    assert fname


def test_misshaped_scale(copy):
    def edit(t):
        t["layers.1.attn.wq_a.scale"] = np.concatenate([t["layers.1.attn.wq_a.scale"]] * 2)

    fname = edit_tensors(copy, "layers.1.attn.wq_a.scale", edit)
    with pytest.raises(CheckpointError, match=rf"layers\.1\.attn\.wq_a\.scale' in {fname}: shape \[2, 2\], "
                                              rf"expected \[1, 2\]"):
        dsjax.load_model(copy, dtype="float32")


def test_misshaped_mxfp4_weight(copy):
    name = "layers.3.ffn.experts.0.w2.weight"

    def edit(t):
        t[name] = t[name][:, :-1]

    fname = edit_tensors(copy, name, edit)
    with pytest.raises(CheckpointError, match=rf"{name}' in {fname}: shape \[64, 15\], expected \[64, 16\]"):
        dsjax.load_model(copy, dtype="float32")


def test_non_finite_values(copy):
    name = "layers.0.attn.attn_sink"

    def edit(t):
        t[name] = t[name].copy()
        t[name][1] = np.nan

    fname = edit_tensors(copy, name, edit)
    dsjax.load_model(copy, dtype="float32", check_finite=False)  # the scan can be skipped
    with pytest.raises(CheckpointError, match=rf"{name}' in {fname}: non-finite"):
        dsjax.load_model(copy, dtype="float32", check_finite=True)
    with pytest.raises(CheckpointError, match=rf"{name}' in {fname}: non-finite"):
        dsjax.load_model(copy, dtype="float32")  # and runs by default


def test_mtp_layer_is_loaded(quantized):
    """mtp.0.* (FP8 e_proj / h_proj / attention, MXFP4 experts) lands in Model.mtp."""
    directory, hf_model = quantized
    model = dsjax.load_model(directory, dtype="float32")
    ref = hf_model.mtp_reference
    assert model.mtp is not None
    np.testing.assert_array_equal(np.asarray(model.mtp.e_proj), ref["mtp.0.e_proj.weight"])
    np.testing.assert_array_equal(np.asarray(model.mtp.block.attn.q_b_proj), ref["mtp.0.attn.wq_b.weight"])
    np.testing.assert_array_equal(np.asarray(model.mtp.block.moe.w2[3]), ref["mtp.0.ffn.experts.3.w2.weight"])
    np.testing.assert_array_equal(np.asarray(model.mtp.hc_head.fn), ref["mtp.0.hc_head_fn"])
    assert dsjax.load_model(directory, dtype="float32", mtp=False).mtp is None


def test_resident_needs_a_quantized_checkpoint(hf_checkpoints):
    _, path = hf_checkpoints("mixed")
    with pytest.raises(ValueError, match="needs an FP8 / MXFP4 checkpoint"):
        dsjax.load_model(path, quantized="resident")


@pytest.mark.parametrize("mode", ["dequantize", "resident"])
def test_orbax_round_trip(quantized, tmp_path, mode, rng):
    """safetensors -> `dsjax convert` -> orbax -> load_model: identical logits, also on a mesh."""
    import subprocess
    import sys

    src, _ = quantized
    if mode == "dequantize":  # and the files beside the weights come along (the drafter's vocabulary)
        src = shutil.copytree(src, tmp_path / "src")
        (src / "draft_vocab.json").write_text(json.dumps({"ids": [5, 2, 9]}))
    dst = tmp_path / "orbax"
    out = subprocess.run([sys.executable, "-m", "dsjax.cli", "convert", str(src), str(dst), "--dtype", "float32",
                          "--quantized", mode], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    ids = rng.integers(0, 512, (8, 19))
    want = dsjax.load_model(src, dtype="float32", quantized=mode).logits(ids)
    converted = dsjax.load_model(dst, dtype="float32")
    np.testing.assert_array_equal(converted.logits(ids), want)
    if mode == "dequantize":
        assert converted.draft_vocab.tolist() == [2, 5, 9]
    if jax.device_count() >= 8:
        sharded = dsjax.load_model(dst, dtype="float32", mesh="data=2,expert=4")
        w3 = layer_block(sharded.params, sharded.config, 1).moe.w3
        assert (w3 if mode == "dequantize" else w3.packed).sharding.spec[0] == "expert"
        np.testing.assert_allclose(sharded.logits(ids), want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)
