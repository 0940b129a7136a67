"""Pretraining a small DeepSeek-V4 model (main model + its MTP layer + the Lightning
Indexer) from scratch, on the model's own functions. Deterministic, seeded, resumable.

    python -m dsjax.train.pretrain --config configs/dsjax-tiny-py.json --out /work/tinypy-run --resume

* Data: dsjax/train/data.py (the pinned Python stdlib corpus, V4 tokenizer, packed
  sequences; the batch of step k is a pure function of the step).
* Vocabulary: dsjax/train/vocab.py (rare tokens share one row; exact full-vocab softmax).
* Objective: dsjax/train/objective.py (next-token CE + lambda_mtp * MTP CE + lambda_idx *
  indexer KL).
* Optimizer: AdamW (b1 0.9, b2 0.95, weight decay on matrices only), global-norm clipping,
  linear warmup then cosine decay to lr * min_lr_ratio over `steps`. All floating-point
  weights train in float32; integer tables (hash routing tid2eid) stay as initialised; the
  router's selection bias gets no gradient (it only picks experts) and stays 0 (DeepSeek's
  auxiliary-loss-free bias update is not implemented: the forward does not return expert
  loads, and the dropless MoE loses no tokens to imbalance).
* Checkpoints: `<out>/ckpt-<step>/` = state.npz (params, MTP params, optimizer state, by
  pytree path) + meta.json (step, hyperparameters, config) + vocab_kept.npy, written to a
  temporary directory and renamed, every `ckpt_minutes` and at the end; the last two kept.
  `--resume` continues from the newest: the next step's loss is bit-identical to an
  uninterrupted run's (tests/test_train.py).
* Log: `<out>/log.jsonl`, one JSON object per logged step (losses, lr, grad norm, tokens,
  seconds) and per evaluation on held-out sequences (`"eval": true`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsjax.compile_cache import setup_compile_cache
from dsjax.config import ModelConfig, load_config
from dsjax.model import decoder_streams, logits_of, model_specs, mtp_forward, mtp_head, mtp_specs
from dsjax.params import LAYERS, init_params, is_spec, path_str
from dsjax.tokenizer import load_tokenizer
from dsjax.train import data
from dsjax.train.objective import pretrain_losses
from dsjax.train.vocab import VocabMap, compact_config, full_nll


EVAL_SEQUENCES = 32  # held-out sequences each evaluation scores (the first of the packed held-out split)


@dataclasses.dataclass(frozen=True)
class Hparams:
    seq_len: int = 256
    batch: int = 8
    steps: int = 3000  # the schedule's length (a run may stop earlier and resume)
    lr: float = 3e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3  # DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1
    indexer_weight: float = 1.0  # the indexer's loss reaches only the indexer's weights
    seed: int = 0
    min_count: int = 2  # tokens rarer than this in the training split share one row


def _is_float(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def init_model(cfg: ModelConfig, seed: int) -> dict:
    """{"params", "mtp"}: float32 ModelParams and MTPParams, seeded."""
    return {"params": init_params(model_specs(cfg, jnp.float32), seed),
            "mtp": init_params(mtp_specs(cfg, jnp.float32), seed + 1)}


def trainable(model: dict) -> dict:
    """The floating-point leaves (None elsewhere): what the optimizer updates."""
    return jax.tree.map(lambda a: a if _is_float(a) else None, model)


def combine(train: dict, model: dict) -> dict:
    """The trained leaves put back into the full model tree (integer leaves from `model`)."""
    flat_t = jax.tree_util.tree_flatten(train, is_leaf=lambda x: x is None)[0]
    flat_m, tree = jax.tree_util.tree_flatten(model, is_leaf=lambda x: x is None)
    return tree.unflatten([t if t is not None else m for t, m in zip(flat_t, flat_m)])


def decay_mask(cfg: ModelConfig) -> dict:
    """Weight decay on matrices (>= 2 axes besides a stacked-layers axis), not on norms,
    biases, sinks or mHC scales; None on integer leaves (the shape of `trainable`)."""
    specs = {"params": model_specs(cfg, jnp.float32), "mtp": mtp_specs(cfg, jnp.float32)}
    return jax.tree.map(lambda s: sum(a != LAYERS for a in s.axes) >= 2 if _is_float(s) else None, specs,
                        is_leaf=is_spec)


@functools.lru_cache(maxsize=8)
def optimizer(cfg: ModelConfig, hp: Hparams):
    schedule = optax.warmup_cosine_decay_schedule(0.0, hp.lr, hp.warmup, max(hp.steps, hp.warmup + 1),
                                                  end_value=hp.lr * hp.min_lr_ratio)
    opt = optax.chain(optax.clip_by_global_norm(hp.clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=hp.weight_decay,
                                  mask=decay_mask(cfg)))
    return opt, schedule


@functools.lru_cache(maxsize=8)
def make_step(cfg: ModelConfig, vocab: VocabMap | None, hp: Hparams):
    """-> jitted step(train, frozen, opt_state, tokens [B, S+1]) -> (train, opt_state,
    metrics); frozen: the model tree whose integer leaves complete `train`. Cached: runs
    with the same settings in one process share one compiled step."""
    opt, _ = optimizer(cfg, hp)

    def loss_fn(train, frozen, tokens):
        m = combine(train, frozen)
        losses = pretrain_losses(m["params"], m["mtp"], tokens, cfg, vocab)
        total = losses["lm"] + hp.mtp_weight * losses["mtp"] + hp.indexer_weight * losses["indexer"]
        return total, losses

    @jax.jit
    def step(train, frozen, opt_state, tokens):
        (total, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(train, frozen, tokens)
        updates, opt_state = opt.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, {"loss": total, **losses,
                                                                "grad_norm": optax.tree.norm(grads)}

    return step


@functools.lru_cache(maxsize=8)
def make_eval(cfg: ModelConfig, vocab: VocabMap | None):
    """-> jitted eval(model, tokens [B, S+1]) -> per-batch sums: lm / mtp NLL, top-1 hits,
    and the MTP layer's agreement with the main model's next greedy token (the first
    draft's greedy acceptance, teacher-forced)."""

    @jax.jit
    def evaluate(model, tokens):
        params, mtp = model["params"], model["mtp"]
        inputs, nxt = tokens[:, :-1], tokens[:, 1:]
        streams, _ = decoder_streams(params, inputs, cfg)
        logits = logits_of(params, streams, cfg)
        out, _ = mtp_forward(mtp, params, streams, nxt, cfg)
        mtp_logits = mtp_head(mtp, params, out, cfg)
        nll = full_nll(logits, nxt, vocab) if vocab is not None else -jnp.take_along_axis(
            jax.nn.log_softmax(logits), nxt[..., None], axis=-1)[..., 0]
        mtp_nll = full_nll(mtp_logits[:, :-1], nxt[:, 1:], vocab) if vocab is not None else -jnp.take_along_axis(
            jax.nn.log_softmax(mtp_logits[:, :-1]), nxt[:, 1:, None], axis=-1)[..., 0]
        greedy, draft = jnp.argmax(logits, -1), jnp.argmax(mtp_logits, -1)
        return {"lm_nll": jnp.sum(nll), "lm_n": nll.size, "lm_hits": jnp.sum(greedy == nxt),
                "mtp_nll": jnp.sum(mtp_nll), "mtp_n": mtp_nll.size, "mtp_hits": jnp.sum(draft[:, :-1] == nxt[:, 1:]),
                "mtp_agree": jnp.sum(draft[:, :-1] == greedy[:, 1:])}

    return evaluate


def run_eval(evaluate, model: dict, sequences: np.ndarray, batch: int) -> dict:
    sums: dict[str, float] = {}
    for i in range(0, len(sequences) - batch + 1, batch):
        for k, v in evaluate(model, jnp.asarray(sequences[i:i + batch])).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    lm, mtp = sums["lm_nll"] / sums["lm_n"], sums["mtp_nll"] / sums["mtp_n"]
    return {"eval_lm": lm, "eval_ppl": float(np.exp(lm)), "eval_mtp": mtp, "eval_lm_top1": sums["lm_hits"] / sums["lm_n"],
            "eval_mtp_top1": sums["mtp_hits"] / sums["mtp_n"], "eval_mtp_agree": sums["mtp_agree"] / sums["mtp_n"]}


# ----------------------------------------------------------------------------- checkpoints
def _flat(tree) -> dict[str, np.ndarray]:
    return {path_str(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(template, arrays) -> object:
    leaves, tree = jax.tree_util.tree_flatten_with_path(template)
    missing = [path_str(p) for p, _ in leaves if path_str(p) not in arrays]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} arrays, e.g. {missing[:3]}")
    return tree.unflatten([jnp.asarray(arrays[path_str(p)]) for p, _ in leaves])


def save_checkpoint(out: Path, step: int, model: dict, opt_state, meta: dict, vocab: VocabMap | None,
                    keep: int = 2) -> Path:
    final = out / f"ckpt-{step:07d}"
    tmp = out / f".ckpt-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    arrays = {f"model/{k}": v for k, v in _flat(model).items()}
    arrays.update({f"opt/{k}": v for k, v in _flat(opt_state).items()})
    np.savez(tmp / "state.npz", **arrays)
    if vocab is not None:
        np.save(tmp / "vocab_kept.npy", vocab.kept)
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(out.glob("ckpt-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted(p for p in Path(out).glob("ckpt-*") if (p / "meta.json").is_file())
    return found[-1] if found else None


def load_checkpoint(ckpt: Path, model_template: dict, opt_template):
    """-> (step, model, opt_state, meta)."""
    z = np.load(Path(ckpt) / "state.npz")
    arrays = {k: z[k] for k in z.files}
    model = _unflat(model_template, {k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")})
    opt_state = _unflat(opt_template, {k[len("opt/"):]: v for k, v in arrays.items() if k.startswith("opt/")})
    meta = json.loads((Path(ckpt) / "meta.json").read_text())
    return meta["step"], model, opt_state, meta


def load_vocab(ckpt: Path, full_size: int) -> VocabMap | None:
    f = Path(ckpt) / "vocab_kept.npy"
    return VocabMap(np.load(f), full_size) if f.is_file() else None


# ----------------------------------------------------------------------------- the loop
def train(cfg: ModelConfig, hp: Hparams, out: Path, train_docs: list[np.ndarray], held_docs: list[np.ndarray], *,
          resume: bool = False, stop_at: int | None = None, ckpt_minutes: float = 5.0, log_every: int = 10,
          eval_every: int = 200, eval_sequences: int = EVAL_SEQUENCES, compact_vocab: bool = True, on_log=print,
          init_from: Path | None = None) -> dict:
    """Train (or continue) the run in `out` up to step `stop_at` (default hp.steps);
    checkpoint at the end. Documents are full-vocabulary token arrays. -> the final model
    tree (compact vocabulary when compact_vocab) and the VocabMap under "vocab".
    init_from: a checkpoint of another run (same config and vocabulary) whose weights this
    run starts from, with a fresh optimizer and its own schedule (continued pretraining:
    another run's schedule has decayed; `resume` would only finish it). Ignored once `out`
    has a checkpoint of its own (then resume continues this run)."""
    setup_compile_cache()  # the training step takes a minute or more to compile on a CPU
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = None
    if compact_vocab:
        counts = np.bincount(np.concatenate(train_docs), minlength=cfg.vocab_size)
        vocab = VocabMap.from_counts(counts, hp.min_count)
        tcfg = compact_config(cfg, vocab)
        remap = vocab.to_compact
    else:
        tcfg, remap = cfg, np.arange(cfg.vocab_size, dtype=np.int32)
    batches = data.Batches(remap[data.pack(train_docs, hp.seq_len, hp.seed)], hp.batch, hp.seed)
    held = remap[data.pack(held_docs, hp.seq_len, None)][:eval_sequences]

    model = init_model(tcfg, hp.seed)
    opt, schedule = optimizer(tcfg, hp)
    opt_state = opt.init(trainable(model))
    meta = {"config": cfg.name, "hparams": dataclasses.asdict(hp), "compact_vocab": compact_vocab,
            "train_sequences": len(batches.sequences), "vocab_compact": tcfg.vocab_size}
    step = 0
    ckpt = latest_checkpoint(out) if resume else None
    if ckpt is not None:
        step, model, opt_state, saved = load_checkpoint(ckpt, model, opt_state)
        if saved["hparams"] != meta["hparams"] or saved["config"] != meta["config"]:
            raise ValueError(f"{ckpt}: saved with other settings ({saved['hparams']}, {saved['config']}) "
                             f"than this run ({meta['hparams']}, {meta['config']})")
        on_log(f"resumed {ckpt} at step {step}")
    elif init_from is not None:
        src = Path(init_from)
        src = src if (src / "meta.json").is_file() else latest_checkpoint(src)
        if src is None:
            raise ValueError(f"{init_from}: no checkpoint (ckpt-*/meta.json) to start from")
        src_meta = json.loads((src / "meta.json").read_text())
        if src_meta["config"] != meta["config"] or src_meta.get("vocab_compact") != meta["vocab_compact"]:
            raise ValueError(f"{src}: config {src_meta['config']!r} / vocabulary {src_meta.get('vocab_compact')} "
                             f"differ from this run's ({meta['config']!r} / {meta['vocab_compact']})")
        _, model, _, _ = load_checkpoint(src, model, opt_state)
        meta["init_from"] = {"checkpoint": str(src), "step": src_meta["step"]}
        on_log(f"starting from the weights of {src} (step {src_meta['step']}); fresh optimizer and schedule")
    train_step = make_step(tcfg, vocab, hp)
    evaluate = make_eval(tcfg, vocab) if len(held) >= 1 else None
    stop = hp.steps if stop_at is None else stop_at
    params = trainable(model)
    frozen = jax.tree.map(lambda a: None if _is_float(a) else a, model)  # integer tables
    log = (out / "log.jsonl").open("a")
    last_ckpt, t0 = time.time(), time.time()
    history = []
    while step < stop:
        t = time.time()
        params, opt_state, metrics = train_step(params, frozen, opt_state, jnp.asarray(batches(step)))
        step += 1
        record = {k: float(v) for k, v in metrics.items()}
        history.append(record)
        if step % log_every == 0 or step == stop or step == 1:
            record.update(step=step, lr=float(schedule(step - 1)), tokens=step * hp.batch * hp.seq_len,
                          step_s=round(time.time() - t, 3), elapsed_s=round(time.time() - t0, 1))
            log.write(json.dumps(record) + "\n")
            log.flush()
            on_log(f"step {step:6d}  loss {record['loss']:.4f}  lm {record['lm']:.4f}  mtp {record['mtp']:.4f}  "
                   f"indexer {record['indexer']:.4f}  {record['step_s']:.2f} s/step")
        if evaluate is not None and eval_every and (step % eval_every == 0 or step == stop):
            ev = run_eval(evaluate, combine(params, model), held, hp.batch)
            log.write(json.dumps({"step": step, "eval": True, **ev}) + "\n")
            log.flush()
            on_log(f"eval step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        if time.time() - last_ckpt > ckpt_minutes * 60 and step < stop:
            save_checkpoint(out, step, combine(params, model), opt_state, meta, vocab)
            last_ckpt = time.time()
    log.close()
    model = combine(params, model)
    if ckpt is None or step > ckpt_step(ckpt):
        save_checkpoint(out, step, model, opt_state, meta, vocab)
    return {"model": model, "vocab": vocab, "config": tcfg, "history": history, "step": step, "out": out}


def ckpt_step(ckpt: Path) -> int:
    return int(Path(ckpt).name.split("-")[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/dsjax-tiny-py.json")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, log.jsonl, tokenized corpus cache)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument("--stop-at", type=int, default=None, help="stop (and checkpoint) at this step; resume later")
    ap.add_argument("--init-from", default=None, help="start from another run's weights (its newest checkpoint, or a "
                    "ckpt-* dir) with a fresh optimizer and this run's schedule; pass another --seed for a new "
                    "data order")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    for f in dataclasses.fields(Hparams):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = ap.parse_args()
    hp = Hparams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hparams)})
    cfg = load_config(args.config)
    root, listing = data.stdlib_root(), data.load_file_list()
    train_docs, held_docs = data.corpus_tokens(root, listing, load_tokenizer(), Path(args.out))
    print(f"{cfg.name}: {len(train_docs)} training documents ({sum(map(len, train_docs))} tokens), "
          f"{len(held_docs)} held out ({sum(map(len, held_docs))} tokens); {hp}", flush=True)
    train(cfg, hp, Path(args.out), train_docs, held_docs, resume=args.resume, stop_at=args.stop_at,
          ckpt_minutes=args.ckpt_minutes, log_every=args.log_every, eval_every=args.eval_every,
          on_log=lambda s: print(s, flush=True), init_from=args.init_from)


if __name__ == "__main__":
    main()
