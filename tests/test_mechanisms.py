"""Per-mechanism checks: each dsjax function against the HF transformers submodule it
reimplements, with the SAME weights (the torch tensors copied into the dsjax param
dataclasses), on random inputs, in fp32.

Tolerance: unless a test says otherwise, max |dsjax - HF| <= 1e-5 on values of magnitude
~1..5. Both sides compute in fp32 and differ only in summation order, so the expected error
is a few fp32 ulps times the reduction depth (observed <= 3e-6); 1e-5 leaves head-room without
hiding a wrong mechanism, whose errors are O(0.1..1).

Weights are copied straight from the torch modules (not through the checkpoint loader), so a
failure here points at the math, not at name mapping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dsjax
import hf_oracle
from dsjax.layers import hyper_connection
from dsjax.layers.attention import Attention, attention_forward, compressed_visible
from dsjax.layers.compressor import Compressor, compress_kv
from dsjax.layers.hyper_connection import HyperConnection, HyperHead, collapse, expand, hc_mixes, head_collapse
from dsjax.layers.indexer import Indexer, index_queries, index_scores, index_weights, select_topk
from dsjax.layers.moe import MoE, moe_forward, route
from dsjax.layers.rope import apply_rope, inv_freq, rope_cos_sin
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

ATOL = 1e-5
HC_MULT = {"hca": 2, "mixed": 3, "legacy": 4}

# The bigger pieces run jitted, as `dsjax.forward` runs them (and eager dispatch would
# dominate the runtime); the small ones run eagerly.
attention_forward_jit = jax.jit(attention_forward, static_argnames=("layer", "cfg"))
compress_kv_jit = jax.jit(compress_kv, static_argnames=("ratio", "overlap", "cfg"))
moe_forward_jit = jax.jit(moe_forward, static_argnames=("cfg",))


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module", autouse=True)
def _fp32_matmuls():
    # CPU already multiplies fp32 exactly; on accelerators keep XLA from using reduced precision.
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """oracle(name, **overrides) -> (HF model, dsjax ModelConfig), each built once per module."""
    cache = {}

    def get(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            model = hf_oracle.build(name, **overrides)
            directory = tmp_path_factory.mktemp(name)
            hf_oracle.save(model, directory)
            cache[key] = (model, dsjax.load_config(str(directory)))
        return cache[key]

    return get


def j(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.detach().cpu().numpy())


def randn(*shape, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((scale * rng.standard_normal(shape)).astype(np.float32))


def max_err(actual, expected) -> float:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected, np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != HF {e.shape}"
    return float(np.max(np.abs(a - e))) if a.size else 0.0


def assert_close(actual, expected, atol: float = ATOL, what: str = ""):
    err = max_err(actual, expected)
    assert err <= atol, f"{what}: max |dsjax - HF| = {err:.3g} > {atol:.1g}"


def hc_params(m) -> HyperConnection:
    return HyperConnection(fn=j(m.fn), base=j(m.base), scale=j(m.scale))


def head_params(m) -> HyperHead:
    return HyperHead(fn=j(m.hc_fn), base=j(m.hc_base), scale=j(m.hc_scale))


def compressor_params(m) -> Compressor:
    """HF HCA / CSA compressor or the indexer (same four tensors)."""
    return Compressor(kv_proj=j(m.kv_proj.weight), gate_proj=j(m.gate_proj.weight),
                      position_bias=j(m.position_bias), kv_norm=j(m.kv_norm.weight))


def indexer_params(ix) -> Indexer:
    return Indexer(compressor=compressor_params(ix), q_b_proj=j(ix.q_b_proj.weight),
                   weights_proj=j(ix.scorer.weights_proj.weight))


def attention_params(a) -> Attention:
    comp = a.compressor
    return Attention(
        q_a_proj=j(a.q_a_proj.weight), q_a_norm=j(a.q_a_norm.weight), q_b_proj=j(a.q_b_proj.weight),
        kv_proj=j(a.kv_proj.weight), kv_norm=j(a.kv_norm.weight), o_a_proj=j(a.o_a_proj.weight),
        o_b_proj=j(a.o_b_proj.weight), sinks=j(a.sinks),
        compressor=None if comp is None else compressor_params(comp),
        indexer=indexer_params(comp.indexer) if hasattr(comp, "indexer") else None)


def moe_params(block) -> MoE:
    gate, experts, shared = block.gate, block.experts, block.shared_experts
    inter = experts.gate_up_proj.shape[1] // 2  # gate_up_proj [E, 2I, D]: gate rows, then up rows
    is_hash = hasattr(gate, "tid2eid")
    return MoE(
        router=j(gate.weight), w1=j(experts.gate_up_proj[:, :inter]), w3=j(experts.gate_up_proj[:, inter:]),
        w2=j(experts.down_proj), shared_w1=j(shared.gate_proj.weight), shared_w3=j(shared.up_proj.weight),
        shared_w2=j(shared.down_proj.weight),
        router_bias=None if is_hash else j(gate.e_score_correction_bias),
        tid2eid=j(gate.tid2eid).astype(jnp.int32) if is_hash else None)


def positions_for(b: int, s: int) -> tuple[torch.Tensor, jax.Array]:
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    return pos, jnp.asarray(pos.numpy(), jnp.int32)


class Capture:
    """Forward hook that records a module's (args, kwargs, output) on every call."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        self.calls.append((args, kwargs, output))

    def remove(self):
        self.handle.remove()


