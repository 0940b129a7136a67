"""Pretraining (dsjax/train): the objective trains, resumes bit-identically, the data
pipeline is deterministic and keeps held-out files out, and the export loads through the
normal checkpoint loader. Tiny dims, a few steps each."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax.config import load_config
from dsjax.train import data
from dsjax.model import forward
from dsjax.train.export import export
from dsjax.train.objective import pretrain_losses
from dsjax.train.pretrain import Hparams, combine, init_model, train, trainable
from dsjax.train.vocab import VocabMap, compact_config, expand


def tiny_cfg():
    # index_topk 2 < the 4 entries a 16-token sequence has at ratio 4: the indexer really selects
    return dataclasses.replace(load_config("tiny"), index_topk=2)


def fake_docs(n: int, seed: int, vocab: int = 400) -> list[np.ndarray]:
    """Token documents with structure (a repeating pattern per document) so there is something to learn."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        pattern = rng.integers(3, vocab, rng.integers(3, 7))
        docs.append(np.concatenate([[0], np.tile(pattern, 12)]).astype(np.int32))
    return docs


HP = Hparams(seq_len=16, batch=4, steps=30, lr=1e-2, warmup=3, seed=3)
# exactly one batch of sequences: every step sees the same batch (the overfit check); all
# tests train on it, so they share one compiled training step (persistent compile cache)
DOCS = [fake_docs(1, 0)[0][: HP.batch * (HP.seq_len + 1)]]
QUIET = dict(eval_every=0, on_log=lambda s: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train(tiny_cfg(), HP, tmp_path_factory.mktemp("run"), DOCS, [], **QUIET)


def test_overfit_fixed_batch_all_losses_fall(trained):
    """One batch repeated: the LM, MTP and indexer losses all fall over 30 steps."""
    h = trained["history"]
    first, last = h[0], h[-1]
    assert all(np.isfinite(r[k]) for r in h for k in ("lm", "mtp", "indexer"))
    assert last["lm"] < 0.5 * first["lm"], (first, last)
    assert last["mtp"] < 0.7 * first["mtp"], (first, last)
    assert last["indexer"] < first["indexer"], (first, last)


def test_resume_is_bit_identical(trained, tmp_path):
    """Stopped at step 3 and resumed: steps 4.. give the uninterrupted run's losses bit for bit."""
    train(tiny_cfg(), HP, tmp_path, DOCS, [], stop_at=3, **QUIET)
    rest = train(tiny_cfg(), HP, tmp_path, DOCS, [], resume=True, stop_at=8, **QUIET)
    assert [r["loss"] for r in rest["history"]] == [r["loss"] for r in trained["history"][3:8]]
    assert json.loads((tmp_path / "ckpt-0000008" / "meta.json").read_text())["step"] == 8


def test_init_from_starts_at_the_other_runs_weights(trained, tmp_path):
    """Continued pretraining: a new run started from the trained run's checkpoint begins at
    its loss, not at a fresh init's; its checkpoint records where it came from."""
    src = max(p for p in trained["out"].glob("ckpt-*"))
    cont = train(tiny_cfg(), HP, tmp_path, DOCS, [], init_from=src, stop_at=1, **QUIET)
    first_fresh, last = trained["history"][0]["loss"], trained["history"][-1]["loss"]
    assert abs(cont["history"][0]["loss"] - last) < 0.25 * (first_fresh - last), (cont["history"][0], last)
    meta = json.loads((tmp_path / "ckpt-0000001" / "meta.json").read_text())
    assert meta["init_from"]["step"] == HP.steps


def test_gradients_reach_every_mechanism():
    """float32 backward through mHC (Sinkhorn), hash and top-k MoE, CSA / HCA compressors and
    the MTP layer: every trained weight gets a finite gradient, non-zero except where the
    weight only selects (router bias); the indexer only from its own loss."""
    cfg = tiny_cfg()
    vocab = VocabMap(np.arange(300, dtype=np.int32), cfg.vocab_size)
    ccfg = compact_config(cfg, vocab)
    model = init_model(ccfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 17)), jnp.int32)

    @jax.jit
    def grads(t):  # (d(lm + mtp), d indexer): one program
        def f(t):
            m = combine(t, model)
            losses = pretrain_losses(m["params"], m["mtp"], tokens, ccfg, vocab)
            return jnp.stack([losses["lm"] + losses["mtp"], losses["indexer"]])
        return jax.jacrev(f)(t)

    both = grads(trainable(model))
    flat = lambda i: {jax.tree_util.keystr(p): np.asarray(a[i]) for p, a in jax.tree_util.tree_flatten_with_path(both)[0]}
    lm, idx = flat(0), flat(1)
    assert all(np.isfinite(a).all() for a in lm.values())
    zero = {k for k, a in lm.items() if not np.any(a)}
    assert zero and all("router_bias" in k or "indexer" in k for k in zero), sorted(zero)
    assert any("indexer" in k for k in zero)  # the LM losses do not train the indexer
    assert all(not np.any(a) for k, a in idx.items() if "indexer" not in k)  # its input is detached
    assert all(np.any(a) for k, a in idx.items() if "indexer" in k and "position_bias" not in k)


