"""Meshes (8 fake CPU devices): sharded forward, decode and engine equal one device;
experts split over the expert axis; skewed routing; two processes with jax.distributed."""

import functools
import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.model.cache import batch_axes
from dsjax.model.cache_layout import init_cache
from dsjax.model import forward, model_specs, mtp_specs
from dsjax.params import init_params
from dsjax.sharding.rules import batch_sharding, make_mesh, parse_mesh_spec, shardings_for

MESHES = ["data=1", "data=2,expert=4", "expert=8", "data=2,expert=2,tensor=2"]
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


@pytest.fixture(scope="module")
def single():
    return dsjax.load_model("tiny", dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 5000, int(k)).tolist() for k in (5, 37, 12, 70, 3, 20, 44, 9)]


@pytest.mark.parametrize("mesh", MESHES)
def test_forward_matches_one_device(single, mesh, rng):
    # one mesh gets a sequence shorter than the HCA ratio (no compressed entry at all)
    ids = rng.integers(0, 5000, (8, 12 if mesh == "data=2,expert=4" else 37))
    sharded = dsjax.load_model("tiny", dtype="float32", mesh=mesh)
    np.testing.assert_allclose(sharded.logits(ids), single.logits(ids), atol=1e-5, rtol=0)


def test_forward_hf_config_on_mesh(hf_checkpoints, rng):
    """An HF-converted checkpoint read shard by shard: hc_mult 2, 16 experts on expert=8."""
    _, path = hf_checkpoints("hca")
    ids = rng.integers(0, 512, (8, 23))
    want = dsjax.load_model(path, dtype="float32").logits(ids)
    got = dsjax.load_model(path, dtype="float32", mesh="data=2,expert=2,tensor=2").logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=0)


@pytest.mark.parametrize("mesh", MESHES[1:])
def test_cached_decode_on_mesh_matches_full_forward(single, mesh, rng):
    """Prefill + decode through the batch-sharded cache equals the one-device forward."""
    model = dsjax.load_model("tiny", dtype="float32", mesh=mesh)
    cfg = model.config
    ids = rng.integers(0, 5000, (8, 40)).astype(np.int32)
    want = np.asarray(forward(single.params, jnp.asarray(ids), cfg)[0])
    got = []
    with model.mesh_context():
        cache = init_cache(cfg, 8, 256, jnp.float32)
        cache = jax.tree.map(lambda a, ax: jax.device_put(a, batch_sharding(model.mesh, a.ndim, ax)), cache,
                             batch_axes(cache))
        for start, c in ((0, 24), (24, 8), *((p, 1) for p in range(32, 40))):
            tok = jax.device_put(ids[:, start:start + c], batch_sharding(model.mesh, 2))
            n = jax.device_put(np.full(8, c, np.int32), batch_sharding(model.mesh, 1))
            logits, cache = forward(model.params, tok, cfg, cache, n_valid=n, ctx_bucket=256)
            got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh", MESHES[-1:])  # all three axes at once; forward and decode cover the others
def test_greedy_engine_tokens_match_one_device(single, mesh, prompts):
    want = dsjax.generate(single, prompts, 12)
    assert dsjax.generate(dsjax.load_model("tiny", dtype="float32", mesh=mesh), prompts, 12) == want


def test_greedy_speculation_on_mesh_matches_plain_engine():
    """Speculative decoding (the MTP drafter, 2 drafts) on data=2,expert=4: each slot's row on
    its own batch shard, prefill chunks over every row at once, the verify step's rollback and
    the drafter's ring row by row. tiny cut to a 6-token vocabulary (a random drafter then
    both hits and misses; seed 6: outputs that change token, not one token repeated): greedy
    requests equal the plain engine's on the same mesh; a sampled request in the batch sends
    the greedy rows through the sampling variant (draft distributions, acceptance draws on
    each shard's rows)."""
    cfg = dsjax.load_config("tiny").replace(vocab_size=6, name="tiny-v6")
    mesh = make_mesh("data=2,expert=4")
    specs, m_specs = model_specs(cfg, jnp.float32), mtp_specs(cfg, jnp.float32)
    with jax.set_mesh(mesh):
        model = dsjax.Model(cfg, init_params(specs, 6, shardings_for(specs, mesh)), jnp.float32, mesh,
                            init_params(m_specs, 7, shardings_for(m_specs, mesh)))
    prompts = [np.random.default_rng(0).integers(2, 6, n).tolist() for n in (5, 19, 12)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 3
    prompts.append(prompts[1])
    params.append(SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5))
    engine = functools.partial(Engine, model, max_slots=8, capacity=64, prefill_chunk=16)
    plain = engine().generate(prompts[:3], params[:3])
    spec = engine(num_draft_tokens=2, spec_policy="fixed")
    assert spec.generate(prompts, params)[:3] == plain
    m = spec.spec_metrics()
    assert 0 < m["drafts_accepted"] < m["drafts_proposed"]


