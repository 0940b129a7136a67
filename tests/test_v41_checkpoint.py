"""A DeepSeek-V4.1 checkpoint in DeepSeek's original format, written by the test suite's own
writer (tests/v41_checkpoint.py): its tensors are exactly those spec §8 lists (checked at
V4.1-Flash size by count and at tiny size by name), it loads to the values written, Engram
rows come from memory-mapped tables one row at a time, and the loaded model runs."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import v41_checkpoint
from dsjax.checkpoint import engram_tables
from dsjax.checkpoint.engram_tables import EngramStore
from dsjax.checkpoint.loader import load_checkpoint
from dsjax.checkpoint.names import canonical_name, mtp_weight_names, weight_names
from dsjax.checkpoint.safetensors_io import CheckpointError, CheckpointFiles
from dsjax.config import RuntimeOptions, load_config
from dsjax.layers.engram import dequant_rows, ngram_row_ids
from dsjax.model.v41.backbone import v41_logits, v41_streams
from dsjax.model.v41.params import DSparkParams, dspark_specs, v41_model_specs
from dsjax.params import spec_leaves

FP8_SCALED = v41_checkpoint.FP8


def _stored_names(cfg) -> set[str]:
    """The hub names (with scales, Engram tables) dsjax's name tables say a checkpoint holds."""
    names = set()
    for table, n_exp in ((weight_names(cfg), cfg.n_routed_experts),
                         (mtp_weight_names(cfg), cfg.v41.dspark.n_routed_experts)):
        for src in table.values():
            found = [f"{src.name}.{e}.{src.expert}.weight" for e in range(n_exp)] if src.expert else [src.name]
            for name in found:
                name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
                names.add(name)
                if name.endswith(FP8_SCALED) or ".experts." in name:
                    names.add(name[: -len("weight")] + "scale")
    for layer in cfg.v41.engram.layer_ids:
        names |= {f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"}
    return names


def test_tensor_names_match_the_release():
    flash = load_config("v41-flash")
    assert len(_stored_names(flash)) == 96085 - 266  # the release's count without the vision tower (§8)
    assert _stored_names(flash) == v41_checkpoint.expected_names(flash)
    tiny = load_config("tiny-v41")
    assert _stored_names(tiny) == v41_checkpoint.expected_names(tiny)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = load_config("tiny-v41")
    rng = np.random.default_rng(0)
    params, dspark = v41_checkpoint.random_weights(cfg, rng, perturb_dspark=False)
    directory = tmp_path_factory.mktemp("v41-ckpt")
    deq, deq_dspark, tables = v41_checkpoint.write(directory, cfg, params, dspark, rng)
    return cfg, directory, deq, deq_dspark, tables


def test_loads_the_values_written(checkpoint):
    cfg, directory, deq, deq_dspark, _ = checkpoint
    params, dspark = load_checkpoint(directory, cfg, v41_model_specs(cfg, jnp.float32),
                                     mtp_specs=dspark_specs(cfg, jnp.float32))
    for (path, got), (_, want) in zip(spec_leaves(params), spec_leaves(deq)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)
    for (path, got), (_, want) in zip(spec_leaves(dspark), spec_leaves(deq_dspark)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)
    # without the drafter's specs, its tensors are not an error; a missing backbone tensor is, by name
    load_checkpoint(directory, cfg, v41_model_specs(cfg, jnp.float32))
    files = CheckpointFiles(directory)
    names = {canonical_name(n) for n in files.tensors}
    files.close()
    assert "layers.5.attn.compressor.wgate.weight" in names  # a ratio-2 KV source has a gate
    assert "layers.10.attn.compressor.wgate.weight" not in names  # ratio 1 has none
    broken = dataclasses.replace(cfg, v41=dataclasses.replace(cfg.v41, kv_source_layers=(2, 5, 8, 9, 10)))
    with pytest.raises(CheckpointError, match="layers.9.attn.compressor"):
        load_checkpoint(directory, broken, v41_model_specs(broken, jnp.float32))


def test_engram_rows_from_host_tables_and_the_loaded_model_runs(checkpoint):
    """Rows are gathered from the memory-mapped tables (only those rows read), dequantized on
    the device, and the loaded model's logits equal those of the written values with rows
    looked up in the written (dequantized) tables."""
    cfg, directory, deq, _, tables = checkpoint
    params = load_checkpoint(directory, cfg, v41_model_specs(cfg, jnp.float32))
    b, s = 2, 12
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (b, s))
    store = EngramStore.from_checkpoint(directory, cfg)
    try:
        stored, history = store.rows(tokens, store.initial_history(b))
        e = cfg.v41.engram
        assert store.bytes_read == len(e.layer_ids) * b * s * e.n_hash * (e.head_dim + e.head_dim // 32)
        kappa = store.token_map[tokens].astype(np.int64)
        ids = [ngram_row_ids(store.layout, k, kappa, store.initial_history(b)) for k in range(len(e.layer_ids))]
    finally:
        store.close()
    rows = tuple(jax.jit(dequant_rows)(q, sc).astype(jnp.float32) for q, sc in stored)
    want_rows = tuple(jnp.asarray(tables[layer][i]) for layer, i in zip(e.layer_ids, ids))
    for got, want in zip(rows, want_rows):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    opts = RuntimeOptions(round_trips=False)
    run = jax.jit(lambda p, t, r: v41_logits(p, *v41_streams(p, t, cfg, engram_rows=r, opts=opts)[:2], cfg))
    got = np.asarray(run(params, jnp.asarray(tokens, jnp.int32), rows))
    want = np.asarray(run(jax.tree.map(jnp.asarray, deq), jnp.asarray(tokens, jnp.int32), want_rows))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_a_copied_checkpoints_engram_store_keeps_its_number(checkpoint, tmp_path, monkeypatch):
    """The number a V4.1 CPU step calls its Engram store by (`EngramStore.key`, part of the
    compiled program) follows the tables' bytes for files of at most IDENTITY_BYTES: a copy of
    the checkpoint elsewhere (other paths, other times) has the same number, so the steps
    compiled for one are read from JAX's persistent cache for the other; one changed byte of a
    table file gives another number. Larger files are known by path, size and time: then the
    copy has another number."""
    cfg, directory, *_ = checkpoint

    def key(d):
        store = EngramStore.from_checkpoint(d, cfg)
        try:
            return store.key, store.tables[0].path
        finally:
            store.close()

    (want, table), copy = key(directory), shutil.copytree(directory, tmp_path / "copy")
    assert key(copy)[0] == want
    changed = shutil.copytree(directory, tmp_path / "changed")
    data = bytearray((changed / table.name).read_bytes())
    data[-1] ^= 1
    (changed / table.name).write_bytes(bytes(data))
    assert key(changed)[0] != want
    monkeypatch.setattr(engram_tables, "IDENTITY_BYTES", 0)
    assert key(copy)[0] != key(directory)[0]


def test_engram_rows_fetched_inside_the_cached_step(checkpoint):
    """The cached path with Engram rows fetched by the host during the jitted step
    (`engram_fetch`: hashing with the cache's history, a row gather from the mapped tables)
    equals the full-sequence forward given the rows up front: prefill 8, then 4 decodes, with
    one row idle in the last decode (its history stays)."""
    import functools

    from dsjax.model.cache_layout import init_cache
    from dsjax.model.v41.backbone import v41_streams_cached

    cfg, directory, deq, _, _ = checkpoint
    params = jax.tree.map(jnp.asarray, deq)
    opts = RuntimeOptions(round_trips=False, index_keys_from_owner=True)
    b, s = 2, 12
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    store = EngramStore.from_checkpoint(directory, cfg)
    try:
        stored, _ = store.rows(tokens, store.initial_history(b))
        rows = tuple(dequant_rows(jnp.asarray(q), jnp.asarray(sc)).astype(jnp.float32) for q, sc in stored)
        full = jax.jit(lambda p, t, r: v41_logits(p, *v41_streams(p, t, cfg, engram_rows=r, opts=opts)[:2], cfg))
        want = np.asarray(full(params, tokens, rows))
        before = store.bytes_read

        @functools.partial(jax.jit, static_argnames="c")
        def step(params, t, cache, n_valid, c):
            streams, pi, cache, _ = v41_streams_cached(params, t, cfg, cache, ctx_bucket=32, n_valid=n_valid,
                                                       engram_rows=store.fetch, opts=opts)
            return v41_logits(params, streams, pi, cfg), cache

        cache = init_cache(cfg, b, 32, jnp.float32)
        got, pos = [], 0
        for c in (8, 1, 1, 1):
            logits, cache = step(params, tokens[:, pos:pos + c], cache, np.full(b, c, np.int32), c=c)
            got.append(np.asarray(logits))
            pos += c
        np.testing.assert_allclose(np.concatenate(got, axis=1), want[:, :pos], atol=1e-5 * np.abs(want).max(), rtol=0)
        e = cfg.v41.engram
        assert store.bytes_read - before == len(e.layer_ids) * b * pos * e.n_hash * (e.head_dim + e.head_dim // 32)
        kappa = store.token_map[tokens[:, pos - 3:pos]]
        np.testing.assert_array_equal(np.asarray(cache.history), kappa)  # the last 3 compressed ids
        idle = np.asarray(step(params, tokens[:, pos:pos + 1], cache, np.array([1, 0], np.int32), c=1)[1].history)
        np.testing.assert_array_equal(idle[1], kappa[1])  # a row with n_valid 0 keeps its history
        np.testing.assert_array_equal(idle[0], np.append(kappa[0, 1:], store.token_map[tokens[0, pos]]))
    finally:
        store.close()


def test_load_model_and_engine_generate(checkpoint):
    """`dsjax.load_model` reads the checkpoint and maps its Engram tables; the engine's greedy
    output (prefill, cached decode steps fetching Engram rows from the host, and a second
    request reusing the first one's slot) is the argmax of the full-sequence forward given the
    rows the written tables hold for the whole sequence."""
    import dsjax
    from dsjax.engine.engine import Engine
    from dsjax.engine.sampler import SamplingParams

    cfg, directory, deq, _, tables = checkpoint
    model = dsjax.load_model(directory, dtype="float32")
    model = model.replace(options=model.options.replace(round_trips=False, index_keys_from_owner=True))
    assert isinstance(model.params.engram_tables, EngramStore) and isinstance(model.mtp, DSparkParams)
    prompts = [[11, 402, 7, 7, 93, 5000], [3, 129279, 44, 12, 8, 61]]
    engine = Engine(model, max_slots=1, capacity=32, prefill_chunk=8)
    out = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    seqs = np.array([p + o for p, o in zip(prompts, out)], np.int32)  # [2, 12]

    e = cfg.v41.engram
    store = EngramStore.from_checkpoint(directory, cfg)
    try:
        kappa = store.token_map[seqs].astype(np.int64)
        history = store.initial_history(len(seqs))
    finally:
        store.close()
    rows = tuple(jnp.asarray(tables[layer][ngram_row_ids(model.params.engram_tables.layout, k, kappa, history)])
                 for k, layer in enumerate(e.layer_ids))
    opts = model.options
    full = jax.jit(lambda p, t, r: v41_logits(p, *v41_streams(p, t, cfg, engram_rows=r, opts=opts)[:2], cfg))
    want = np.asarray(full(jax.tree.map(jnp.asarray, deq), seqs, rows))
    np.testing.assert_array_equal(seqs[:, 6:], want[:, 5:-1].argmax(-1))
    # Model.logits, rows fetched from the mapped tables during the forward
    np.testing.assert_allclose(model.logits(seqs), want, atol=1e-5 * np.abs(want).max(), rtol=0)
