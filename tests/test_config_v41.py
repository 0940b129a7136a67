"""DeepSeek-V4.1 configs: DeepSeek's flat inference/config.json and the HF form read to one
ModelConfig; the layer schedule and sharing of spec deepseek-v41.md §1.2 (expected values
written out from the spec's table here); the scanned layer plan; parameter and cache counts
against the spec's totals (§1, §2.12, §5.5)."""

import json
import subprocess
import sys
import warnings

import pytest

from dsjax.config import CSA, SLIDING, ConfigError, from_hf_dict, load_config, to_hf_dict
from dsjax.config.io import from_flat_v41, to_flat_v41
from dsjax.engine.spec_options import engine_draft_vocab
from dsjax.model.cache_layout import cache_bytes
from dsjax.param_count import count_params

# spec §1.1, verbatim values of the flat file
FLAT = dict(
    vocab_size=129280, dim=5120, n_layers=40, n_mtp_layers=3, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128, norm_eps=1e-20, rope_theta=10000,
    compress_rope_theta=160000, original_seq_len=65536, rope_factor=16, beta_fast=32, beta_slow=1,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], kv_source_layers=[2, 8, 14, 20],
    index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8, n_routed_experts=384,
    n_activated_experts=6, n_shared_experts=1, moe_inter_dim=2304, score_func="sqrtsoftplus", route_scale=1.5,
    swiglu_limit=10.0, dtype="fp8", expert_dtype="fp4", hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
    engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_id=2,
    engram_compressed_vocab_size=99092, dspark_block_size=5, dspark_noise_token_id=128799,
    dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256, dspark_n_routed_experts=128,
    dspark_n_activated_experts=3, image_token_id=129264, vision_n_layers=32, vision_dim=1024,
    max_batch_size=4, max_seq_len=4096)

# spec §1.2's table: layer -> (ratio, compressed KV from, index keys from, top-k from, candidates from)
#   "own" = the layer itself; None = not applicable
SCHEDULE = {0: (0, None, None, None, None), 1: (0, None, None, None, None)}
for src in (2, 8, 14):
    SCHEDULE[src] = (2, src, src, src, None)
    for c in range(src + 1, src + 6):
        SCHEDULE[c] = (2, src, None, src, None)
SCHEDULE[20] = (1, 20, 20, 20, None)
for c in (21, 22, 23):
    SCHEDULE[c] = (1, 20, None, 20, None)
for src in (24, 28, 32, 36):
    SCHEDULE[src] = (1, 20, 20, src, 20)
    for c in range(src + 1, src + 4):
        SCHEDULE[c] = (1, 20, None, src, None)


def test_flat_and_hf_forms_read_to_the_named_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field of the release's file is known (vision ones: another tower)
        flat = from_flat_v41(FLAT, name="v41-flash")
    with pytest.warns(UserWarning, match="mystery_field"):
        from_flat_v41(dict(FLAT, mystery_field=1))
    named = load_config("v41-flash")
    assert flat == named and named.model_type == "deepseek_v41"
    # HF's form: text_config with renamed keys (§1.1), yarn in rope_scaling, token ids at the root
    hf = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0,
          "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]},
          "text_config": {
              "hidden_size": 5120, "num_hidden_layers": 40, "moe_intermediate_size": 2304, "num_attention_heads": 64,
              "num_key_value_heads": 1, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-20, "sliding_window": 128,
              "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
              "topk_method": "noaux_tc", "kv_source_layer_ids": [2, 8, 14, 20],
              "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer_id": 20,
              "engram_pad_token_id": 2, "num_nextn_predict_layers": 3, "dspark_num_experts_per_tok": 3,
              "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                               "original_max_position_embeddings": 65536},
              "max_position_embeddings": 1048576, "tie_word_embeddings": False, "hidden_act": "silu",
              **{k: FLAT[k] for k in (
                  "vocab_size", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "rope_theta",
                  "compress_rope_theta", "compress_ratios", "index_n_heads", "index_head_dim", "index_topk",
                  "candidate_topk_blocks", "candidate_block_size", "n_routed_experts", "n_shared_experts",
                  "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
                  "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads",
                  "engram_head_dim", "engram_compressed_vocab_size", "dspark_block_size", "dspark_noise_token_id",
                  "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts")}}}
    assert from_hf_dict(hf, name="v41-flash") == named
    assert from_hf_dict(to_hf_dict(named), name="v41-flash") == named
    assert from_flat_v41(to_flat_v41(named), name="v41-flash") == named
    c = named
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim,
            c.q_lora_rank, c.o_groups, c.o_lora_rank) == (5120, 40, 64, 512, 64, 1280, 8, 1024)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.index_n_heads) == (384, 6, 2304, 32)
    assert c.rms_norm_eps == 1e-20 and c.num_nextn_predict_layers == 3 and c.pad_token_id == 2
    assert c.rope_compress.scaling == "yarn" and c.rope_compress.factor == 16 and c.rope_compress.theta == 160000
    assert c.rope_compress.attention_factor == 1.0 and c.rope_main.scaling == "default"  # no mscale (§2.1)
    assert c.v41.engram.n_hash == 24 and c.v41.dspark.target_layer_ids == (37, 38, 39)


