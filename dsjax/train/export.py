"""Trained parameters -> a checkpoint directory in DeepSeek's own format, which
`dsjax.load_model(dir)` reads through the normal loader (dsjax/checkpoint/loader.py):

    config.json         HF form (`to_hf_dict`) + quantization_config (fp8 e4m3, ue8m0 scales,
                        128 x 128 blocks, experts fp4)
    model.safetensors   DeepSeek's original tensor names (dsjax/checkpoint/names.py)
    tokenizer.json, tokenizer_config.json   the bundled V4 tokenizer
    draft_vocab.json    with --draft-vocab N: the N token ids most frequent in the training
                        split, which the MTP drafter proposes from (`Engine(draft_vocab=)`)

    python -m dsjax.train.export --run /work/tinypy-run --config configs/dsjax-tiny-py.json --out DIR \
        [--draft-vocab 8192]

Storage, as in the V4 checkpoints (and the spec's table):
  FP8 E4M3 + E8M0 block scales   attention wq_a / wq_b / wkv / wo_a / wo_b, indexer wq_b,
                                 shared experts w1 / w2 / w3, MTP e_proj / h_proj
  MXFP4 (E2M1 pairs, E8M0 / 32)  routed experts w1 / w2 / w3
  F32                            hc_* (mHC), attn_sink, ape (compressor position bias), gate.bias
  I64                            gate.tid2eid (hash routing)
  BF16                           everything else: embed, norms, compressor wkv / wgate,
                                 indexer weights_proj, gate.weight
Scales are powers of two chosen so the block's largest magnitude fits (448 for E4M3, 6 for
E2M1); values round to nearest (even). `to_deepseek` also returns the dequantized weights
as dsjax trees: exactly what the loader reconstructs, the oracle of the round-trip test.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsjax.checkpoint import write_safetensors
from dsjax.checkpoint.names import mtp_weight_names, per_layer_paths, weight_names
from dsjax.config import ModelConfig, load_config
from dsjax.config.io import to_hf_dict
from dsjax.model import forward
from dsjax.params import path_str
from dsjax.tokenizer import bundled_tokenizer_path, load_tokenizer
from dsjax.train import data, pretrain
from dsjax.train.vocab import VocabMap, compact_config, expand

FP8_BLOCK = 128
FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
                "indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
                "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")
F32_MARKS = ("hc_", "attn_sink", ".ape", "gate.bias")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "expert_dtype": "fp4"}


def _exponents(amax: np.ndarray, top: float) -> np.ndarray:
    """Smallest power-of-two exponent e with amax / 2^e <= top (E8M0 range)."""
    return np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / top)), -127, 127).astype(np.int32)


def fp8_quantize(w: np.ndarray, block: int = FP8_BLOCK):
    """[out, in] -> (E4M3 values, E8M0 scales [ceil(out/b), ceil(in/b)], dequantized f32)."""
    out, inn = w.shape
    ro, ri = -(-out // block), -(-inn // block)
    padded = np.zeros((ro * block, ri * block), np.float32)
    padded[:out, :inn] = w
    amax = np.abs(padded.reshape(ro, block, ri, block)).max(axis=(1, 3))
    e = _exponents(amax, 448.0)
    scale = np.repeat(np.repeat(np.ldexp(np.float32(1), e), block, 0), block, 1)[:out, :inn]
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    return q, (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu), q.astype(np.float32) * scale


def mxfp4_quantize(w: np.ndarray):
    """[out, in] -> (int8 [out, in/2] two E2M1 codes a byte, low nibble first; E8M0 [out, in/32];
    dequantized f32)."""
    out, inn = w.shape
    groups = w.reshape(out, inn // 32, 32)
    e = _exponents(np.abs(groups).max(axis=-1), 6.0)
    scale = np.ldexp(np.float32(1), e)[..., None]
    q = (groups / scale).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8).reshape(out, inn) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    deq = (q.astype(np.float32) * scale).reshape(out, inn)
    return packed, (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu), deq


def store(name: str, a: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One tensor by its DeepSeek name -> (the stored tensors, the values the loader reads back)."""
    if name.endswith(FP8_SUFFIXES):
        q, s, deq = fp8_quantize(a)
        return {name: q, name[: -len("weight")] + "scale": s}, deq
    if ".experts." in name:
        q, s, deq = mxfp4_quantize(a)
        return {name: q, name[: -len("weight")] + "scale": s}, deq
    if np.issubdtype(a.dtype, np.integer):
        return {name: a.astype(np.int64)}, a
    if any(m in name for m in F32_MARKS):
        return {name: a.astype(np.float32)}, a.astype(np.float32)
    b = a.astype(ml_dtypes.bfloat16)
    return {name: b}, b.astype(np.float32)