# ----------------------------------------------------------------------------- 1. hyper-connections
@pytest.mark.parametrize("name", ["hca", "mixed", "legacy"])
@pytest.mark.parametrize("which", ["attn_hc", "ffn_hc"])
@pytest.mark.parametrize("rolled", [True, False], ids=["sinkhorn_loop", "sinkhorn_written_out"])
def test_hyper_connection_mixes_and_collapse(oracle, name, which, rolled, monkeypatch):
    """Both Sinkhorn forms (a device loop on CPU, written out on GPU / TPU) against HF's."""
    monkeypatch.setattr(hyper_connection, "sinkhorn", functools.partial(hyper_connection.sinkhorn, rolled=rolled))
    model, cfg = oracle(name)
    assert cfg.hc_mult == HC_MULT[name]
    m = getattr(model.model.layers[1], which)
    x = randn(2, 7, cfg.hc_mult, cfg.hidden_size, seed=1)
    with torch.no_grad():
        post_hf, comb_hf, collapsed_hf = m(x)
    pre, post, comb = hc_mixes(hc_params(m), j(x), cfg)
    assert_close(post, post_hf, what="post")
    assert_close(comb, comb_hf, what="comb (Sinkhorn)")
    assert_close(collapse(j(x), pre), collapsed_hf, what="collapse")
    # the check has teeth: comb is not symmetric, so a transposed comb would fail above
    assert np.max(np.abs(np.asarray(comb) - np.swapaxes(np.asarray(comb), -1, -2))) > 1e-2


@pytest.mark.parametrize("name", ["hca", "mixed", "legacy"])
def test_hyper_connection_expand(oracle, name):
    model, cfg = oracle(name)
    m = model.model.layers[0].attn_hc
    x = randn(2, 7, cfg.hc_mult, cfg.hidden_size, seed=2)
    y = randn(2, 7, cfg.hidden_size, seed=3)
    with torch.no_grad():
        post, comb, _ = m(x)
        # DeepseekV4DecoderLayer.forward, verbatim
        ref = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    assert_close(expand(j(y), j(x), j(post), j(comb)), ref, what="expand")


