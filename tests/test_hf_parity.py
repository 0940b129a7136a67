"""End-to-end: dsjax logits and greedy tokens equal HF DeepseekV4ForCausalLM's."""

import json
import shutil

import numpy as np
import pytest
import torch

import dsjax
import hf_oracle

# (config, sequence length): lengths are off every compression grid and longer than the
# window; "legacy" runs past one 128-token HCA window; "repeat" runs layers under lax.scan.
CASES = [("mixed", 37), ("legacy", 150), ("hca", 23), ("repeat", 37)]


@pytest.mark.parametrize("name,seq", CASES)
def test_logits_match_hf_fp32(hf_checkpoints, name, seq, rng):
    hf_model, path = hf_checkpoints(name)
    ids = rng.integers(0, hf_model.config.vocab_size, (3, seq))
    ref = hf_oracle.hf_logits(hf_model, ids).numpy()
    got = dsjax.load_model(path, dtype="float32").logits(ids)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seq", [1, 3, 5])
def test_prompts_shorter_than_every_ratio(hf_checkpoints, seq, rng):
    hf_model, path = hf_checkpoints("mixed")
    ids = rng.integers(0, 512, (2, seq))
    np.testing.assert_allclose(dsjax.load_model(path, dtype="float32").logits(ids),
                               hf_oracle.hf_logits(hf_model, ids).numpy(), atol=1e-4, rtol=0)


def test_every_mechanism_is_covered():
    """The parity configs together exercise every layer type, both MoE kinds, hc_mult != 4
    and YaRN on compressed layers (so a config edit cannot silently drop one)."""
    cfgs = [hf_oracle.make_config(name) for name, _ in CASES]
    layer_types = {t for c in cfgs for t in c.layer_types}
    assert layer_types == {hf_oracle.SLIDING, hf_oracle.CSA, hf_oracle.HCA}
    assert {t for c in cfgs for t in c.mlp_layer_types} == {"hash_moe", "moe"}
    assert any(c.hc_mult != 4 for c in cfgs) and any(c.hc_mult == 4 for c in cfgs)
    assert all(c.rope_parameters["compress"]["rope_type"] == "yarn" for c in cfgs)
    for (name, seq), c in zip(CASES, cfgs):
        assert seq > c.sliding_window
        for t in set(c.layer_types) - {hf_oracle.SLIDING}:
            ratio = c.compress_rates[t]
            assert seq % ratio and seq >= ratio, (name, t)
        # top-k >= visible entries: HF's torch.topk tie order must not matter here
        assert c.index_topk >= seq // c.compress_rates[hf_oracle.CSA]


def test_legacy_config_keys(hf_checkpoints, tmp_path, rng):
    """A config.json in the legacy form (compress_ratios incl. the MTP entry, num_hash_layers,
    qk_rope_head_dim, a flat yarn rope_scaling) loads to the same model."""
    hf_model, path = hf_checkpoints("mixed")
    shutil.copytree(path, tmp_path / "ckpt")
    cfg_path = tmp_path / "ckpt" / "config.json"
    raw = json.loads(cfg_path.read_text())
    ratio = {hf_oracle.SLIDING: 0, hf_oracle.CSA: 4, hf_oracle.HCA: 8}
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                          "rope_parameters", "partial_rotary_factor")}
    legacy.update(
        compress_ratios=[ratio[t] for t in raw["layer_types"]] + [0],
        compress_rate_csa=4, compress_rate_hca=8,
        num_hash_layers=raw["mlp_layer_types"].count("hash_moe"),
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1},
    )
    cfg_path.write_text(json.dumps(legacy))
    assert dsjax.load_config(tmp_path / "ckpt") == dsjax.load_config(path).replace(name="ckpt")
    ids = rng.integers(0, 512, (1, 21))
    np.testing.assert_array_equal(dsjax.load_model(tmp_path / "ckpt", dtype="float32").logits(ids),
                                  dsjax.load_model(path, dtype="float32").logits(ids))


def test_sharded_checkpoint(hf_checkpoints, tmp_path, rng):
    """model-0000N-of-0000M.safetensors + model.safetensors.index.json."""
    hf_model, _ = hf_checkpoints("hca")
    hf_oracle.save(hf_model, tmp_path, max_shard_size="200KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    ids = rng.integers(0, 512, (2, 19))
    np.testing.assert_allclose(dsjax.load_model(tmp_path, dtype="float32").logits(ids),
                               hf_oracle.hf_logits(hf_model, ids).numpy(), atol=1e-4, rtol=0)


def test_hf_in_memory_names(hf_checkpoints, tmp_path, rng):
    """Checkpoints written with HF's module names (self_attn.q_a_proj, fused gate_up_proj)."""
    from dsjax.checkpoint import write_safetensors

    hf_model, path = hf_checkpoints("mixed")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    write_safetensors(tmp_path / "model.safetensors",
                      {k: v.numpy() for k, v in hf_model.state_dict().items()})
    ids = rng.integers(0, 512, (2, 13))
    np.testing.assert_array_equal(dsjax.load_model(tmp_path, dtype="float32").logits(ids),
                                  dsjax.load_model(path, dtype="float32").logits(ids))


def test_bf16_no_worse_than_hf_bf16(hf_checkpoints, rng):
    """bf16 has ~3 significant digits and MoE routing is discontinuous: a bf16 rounding can
    flip an expert choice and move a logit by O(1). So the tolerance is relative to the
    oracle's own bf16 error: against HF fp32, dsjax-bf16's mean |error| must not exceed
    1.25x HF-bf16's, and stay small relative to the logit scale."""
    hf_model, path = hf_checkpoints("mixed")
    ids = rng.integers(0, 512, (2, 37))
    ref = hf_oracle.hf_logits(hf_model, ids).numpy()
    hf_bf16 = hf_oracle.hf_logits(hf_oracle.build("mixed").to(torch.bfloat16), ids).numpy()
    ours = dsjax.load_model(path, dtype="bfloat16")
    assert ours.params.embed.dtype == np.dtype("bfloat16") and ours.params.norm.dtype == np.float32
    got = ours.logits(ids)
    err, hf_err = np.abs(got - ref).mean(), np.abs(hf_bf16 - ref).mean()
    assert err <= 1.25 * hf_err, (err, hf_err)
    assert err / np.abs(ref).mean() < 0.1  # HF-bf16 itself sits near 0.08 on these weights
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.8


@pytest.mark.parametrize("name", ["mixed", "hca"])
def test_greedy_generate_matches_hf(hf_checkpoints, name):
    hf_model, path = hf_checkpoints(name)
    prompts = [[0, 17, 99, 3, 250, 7, 44, 12, 9, 300, 5], [0, 400, 401]]
    new = 24
    ours = dsjax.generate(dsjax.load_model(path, dtype="float32"), prompts, max_new_tokens=new)
    for prompt, got in zip(prompts, ours):
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                eos_token_id=hf_model.config.eos_token_id, pad_token_id=2)
        expected = out[0, len(prompt):].tolist()
        if hf_model.config.eos_token_id in expected:  # HF pads after EOS; dsjax stops there
            expected = expected[: expected.index(hf_model.config.eos_token_id) + 1]
        assert got == expected
