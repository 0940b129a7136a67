"""Bad checkpoints fail before anything is used, with an error naming tensor and file."""

import json
import shutil

import numpy as np
import pytest

import dsjax
from dsjax.checkpoint import CheckpointError, SafetensorsFile, write_safetensors


@pytest.fixture
def ckpt(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints("mixed")
    shutil.copytree(path, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _rewrite(directory, edit):
    f = SafetensorsFile(directory / "model.safetensors")
    tensors = {n: np.array(f.read(n)) for n in f.tensors}
    f.close()
    edit(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.attn.wq_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.attn\.wq_b\.weight"):
        dsjax.load_model(ckpt, dtype="float32")


def test_missing_routed_expert(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.2.ffn.experts.5.w3.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.5\.w3\.weight"):
        dsjax.load_model(ckpt, dtype="float32")


def test_misshaped_tensor(ckpt):
    def edit(t):
        t["model.layers.0.attn.wkv.weight"] = np.zeros((31, 64), np.float32)

    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        dsjax.load_model(ckpt, dtype="float32")
    msg = str(e.value)
    assert "model.layers.0.attn.wkv.weight" in msg and "model.safetensors" in msg
    assert "[31, 64]" in msg and "[32, 64]" in msg


def test_wrongly_typed_tensor(ckpt):
    def edit(t):
        t["model.layers.0.ffn.gate.tid2eid"] = t["model.layers.0.ffn.gate.tid2eid"].astype(np.float32)

    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=r"tid2eid.*dtype F32.*integer"):
        dsjax.load_model(ckpt, dtype="float32")


def test_unexpected_tensor(ckpt):
    def edit(t):
        t["model.layers.0.attn.surprise.weight"] = np.zeros((2, 2), np.float32)

    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=r"does not use.*layers\.0\.attn\.surprise\.weight.*model\.safetensors"):
        dsjax.load_model(ckpt, dtype="float32")


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*' ends at byte .*truncated"):
        dsjax.load_model(ckpt, dtype="float32")


def test_corrupt_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt header"):
        dsjax.load_model(ckpt, dtype="float32")


def test_config_does_not_match_weights(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["hidden_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"shape \[.*\], expected \[.*96"):
        dsjax.load_model(ckpt, dtype="float32")


def test_index_names_missing_shard(hf_checkpoints, tmp_path):
    hf_model, _ = hf_checkpoints("hca")
    hf_model.save_pretrained(tmp_path, max_shard_size="200KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        dsjax.load_model(tmp_path, dtype="float32")


def test_no_weights(tmp_path, hf_checkpoints):
    _, path = hf_checkpoints("mixed")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        dsjax.load_model(tmp_path, dtype="float32")