# ----------------------------------------------------------------------------- 2. head collapse
@pytest.mark.parametrize("name", ["hca", "mixed", "legacy"])
def test_head_collapse(oracle, name):
    model, cfg = oracle(name)
    m = model.model.hc_head
    x = randn(2, 7, cfg.hc_mult, cfg.hidden_size, seed=4)
    with torch.no_grad():
        ref = m(x)
    assert_close(head_collapse(head_params(m), j(x), cfg), ref, what="head_collapse")


# ----------------------------------------------------------------------------- 3./4. compressors, indexer
def run_hf_compressor(comp, x, q_residual, layer_idx):
    """Call an HF compressor statelessly; for CSA also capture the indexer's scorer inputs / output
    and the indexer's top-k output."""
    b, s, _ = x.shape
    pos, _ = positions_for(b, s)
    scorer = indexer = None
    if hasattr(comp, "indexer"):
        scorer, indexer = Capture(comp.indexer.scorer), Capture(comp.indexer)
    try:
        with torch.no_grad():
            kv, mask = comp(x, q_residual, pos, None, layer_idx)
    finally:
        for c in (scorer, indexer):
            if c is not None:
                c.remove()
    return kv, mask, scorer, indexer


# (config, layer index, sequence lengths): every length is off the ratio grid, and each set
# includes a length with exactly one complete window (CSA: no previous window to overlap).
COMPRESSOR_CASES = [
    ("mixed", 1, (6, 21)),  # CSA, m = 4
    ("mixed", 2, (13, 21)),  # HCA, m = 8
    ("hca", 0, (7, 18)),  # HCA, m = 4
    ("hca", 2, (7, 18)),  # CSA, m = 4
    ("legacy", 0, (5, 19)),  # CSA, m = 4, hc_mult 4 model
    ("legacy", 1, (131, 261)),  # HCA, m = 128
]


@pytest.mark.parametrize("name,layer_idx,lengths", COMPRESSOR_CASES)
def test_compressor(oracle, name, layer_idx, lengths):
    model, cfg = oracle(name)
    layer = cfg.layers[layer_idx]
    comp = model.model.layers[layer_idx].self_attn.compressor
    assert layer.compress_ratio == comp.compress_rate
    p = compressor_params(comp)
    for s in lengths:
        x = randn(2, s, cfg.hidden_size, seed=s)
        q_res = randn(2, s, cfg.q_lora_rank, seed=s + 1)
        kv_hf, mask_hf, _, _ = run_hf_compressor(comp, x, q_res, layer_idx)
        ours = compress_kv_jit(p, j(x), ratio=layer.compress_ratio, overlap=layer.overlap, cfg=cfg)
        assert ours.shape[1] == s // layer.compress_ratio
        assert_close(ours, kv_hf[:, 0], what=f"{layer.attention} entries, S={s}")
        if not layer.overlap:  # HCA: the mask is pure causality
            _, pos = positions_for(2, s)
            visible = compressed_visible(pos, ours.shape[1], layer.compress_ratio)
            np.testing.assert_array_equal(np.asarray(visible), np.isfinite(mask_hf[:, 0].numpy()))


@pytest.mark.parametrize("name,layer_idx,s", [("mixed", 1, 3), ("mixed", 2, 5), ("legacy", 1, 19)])
def test_compressor_shorter_than_ratio(oracle, name, layer_idx, s):
    """S < ratio: no complete window. HF returns zero entries [B, 1, 0, d]; dsjax [B, 0, d]."""
    model, cfg = oracle(name)
    layer = cfg.layers[layer_idx]
    comp = model.model.layers[layer_idx].self_attn.compressor
    assert s < layer.compress_ratio
    x, q_res = randn(2, s, cfg.hidden_size, seed=s), randn(2, s, cfg.q_lora_rank, seed=s + 1)
    kv_hf, _, _, _ = run_hf_compressor(comp, x, q_res, layer_idx)
    assert tuple(kv_hf.shape) == (2, 1, 0, cfg.head_dim)
    ours = compress_kv(compressor_params(comp), j(x), ratio=layer.compress_ratio, overlap=layer.overlap, cfg=cfg)
    assert ours.shape == (2, 0, cfg.head_dim)