def _tensors_of(tree, table, cfg: ModelConfig):
    """dsjax tree -> ({DeepSeek name: stored tensor}, the dequantized tree)."""
    tensors = {}

    def leaf(path, a):
        a = np.asarray(a)
        name = path_str(path)
        layers = per_layer_paths(cfg, name)
        slices = [(table[name], a, None)] if layers is None else [(table[p], a[r], r) for r, p in enumerate(layers)]
        deq = np.empty(a.shape, np.float32 if np.issubdtype(a.dtype, np.floating) else a.dtype)
        for src, x, r in slices:
            at = () if r is None else (r,)
            if src.expert is None:
                stored, d = store(src.name, x)
                tensors.update(stored)
                deq[at] = d
            else:
                for e in range(x.shape[0]):
                    stored, d = store(f"{src.name}.{e}.{src.expert}.weight", x[e])
                    tensors.update(stored)
                    deq[(*at, e)] = d
        return deq

    return tensors, jax.tree_util.tree_map_with_path(leaf, tree)


def to_deepseek(params, mtp, cfg: ModelConfig):
    """Full-vocabulary ModelParams / MTPParams -> ({name: tensor}, {"params", "mtp"} dequantized)."""
    tensors, deq_params = _tensors_of(params, weight_names(cfg), cfg)
    mtp_tensors, deq_mtp = _tensors_of(mtp, mtp_weight_names(cfg), cfg)
    return {**tensors, **mtp_tensors}, {"params": deq_params, "mtp": deq_mtp}


