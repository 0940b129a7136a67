"""One validated config type: HF config.json as is, legacy keys, named configs, errors
that name the field."""

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

import dsjax
from dsjax.config import CSA, HCA, SLIDING, ConfigError, from_hf_dict, load_config, to_hf_dict
from dsjax.layers.rope import inv_freq


def test_named_configs():
    flash = load_config("v4-flash")
    assert flash.num_hidden_layers == 43 and flash.hidden_size == 4096
    assert flash.layer_types == (SLIDING, SLIDING) + (CSA, HCA) * 20 + (CSA,)
    assert flash.mlp_layer_types[:3] == ("hash_moe",) * 3 and set(flash.mlp_layer_types[3:]) == {"moe"}
    assert (flash.compress_rate_csa, flash.compress_rate_hca, flash.sliding_window) == (4, 128, 128)
    assert flash.rope_compress.scaling == "yarn" and flash.rope_compress.attention_factor == 1.0
    assert flash.rope_main.scaling == "default"
    pro = load_config("v4-pro")
    assert (pro.hidden_size, pro.num_attention_heads, pro.o_groups, pro.index_topk,
            pro.routed_scaling_factor) == (7168, 128, 16, 1024, 2.5)
    tiny = load_config("tiny")
    assert set(tiny.layer_types) == {SLIDING, CSA, HCA} and set(tiny.mlp_layer_types) == {"hash_moe", "moe"}


@pytest.mark.parametrize("name", ["mixed", "legacy", "hca"])
def test_matches_hf_config_parsing(name):
    """Our reading of a config equals HF's: schedule, rope frequencies for both rope types."""
    import hf_oracle

    hf = hf_oracle.make_config(name)
    ours = from_hf_dict(hf.to_dict())
    assert list(ours.layer_types) == hf.layer_types and list(ours.mlp_layer_types) == hf.mlp_layer_types
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim
    rotary = DeepseekV4RotaryEmbedding(hf)
    for kind in ("main", "compress"):
        np.testing.assert_allclose(inv_freq(ours.rope(kind), ours.qk_rope_head_dim),
                                   getattr(rotary, f"{kind}_inv_freq").numpy(), rtol=1e-6)
        assert ours.rope(kind).attention_factor == getattr(rotary, f"{kind}_attention_scaling")


def test_hf_dict_round_trip():
    cfg = load_config("v4-flash")
    assert from_hf_dict(to_hf_dict(cfg), name=cfg.name) == cfg
    # and HF reads what we write
    hf = DeepseekV4Config(**to_hf_dict(cfg))
    assert list(hf.layer_types) == list(cfg.layer_types)


def _flash_raw():
    return json.loads((dsjax.config.configs_dir() / "v4-flash.json").read_text())