@pytest.mark.parametrize("name,layer_idx", [("mixed", 1), ("mixed", 3), ("hca", 2), ("legacy", 0)])
def test_indexer_compressor_queries_and_scores(oracle, name, layer_idx):
    """The indexer's own compressor (overlap, index_head_dim), its roped queries, its per-head
    weights and its scores, against what HF's DeepseekV4Indexer hands its scorer."""
    model, cfg = oracle(name)
    layer = cfg.layers[layer_idx]
    assert layer.has_indexer
    comp = model.model.layers[layer_idx].self_attn.compressor
    p = indexer_params(comp.indexer)
    for s in (6, 21):  # one window (no overlap partner) and five (S=3, no window: see above)
        x = randn(2, s, cfg.hidden_size, seed=10 + s)
        q_res = randn(2, s, cfg.q_lora_rank, seed=20 + s)
        _, _, scorer, _ = run_hf_compressor(comp, x, q_res, layer_idx)
        (q_hf, keys_hf, x_hf), _, scores_hf = scorer.calls[0]
        assert torch.equal(x_hf, x)
        keys = compress_kv_jit(p.compressor, j(x), ratio=layer.compress_ratio, overlap=True, cfg=cfg)
        assert_close(keys, keys_hf, what=f"indexer keys, S={s}")
        _, pos = positions_for(2, s)
        cos, sin = rope_cos_sin(pos, cfg.rope("compress"), cfg.qk_rope_head_dim)
        q = index_queries(p, j(q_res), cos, sin, cfg)
        assert_close(q, q_hf, what=f"indexer queries, S={s}")
        w = index_weights(p, j(x), cfg)
        with torch.no_grad():
            w_hf = comp.indexer.scorer.weights_proj(x).float() * comp.indexer.scorer.weights_scaling
        assert_close(w, w_hf, what="indexer head weights")
        assert_close(index_scores(q, keys, w, cfg), scores_hf, what=f"indexer scores, S={s}")
        # the scoring formula alone, on HF's own inputs
        assert_close(index_scores(j(q_hf), j(keys_hf), w, cfg), scores_hf, what="index_scores on HF inputs")


def selected_sets(indices: torch.Tensor) -> list[list[set[int]]]:
    """HF top-k indices [B, S, k] (-1 = invalid) -> per-query sets of valid entries."""
    return [[{int(i) for i in row if i >= 0} for row in batch] for batch in indices]


def chosen_sets(mask) -> list[list[set[int]]]:
    return [[set(np.flatnonzero(row).tolist()) for row in batch] for batch in np.asarray(mask)]