@pytest.mark.parametrize("mesh", MESHES[1:])
def test_weights_split_over_their_axes(mesh):
    model = dsjax.load_model("tiny", dtype="float32", mesh=mesh)
    sizes = parse_mesh_spec(mesh)
    for block in (b for period in model.params.blocks for b in period):  # stacked layers: leading axis unsharded
        for w in (block.moe.w1, block.moe.w2, block.moe.w3):
            assert {s.data.nbytes for s in w.addressable_shards} == {w.nbytes // sizes["expert"]}
        q = block.attn.q_b_proj
        assert {s.data.nbytes for s in q.addressable_shards} == {q.nbytes // sizes["tensor"]}
        assert {s.data.nbytes for s in block.attn.kv_proj.addressable_shards} == {block.attn.kv_proj.nbytes}
    head = model.params.lm_head
    assert {s.data.nbytes for s in head.addressable_shards} == {head.nbytes // sizes["tensor"]}


def _all_to_two_experts(model):
    """Route every token of every layer to experts 0 and 1 (router flat, bias on 0 and 1;
    hash tables all [0, 1]): the whole batch lands on one expert shard."""
    def one(block):  # a run's stacked block: leaves [repeats, ...]
        moe = block.moe
        router = jnp.zeros_like(moe.router)
        bias = None if moe.router_bias is None else jnp.zeros_like(moe.router_bias).at[..., :2].set(10.0)
        table = None if moe.tid2eid is None else jnp.zeros_like(moe.tid2eid).at[..., 1].set(1)
        return block.replace(moe=moe.replace(router=router, router_bias=bias, tid2eid=table))

    return model.params.replace(blocks=tuple(tuple(one(b) for b in period) for period in model.params.blocks))


def test_skewed_routing(single, rng):
    ids = rng.integers(0, 5000, (8, 33))
    sharded = dsjax.load_model("tiny", dtype="float32", mesh="expert=8")
    skew_one = dsjax.Model(single.config, _all_to_two_experts(single), single.dtype)
    with sharded.mesh_context():
        skew_mesh = dsjax.Model(sharded.config, _all_to_two_experts(sharded), sharded.dtype, sharded.mesh)
    want = skew_one.logits(ids)
    np.testing.assert_allclose(skew_mesh.logits(ids), want, atol=1e-5, rtol=0)
    # capacity-based dropping is an explicit option, and it does drop under this skew
    capped = skew_mesh.replace(options=skew_mesh.options.replace(moe_capacity_factor=1.0))
    assert np.abs(capped.logits(ids) - want).max() > 1e-3


def test_two_processes_with_jax_distributed(single, prompts):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).parent / "scripts" / "distributed_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), f"localhost:{port}", "2", str(i), "data=2,expert=4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    want = dsjax.generate(single, prompts, 10)
    for r in results:
        assert r["tokens"] == want[r["pid"]::2]
        assert r["w1_shard_bytes"] == [r["w1_total_bytes"] // 4]  # expert=4: a quarter of the experts each


def test_too_big_for_the_mesh_fails_early():
    with pytest.raises(MemoryError, match=r"need [\d.]+ MiB \(\d+ B\) on each device of mesh .*expert.*: 8.*"
                                          r"holds 1\.00 MiB \(1048576 B\); use a larger mesh"):
        dsjax.load_model("tiny", dtype="float32", mesh="expert=8", device_memory_bytes=1 << 20)
    from dsjax.config import load_config
    from dsjax.model import model_specs
    from dsjax.sharding.rules import bytes_per_device

    flash = bytes_per_device(model_specs(load_config("v4-flash")), {"expert": 8})
    assert flash["routed_experts"] == 43 * 256 * 3 * 2048 * 4096 * 2 // 8


def test_mesh_spec_errors():
    with pytest.raises(ValueError, match="unknown axis 'pipeline'"):
        parse_mesh_spec("pipeline=2")
    with pytest.raises(ValueError, match="expected comma-separated axis=size"):
        parse_mesh_spec("data:2")
    with pytest.raises(ValueError, match="needs 16 devices, 8 are available"):
        make_mesh("data=2,expert=8")
    with pytest.raises(ValueError, match="expert=3 does not divide n_routed_experts=8"):
        dsjax.load_model("tiny", mesh="expert=3")
