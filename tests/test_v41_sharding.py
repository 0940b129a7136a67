"""DeepSeek-V4.1 on a mesh (8 fake CPU devices): prefill chunks and decodes through the
batch-sharded cache, with experts split over the expert axis and weights over the tensor
axis, equal the full-sequence forward (the float64 oracle's, unsharded; tiny-v41, fp32, no
round trips, the owner's index keys so chunked and full agree)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.config import RuntimeOptions, load_config
from dsjax.engine.engine import Engine
from dsjax.engine.executables import host_callbacks
from dsjax.engine.sampler import SamplingParams
from dsjax.model.cache import batch_axes
from dsjax.model.cache_layout import init_cache
from dsjax.model.forward_pass import forward
from dsjax.model.v41.backbone import v41_logits, v41_streams_cached
from dsjax.model.v41.params import v41_model_specs
from dsjax.params import init_params
from dsjax.sharding.rules import batch_sharding, make_mesh, shardings_for

import v41_oracle  # tests/ is on sys.path (conftest.py)
from test_v41_forward import HP, _oracle_weights

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
OPTS = RuntimeOptions(round_trips=False, index_keys_from_owner=True)
CAP = 32


def test_cached_decode_on_mesh_matches_one_device():
    cfg = load_config("tiny-v41")
    specs = v41_model_specs(cfg, jnp.float32)
    ids = np.random.default_rng(0).integers(0, 5000, (8, 20)).astype(np.int32)
    want, _ = v41_oracle.forward(_oracle_weights(init_params(specs, seed=0), cfg), ids, HP)  # float64, no mesh

    @functools.partial(jax.jit, static_argnames="c", donate_argnames="cache")
    def step(params, tokens, cache, n_valid, c):
        streams, pi, cache, _ = v41_streams_cached(params, tokens, cfg, cache, ctx_bucket=CAP, n_valid=n_valid,
                                                   opts=OPTS)
        return v41_logits(params, streams, pi, cfg), cache

    mesh = make_mesh("data=2,expert=2,tensor=2")
    got = []
    with jax.set_mesh(mesh):
        params = init_params(specs, seed=0, shardings=shardings_for(specs, mesh))
        cache = init_cache(cfg, 8, CAP, jnp.float32)
        cache = jax.tree.map(lambda a, ax: jax.device_put(a, batch_sharding(mesh, a.ndim, ax)), cache,
                             batch_axes(cache))
        for start, c in ((0, 8), (8, 8), *((p, 1) for p in range(16, 20))):
            tok = jax.device_put(ids[:, start:start + c], batch_sharding(mesh, 2))
            n = jax.device_put(np.full(8, c, np.int32), batch_sharding(mesh, 1))
            logits, cache = step(params, tok, cache, n, c=c)
            got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_load_model_on_mesh_with_round_trips_and_engram():
    """`dsjax.load_model` of tiny-v41 on a mesh (its seeded Engram tables read on the host before
    the forward, the rows split over the batch axes; the quantisation round trips on, as by
    default) gives the one-device model's logits, from a program without a host callback (JAX's
    persistent cache keeps it): the FP4 round trip's values are summed from code steps, not
    gathered from a constant table, which under an explicit mesh had no sharding."""
    ids = np.random.default_rng(1).integers(0, 5000, (2, 10))
    model = dsjax.load_model("tiny-v41", mesh="data=2,expert=4")
    assert model.options.round_trips and model.params.engram_tables is not None
    rows = np.pad(ids, ((0, model.batch_shards() - 2), (0, 0))).astype(np.int32)  # the batch shards' rows
    with model.mesh_context():
        x = jax.device_put(rows, batch_sharding(model.mesh, 2))
        lowered = forward.lower(model.sequence_params(rows), x, model.config, opts=model.options)
    assert not host_callbacks(lowered)
    got = model.logits(ids)
    want = dsjax.load_model("tiny-v41").logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_engine_on_a_tensor_mesh_equals_one_device():
    """A V4.1 engine whose mesh splits the vocabulary (tensor=2): the head's vocab-parallel
    logits are gathered before the rows are sampled (the sampler runs per batch shard; they
    reached it split and the step failed), and greedy tokens equal one device's (round trips
    off: with them, tensor-parallel sums can round a quantisation step the other way)."""
    prompts = np.random.default_rng(4).integers(0, 5000, (2, 11)).tolist()
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    off = lambda m: m.replace(options=m.options.replace(round_trips=False))  # noqa: E731
    want = Engine(off(dsjax.load_model("tiny-v41")), max_slots=2, capacity=CAP, prefill_chunk=16).generate(
        prompts, sampling)
    mesh_model = off(dsjax.load_model("tiny-v41", mesh="data=2,tensor=2"))
    assert Engine(mesh_model, max_slots=2, capacity=CAP, prefill_chunk=16).generate(prompts, sampling) == want