@pytest.mark.parametrize("name,layer_idx", [("mixed", 1), ("hca", 2)])
def test_indexer_topk_all_visible(oracle, name, layer_idx):
    """index_topk (64) >= number of entries: both sides keep exactly the causally visible set."""
    model, cfg = oracle(name)
    layer = cfg.layers[layer_idx]
    comp = model.model.layers[layer_idx].self_attn.compressor
    s = 22
    x, q_res = randn(2, s, cfg.hidden_size, seed=30), randn(2, s, cfg.q_lora_rank, seed=31)
    _, mask_hf, scorer, indexer = run_hf_compressor(comp, x, q_res, layer_idx)
    scores_hf = scorer.calls[0][2]
    n = scores_hf.shape[-1]
    assert cfg.index_topk >= n
    _, pos = positions_for(2, s)
    visible = compressed_visible(pos, n, layer.compress_ratio)
    chosen = select_topk(j(scores_hf), visible, cfg.index_topk)
    assert chosen_sets(chosen) == selected_sets(indexer.calls[0][2])
    # and the CSA block bias HF builds from that selection
    np.testing.assert_array_equal(np.asarray(chosen), np.isfinite(mask_hf[:, 0].numpy()))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_indexer_topk_selection(oracle, k):
    """index_topk < visible entries. Scores are HF's own; where HF's k-th and (k+1)-th visible
    scores are tied (ReLU makes exact zeros common) the choice is implementation-defined, so
    there we check that dsjax's set is *a* valid top-k; elsewhere the sets must be equal."""
    model, cfg = oracle("mixed", index_topk=k)
    layer_idx = 1
    layer = cfg.layers[layer_idx]
    comp = model.model.layers[layer_idx].self_attn.compressor
    s = 29
    x, q_res = randn(2, s, cfg.hidden_size, seed=40), randn(2, s, cfg.q_lora_rank, seed=41)
    _, _, scorer, indexer = run_hf_compressor(comp, x, q_res, layer_idx)
    scores = scorer.calls[0][2].numpy()
    hf_sets = selected_sets(indexer.calls[0][2])
    _, pos = positions_for(2, s)
    visible = np.asarray(compressed_visible(pos, scores.shape[-1], layer.compress_ratio))
    ours = chosen_sets(select_topk(jnp.asarray(scores), jnp.asarray(visible), k))
    compared = 0
    for b in range(2):
        for t in range(s):
            vis = np.flatnonzero(visible[b, t])
            mine, theirs = ours[b][t], hf_sets[b][t]
            assert len(mine) == min(k, len(vis)) == len(theirs), (b, t)
            assert mine <= set(vis.tolist())
            ranked = np.sort(scores[b, t, vis])[::-1]
            rest = set(vis.tolist()) - mine
            if rest:  # a valid top-k: nothing left out scores above anything kept
                assert min(scores[b, t, sorted(mine)]) >= max(scores[b, t, sorted(rest)]), (b, t)
            if len(vis) <= k or ranked[k - 1] > ranked[k]:
                assert mine == theirs, (b, t, mine, theirs)
                compared += 1
    assert compared >= s  # most queries have an unambiguous top-k


# ----------------------------------------------------------------------------- 5. router, MoE
def sort_routes(weights, idx):
    weights, idx = np.asarray(weights), np.asarray(idx)
    order = np.argsort(idx, axis=-1)
    return np.take_along_axis(weights, order, -1), np.take_along_axis(idx, order, -1)


# mixed 0 / legacy 1: hash routing; mixed 1 / legacy 2: top-2 of 8; hca 0: top-3 of 16
MOE_CASES = [("mixed", 0), ("mixed", 1), ("legacy", 1), ("legacy", 2), ("hca", 0)]


@pytest.mark.parametrize("name,layer_idx", MOE_CASES)
def test_router(oracle, name, layer_idx):
    model, cfg = oracle(name)
    block = model.model.layers[layer_idx].mlp
    assert block.is_hash == (cfg.layers[layer_idx].mlp == "hash_moe")
    b, s = 2, 11
    x = randn(b, s, cfg.hidden_size, seed=50)
    ids = torch.from_numpy(np.random.default_rng(51).integers(0, cfg.vocab_size, (b, s)))
    with torch.no_grad():
        _, w_hf, idx_hf = block.gate(x, ids) if block.is_hash else block.gate(x)
    w, idx = route(moe_params(block), j(x).reshape(b * s, -1), jnp.asarray(ids.numpy()).reshape(-1), cfg)
    w, idx = sort_routes(w, idx)
    w_ref, idx_ref = sort_routes(w_hf.numpy(), idx_hf.numpy())
    np.testing.assert_array_equal(idx, idx_ref)
    assert_close(w, w_ref, what="routing weights")
    if not block.is_hash:  # the bias must change the selection somewhere, or it is not being tested
        scores = np.sqrt(np.log1p(np.exp(x.reshape(b * s, -1).numpy() @ block.gate.weight.detach().numpy().T)))
        unbiased = np.sort(np.argsort(-scores, axis=-1)[:, : cfg.num_experts_per_tok], axis=-1)
        assert (unbiased != idx_ref).any() or cfg.num_experts_per_tok == cfg.n_routed_experts


