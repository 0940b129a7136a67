"""Expert parallelism reading the routed experts as stored under the Mosaic TPU kernels
(dsjax/layers/moe.py `dispatch_combine` -> `stored_ffn`): each device of the `expert` axis
hands its local experts' (bytes, E8M0 exponents) to the grouped-FFN kernel, checked as
test_mosaic_tpu.py checks the kernels: in TPU interpret mode with the race detector, the
tiny model's logits on a fake-device mesh against one device's reference (which dequantizes),
and V4-Flash's programs exported for TPU on a v5e-8-sized mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_mosaic_tpu

from dsjax.config import load_config
from dsjax.kernels import grouped_matmul

race_detector = test_mosaic_tpu.race_detector  # the autouse fixture: every kernel call here with the detector on


def _two_layer_model(fmt: str, mesh=None, kernels: str = "reference", ep_dispatch: str = "auto"):
    """The tiny model cut to its first two layers (a hash-routed and a top-k MoE: both kinds of
    routing, half the interpreted program), routed experts kept as stored: MXFP4 as the release
    stores them, or FP8 with V4.1's 32 x 32 blocks (several per expert); the same seeded bytes
    on one device and on `mesh`."""
    import dataclasses

    from dsjax.api import Model
    from dsjax.config import RuntimeOptions
    from dsjax.layers.quantized import resident_specs
    from dsjax.model.family import family_of
    from dsjax.params import init_params
    from dsjax.sharding.rules import shardings_for

    cfg = load_config("tiny")
    cfg = dataclasses.replace(cfg, num_hidden_layers=2, layer_types=cfg.layer_types[:2],
                              mlp_layer_types=cfg.mlp_layer_types[:2])
    family = family_of(cfg)
    specs = family.param_specs(cfg, jnp.float32)
    if fmt == "mxfp4":
        stored = family.stored_format
        specs = resident_specs(specs, stored.fp8_block, stored.experts_fp4, stored.fp8_linears)
    else:
        specs = resident_specs(specs, (32, 32), experts_fp4=False, fp8_linears=())
    params = init_params(specs, 3, None if mesh is None else shardings_for(specs, mesh))
    return Model(cfg, params, jnp.float32, mesh, options=RuntimeOptions(kernels=kernels, ep_dispatch=ep_dispatch))


@pytest.mark.parametrize("fmt,ep_dispatch", [("mxfp4", "padded"), ("fp8", "ragged")])
def test_expert_parallel_step_reads_the_stored_experts(fmt, ep_dispatch, rng, monkeypatch):
    """On a data=2, expert=2 mesh with resident MXFP4 / FP8 experts, the kernel inside the
    expert-parallel step's shard_map gets each device's E / 2 experts as stored bytes (not a
    dequantized array), and the logits are one device's reference's (which dequantizes) within
    1e-5 of their scale (measured 5e-7 for both), through either exchange (the ragged one
    emulated on CPU)."""
    from dsjax.sharding.rules import make_mesh

    seen = []
    fn = grouped_matmul.tpu_grouped_ffn

    def spy(*a, **k):
        manual = jax.sharding.get_abstract_mesh().manual_axes
        seen.append((type(a[2]), a[2][0].dtype, a[2][0].shape[0], "expert" in manual))
        return fn(*a, **k)

    monkeypatch.setattr(grouped_matmul, "tpu_grouped_ffn", spy)
    ids = rng.integers(0, 5000, (4, 12))
    want = np.asarray(_two_layer_model(fmt).logits(ids))
    got = np.asarray(_two_layer_model(fmt, make_mesh("data=2,expert=2"), "mosaic_tpu", ep_dispatch).logits(ids))
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{fmt}: max |err| / scale = {err:.2e}")
    assert err <= 1e-5, err
    stored = jnp.int8 if fmt == "mxfp4" else jnp.float8_e4m3fn
    n_local = load_config("tiny").n_routed_experts // 2
    assert seen and all(s == (tuple, stored, n_local, True) for s in seen), seen


@pytest.mark.parametrize("experts_fp4,s", [(True, 1), (False, 1), (True, 256)])
def test_v4_flash_expert_parallel_step_exports_reading_stored_experts(experts_fp4, s, monkeypatch):
    """V4-Flash's decode step or a 256-token prefill chunk (8 rows, 8192 tokens of cache,
    abstract weights kept as stored: MXFP4 experts as released, or FP8 experts with its
    (128, 128) blocks) on a v5e-8-sized mesh of fake devices (data=2, expert=4) exports for TPU
    with v5e's block table (every kernel's blocks within Mosaic's block-shape rules: the chunk
    failed them with v5e's 4-query indexer blocks before), the grouped FFN in it reading each
    device's 64 local experts' stored bytes and exponents: int8 [64, N, K/2 | K] and uint8
    operands, no dequantized expert array."""
    import re

    from dsjax.config import RuntimeOptions
    from dsjax.kernels import dispatch, tpu_blocks
    from dsjax.layers.quantized import resident_specs
    from dsjax.model import batch_axes, cache_shapes, forward
    from dsjax.model.family import family_of
    from dsjax.params import abstract_params
    from dsjax.sharding.rules import batch_sharding, make_mesh, shardings_for
    from jax.experimental.pallas import tpu as pltpu

    S = jax.ShapeDtypeStruct
    monkeypatch.setattr(dispatch, "tpu_available", lambda: True)  # compile, as on a TPU
    monkeypatch.setattr(tpu_blocks, "generation", lambda: "v5e")
    jax.clear_caches()  # the kernels read the table when traced: no trace with another's blocks reused
    cfg = load_config("v4-flash")
    stored = family_of(cfg).stored_format
    specs = resident_specs(family_of(cfg).param_specs(cfg, jnp.bfloat16), stored.fp8_block, experts_fp4,
                           stored.fp8_linears)
    mesh = make_mesh("data=2,expert=4")
    params = abstract_params(specs, shardings_for(specs, mesh))
    cache = jax.tree.map(lambda a, ax: S(a.shape, a.dtype, sharding=batch_sharding(mesh, a.ndim, ax)),
                         cache_shapes(cfg, 8, 8192, jnp.bfloat16), batch_axes(cache_shapes(cfg, 8, 8192, jnp.bfloat16)))
    tokens, n_valid = (S(shape, jnp.int32, sharding=batch_sharding(mesh, len(shape))) for shape in ((8, s), (8,)))
    with pltpu.force_tpu_interpret_mode(None), jax.set_mesh(mesh):
        unstable = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
        text = jax.export.export(forward, platforms=["tpu"], disabled_checks=unstable)(
            params, tokens, cfg, cache, opts=RuntimeOptions(kernels="mosaic_tpu"), ctx_bucket=8192,
            n_valid=n_valid).mlir_module()
    jax.clear_caches()  # nor these traces after
    ffn = [line for line in text.splitlines() if "tpu_custom_call" in line and "dsjax_grouped_ffn" in line]
    pairs = [(len(re.findall(r"tensor<64x\d+x\d+xi8>", f)), len(re.findall(r"tensor<64x\d+x\d+xui8>", f)))
             for f in ffn]  # each call's stored bytes and E8M0 exponents: W1 and W3, then W2
    assert len(ffn) % 2 == 0 and sorted(set(pairs)) == [(1, 1), (2, 2)], pairs
    assert not re.search(r"tensor<64x(2048x4096|4096x2048)xbf16>", text)  # no local expert dequantized
    assert text.count("stablehlo.custom_call @ragged_all_to_all") > 0
