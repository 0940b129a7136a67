"""Speculative decoding on CPU with the trained dsjax-tiny-py and its MTP drafter: wall clock
and acceptance against plain decoding and `decode_steps=4`, batch 1 and 8: the fixed policy
at k = 1..4 and the confidence policy with a reduced draft vocabulary (the model's
draft_vocab.json, else the N most frequent training tokens), and the drafter over the full
vocabulary at k = 3 (flags choose the k of each).

    python benchmarks/spec_bench.py --out benchmarks/results/spec_cpu_tinypy.json

Prompts: cuts of 32-64 tokens from the held-out stdlib files (dsjax.train.data), which the
model never trained on. Greedy, 64 new tokens each, so every speculative run must reproduce
the plain run's tokens (`identical`). Batch 1 runs the prompts one after another through a
one-slot engine, batch 8 all at once. Per run: tok/s (generated tokens / wall time, the best
of `--repeats` timed runs after one that compiles), speedup against plain decoding and
against decode_steps=4, tokens per target step (per request: `tokens_per_row_step`),
acceptance per draft position (accepted when judged) and overall.

On this model the 129280-row output head is most of a step (hidden 128, 4 layers), and the
drafter reads the same head: the reduced vocabulary is what lets a draft cost much less than
a target step.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import jax
import numpy as np

from results_io import write_result  # noqa: E402

import dsjax
from dsjax.engine.engine import Engine
from dsjax.engine.sampler import SamplingParams
from dsjax.tokenizer import load_tokenizer
from dsjax.train import data
from dsjax.train.export import most_frequent
from dsjax.weights import resolve

SPEC_KEYS = ("acceptance_rate", "acceptance_by_position", "judged_by_position", "tokens_per_row_step",
             "tokens_per_target_step", "drafts_proposed", "drafts_accepted", "verify_costs")


def held_out_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """n prompts of lo..hi tokens, each cut at a random place from a different held-out file."""
    root, listing = data.stdlib_root(), data.load_file_list()
    names = [f["path"] for f in listing["files"] if data.is_held_out(f["path"])]
    docs = data.tokenize(data.read_documents(root, listing, held_out=True), tokenizer)
    rng = np.random.default_rng(seed)
    usable = [i for i, d in enumerate(docs) if len(d) > hi + 64]
    prompts, sources = [], []
    for i in rng.choice(usable, n, replace=False):
        length = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(docs[i]) - length - 64))
        prompts.append(docs[i][start: start + length].tolist())
        sources.append(f"{names[i]}[{start}:{start + length}]")
    return prompts, sources


def run(model, prompts, batch: int, new_tokens: int, repeats: int, **engine_kw) -> dict:
    """Best wall time of engine.generate over `repeats` runs after one that compiles."""
    engine = Engine(model, max_slots=batch, capacity=256, prefill_chunk=32, **engine_kw)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)
    times, tokens = [], None
    for _ in range(repeats):
        engine.policy.reset()
        t = time.perf_counter()
        tokens = engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
    seconds = min(times)
    out = {"seconds": seconds, "seconds_all": times, "tokens_per_s": sum(map(len, tokens)) / seconds,
           "tokens": tokens}
    if engine.num_draft_tokens:
        m = engine.spec_metrics()
        out.update({k: m[k] for k in SPEC_KEYS})
    return out


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dsjax-tiny-py", help="a checkpoint with its MTP layer (default: bundled)")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="reduced draft vocabulary when the model has no draft_vocab.json: the N most frequent "
                         "training tokens (from the run's corpus cache)")
    ap.add_argument("--run", default="/work/tinypy-run", help="training run directory (its corpus-*.npz)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ks", default="1,2,3,4", help="draft lengths of the reduced drafter, fixed policy")
    ap.add_argument("--confidence-ks", default="3", help="draft lengths of the reduced drafter, confidence policy")
    ap.add_argument("--full-ks", default="3", help="draft lengths of the full-vocabulary drafter (fixed policy)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/spec_cpu_tinypy.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = dsjax.load_model(args.model, dtype="float32")
    if model.mtp is None:
        raise SystemExit(f"{args.model}: no MTP layer (mtp.0.*) to draft with")
    tokenizer = load_tokenizer()
    if model.draft_vocab is not None:
        reduced, source = model.draft_vocab, "the checkpoint's draft_vocab.json"
    else:
        train_docs, _ = data.corpus_tokens(data.stdlib_root(), data.load_file_list(), tokenizer, Path(args.run))
        reduced, _ = most_frequent(train_docs, model.config.vocab_size, args.draft_vocab)
        source = f"the {len(reduced)} most frequent training tokens ({args.run})"
    prompts, sources = held_out_prompts(tokenizer, args.prompts, 32, 64, args.seed)
    checkpoint = Path(resolve(args.model)).resolve()
    result = {
        "platform": platform.processor() or platform.machine(), "jax": jax.__version__,
        "devices": str(jax.devices()), "model": f"{args.model} (float32) from {checkpoint}",
        "training": (checkpoint / "training.json").read_text() if (checkpoint / "training.json").is_file() else None,
        "prompts": sources, "prompt_lens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
        "decoding": "greedy", "draft_vocab": {"size": int(len(reduced)), "source": source},
        "timing": f"best of {args.repeats} runs after a compiling one", "runs": {},
    }
    drafters = {"full": False, "reduced": reduced}
    for batch in map(int, args.batches.split(",")):
        runs = {"plain": run(model, prompts, batch, args.new_tokens, args.repeats),
                "plain_decode_steps4": run(model, prompts, batch, args.new_tokens, args.repeats, decode_steps=4)}
        configs = [("reduced", "fixed", k) for k in _ints(args.ks)] + \
            [("reduced", "confidence", k) for k in _ints(args.confidence_ks)] + \
            [("full", "fixed", k) for k in _ints(args.full_ks)]
        for vocab, policy, k in configs:
            runs[f"{vocab}_{policy}_k{k}"] = r = run(model, prompts, batch, args.new_tokens, args.repeats,
                                                     num_draft_tokens=k, spec_policy=policy, draft_vocab=drafters[vocab])
            print(f"batch {batch} {vocab:7s} {policy:10s} k={k}: {r['tokens_per_s']:7.1f} tok/s, "
                  f"{r['tokens_per_row_step']:.2f} tok/row step, acceptance by position "
                  f"{[round(a, 3) if a is not None else None for a in r['acceptance_by_position']]}", flush=True)
        base, steps4 = runs["plain"], runs["plain_decode_steps4"]
        for r in runs.values():
            r["speedup_vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["speedup_vs_decode_steps4"] = r["tokens_per_s"] / steps4["tokens_per_s"]
        expected = base["tokens"]
        for r in runs.values():
            r["identical"] = r.pop("tokens") == expected
        result["runs"][f"batch{batch}"] = runs
        print(f"batch {batch}: plain {base['tokens_per_s']:.1f} tok/s, decode_steps=4 "
              f"{steps4['tokens_per_s']:.1f} tok/s", flush=True)
    result["seconds_total"] = time.perf_counter() - t0
    write_result(result, args.out)


if __name__ == "__main__":
    main()