@pytest.mark.parametrize("edit,field", [
    (lambda r: r.pop("hidden_size"), "hidden_size"),
    (lambda r: r.update(hidden_size=-4), "hidden_size"),
    (lambda r: r.update(num_attention_heads="64"), "num_attention_heads"),
    (lambda r: r.update(o_groups=7), "o_groups"),
    (lambda r: r.update(num_key_value_heads=8), "num_key_value_heads"),
    (lambda r: r.update(compress_ratios=[0, 3] + [4] * 42), "compress_ratios"),
    (lambda r: (r.pop("compress_ratios"), r.update(layer_types=["sliding_attention"] * 42)), "layer_types"),
    (lambda r: (r.pop("compress_ratios"), r.update(layer_types=["full_attention"] * 43)), "layer_types"),
    (lambda r: r.update(mlp_layer_types=["hash_moe"] * 43 + ["moe"]), "mlp_layer_types"),
    (lambda r: r.update(scoring_func="relu"), "scoring_func"),
    (lambda r: r.update(num_experts_per_tok=300), "num_experts_per_tok"),
    (lambda r: r.update(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (lambda r: r.update(rope_scaling={"type": "yarn", "factor": 16}), "original_max_position_embeddings"),
    (lambda r: r.update(rope_scaling={"type": "dynamic", "factor": 2}), "rope_type"),
    (lambda r: r.update(rms_norm_eps=0), "rms_norm_eps"),
    (lambda r: r.update(eos_token_id=200000), "eos_token_id"),
    (lambda r: r.update(model_type="llama"), "model_type"),
])
def test_bad_field_is_named(edit, field):
    raw = _flash_raw()
    edit(raw)
    with pytest.raises(ConfigError, match=field):
        from_hf_dict(raw)


def test_bad_file_is_named(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json"):
        load_config(p)
    named = ", ".join(sorted(f.stem for f in (Path(__file__).parents[1] / "configs").glob("*.json")))
    assert "v4-flash, v4-flash-1gpu" in named
    with pytest.raises(FileNotFoundError, match=f"named configs: {named}"):
        load_config("v5-ultra")


def test_layer_runs_follow_the_periodic_schedule():
    """The decoder's layer plan: greedy runs of a repeating period (issue 13, compile time)."""
    def plan(name):
        return [([(l.attention, l.mlp) for l in r.layers], r.repeats) for r in load_config(name).layer_runs]

    from dsjax.config import HASH_MOE, TOPK_MOE
    assert plan("small") == [([(SLIDING, HASH_MOE)], 2), ([(CSA, TOPK_MOE), (HCA, TOPK_MOE)], 3)]
    assert plan("v4-flash") == [([(SLIDING, HASH_MOE)], 2), ([(CSA, HASH_MOE)], 1),
                                ([(HCA, TOPK_MOE), (CSA, TOPK_MOE)], 20)]
    for name in ("tiny", "small", "v4-flash"):
        cfg = load_config(name)
        flat = [run.layer(r, j) for run in cfg.layer_runs for r in range(run.repeats) for j in range(len(run.layers))]
        assert flat == list(cfg.layers)


@pytest.mark.parametrize("name, full, fields", [
    ("v4-flash-1gpu", "v4-flash", {"n_routed_experts"}),
    ("v41-flash-1gpu", "v41-flash", {"n_routed_experts", "engram"})])
def test_one_gpu_configs_are_the_full_model_with_experts_cut(name, full, fields):
    """The one-GPU configs differ from the full ones only in what their descriptions say was
    cut, and their stored (resident) weights plus a 64 x 4096-token KV cache fit an H200's
    139 GiB; with 64 experts (what gpu_engine.py picks on an H100), a 78 GiB H100. Bytes from
    the specs as the release stores them (dsjax.model.stored.weight_specs), the form a named
    config is drawn in."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dsjax.model.cache_layout import cache_shapes
    from dsjax.model.stored import weight_specs
    from dsjax.model.v41.params import engram_table_values
    from dsjax.params import spec_leaves

    one, ref = load_config(name), load_config(full)
    assert "description" in json.loads((dsjax.config.configs_dir() / f"{name}.json").read_text())
    differ = {f.name for f in dataclasses.fields(one) if getattr(one, f.name) != getattr(ref, f.name)} - {"name", "v41"}
    if one.v41 is not None:
        differ |= {"engram"} if one.v41.engram != ref.v41.engram else set()
        assert dataclasses.replace(one.v41, engram=ref.v41.engram) == ref.v41
        assert engram_table_values(one) * (1 + 1 / 32) <= dsjax.api.SEEDED_ENGRAM_BYTES  # seeded in host memory
    assert differ == fields and one.num_hidden_layers == ref.num_hidden_layers
    for experts, device_gib in ((one.n_routed_experts, 139), (64, 78)):
        cfg = one.replace(n_routed_experts=experts)
        weights = sum(s.nbytes for _, s in spec_leaves(weight_specs(cfg, jnp.bfloat16, "resident")[0]))
        cache = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache_shapes(cfg, 64, 4096 + 128)))
        assert weights + cache < 0.9 * device_gib * 2**30, (experts, weights / 2**30, cache / 2**30)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):  # top-6 needs at least 6 experts
        from_hf_dict({**json.loads((dsjax.config.configs_dir() / "v4-flash-1gpu.json").read_text()),
                      "n_routed_experts": 4})
