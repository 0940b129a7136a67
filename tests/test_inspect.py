"""dsjax.inspect: capture and edit intermediates of the forward under jit, each checked against
an oracle (docs/inspect.md): capture changes nothing (bitwise, and the program without captures
is `forward`'s); captured routing is `route` recomputed from the captured MoE input; an expert
ablation is the model with that expert's down projection zeroed; patching a layer's streams with
another run's gives that run's logits, and at a position leaves earlier positions alone; on a
mesh with expert parallelism the same as one device. Tiny V4 (one layer per run, and a variant
with scanned runs) and tiny V4.1 (runs scanned inside a period)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import inspect
from dsjax.api import SMALLEST_SEQUENCE, padded_size
from dsjax.engine.executables import host_callbacks
from dsjax.inspect import _inspect
from dsjax.layers.moe import route
from dsjax.model import forward, layer_block, layer_slot, model_specs
from dsjax.params import init_params

S = 80  # long enough for the CSA layers' indexer to select (80 / 4 = 20 entries > index_topk 16); a length
# `Model.logits` runs as it is (`padded_size`), so its logits and `inspect.forward`'s compare bit for bit


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32")


@pytest.fixture(scope="module")
def scanned(tiny):
    """tiny with two scanned runs: 2 x sliding (hash MoE), 2 x [CSA, HCA]."""
    base = tiny.config
    cfg = base.replace(num_hidden_layers=6, layer_types=base.layer_types[:1] * 2 + base.layer_types[1:3] * 2,
                       mlp_layer_types=base.mlp_layer_types[:1] * 2 + base.mlp_layer_types[1:2] * 4)
    assert [run.repeats for run in cfg.layer_runs] == [2, 2]
    return dsjax.Model(cfg, init_params(model_specs(cfg, jnp.float32), 3), jnp.float32, None)


@pytest.fixture(scope="module")
def v41():
    model = dsjax.load_model("tiny-v41", dtype="float32")
    assert any(run.repeats > 1 and max(run.inner) > 1 for run in model.config.layer_runs)
    return model


@pytest.fixture(scope="module")
def models(tiny, scanned, v41):
    return {"tiny": tiny, "scanned": scanned, "v41": v41}


def ids(seed: int, b: int = 2, s: int = S) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, (b, s)).astype(np.int32)


def test_logits_share_padded_programs_and_equal_the_unpadded_forward(tiny):
    """`Model.logits` runs [B, S] padded to `padded_size` (at least 16 tokens, then four sizes an
    octave): lengths 17..20 share one program, and each one's logits are those of the forward
    over the exact shape (`inspect.forward`) to float rounding, so nothing of the padding after
    a sequence reaches it (causal), while a padding that leaked would move them far more."""
    n = np.arange(1, 5000)
    sizes = np.array([padded_size(int(k), SMALLEST_SEQUENCE) for k in n])
    assert padded_size(S, SMALLEST_SEQUENCE) == S and (sizes >= n).all() and (np.diff(sizes) >= 0).all()
    assert (sizes[n > SMALLEST_SEQUENCE] <= 1.25 * n[n > SMALLEST_SEQUENCE]).all()
    assert len(set(sizes)) == 34  # 16, four an octave up to 4096, then 5120
    assert [padded_size(b, 1) for b in range(1, 11)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10]
    programs = forward._cache_size()
    for s in (17, 19, 20):
        x = ids(4, 2, s)
        np.testing.assert_allclose(tiny.logits(x), np.asarray(inspect.forward(tiny, x)[0]), rtol=1e-5, atol=1e-5)
    assert forward._cache_size() == programs + 1


def test_v41_whole_sequence_fetches_its_engram_rows_before_the_call(v41, monkeypatch):
    """`Model.logits` and `inspect.forward` on one device fetch V4.1's Engram rows from the host
    tables before the call, and a program that fetches them during the step calls the store by
    number on a CPU (`cpu_kernels.host_call`): neither holds a host callback (JAX's persistent
    cache keeps them; a program with one is compiled in every process), and their logits are
    equal bit for bit. The fetch by number gives the bytes that `jax.pure_callback` gives (what
    an engine step runs on a GPU or a TPU), checked on the fetch alone: a whole forward with a
    callback would compile in every run of the suite."""
    from dsjax.kernels import cpu as cpu_kernels
    from dsjax.layers.engram import BEFORE_START
    from dsjax.model.forward_pass import forward
    from dsjax.model.interface import with_sequence_rows
    from dsjax.model.v41.backbone import engram_fetch

    cfg, x = v41.config, ids(3)
    store = v41.params.engram_tables
    assert store is not None
    by_number = forward.lower(v41.params, jnp.asarray(x), cfg, opts=v41.options)
    before = forward.lower(with_sequence_rows(v41.params, x, cfg), jnp.asarray(x), cfg, opts=v41.options)
    assert not host_callbacks(before) and not host_callbacks(by_number) and cpu_kernels.HOST in by_number.as_text()
    want = np.asarray(before.compile()(with_sequence_rows(v41.params, x, cfg), jnp.asarray(x))[0])
    np.testing.assert_array_equal(np.asarray(by_number.compile()(v41.params, jnp.asarray(x))[0]), want)
    np.testing.assert_array_equal(v41.logits(x), want)
    np.testing.assert_array_equal(np.asarray(inspect.forward(v41, x)[0]), want)

    history = np.full((2, cfg.v41.engram.max_ngram_size - 1), BEFORE_START, np.int32)
    history[1] = x[1, -history.shape[1]:]  # a row in mid-sequence
    args = (jnp.asarray(x), jnp.asarray(history), jnp.asarray([S, S - 7], jnp.int32))

    def fetched():
        lowered = jax.jit(lambda *a: engram_fetch(store.fetch, cfg, *a)).lower(*args)
        return lowered, [np.asarray(a).tobytes() for a in jax.tree.leaves(lowered.compile()(*args))]

    number, got = fetched()
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "host_calls", lambda: False)
        callback, expected = fetched()
    assert host_callbacks(callback) and not host_callbacks(number) and cpu_kernels.HOST in number.as_text()
    assert got == expected


@pytest.mark.parametrize("name", ["tiny", "scanned", "v41"])
def test_capture_changes_nothing(models, name):
    """Every point captured: the logits are the plain forward's, bit for bit; the captured streams
    chain from layer to layer (so stacked scan outputs were cut into the right layers)."""
    model = models[name]
    x = ids(0)
    logits, trace = inspect.forward(model, x, capture="*")
    np.testing.assert_array_equal(np.asarray(logits), model.logits(x))
    cfg = model.config
    assert set(inspect.names(model, 2, S)) >= {k for k in trace}
    for layer in cfg.layers[:-1]:
        nxt = cfg.layers[layer.index + 1]
        if not nxt.engram:  # an Engram update lies between them
            np.testing.assert_array_equal(trace[f"layers.{layer.index}.mhc.streams_out"],
                                          trace[f"layers.{nxt.index}.mhc.streams_in"])
    np.testing.assert_array_equal(trace[f"layers.{cfg.layers[-1].index}.mhc.streams_out"], trace["final.streams"])
    if name == "v41":
        assert trace["layers.1.engram.gate"].shape == (2, S, cfg.hc_mult)


def _strip(text: str) -> str:
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", text)  # location metadata
    text = re.sub(r"#loc\d*\s*=.*\n", "", text)
    return re.sub(r"module @\S+", "module @m", text)


@pytest.mark.parametrize("name", ["tiny", "v41"])
def test_program_without_capture_is_forwards(models, name):
    model = models[name]
    x = jnp.asarray(ids(0))
    want = forward.lower(model.params, x, model.config, opts=model.options).as_text()
    got = _inspect.lower(model.params, x, {}, cfg=model.config, opts=model.options, capture=()).as_text()
    assert _strip(got) == _strip(want)


@pytest.mark.parametrize("name", ["tiny", "v41"])
def test_router_capture_is_route_recomputed(models, name):
    model = models[name]
    cfg, x = model.config, ids(1)
    _, trace = inspect.forward(model, x, capture={"layers.*.moe.in", "layers.*.moe.experts", "layers.*.moe.weights"})
    recompute = jax.jit(route, static_argnames="cfg")
    for layer in cfg.layers:
        i = layer.index
        h = trace[f"layers.{i}.moe.in"]
        w, e = recompute(layer_block(model.params, cfg, i).moe, h.reshape(-1, h.shape[-1]), jnp.asarray(x).reshape(-1),
                         cfg)
        np.testing.assert_array_equal(trace[f"layers.{i}.moe.experts"].reshape(e.shape), e)
        np.testing.assert_allclose(trace[f"layers.{i}.moe.weights"].reshape(w.shape), w, atol=1e-6, rtol=0)
    if name == "tiny":  # the hash layer's experts are its table's rows
        table = np.asarray(layer_block(model.params, cfg, 0).moe.tid2eid)
        np.testing.assert_array_equal(trace["layers.0.moe.experts"], table[x])


def _zero_down_projection(model, layer: int, expert: int):
    k, j, r = layer_slot(model.config, layer)
    block = model.params.blocks[k][j]
    w2 = block.moe.w2.at[r, expert].set(0.0)
    blocks = list(map(list, model.params.blocks))
    blocks[k][j] = block.replace(moe=block.moe.replace(w2=w2))
    return model.replace(params=model.params.replace(blocks=tuple(map(tuple, blocks))))


@pytest.mark.parametrize("name, layer, expert", [("tiny", 1, 3), ("scanned", 4, 5), ("v41", 3, 2)])
def test_ablating_an_expert_is_zeroing_its_down_projection(models, name, layer, expert):
    """Scanned layers (4 of `scanned`; 3 of V4.1, inside a period's inner scan) take the edit
    stacked over their run; the routing weights are kept."""
    model = models[name]
    x = ids(2)
    base, plain = inspect.forward(model, x, capture=f"layers.{layer}.moe.weights")
    logits, trace = inspect.forward(model, x, capture=f"layers.{layer}.moe.weights",
                                    edits=inspect.ablate(model.config, layer, [expert]))
    want = _zero_down_projection(model, layer, expert).logits(x)
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-6, rtol=0)
    assert not np.array_equal(np.asarray(logits), np.asarray(base))
    np.testing.assert_array_equal(trace[f"layers.{layer}.moe.weights"], plain[f"layers.{layer}.moe.weights"])


def test_an_edit_sweep_compiles_once(tiny):
    x = ids(2)
    inspect.forward(tiny, x, capture="layers.1.moe.out", edits=inspect.ablate(tiny.config, 1, [0]))
    before = _inspect._cache_size()
    outs = [np.asarray(inspect.forward(tiny, x, capture="layers.1.moe.out",
                                       edits=inspect.ablate(tiny.config, 1, [e]))[1]["layers.1.moe.out"])
            for e in range(1, 4)]
    assert _inspect._cache_size() == before
    assert not np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("name, layer", [("tiny", 2), ("scanned", 4)])
def test_patching_streams(models, name, layer):
    """B's streams into layer `layer` replaced by A's: A's logits, bitwise (no hash layer or
    Engram after it reads B's tokens). At one position p only: B's logits before p unchanged."""
    model = models[name]
    a, b = ids(3), ids(4)
    point = f"layers.{layer}.mhc.streams_in"
    want, trace_a = inspect.forward(model, a, capture=point)
    got, _ = inspect.forward(model, b, edits=inspect.patch(point, trace_a[point]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    p = 50
    plain = model.logits(b)
    got, _ = inspect.forward(model, b, edits=inspect.patch(point, trace_a[point], where=inspect.at_positions(S, p)))
    got = np.asarray(got)
    np.testing.assert_array_equal(got[:, :p], plain[:, :p])
    assert not np.allclose(got[:, p], plain[:, p])


def test_patching_a_scanned_v41_layer_edits_that_layer_only(v41):
    a, b = ids(3), ids(4)
    pattern = "layers.[24].mhc.streams_in"  # two repeats of one period position: one edited
    _, trace_a = inspect.forward(v41, a, capture=pattern)
    _, plain = inspect.forward(v41, b, capture=pattern)
    _, got = inspect.forward(v41, b, capture=pattern,
                             edits=inspect.patch("layers.4.mhc.streams_in", trace_a["layers.4.mhc.streams_in"]))
    np.testing.assert_array_equal(got["layers.4.mhc.streams_in"], trace_a["layers.4.mhc.streams_in"])
    np.testing.assert_array_equal(got["layers.2.mhc.streams_in"], plain["layers.2.mhc.streams_in"])


def test_steering_and_forced_routing(tiny):
    x = ids(5)
    cfg = tiny.config
    v = np.random.default_rng(0).normal(size=cfg.hidden_size).astype(np.float32)
    _, plain = inspect.forward(tiny, x, capture="layers.3.mhc.streams_in")
    _, steered = inspect.forward(tiny, x, capture="layers.3.mhc.streams_in",
                                 edits=inspect.steer("layers.3.mhc.streams_in", v))
    np.testing.assert_array_equal(steered["layers.3.mhc.streams_in"], plain["layers.3.mhc.streams_in"] + v)
    names = {"layers.2.moe.experts", "layers.2.moe.weights", "layers.2.moe.scores"}
    _, forced = inspect.forward(tiny, x, capture=names, edits=inspect.force_experts(2, [6, 1]))
    np.testing.assert_array_equal(forced["layers.2.moe.experts"], np.broadcast_to([6, 1], (2, S, 2)))
    s = np.asarray(forced["layers.2.moe.scores"])[..., [6, 1]]
    np.testing.assert_allclose(forced["layers.2.moe.weights"], s / s.sum(-1, keepdims=True) * cfg.routed_scaling_factor,
                               rtol=1e-6)


def test_masking_indexer_entries(tiny):
    x = ids(6)
    hidden = np.zeros(S // 4, bool)
    hidden[:3] = True  # entries 0..2 hidden from every query of layer 1
    names = {"layers.1.indexer.visible", "layers.1.indexer.selected"}
    plain_logits, plain = inspect.forward(tiny, x, capture=names)
    logits, trace = inspect.forward(tiny, x, capture=names, edits=inspect.mask_entries(1, hidden))
    assert not np.asarray(trace["layers.1.indexer.visible"])[..., :3].any()
    np.testing.assert_array_equal(np.asarray(trace["layers.1.indexer.visible"])[..., 3:],
                                  np.asarray(plain["layers.1.indexer.visible"])[..., 3:])
    selected = np.asarray(trace["layers.1.indexer.selected"])
    last = selected[:, -1]  # the last query sees 20 entries, keeps 16: never a hidden one
    assert (last >= 3).all()
    np.testing.assert_array_equal(np.asarray(logits)[:, :3], np.asarray(plain_logits)[:, :3])  # nothing visible yet
    assert not np.allclose(np.asarray(logits)[:, -1], np.asarray(plain_logits)[:, -1])


def test_bad_names_and_shapes(tiny):
    x = ids(0)
    with pytest.raises(ValueError, match=r"matches no point(.|\n)*layers\.\{i\}\.moe\.experts  i in \[0, 1, 2, 3\]"):
        inspect.forward(tiny, x, capture="layers.*.moe.expert_ids")
    with pytest.raises(ValueError, match=r"layers\.9\.mhc\.streams_in'\]: no such point"):
        inspect.forward(tiny, x, edits=inspect.patch("layers.9.mhc.streams_in", np.zeros(4)))
    with pytest.raises(ValueError, match=r"value shape \(3, 64\) does not broadcast to the tapped shape "
                                         r"\(2, 80, 4, 64\)"):
        inspect.forward(tiny, x, edits=inspect.patch("layers.1.mhc.streams_in", np.zeros((3, 64), np.float32)))
    with pytest.raises(ValueError, match=r"`where` shape \(1, 7\)"):
        inspect.forward(tiny, x, edits=inspect.patch("layers.1.mhc.streams_in", 0.0, where=np.ones((1, 7), bool)))
    with pytest.raises(TypeError, match="not one of"):
        inspect.forward(tiny, x, edits={"layers.1.moe.in": np.zeros(3)})
    with pytest.raises(ValueError, match=r"\['drafter\.logits'\] matches no point(.|\n)*loaded with its drafter"):
        inspect.forward(tiny, x, capture="drafter.logits")  # tiny is loaded without its MTP layer
    with pytest.raises(ValueError, match="draft_tokens must be an int in 1..any"):
        inspect.forward(tiny, x, capture="final.hidden", draft_tokens=0)


def fp32_mechanisms(model):
    """V4.1 without the reference's FP8 / FP4 round trips (and with its own index keys): on a mesh
    the products reduce in another order, and an fp32 ulp there can move an FP8 rounding by a
    whole FP8 step, so mesh == one device holds to fp32 rounding only for these numerics."""
    return model.replace(options=model.options.replace(round_trips=False, index_keys_from_owner=True))


MESH_CASES = {"tiny": ("tiny", 1, {"layers.1.moe.experts", "layers.1.moe.weights", "layers.2.mhc.streams_out"}),
              "v41": ("tiny-v41", 3, {"layers.3.moe.experts", "layers.3.moe.weights", "layers.4.mhc.streams_out",
                                      "layers.1.engram.gate", "layers.2.indexer.selected"})}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("name", sorted(MESH_CASES))
def test_on_a_mesh_with_expert_parallelism(models, name):
    """data=2, expert=2: captures keep the batch split; an ablation equals one device's (V4.1:
    its routing, Engram gates and candidate-block selections too)."""
    model_name, layer, capture = MESH_CASES[name]
    one, sharded = models[name], dsjax.load_model(model_name, dtype="float32", mesh="data=2,expert=2")
    if name == "v41":
        one, sharded = fp32_mechanisms(one), fp32_mechanisms(sharded)
    x = ids(7, b=4, s=S if name == "tiny" else 40)
    edits = inspect.ablate(one.config, layer, [3])
    want_logits, want = inspect.forward(one, x, capture=capture, edits=edits)
    logits, trace = inspect.forward(sharded, x, capture=capture, edits=edits)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5, rtol=0)
    for point in capture:
        if point.endswith(("experts", "selected")):
            np.testing.assert_array_equal(trace[point], want[point], err_msg=point)
        np.testing.assert_allclose(trace[point], want[point], atol=1e-5, rtol=0, err_msg=point)
        shard = trace[point].sharding.shard_shape(trace[point].shape)
        assert shard[0] == 4 // sharded.batch_shards(), (point, trace[point].sharding)


@pytest.mark.parametrize("name,k", [("tiny", 3), ("tiny-v41", 5)])
def test_drafts_are_the_drafters_after_each_position(name, k):
    """`drafter.tokens` / `drafter.logits` at position t are what the drafter drafts on the engine's
    path: the target's cached prefill of positions 0..t (its own features, not the full forward's
    taps), committed, then k greedy drafts; MTP's first draft is also its full-sequence forward
    (the training path). Capturing them changes no logit."""
    from dsjax.model import mtp_forward, mtp_head
    from dsjax.model.cache_layout import init_cache
    from dsjax.model.interface import drafter_for

    model = dsjax.load_model(name, dtype="float32", seed=0, mtp=True)
    cfg, opts, drafter = model.config, model.options, drafter_for(model.config)
    x = ids(9, b=2, s=20)
    plain, _ = inspect.forward(model, x)
    logits, trace = inspect.forward(model, x, capture="drafter.*", draft_tokens=k)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain))
    tokens, drafted = np.asarray(trace["drafter.tokens"]), np.asarray(trace["drafter.logits"])
    assert tokens.shape == (2, 19, k) and drafted.shape == (2, 19, k, cfg.vocab_size)
    np.testing.assert_array_equal(tokens, np.argmax(drafted, axis=-1))
    scale = np.abs(drafted).max()
    if name == "tiny":
        _, full = inspect.forward(model, x, capture="final.streams")
        first = jax.jit(lambda weights, params, streams, x:  # one program, not ~200 op by op
                        mtp_head(weights, params, mtp_forward(weights, params, streams, x, cfg)[0], cfg))
        want = first(model.mtp, model.params, full["final.streams"][:, :-1], jnp.asarray(x[:, 1:]))
        np.testing.assert_allclose(drafted[:, :, 0], want, atol=1e-5 * scale)

    @jax.jit
    def engine_path(params, weights, n):  # positions 0..n-1 prefilled in one chunk, committed, then k drafts
        start, n_valid = jnp.zeros((2,), jnp.int32), jnp.full((2,), n, jnp.int32)
        _, features, _ = drafter.target_chunk(params, jnp.asarray(x), cfg, init_cache(cfg, 2, 32, jnp.float32),
                                              opts=opts, n_valid=n_valid, ctx_bucket=32)
        state, context = drafter.commit(weights, params, drafter.init_state(cfg, 2, jnp.float32), features,
                                        jnp.asarray(np.roll(x, -1, axis=1)), start, n_valid, cfg, opts)
        return drafter.draft(weights, params, state, context, cfg, opts, k=k, sampler=inspect._GreedyLogits())[:2]

    for t in (0, 8, 18):
        want_tokens, want_logits = engine_path(model.params, model.mtp, jnp.int32(t + 1))  # one program
        np.testing.assert_array_equal(tokens[:, t], want_tokens, err_msg=f"t={t}")
        np.testing.assert_allclose(drafted[:, t], want_logits, atol=1e-5 * scale, err_msg=f"t={t}")


@pytest.mark.parametrize("name", ["scanned", "v41"])
def test_taps_read_the_cached_forward_too(models, name):
    """What the engine's per-token capture stands on (tests/test_engine_capture.py): a session
    around the cached forward's trace captures each layer's routing chunk by chunk: V4's is the
    full forward's;
    V4.1's chunks follow the reference's key rule and round trips, so its routing is checked
    against `route` recomputed from the chunk's own captured MoE input."""
    from dsjax.layers import taps
    from dsjax.model.cache_layout import init_cache
    from dsjax.model.forward_pass import forward_traced

    model = models[name]
    cfg, x = model.config, ids(8, b=2, s=24)
    points = ("layers.*.moe.experts", "layers.*.moe.in")

    @jax.jit
    def chunk(params, tokens, cache):
        with taps.session(points, {}) as s:
            _, cache = forward_traced(params, tokens, cfg, cache, opts=model.options, ctx_bucket=64)
        return cache, s.found

    cache = init_cache(cfg, 2, 64, jnp.float32)
    found = []
    for start, c in ((0, 16), (16, 8)):
        cache, got = chunk(model.params, jnp.asarray(x[:, start:start + c]), cache)
        found.append(got)
        for layer in cfg.layers:
            h, i = got[f"layers.{layer.index}.moe.in"], layer.index
            _, e = route(layer_block(model.params, cfg, i).moe, h.reshape(-1, h.shape[-1]),
                         jnp.asarray(x[:, start:start + c]).reshape(-1), cfg)
            np.testing.assert_array_equal(got[f"layers.{i}.moe.experts"].reshape(e.shape), e)
    assert set(found[0]) == {f"layers.{layer.index}.{p[9:]}" for layer in cfg.layers for p in points}
    if name == "scanned":
        _, want = inspect.forward(model, x, capture="layers.*.moe.experts")
        for key in want:
            np.testing.assert_array_equal(np.concatenate([f[key] for f in found], axis=1), want[key])
