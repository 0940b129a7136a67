"""Declared parameters: abstract shapes without allocation, seeded init, published counts."""

import jax
import jax.numpy as jnp
import numpy as np

import dsjax
from dsjax.config import load_config
from dsjax.model import layer_block, model_specs
from dsjax.param_count import count_params
from dsjax.params import abstract_params, init_values, spec_leaves


def test_abstract_full_size_allocates_nothing():
    cfg = load_config("v4-flash")
    shapes = abstract_params(model_specs(cfg, jnp.bfloat16))
    leaves = jax.tree.leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    shapes = shapes.replace(blocks=[layer_block(shapes, cfg, i) for i in range(cfg.num_hidden_layers)])
    assert shapes.blocks[2].moe.w1.shape == (256, 2048, 4096)
    assert shapes.blocks[2].attn.indexer.q_b_proj.shape == (64 * 128, 1024)
    assert shapes.blocks[3].attn.indexer is None and shapes.blocks[3].attn.compressor.position_bias.shape == (128, 512)
    assert shapes.blocks[0].attn.compressor is None and shapes.blocks[0].moe.tid2eid.shape == (129280, 6)
    assert shapes.blocks[2].attn.compressor.kv_proj.shape == (1024, 4096)  # CSA: a | b halves


def test_v4_flash_counts_match_published():
    """DeepSeek publishes 284 B total / 13 B active for V4-Flash (main model, no MTP)."""
    c = count_params(load_config("v4-flash"))
    assert abs(c["total"] / 284e9 - 1) < 0.005
    assert 13e9 <= c["active_excluding_embedding"] < 13.5e9
    routed = 43 * 256 * 3 * 2048 * 4096
    assert c["by_group"]["routed_experts"] == routed
    pro = count_params(load_config("v4-pro"))
    assert abs(pro["total"] / 1.6e12 - 1) < 0.03 and 48e9 < pro["active_excluding_embedding"] < 50e9


def test_init_is_seeded_and_shard_independent():
    cfg = load_config("tiny")
    specs = model_specs(cfg, jnp.float32)
    a = dsjax.load_model("tiny", dtype="float32", seed=1).params
    b = dsjax.load_model("tiny", dtype="float32", seed=1).params
    c = dsjax.load_model("tiny", dtype="float32", seed=2).params
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(layer_block(a, cfg, 1).attn.q_b_proj, layer_block(c, cfg, 1).attn.q_b_proj)
    for name, spec in spec_leaves(specs):
        if spec.shape and spec.shape[0] > 3:
            full = init_values(spec, 1, name)
            part = init_values(spec, 1, name, (slice(2, spec.shape[0] - 1),))
            np.testing.assert_array_equal(full[2:-1], part)
        if spec.axes[:1] == ("layers",) and len(spec.shape) > 1 and spec.shape[1] > 3:  # stacked: a shard of each layer
            full = init_values(spec, 1, name)
            part = init_values(spec, 1, name, (slice(None), slice(2, spec.shape[1] - 1)))
            np.testing.assert_array_equal(full[:, 2:-1], part)
    table = np.asarray(layer_block(a, cfg, 0).moe.tid2eid)
    assert all(len(set(row)) == len(row) for row in table[:1000])  # distinct experts per token
    assert abs(np.std(np.asarray(a.embed)) - 0.02) < 1e-3


def test_resident_seeded_weights_are_stored_bytes_of_the_init_magnitude():
    """A named config loaded quantized="resident" draws FP8 / MXFP4 bytes on the device
    (seeded_stored's rule): the stored dtypes and shapes of its specs, E8M0 exponents from the
    rule's set, dequantized weights ~ N(0, std) within sampling and format error, and logits
    finite and of the bf16-init model's scale."""
    from dsjax.layers.quantized import Fp4Weight, Fp8Weight, dense
    from dsjax.model.stored import weight_specs
    from dsjax.params import check_against_specs

    cfg = load_config("tiny")
    model = dsjax.load_model("tiny", dtype="float32", quantized="resident", mtp=False)
    specs = weight_specs(cfg, jnp.float32, "resident")[0]
    check_against_specs(model.params, specs)
    stored = [w for w in jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, (Fp8Weight, Fp4Weight)))
              if isinstance(w, (Fp8Weight, Fp4Weight))]
    assert {type(w) for w in stored} == {Fp8Weight, Fp4Weight}
    exps = set()
    for w in stored:
        d = np.asarray(dense(w, jnp.float32)).ravel()
        e = np.asarray(w.scale_exp)
        # 2^(e0-127) = 2^round(log2 0.02) = 2^-6 (FP8) / 2^floor(log2 0.02) = 2^-6 (MXFP4); u in {-1,0,1} / {0,1}
        allowed = {120, 121, 122} if isinstance(w, Fp8Weight) else {121, 122}
        assert set(np.unique(e)) <= allowed, (type(w).__name__, np.unique(e))
        exps |= set(np.unique(e).tolist())
        assert abs(d.std() / 0.02 - 1) < 0.08 and abs(d.mean()) < 5 * 0.02 / np.sqrt(d.size), (d.std(), d.mean())
    assert len(exps) == 3  # the exponents are drawn, not one constant
    assert abs(np.asarray(model.params.embed).std() / 0.02 - 1) < 0.01  # plain weights: N(0, std), on the device
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 12))
    logits = model.logits(ids)
    plain = dsjax.load_model("tiny", dtype="float32", mtp=False).logits(ids)
    assert np.isfinite(logits).all() and 0.7 < logits.std() / plain.std() < 1.4


def test_resident_seeded_weights_do_not_depend_on_the_sharding():
    """Each [out, in] slice of a stored weight has its own key: drawn sharded over experts
    (each device its slices) the bytes are the single device's, bit for bit."""
    if jax.device_count() < 8:
        import pytest
        pytest.skip("needs 8 devices")
    one = dsjax.load_model("tiny", dtype="float32", quantized="resident", mtp=False)
    mesh = dsjax.load_model("tiny", dtype="float32", quantized="resident", mtp=False, mesh="data=2,expert=4")
    assert mesh.params.blocks[0][0].moe.w1.packed.sharding.spec[1] == "expert"
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(mesh.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