def test_layer_schedule_and_sharing_follow_the_spec_table():
    cfg = load_config("v41-flash")
    for layer in cfg.layers:
        ratio, kv, keys, topk, cand = SCHEDULE[layer.index]
        assert layer.compress_ratio == ratio and layer.attention == (CSA if ratio else SLIDING)
        assert layer.engram == (layer.index in (1, 14))
        s = layer.sharing
        if not ratio:
            assert s is None
            continue
        assert (s.kv_from, s.topk_from, s.candidates_from) == (kv, topk, cand), layer.index
        assert layer.has_compressor == (kv == layer.index)
        assert layer.has_indexer == (topk == layer.index)
        if keys is not None:
            assert s.index_keys_from == keys
        assert layer.has_index_keys == (keys == layer.index)
        assert s.publishes_candidates == (layer.index == 20)
        assert not layer.overlap  # V4.1 compressors never overlap


def test_layer_plan_scans_the_shared_schedule():
    """Every layer appears once, as itself, in the plan; copies of a period read their own
    copy's sources; an Engram layer starts a run; the program holds 10 block bodies for 40
    layers (V4-Flash: 5 for 43)."""
    for name in ("v41-flash", "tiny-v41"):
        cfg = load_config(name)
        runs = cfg.layer_runs
        flat = [run.layer(r, j, i) for run in runs for r in range(run.repeats)
                for j in range(len(run.layers)) for i in range(run.inner[j])]
        assert flat == list(cfg.layers)
        for run in runs:
            assert not any(layer.engram for layer in run.layers[1:]) and (run.repeats == 1 or not run.layers[0].engram)
            for j, indices in enumerate(run.indices):
                assert all(run.slot(i) == (j, k) for k, i in enumerate(indices))
    runs = load_config("v41-flash").layer_runs
    assert [(run.first, run.repeats, run.inner) for run in runs] == [
        (0, 1, (1,)), (1, 1, (1,)), (2, 2, (1, 5)), (14, 1, (1,)), (15, 1, (5,)), (20, 1, (1,)), (21, 1, (3,)),
        (24, 4, (1, 3))]
    assert sum(len(run.layers) for run in runs) == 10


def test_tiny_v41_exercises_every_mechanism():
    cfg = load_config("tiny-v41")
    layers = cfg.layers
    ratios = {layer.compress_ratio for layer in layers}
    assert ratios == {0, 1, 2}
    engram_before = {layers[i].compress_ratio for i in cfg.v41.engram.layer_ids}
    assert engram_before == {0, 2}  # before a window-only layer and before a ratio-2 KV source
    assert any(run.repeats > 1 and max(run.inner) > 1 for run in cfg.layer_runs)  # consumers scanned inside a period
    restricted = [layer for layer in layers if layer.sharing and layer.sharing.candidates_from is not None]
    assert len(restricted) >= 2 and cfg.v41.candidate_source_layer in cfg.v41.kv_source_layers
    assert cfg.v41.dspark.target_layer_ids == tuple(range(cfg.num_hidden_layers - 3, cfg.num_hidden_layers))
    assert cfg.num_nextn_predict_layers == 3 and cfg.vocab_size == 129280  # the real tokenizer's ids