def test_data_deterministic_and_held_out_excluded(tmp_path):
    root = tmp_path / "lib"
    names = [f"pkg{i}/mod{j}.py" for i in range(6) for j in range(8)] + ["test/test_x.py", "site-packages/x.py",
                                                                        "encodings/cp.py", "a/tests/t.py"]
    for k, n in enumerate(names):
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_text(f"def f{k}(x):\n    return x + {k}  # {n}\n" * 5)
    paths = data.scan_stdlib(root)
    assert paths == sorted(paths) and len(paths) == 48  # tests, third-party, generated tables excluded
    listing = data.file_list(root, paths)
    held = [p for p in paths if data.is_held_out(p)]
    assert 0 < len(held) < len(paths)
    tok = dsjax.load_tokenizer()
    train_docs = data.tokenize(data.read_documents(root, listing, held_out=False), tok)
    held_docs = data.tokenize(data.read_documents(root, listing, held_out=True), tok)
    assert len(train_docs) + len(held_docs) == 48 and all(d[0] == tok.bos_id for d in train_docs)
    make = lambda: data.Batches(data.pack(train_docs, 32, 5), 4, 5)
    a, b = make(), make()
    assert all(np.array_equal(a(s), b(s)) for s in range(12))
    assert not np.array_equal(a(0), data.Batches(data.pack(train_docs, 32, 6), 4, 6)(0))
    # no held-out text in any training batch: each held-out file's unique tag never appears
    seen = "".join(tok.decode(row) for s in range(len(a.sequences) // 4 + 1) for row in a(s))
    assert all(f"# {p}" not in seen for p in held)
    assert all(f"# {p}" in "".join(tok.decode(d) for d in held_docs) for p in held)
    (root / paths[0]).write_text("changed")
    with pytest.raises(ValueError, match="pinned"):
        data.read_documents(root, listing, held_out=data.is_held_out(paths[0]))


def test_pinned_file_list_is_sorted_and_split():
    listing = data.load_file_list()
    paths = [f["path"] for f in listing["files"]]
    assert paths == sorted(paths) and len(paths) > 500
    assert not any(p.startswith(("test/", "site-packages/", "encodings/")) for p in paths)
    held = [p for p in paths if data.is_held_out(p)]
    assert 0.02 < len(held) / len(paths) < 0.1


def test_export_round_trip(trained, tmp_path):
    """Export -> dsjax.load_model through the normal loader (FP8 / MXFP4 / BF16 as DeepSeek
    stores them). Exact against the exporter's own dequantized weights; within quantization
    error of the trained float32 weights; and the compact training vocabulary expands to the
    same full-vocabulary model."""
    cfg = tiny_cfg()
    vocab, model = trained["vocab"], trained["model"]
    deq = export(model, vocab, cfg, tmp_path / "ckpt")
    loaded = dsjax.load_model(tmp_path / "ckpt", dtype="float32")
    assert loaded.mtp is not None and (tmp_path / "ckpt" / "tokenizer.json").is_file()
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                        {"params": loaded.params, "mtp": loaded.mtp}, deq)
    assert all(jax.tree.leaves(same))  # the loader reads back exactly what was quantized
    kept = vocab.kept
    seen = kept[np.arange(1, 25) % len(kept)]
    ids = np.asarray([[0, *seen[:8], 5000, *seen[8:20], 100000, *seen[20:]]], np.int32)  # 5000 / 100000: shared rows
    got = loaded.logits(ids)[0]
    full = expand(model["params"], vocab)
    want, _ = forward(jax.tree.map(jnp.asarray, full), jnp.asarray(ids), cfg)
    want = np.asarray(want[0])
    # compact training model == its full-vocabulary expansion (unquantized)
    compact, _ = forward(model["params"], jnp.asarray(vocab.to_compact[ids]), trained["config"])
    compact = np.asarray(compact[0])
    np.testing.assert_allclose(want[:, kept], compact[:, :-1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(want[:, 5000], compact[:, -1], atol=1e-5, rtol=1e-5)
    # the loader path computes the exporter's dequantized model
    oracle = np.asarray(forward(jax.tree.map(jnp.asarray, deq["params"]), jnp.asarray(ids), cfg)[0][0])
    np.testing.assert_allclose(got, oracle, atol=1e-4, rtol=1e-4)
    # Against the unquantized float32 weights. Per weight, MXFP4 (1 mantissa bit, one
    # power-of-two scale per 32 inputs) errs by ~11 % RMS on these experts, FP8 E4M3 by
    # <= 2^-4 relative, BF16 by <= 2^-8; summed over many independent weights, the logits
    # move by a small fraction of their spread (measured: 0.7 % here, 0.5 % on the
    # dsjax-tiny-py run at step 38). Bound: RMS error <= 5 % of the std of the distinct
    # logits (kept rows + one shared row: the shared rows are all equal), the same greedy
    # token everywhere but at near-ties, and the sequence NLL within 0.05 nats. A layout
    # error (a wrong scale, nibble order or expert) moves logits by O(their spread).
    cols = np.concatenate([kept, [5000]])
    centred = want[:, cols] - want[:, cols].mean(-1, keepdims=True)
    err = np.sqrt(np.mean((got[:, cols] - want[:, cols]) ** 2) / np.mean(centred ** 2))
    assert err < 0.05, err
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    nll = lambda logits: -np.mean(np.take_along_axis(jax.nn.log_softmax(logits[:-1]), ids[0, 1:, None], -1))
    assert abs(nll(got) - nll(want)) < 0.05