@pytest.mark.parametrize("name,layer_idx", MOE_CASES)
@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_moe_block(oracle, name, layer_idx, scale):
    """scale 8 pushes expert pre-activations past swiglu_limit (10) so the clamps matter."""
    model, cfg = oracle(name)
    block = model.model.layers[layer_idx].mlp
    b, s = 2, 11
    x = randn(b, s, cfg.hidden_size, seed=60, scale=scale)
    ids = torch.from_numpy(np.random.default_rng(61).integers(0, cfg.vocab_size, (b, s)))
    with torch.no_grad():
        ref = block(x, input_ids=ids)
    out = moe_forward_jit(moe_params(block), j(x), jnp.asarray(ids.numpy()), cfg=cfg)
    # fp32 is a relative precision and the output grows with the input (max |out| ~ 4 at scale
    # 1, ~ 200 at scale 8), so the bound is 1e-5 relative to max |out| (observed: ~2e-7).
    atol = ATOL * max(1.0, float(ref.abs().max()))
    assert_close(out, ref, atol=atol, what=f"moe_forward (scale {scale})")
    if scale > 1:
        with torch.no_grad():
            pre = torch.einsum("td,eid->tei", x.reshape(b * s, -1), block.experts.gate_up_proj)
        assert pre.abs().max() > cfg.swiglu_limit


# ----------------------------------------------------------------------------- 6. rope
@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rope_inv_freq_and_cos_sin(oracle, kind):
    model, cfg = oracle("mixed")
    rot = model.model.rotary_emb
    rope = cfg.rope(kind)
    assert (rope.scaling == "yarn") == (kind == "compress")
    ours = inv_freq(rope, cfg.qk_rope_head_dim)
    ref = getattr(rot, f"{kind}_inv_freq").numpy()
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=0)  # relative: they span 1 .. 8e-6
    assert rope.attention_factor == getattr(rot, f"{kind}_attention_scaling")
    pos = torch.tensor([[0, 1, 2, 7, 63, 64, 65, 500, 4095, 70000]])
    with torch.no_grad():
        cos_hf, sin_hf = rot(torch.zeros(1, dtype=torch.float32), position_ids=pos, layer_type=kind)
    cos, sin = rope_cos_sin(jnp.asarray(pos.numpy()), rope, cfg.qk_rope_head_dim)
    # angles up to 7e4 rad: cos/sin of an fp32 angle that large differ by argument-reduction ulps
    assert_close(cos, cos_hf, atol=2e-5, what="cos")
    assert_close(sin, sin_hf, atol=2e-5, what="sin")


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_apply_rope(oracle, kind):
    _, cfg = oracle("mixed")
    b, s, h = 2, 9, 3
    rope = cfg.rope(kind)
    pos = torch.arange(s).unsqueeze(0).expand(b, -1) * 5
    cos, sin = rope_cos_sin(jnp.asarray(pos.numpy()), rope, cfg.qk_rope_head_dim)
    cos_t, sin_t = torch.from_numpy(np.array(cos)), torch.from_numpy(np.array(sin))
    x = randn(b, h, s, cfg.head_dim, seed=70)  # HF layout [B, H, S, hd]
    ref = apply_rotary_pos_emb(x, cos_t, sin_t)
    ref_inv = apply_rotary_pos_emb(x, cos_t, -sin_t)
    xj = j(x).transpose(0, 2, 1, 3)  # dsjax layout [B, S, H, hd]
    got = apply_rope(xj, cos[..., None, :], sin[..., None, :])
    got_inv = apply_rope(xj, cos[..., None, :], sin[..., None, :], inverse=True)
    assert_close(got, ref.transpose(1, 2), what="apply_rope")
    assert_close(got_inv, ref_inv.transpose(1, 2), what="apply_rope inverse")
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    np.testing.assert_array_equal(np.asarray(got)[..., :nope], np.asarray(xj)[..., :nope])
    # the compressor's 3-D form: entries [B, T, d] with cos [B, T, rd/2]
    e = randn(b, s, cfg.head_dim, seed=71)
    ref3 = apply_rotary_pos_emb(e.unsqueeze(1), cos_t, sin_t).squeeze(1)
    assert_close(apply_rope(j(e), cos, sin), ref3, what="apply_rope 3-D")