def export(model: dict, vocab: VocabMap | None, cfg: ModelConfig, out: Path, provenance: dict | None = None):
    """Trained {"params", "mtp"} (compact vocabulary when `vocab`) -> checkpoint directory
    `out`. Returns the dequantized full-vocabulary trees (see `to_deepseek`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = expand(model["params"], vocab) if vocab is not None else jax.tree.map(np.asarray, model["params"])
    tensors, dequantized = to_deepseek(params, jax.tree.map(np.asarray, model["mtp"]), cfg)
    write_safetensors(out / "model.safetensors", dict(sorted(tensors.items())), metadata={"format": "pt"})
    config = {**to_hf_dict(cfg), "quantization_config": QUANTIZATION_CONFIG}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tok = bundled_tokenizer_path()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tok.parent / f).is_file():
            shutil.copyfile(tok.parent / f, out / f)
    if provenance is not None:
        (out / "training.json").write_text(json.dumps(provenance, indent=1) + "\n")
    return dequantized


def most_frequent(docs: list[np.ndarray], vocab_size: int, n: int) -> tuple[np.ndarray, float]:
    """The (at most) n token ids most frequent in docs, sorted by id, and the fraction of
    the docs' tokens they cover. Ties go to the smaller id; ids that never occur are left
    out, so fewer than n come back when fewer occur."""
    counts = np.bincount(np.concatenate(docs), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[: min(n, int(np.count_nonzero(counts)))]
    return np.sort(order).astype(np.int32), float(counts[order].sum() / max(counts.sum(), 1))


def write_draft_vocab(out: Path, run: Path, cfg: ModelConfig, n: int) -> dict:
    """draft_vocab.json in `out`: the n most frequent token ids of the run's training split
    (its tokenized corpus cache, corpus-*.npz; tokenized anew if the run has none)."""
    if n <= 0:
        raise ValueError(f"--draft-vocab must be a positive number of tokens, got {n}")
    train_docs, _ = data.corpus_tokens(data.stdlib_root(), data.load_file_list(), load_tokenizer(), run)
    ids, coverage = most_frequent(train_docs, cfg.vocab_size, n)
    record = {"ids": ids.tolist(), "source": f"the {len(ids)} most frequent token ids of the training split "
                                              f"({sum(map(len, train_docs))} tokens, {run})",
              "train_coverage": round(coverage, 6)}
    (Path(out) / "draft_vocab.json").write_text(json.dumps(record) + "\n")
    return record


def load_run(ckpt: Path, cfg: ModelConfig):
    """A pretraining checkpoint -> ({"params", "mtp"}, VocabMap | None, meta)."""
    vocab = pretrain.load_vocab(ckpt, cfg.vocab_size)
    tcfg = compact_config(cfg, vocab) if vocab is not None else cfg
    template = pretrain.init_model(tcfg, 0)
    z = np.load(Path(ckpt) / "state.npz")
    model = pretrain._unflat(template, {k[len("model/"):]: z[k] for k in z.files if k.startswith("model/")})
    return model, vocab, json.loads((Path(ckpt) / "meta.json").read_text())


def mean_nll(model, sequences: np.ndarray, batch: int = 4) -> float:
    """Mean next-token NLL (nats, full-vocabulary softmax) of a loaded `dsjax.Model` over
    token sequences [N, S + 1]: how the shipped checkpoint is scored (report and tests)."""
    @jax.jit
    def nll(params, tokens):
        logits, _ = forward(params, tokens[:, :-1], model.config, opts=model.options)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0].sum()

    total = sum(float(nll(model.params, jnp.asarray(sequences[i:i + batch]))) for i in range(0, len(sequences), batch))
    return total / sequences[:, 1:].size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="pretraining run directory (its newest checkpoint) or a ckpt-* dir")
    ap.add_argument("--config", default="configs/dsjax-tiny-py.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="also write draft_vocab.json: the N most frequent training token ids (MTP drafts)")
    args = ap.parse_args()
    run = Path(args.run)
    ckpt = run if (run / "meta.json").is_file() else pretrain.latest_checkpoint(run)
    if ckpt is None:
        raise SystemExit(f"{run}: no checkpoint (ckpt-*/meta.json) found")
    cfg = load_config(args.config)
    model, vocab, meta = load_run(ckpt, cfg)
    provenance = {"checkpoint": str(ckpt), "step": meta["step"], "hparams": meta["hparams"]}
    if "init_from" in meta:  # continued pretraining: the run it started from
        provenance["init_from"] = meta["init_from"]
    log = ckpt.parent / "log.jsonl"
    if log.is_file():  # the run's own held-out evaluation at this step: what the shipped weights must reproduce
        evals = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("eval") and r["step"] == meta["step"]]
        if evals:
            provenance["eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
            provenance["eval_sequences"] = {"count": pretrain.EVAL_SEQUENCES, "seq_len": meta["hparams"]["seq_len"],
                                            "what": "data.pack(held-out documents, seq_len, None)[:count]"}
    export(model, vocab, cfg, Path(args.out), provenance)
    size = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    print(f"wrote {args.out} from {ckpt} (step {meta['step']}): model.safetensors {size / 2**20:.1f} MiB")
    if args.draft_vocab:
        record = write_draft_vocab(Path(args.out), run.parent if ckpt == run else run, cfg, args.draft_vocab)
        print(f"wrote draft_vocab.json: {len(record['ids'])} ids covering {record['train_coverage']:.1%} of the "
              f"training tokens")


if __name__ == "__main__":
    main()
