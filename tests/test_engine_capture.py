"""The engine's capture (dsjax.engine.capture) against its oracle, dsjax.inspect's full forward:
the routing (experts, hash layers' too, and weights) and the indexer selections an engine records
for a request's every computed position equal `inspect.forward`'s over prompt + tokens[:-1]; an
engine without capture runs the programs it ran before; bad names list the valid ones. Tiny V4,
greedy, a handful of tokens; two engines of three programs each; and tiny V4.1 (routing, the
candidate-block indexer's selections, Engram gates) in one engine."""

import jax
import numpy as np
import pytest

import dsjax
from dsjax import inspect
from dsjax.engine import Engine, PrefixCacheOptions, SamplingParams
from dsjax.engine.capture import expert_counts
from dsjax.engine.programs import decode_step
from dsjax.model import layer_block

POINTS = ("layers.*.moe.experts", "layers.*.moe.weights", "layers.*.indexer.selected")
LONG, SHORT, TOKENS = 70, 45, 6  # LONG + TOKENS - 1 = 75 positions: 18 compressed entries > index_topk 16


@pytest.fixture(scope="module")
def tiny():
    return dsjax.load_model("tiny", dtype="float32", seed=0)


def _run(engine, prompts):
    """Greedy requests, all but the last asking for capture; -> per request (tokens, events)."""
    events = {}
    ids = [engine.add_request(p, SamplingParams(max_tokens=TOKENS, ignore_eos=True, capture=i < len(prompts) - 1))
           for i, p in enumerate(prompts)]
    for e in engine.run():
        events.setdefault(e.request_id, []).append(e)
    return [(engine.requests[i].tokens, events[i]) for i in ids]


def _trace(events) -> dict[str, np.ndarray]:
    """A request's captured points over its computed positions: the prompt's but its last (first
    event), then each token's step -> name -> [P + G - 1, ...]."""
    return {name: np.concatenate([prompt, np.stack([e.capture[name] for e in events])])
            for name, prompt in events[0].prompt_capture.items()}


def _visible_only(selected: np.ndarray, ratio: int) -> np.ndarray:
    """Selections [S, k] with entries a query cannot see (w >= (p + 1) // ratio) as -1, sorted."""
    visible = (np.arange(len(selected)) + 1) // ratio
    return np.sort(np.where(selected < visible[:, None], selected, -1), axis=-1)


@pytest.fixture(scope="module", params=["plain", "invariant-2-steps"])
def captured(tiny, request):
    """Two capturing engines (one with batch-invariant tiles and two decode steps a dispatch),
    three requests of which the last does not ask; -> (engine, runs)."""
    kw = {"plain": {}, "invariant-2-steps": dict(batch_invariant=True, decode_steps=2)}[request.param]
    engine = Engine(tiny, max_slots=2, capacity=256, prefill_chunk=32, capture=POINTS, **kw)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 5000, n).tolist() for n in (LONG, SHORT, 20)]
    return engine, prompts, _run(engine, prompts)


