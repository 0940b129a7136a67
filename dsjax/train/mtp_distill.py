"""Self-distillation of the MTP drafter: train a model's MTP layer on the model's own greedy
continuations, so that its drafts agree with the target (random weights give an MTP layer
that never does). Seeded and deterministic.

    python -m dsjax.train.mtp_distill --model tiny --steps 300 --out /tmp/dsjax_tiny_mtp

At position t the MTP layer sees the target's streams X_t and token x_{t+1} and learns to
predict x_{t+2}, the target's own next-next greedy token. Only the MTP layer trains (the
embedding and the output head it shares stay frozen).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dsjax
from dsjax.checkpoint import orbax_io
from dsjax.model import decoder_streams, mtp_forward, mtp_head


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def distillation_data(model, prompts: list[list[int]], new_tokens: int):
    """Greedy continuations of the prompts (all the same length) and the target's streams
    along them. -> (streams [B, S, N, D], next tokens [B, S], targets [B, S], mask [B, S]):
    position t predicts targets[t] = x_{t+2}, learnt where that is a generated token."""
    prompt_len = len(prompts[0])
    if any(len(p) != prompt_len for p in prompts):
        raise ValueError("distillation prompts must all have the same length")
    outs = dsjax.generate(model, prompts, new_tokens)
    length = prompt_len + new_tokens
    ids = np.zeros((len(prompts), length), np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = (p + o)[:length]
        ids[i, : len(seq)], lengths[i] = seq, len(seq)
    streams, _ = jax.jit(decoder_streams, static_argnames=("cfg", "opts"))(model.params, jnp.asarray(ids), model.config,
                                                                           opts=model.options)
    t = np.arange(length)
    mask = (t[None] + 2 >= prompt_len) & (t[None] + 2 < lengths[:, None])
    targets = np.zeros_like(ids)
    targets[:, :-2] = ids[:, 2:]
    next_tokens = np.zeros_like(ids)
    next_tokens[:, :-1] = ids[:, 1:]
    return streams, jnp.asarray(next_tokens), jnp.asarray(targets), jnp.asarray(mask, jnp.float32)


def _is_float(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def mtp_objective(mtp, main, streams, next_tokens, targets, mask, cfg):
    """(mean cross-entropy, top-1 agreement) of the MTP layer's x_{t+2} predictions where mask."""
    logits = mtp_head(mtp, main, mtp_forward(mtp, main, streams, next_tokens, cfg)[0], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    n = jnp.maximum(jnp.sum(mask), 1)
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(nll * mask) / n, jnp.sum(hits * mask) / n


def train_mtp(model, prompts: list[list[int]], *, new_tokens: int = 64, steps: int = 300, batch: int = 8,
              lr: float = 5e-2, seed: int = 0, log_every: int = 50):
    """-> (trained MTP params in the model's dtype, {"loss": [...], "agreement": [...]}).
    Starts from model.mtp; adam with cosine decay to lr / 10; minibatches of `batch` sequences."""
    streams, next_tokens, targets, mask = distillation_data(model, prompts, new_tokens)
    cfg, n = model.config, len(prompts)
    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.1))
    mtp = jax.tree.map(lambda a: a.astype(jnp.float32) if _is_float(a) else a, model.mtp)
    trainable = jax.tree.map(_is_float, mtp)
    opt = optax.masked(opt, trainable)
    state = opt.init(mtp)

    @jax.jit
    def step(mtp, state, idx):
        def loss_fn(m):
            return mtp_objective(m, model.params, streams[idx], next_tokens[idx], targets[idx], mask[idx], cfg)

        (loss, agreement), grads = jax.value_and_grad(loss_fn, has_aux=True)(mtp)
        grads = jax.tree.map(lambda g, a: g if _is_float(a) else jnp.zeros_like(a), grads, mtp)
        updates, state = opt.update(grads, state, mtp)
        return optax.apply_updates(mtp, updates), state, loss, agreement

    rng = np.random.default_rng(seed + 1)
    history = {"loss": [], "agreement": []}
    for i in range(steps):
        idx = jnp.asarray(rng.choice(n, min(batch, n), replace=False))
        mtp, state, loss, agreement = step(mtp, state, idx)
        history["loss"].append(float(loss))
        history["agreement"].append(float(agreement))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {history['loss'][-1]:.3f}  agreement {history['agreement'][-1]:.3f}",
                  flush=True)
    return jax.tree.map(lambda new, old: new.astype(old.dtype), mtp, model.mtp), history


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/tmp/dsjax_tiny_mtp")
    args = ap.parse_args()
    model = dsjax.load_model(args.model, dtype="float32", seed=args.seed, mtp=True)
    prompts = random_prompts(model.config.vocab_size, args.prompts, args.prompt_len, args.seed)
    t = time.perf_counter()
    mtp, history = train_mtp(model, prompts, new_tokens=args.new_tokens, steps=args.steps, seed=args.seed)
    trained = model.replace(mtp=mtp)
    orbax_io.save(trained, args.out, quantized="dequantize")
    Path(args.out, "training.json").write_text(json.dumps(
        {"model": args.model, "seed": args.seed, "steps": args.steps, "seconds": time.perf_counter() - t,
         "loss_first": history["loss"][0], "loss_last": history["loss"][-1],
         "agreement_last": history["agreement"][-1]}))
    print(f"saved {args.out} (loss {history['loss'][0]:.2f} -> {history['loss'][-1]:.2f})")


if __name__ == "__main__":
    main()
