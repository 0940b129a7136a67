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
from dsjax.train.objective import pretrain_losses
from dsjax.train.pretrain import Hparams, combine, init_model, train, trainable
from dsjax.train.vocab import VocabMap, compact_config


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


def test_overfit_fixed_batch_all_losses_fall(tmp_path):
    """One batch repeated: the LM, MTP and indexer losses all fall over 30 steps."""
    docs = fake_docs(1, 0)[:1]
    docs = [docs[0][: HP.batch * (HP.seq_len + 1)]]  # exactly one batch of sequences
    out = train(tiny_cfg(), HP, tmp_path, docs, [], eval_every=0, on_log=lambda s: None)
    h = out["history"]
    first, last = h[0], h[-1]
    assert all(np.isfinite(r[k]) for r in h for k in ("lm", "mtp", "indexer"))
    assert last["lm"] < 0.5 * first["lm"], (first, last)
    assert last["mtp"] < 0.7 * first["mtp"], (first, last)
    assert last["indexer"] < first["indexer"], (first, last)


def test_resume_is_bit_identical(tmp_path):
    docs = fake_docs(8, 1)
    hp = dataclasses.replace(HP, steps=6)
    whole = train(tiny_cfg(), hp, tmp_path / "a", docs, [], eval_every=0, on_log=lambda s: None)["history"]
    train(tiny_cfg(), hp, tmp_path / "b", docs, [], stop_at=3, eval_every=0, on_log=lambda s: None)
    rest = train(tiny_cfg(), hp, tmp_path / "b", docs, [], resume=True, eval_every=0, on_log=lambda s: None)
    assert [r["loss"] for r in rest["history"]] == [r["loss"] for r in whole[3:]]
    assert json.loads((tmp_path / "b" / "ckpt-0000006" / "meta.json").read_text())["step"] == 6


def test_gradients_reach_every_mechanism():
    """float32 backward through mHC (Sinkhorn), hash and top-k MoE, CSA / HCA compressors and
    the MTP layer: every trained weight gets a finite gradient, non-zero except where the
    weight only selects (router bias); the indexer only from its own loss."""
    cfg = tiny_cfg()
    vocab = VocabMap(np.arange(300, dtype=np.int32), cfg.vocab_size)
    ccfg = compact_config(cfg, vocab)
    model = init_model(ccfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 17)), jnp.int32)

    def grads(weights):
        def f(t):
            m = combine(t, model)
            losses = pretrain_losses(m["params"], m["mtp"], tokens, ccfg, vocab)
            return sum(w * losses[k] for k, w in weights.items())
        return jax.grad(f)(trainable(model))

    flat = lambda g: {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(g)[0]}
    lm = flat(grads({"lm": 1.0, "mtp": 1.0}))
    idx = flat(grads({"indexer": 1.0}))
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