def test_engine_capture_is_the_full_forwards(tiny, captured):
    """Routing (the hash layer's too) and indexer selections per computed position, and the
    greedy tokens, against `inspect.forward` over prompt + tokens[:-1]; the request that does not
    ask gets no capture."""
    engine, prompts, runs = captured
    cfg = tiny.config
    assert set(engine.capture) == {f"layers.{i}.moe.{p}" for i in range(4) for p in ("experts", "weights")} | {
        "layers.1.indexer.selected", "layers.3.indexer.selected"}
    assert all(e.capture is None and e.prompt_capture is None for e in runs[2][1])
    for prompt, (tokens, events) in zip(prompts[:2], runs):
        assert len(tokens) == TOKENS and all(e.prompt_capture is None for e in events[1:])
        got = _trace(events)
        seq = np.asarray([prompt + tokens[:-1]], np.int32)
        assert all(a.shape[0] == seq.shape[1] for a in got.values())
        logits, want = inspect.forward(tiny, seq, capture={"layers.*.moe.experts", "layers.*.moe.weights"})
        assert np.argmax(np.asarray(logits)[0, len(prompt) - 1:], axis=-1).tolist() == tokens
        for i in range(cfg.num_hidden_layers):
            np.testing.assert_array_equal(got[f"layers.{i}.moe.experts"], want[f"layers.{i}.moe.experts"][0])
            np.testing.assert_allclose(got[f"layers.{i}.moe.weights"], want[f"layers.{i}.moe.weights"][0],
                                       atol=1e-5, rtol=0)
        table = np.asarray(layer_block(tiny.params, cfg, 0).moe.tid2eid)  # the hash layer: its table's rows
        np.testing.assert_array_equal(got["layers.0.moe.experts"], table[seq[0]])
        for i in (1, 3):
            name, ratio = f"layers.{i}.indexer.selected", cfg.layers[i].compress_ratio
            if len(prompt) == LONG:  # the full forward selects (18 entries > 16)
                _, full = inspect.forward(tiny, seq, capture=name)
                np.testing.assert_array_equal(np.sort(got[name], axis=-1), _visible_only(full[name][0], ratio))
            else:  # (no selection in the full forward) every visible entry is attended: w < (p + 1) // ratio
                entries = np.arange(cfg.index_topk)
                fill = np.where(entries < (np.arange(seq.shape[1])[:, None] + 1) // ratio, entries, -1)
                np.testing.assert_array_equal(np.sort(got[name], axis=-1), np.sort(fill, axis=-1))


def test_v41_engine_capture_is_the_full_forwards():
    """Tiny V4.1, its Engram rows fetched from host tables during the steps: routing, indexer
    selections (ratio-2 and ratio-1 layers) and Engram gates per computed position against
    `inspect.forward` over prompt + tokens[:-1]. Under the reference's numerics a cached chunk is
    not the full forward (the published-key rule and FP8 round trips move routing past the first
    chunk: tests/test_inspect.py checks those chunks against `route`), so this runs the
    mechanisms' fp32 numerics (`round_trips=False`, `index_keys_from_owner=True`), where the two
    must agree."""
    base = dsjax.load_model("tiny-v41", dtype="float32", seed=0)
    model = base.replace(options=base.options.replace(round_trips=False, index_keys_from_owner=True))
    cfg = model.config
    points = ("layers.*.moe.experts", "layers.*.moe.weights", "layers.*.indexer.selected", "layers.*.engram.gate")
    engine = Engine(model, max_slots=1, capacity=64, prefill_chunk=32, capture=points)
    prompt = np.random.default_rng(5).integers(3, 5000, SHORT).tolist()
    (tokens, events), (_, others) = _run(engine, [prompt, prompt[:20]])
    assert all(e.capture is None for e in others)
    got = _trace(events)
    seq = np.asarray([prompt + tokens[:-1]], np.int32)
    logits, want = inspect.forward(model, seq, capture=set(points))
    assert np.argmax(np.asarray(logits)[0, len(prompt) - 1:], axis=-1).tolist() == tokens
    indexed = [i for i, layer in enumerate(cfg.layers) if layer.has_indexer]
    engram = [f"layers.{i}.engram.gate" for i in cfg.v41.engram.layer_ids]
    assert {n for n in got if n.endswith("selected")} == {f"layers.{i}.indexer.selected" for i in indexed}
    assert {n for n in got if n.endswith("gate")} == set(engram) and len({cfg.layers[i].compress_ratio
                                                                         for i in indexed}) == 2
    for name, value in got.items():
        full = np.asarray(want[name][0])
        assert value.shape[0] == seq.shape[1], name
        if name.endswith("experts"):
            np.testing.assert_array_equal(value, full, err_msg=name)
        elif name.endswith("selected"):
            ratio = cfg.layers[int(name.split(".")[1])].compress_ratio
            np.testing.assert_array_equal(np.sort(value, axis=-1), _visible_only(full, ratio), err_msg=name)
        else:
            np.testing.assert_allclose(value, full, atol=1e-5, rtol=0, err_msg=name)


def test_expert_counts(tiny, captured):
    _, _, runs = captured
    got = _trace(runs[0][1])
    counts = expert_counts(got, 4, tiny.config.n_routed_experts)
    assert counts.shape == (4, 8) and (counts.sum(axis=1) == (LONG + TOKENS - 1) * 2).all()
    np.testing.assert_array_equal(counts[2], np.bincount(got["layers.2.moe.experts"].ravel(), minlength=8))


def _results(text: str) -> int:
    """The number of results of a lowered program's entry point."""
    head = text[text.index("func.func public @main"):]
    return head[: head.index("{\n")].split("->", 1)[1].count("tensor<")


def test_engines_without_capture_run_the_programs_they_ran(tiny):
    """Without capture no program takes the capture argument and a decode step's outputs are its
    cache, slots and tokens only (the capturing engine's: one more per point); both engines warm
    up the same programs."""
    results, plans = {}, {}
    for capture in ((), POINTS):
        engine = Engine(tiny, max_slots=2, capacity=256, prefill_chunk=32, capture=capture)
        assert engine.runner._capture() == ({"capture": engine.capture} if capture else {})
        plans[capture] = [item.what for item in engine.scheduler.warmup_plans()]
        args = (engine.step_params, engine.cache, engine.slots, engine.runner.none_cancelled)
        static = dict(cfg=tiny.config, opts=engine.opts, ctx_bucket=256, n_logprobs=0, **engine.runner._capture())
        shapes = decode_step.eval_shape(*args, **static)
        assert (shapes[2].capture is None) == (not capture)
        results[capture] = _results(decode_step.lower(*args, **static).as_text())
        assert results[capture] == len(jax.tree.leaves(shapes))
    assert plans[()] == plans[POINTS] and len(plans[()]) == 3  # chunks 16 and 32, decode
    assert results[POINTS] == results[()] + 10  # four layers' experts and weights, two layers' selections


def test_bad_capture_names_list_the_valid_ones(tiny):
    with pytest.raises(ValueError, match=r"matches no point(.|\n)*layers\.\{i\}\.indexer\.selected  i in \[1, 3\]"
                                         r"(.|\n)*layers\.\{i\}\.moe\.experts  i in \[0, 1, 2, 3\]"):
        Engine(tiny, max_slots=1, capacity=256, capture="layers.*.moe.expert_ids")
    with pytest.raises(ValueError, match=r"\['layers\.1\.indexer\.scores'\] matches no point"):  # context-sized
        Engine(tiny, max_slots=1, capacity=256, capture=["layers.*.moe.experts", "layers.1.indexer.scores"])
    with pytest.raises(ValueError, match="capture is not supported with a prefix cache"):
        Engine(tiny, max_slots=1, capacity=256, prefill_chunk=16, capture=POINTS,
               prefix_cache=PrefixCacheOptions(device_bytes=1 << 20))
    with pytest.raises(ValueError, match="this engine captures nothing"):
        Engine(tiny, max_slots=1, capacity=256).add_request([5, 6], SamplingParams(capture=True))
    with pytest.raises(ValueError, match="capture must be a bool"):
        SamplingParams(capture="layers.*")