# ----------------------------------------------------------------------------- 7. attention layers
def run_hf_model_capturing_attention(model, ids):
    hooks = [Capture(layer.self_attn) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for h in hooks:
        (args, kwargs, output), = h.calls
        x = args[0] if args else kwargs["hidden_states"]
        out.append((x, kwargs["position_ids"], output[0]))
    return out


ATTENTION_CASES = [
    # (config, overrides, sequence length): every layer of each model is checked
    ("mixed", {}, 21),  # sliding, CSA (all entries selected), HCA m=8, CSA
    # CSA with a real top-2 selection; 8 index heads so no score is an exact ReLU 0 at the
    # top-2 boundary (checked by assert_unambiguous_topk)
    ("mixed", {"index_topk": 2, "index_n_heads": 8}, 29),
    ("hca", {}, 18),  # HCA m=4, sliding (window 5), CSA; hc_mult 2
    ("legacy", {}, 133),  # CSA, HCA m=128 (one entry), sliding; hc_mult 4
]


@pytest.mark.parametrize("name,overrides,s", ATTENTION_CASES, ids=["mixed", "mixed-top2", "hca", "legacy"])
def test_attention_layers(oracle, name, overrides, s):
    model, cfg = oracle(name, **overrides)
    b = 2
    ids = np.random.default_rng(80).integers(0, cfg.vocab_size, (b, s))
    captured = run_hf_model_capturing_attention(model, ids)
    _, pos = positions_for(b, s)
    for layer, hf_layer, (x, pos_hf, out_hf) in zip(cfg.layers, model.model.layers, captured):
        np.testing.assert_array_equal(np.broadcast_to(pos_hf.numpy(), (b, s)), np.asarray(pos))
        if layer.has_indexer and cfg.index_topk < s // layer.compress_ratio:
            assert_unambiguous_topk(hf_layer.self_attn, x, pos_hf, layer, cfg)
        out = attention_forward_jit(attention_params(hf_layer.self_attn), j(x), pos, layer=layer, cfg=cfg)
        # outputs are O(1..3) after o_b_proj; 1e-5 absolute is a ~1e-5 relative bound
        assert_close(out, out_hf, what=f"layer {layer.index} ({layer.attention})")


def assert_unambiguous_topk(attn, x, pos_hf, layer, cfg):
    """With index_topk < entries, a tie at the k-th score would make the selection (and so the
    layer output) implementation-defined; make sure this input has none, so the comparison is fair."""
    comp = attn.compressor
    pos = pos_hf.expand(x.shape[0], -1)
    cap = Capture(comp.indexer.scorer)
    try:
        with torch.no_grad():
            comp.indexer(x, attn.q_a_norm(attn.q_a_proj(x)), pos, None, layer.index)
    finally:
        cap.remove()
    scores = cap.calls[0][2].numpy()
    visible = np.asarray(compressed_visible(jnp.asarray(pos.numpy()), scores.shape[-1], layer.compress_ratio))
    k = cfg.index_topk
    selective = 0
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            ranked = np.sort(scores[b, t, visible[b, t]])[::-1]
            if ranked.size > k:
                assert ranked[k - 1] > ranked[k], f"tied top-{k} boundary at batch {b} query {t}"
                selective += 1
    assert selective > 0  # some queries really drop visible entries
