"""Expert parallelism's two exchanges (dsjax/sharding/expert_dispatch.py): ragged
(`jax.lax.ragged_all_to_all`) and padded all_to_all give one device's logits under uneven
expert loads with an expert that receives nothing; the CPU stand-in for the ragged collective
against the documented semantics; the ragged collective itself in programs lowered for TPU and
GPU (XLA:CPU has none to run)."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dsjax
from dsjax.config import HASH_MOE, RuntimeOptions
from dsjax.layers.moe import moe_specs, routed_experts_sharded
from dsjax.params import abstract_params
from dsjax.sharding.expert_dispatch import emulated_ragged_all_to_all
from dsjax.sharding.rules import make_mesh, shardings_for

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
NEVER, HOT = 5, 0  # expert 5 receives nothing, expert 0 nearly every token


def _uneven(params):
    """Every MoE layer's routing bent: top-k layers' selection bias -10 on expert NEVER (scores
    are sqrt(softplus) >= 0 and small at tiny's scale, so it never makes the top 2) and +3 on
    HOT; hash layers' tables with NEVER replaced by an expert the row does not hold."""
    def one(block):
        moe = block.moe
        bias = moe.router_bias
        if bias is not None:
            bias = jnp.zeros_like(bias).at[..., NEVER].set(-10.0).at[..., HOT].set(3.0)
        table = moe.tid2eid
        if table is not None:  # K = 2: the row's other entry decides the stand-in
            table = jnp.where(table == NEVER, jnp.where(table[..., ::-1] == NEVER + 1, NEVER + 2, NEVER + 1), table)
        return block.replace(moe=moe.replace(router_bias=bias, tid2eid=table))

    return params.replace(blocks=tuple(tuple(one(b) for b in period) for period in params.blocks))


@pytest.fixture(scope="module")
def want():
    single = dsjax.load_model("tiny", dtype="float32")
    ids = np.random.default_rng(0).integers(0, 5000, (8, 11))
    return ids, dsjax.Model(single.config, _uneven(single.params), single.dtype).logits(ids)


@pytest.mark.parametrize("mesh,modes", [("data=2,expert=4", ("ragged", "padded")), ("expert=8", ("ragged",))])
def test_ragged_and_padded_dispatch_match_one_device(want, mesh, modes):
    ids, logits = want
    model = dsjax.load_model("tiny", dtype="float32", mesh=mesh)
    with model.mesh_context():
        model = dsjax.Model(model.config, _uneven(model.params), model.dtype, model.mesh)
    for mode in modes:
        got = model.replace(options=model.options.replace(ep_dispatch=mode)).logits(ids)
        np.testing.assert_allclose(got, logits, atol=1e-5, rtol=0, err_msg=f"{mesh} {mode}")


def test_emulated_ragged_all_to_all_follows_the_documented_example():
    """jax.lax.ragged_all_to_all's docstring example (axis of size 2), and device 1 sending
    device 0 nothing."""
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    cases = [  # per device: operand, input_offsets, send_sizes, output_offsets, recv_sizes -> result (output 0s [4])
        (([1, 2, 2], [0, 1], [1, 2], [0, 0], [1, 1]), ([3, 4, 0], [0, 1], [1, 1], [1, 2], [2, 1]),
         [[1, 3, 0, 0], [2, 2, 4, 0]]),
        (([1, 2, 2], [0, 1], [1, 2], [0, 0], [1, 0]), ([3, 4, 0], [0, 0], [0, 2], [0, 2], [2, 2]),
         [[1, 0, 0, 0], [2, 2, 3, 4]]),
    ]
    f = jax.jit(jax.shard_map(
        lambda *a: emulated_ragged_all_to_all(a[0][0], jnp.zeros(4, a[0].dtype), *(v[0] for v in a[1:]),
                                              axis_name="expert")[None],
        mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    for dev0, dev1, result in cases:
        args = [jax.device_put(np.array([u, v], np.int32), jax.NamedSharding(mesh, P("expert")))
                for u, v in zip(dev0, dev1)]
        np.testing.assert_array_equal(f(*args), result)


# jax.export serializes only custom calls with compatibility guarantees; the ragged collective
# (a custom call in jax 0.10.2) has none yet, so a program carrying it is exported with this check off
UNSTABLE = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]


@functools.cache
def _moe_lowered(platform: str, ep_dispatch: str) -> str:
    """The routed experts of one tiny top-k layer on data=2,expert=4, as StableHLO for `platform`."""
    cfg = dsjax.load_config("tiny")
    layer = next(spec for spec in cfg.layers if spec.mlp != HASH_MOE)
    mesh = make_mesh("data=2,expert=4")
    specs = moe_specs(cfg, layer, jnp.float32)
    p = abstract_params(specs, shardings_for(specs, mesh))
    rows = jax.NamedSharding(mesh, P(("data", "expert")))
    x = jax.ShapeDtypeStruct((16, cfg.hidden_size), jnp.float32, sharding=rows)
    ids = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=rows)
    f = jax.jit(lambda p, x, ids: routed_experts_sharded(p, x, ids, cfg, ep_dispatch=ep_dispatch))
    with jax.set_mesh(mesh):
        return jax.export.export(f, platforms=[platform], disabled_checks=UNSTABLE)(p, x, ids).mlir_module()


def _ops(text: str) -> dict[str, int]:
    """The collectives in a StableHLO module, by name."""
    found = re.findall(r"stablehlo\.(all_to_all|all_gather|custom_call @ragged_all_to_all)", text)
    return dict(collections.Counter(op.removeprefix("custom_call @") for op in found))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_ragged_all_to_all_lowers_for_tpu_and_gpu(platform):
    """auto picks the collective where XLA has it: one all_gather of the counts, then a ragged
    exchange there and one back, no padded all_to_all; CPU keeps the padded exchange (rows,
    expert ids, rows back), and "padded" is padded everywhere."""
    assert _ops(_moe_lowered(platform, "auto")) == {"all_gather": 1, "ragged_all_to_all": 2}
    assert _ops(_moe_lowered(platform, "padded")) == {"all_to_all": 3}
    assert _ops(_moe_lowered("cpu", "auto")) == {"all_to_all": 3}


def test_ep_dispatch_option_errors():
    with pytest.raises(ValueError, match="ep_dispatch must be one of"):
        RuntimeOptions(ep_dispatch="sparse")
    with pytest.raises(ValueError, match="only ep_dispatch='padded'"):
        RuntimeOptions(ep_dispatch="ragged", moe_capacity_factor=1.0)
