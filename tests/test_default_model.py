"""The bundled default model dsjax-tiny-py: stored in DeepSeek's format, loaded by
`load_model()` through the normal loader, and the shipped weights reproduce the training
run's own held-out evaluation (computed there by a different path: the compact training
vocabulary, unquantized float32 weights)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import dsjax
from dsjax.train import data
from dsjax.train.export import mean_nll
from dsjax.weights import DEFAULT_MODEL, bundled_models, bundled_path

CKPT = bundled_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model():
    return dsjax.load_model()


def test_default_is_the_bundled_checkpoint_in_deepseek_format(model):
    assert DEFAULT_MODEL in bundled_models() and CKPT is not None
    assert model.config.name == DEFAULT_MODEL and model.mtp is not None
    assert model.params.embed.dtype == jnp.float32  # dtype "auto" on CPU
    size = sum(f.stat().st_size for f in CKPT.iterdir() if f.is_file())
    assert size <= 40 * 2**20, f"{size / 2**20:.1f} MiB shipped"
    with safe_open(str(CKPT / "model.safetensors"), "np") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in ("layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale",
                                                          "layers.1.ffn.experts.0.w1.weight",
                                                          "layers.1.ffn.experts.0.w1.scale")}
    # FP8 E4M3 linears with E8M0 block scales, MXFP4 routed experts (E2M1 pairs in int8, E8M0 per 32): V4-Flash's layout
    assert list(stored.values()) == ["F8_E4M3", "F8_E8M0", "I8", "F8_E8M0"], stored
    quant = json.loads((CKPT / "config.json").read_text())["quantization_config"]
    assert quant["fmt"] == "e4m3" and quant["scale_fmt"] == "ue8m0"
    ids = np.asarray(model.draft_vocab)
    assert ids.ndim == 1 and 0 < len(ids) < model.config.vocab_size and len(np.unique(ids)) == len(ids)


def test_shipped_weights_reproduce_the_training_eval(model):
    """Held-out next-token loss of the FP8 / MXFP4 checkpoint, read by the loader, against
    the run's own evaluation of the float32 weights at the exported step (training.json):
    the same sequences, full-vocabulary softmax both ways. Storage rounding may move it a
    little; a broken export or loader moves it by nats (an untrained model: ln 129280 = 11.8)."""
    info = json.loads((CKPT / "training.json").read_text())
    expected, spec = info["eval"]["eval_lm"], info["eval_sequences"]
    tok = dsjax.load_tokenizer()
    held = data.tokenize(data.read_documents(data.stdlib_root(), data.load_file_list(), held_out=True), tok)
    seqs = data.pack(held, spec["seq_len"], None)[: spec["count"]]

    loss = mean_nll(model, seqs)
    assert abs(loss - expected) < 0.05, (loss, expected)
    assert loss < 6.0