def test_params_memory_and_cache_match_the_spec():
    """552 B backbone + 196.6 B Engram values (§1, §5.5); 890 B per token of compressed state
    stored as the reference stores it (§2.12)."""
    c = count_params(load_config("v41-flash"))
    assert round(c["total"] / 1e9) == 552
    assert round(c["engram_tables"] / 1e8) == 1966 and c["engram_tables"] == (384006168 + 384016682) * 256
    bytes_ = cache_bytes(load_config("v41-flash"), 8192)
    assert bytes_["compact_bytes_per_token"] == 890
    # bf16 latents + index keys at the 4 KV sources: 3 x (512 + 128) / 2 + (512 + 128) elements per token
    assert bytes_["compressed_bytes_per_token"] == (3 * 640 / 2 + 640) * 2
    out = subprocess.run([sys.executable, "-m", "dsjax", "params", "--config", "v41-flash", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["engram_tables"] == c["engram_tables"]


@pytest.mark.parametrize("edit,field", [
    (lambda f: f.update(kv_source_layers=[8, 14, 20]), "kv_source_layers"),  # layers 2-7 have no KV source
    (lambda f: f.update(kv_source_layers=[2, 8, 14, 21]), "kv_source_layers"),  # layer 20 (r=1) reads a ratio-2 source
    (lambda f: f.update(index_source_layers=[2, 8, 14, 20, 50]), "index_source_layers"),
    (lambda f: f.update(compress_ratios=[0, 0, 2]), "compress_ratios"),
    (lambda f: f.update(candidate_source_layer=24), "candidate_source_layer"),
    (lambda f: f.update(engram_layer_ids=[1, 44]), "engram_layer_ids"),
    (lambda f: f.update(dspark_n_activated_experts=200), "dspark_n_activated_experts"),
    (lambda f: f.pop("dim"), "dim"),
])
def test_bad_v41_field_is_named(edit, field):
    flat = dict(FLAT, vision_dim=None, vision_n_layers=None)
    edit(flat)
    with pytest.raises(ConfigError, match=field):
        from_flat_v41(flat)


def test_load_model_v41_refusals_are_named(tmp_path):
    """What load_model cannot do for a V4.1 config is refused by name before anything is built
    (a drafter the config does not have). A named config's resident weights are seeded in
    their stored bytes (tests/test_params.py), V4.1's on its 32 x 32 FP8 tiles."""
    import jax

    import dsjax
    from dsjax.layers.quantized import Fp4Weight, Fp8Weight

    model = dsjax.load_model("tiny-v41", dtype="float32", quantized="resident", mtp=False)
    stored = [w for w in jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, (Fp8Weight, Fp4Weight)))
              if isinstance(w, (Fp8Weight, Fp4Weight))]
    assert {type(w) for w in stored} == {Fp8Weight, Fp4Weight}
    assert {w.block for w in stored if isinstance(w, Fp8Weight)} == {(32, 32)}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_hf_dict(load_config("tiny-v41").replace(num_nextn_predict_layers=0))))
    with pytest.raises(ValueError, match="has no DSpark drafter"):
        dsjax.load_model(path, mtp=True)


def test_engine_refuses_a_draft_vocabulary_for_dspark():
    """An Engine's drafter vocabulary (dsjax.engine.policy.engine_draft_vocab): DSpark drafts over
    the whole vocabulary, so a V4.1 model takes no `draft_vocab` list, while V4's MTP drafter
    does (sorted, checked) and False means the full vocabulary for both."""
    v41, v4 = load_config("tiny-v41"), load_config("tiny")
    with pytest.raises(ValueError, match="DSpark head drafts over the whole vocabulary"):
        engine_draft_vocab([3, 1, 2], None, v41)
    assert engine_draft_vocab(False, None, v41) is None and engine_draft_vocab(None, None, v41) is None
    assert engine_draft_vocab([3, 1, 2], None, v4).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="must be None .* got True"):
        engine_draft_vocab(True, None, v4)
