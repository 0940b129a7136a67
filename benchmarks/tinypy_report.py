"""The trained default model `dsjax-tiny-py`: training curve, held-out loss of the SHIPPED
checkpoint (FP8 / MXFP4, read by the normal loader), and greedy / sampled continuations of
Python prompts. Writes JSON (and a PNG of the curve when matplotlib is installed).

    python benchmarks/tinypy_report.py --run /work/tinypy-run --run /work/tinypy-run2 \
        --out benchmarks/results/tinypy_report.json

--run: the pretraining run directory (its log.jsonl gives the curve), repeated for a run
continued with `pretrain --init-from` (the curves join); without it the curve is left out and only the shipped checkpoint is measured. Held-out text: the stdlib files the
pinned list holds out (dsjax/train/data.py), packed into 256-token sequences, every one of
them scored; each row's loss is the model's full-vocabulary next-token cross-entropy.
MTP acceptance per draft position on held-out prompts is measured by benchmarks/spec_bench.py.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from results_io import write_result  # noqa: E402

import dsjax
from dsjax.train import data
from dsjax.train.export import mean_nll

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "def read_lines(path):\n    with open(path) as f:",
           "for i in range(10):"]
SEQ_LEN = 256


def curve(runs: list[Path]) -> dict:
    """log.jsonl of one run, or of a run and its continuations (`pretrain --init-from`) in
    order -> one training curve: per logged step the losses, and the evaluations, steps /
    tokens / seconds counted from the first run's start."""
    train, evals, steps, tokens, seconds = [], [], 0, 0, 0.0
    for run in runs:
        rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
        part = [r for r in rows if not r.get("eval")]
        train += [{**{k: r[k] for k in ("loss", "lm", "mtp", "indexer", "lr", "grad_norm")},
                   "step": r["step"] + steps, "tokens": r["tokens"] + tokens, "run": str(run)} for r in part]
        evals += [{**r, "step": r["step"] + steps, "run": str(run)} for r in rows if r.get("eval")]
        steps, tokens, seconds = steps + part[-1]["step"], tokens + part[-1]["tokens"], seconds + part[-1]["elapsed_s"]
    return {"train": train, "eval": evals, "steps": steps, "tokens": tokens, "train_seconds": seconds,
            "runs": [str(r) for r in runs]}


def held_out_loss(model, tokenizer, max_sequences: int) -> dict:
    """Mean next-token NLL (nats) of the shipped model over packed held-out sequences."""
    docs = data.tokenize(data.read_documents(data.stdlib_root(), data.load_file_list(), held_out=True), tokenizer)
    seqs = data.pack(docs, SEQ_LEN, None)[:max_sequences]  # [N, SEQ_LEN + 1]

    loss = mean_nll(model, seqs)
    n = seqs[:, 1:].size
    return {"sequences": int(len(seqs)), "tokens": int(n), "loss": loss, "perplexity": float(np.exp(loss))}


def parses(prompt: str, text: str) -> bool:
    """Whether prompt + text, cut after its last complete line, is valid Python (an unfinished
    block gets a `pass` so a cut-off body still counts)."""
    whole = prompt + text
    cut = whole[: whole.rfind("\n") + 1] if "\n" in whole else whole
    for candidate in (cut, cut + "    pass\n", cut + "        pass\n", cut + "            pass\n"):
        try:
            ast.parse(candidate)
            return True
        except SyntaxError:
            continue
    return False


def plot(c: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    tok = [r["tokens"] / 1e6 for r in c["train"]]
    ax.plot(tok, [r["lm"] for r in c["train"]], label="train: next token")
    ax.plot(tok, [r["mtp"] for r in c["train"]], label="train: MTP (token after next)", alpha=0.7)
    per_step = c["train"][-1]["tokens"] / c["train"][-1]["step"]
    ax.plot([e["step"] * per_step / 1e6 for e in c["eval"]], [e["eval_lm"] for e in c["eval"]], "o-",
            label="held out: next token")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(0, max(8.0, min(12.0, c["train"][0]["lm"])))
    ax.set_title("dsjax-tiny-py on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", default=[],
                    help="pretraining run directory (log.jsonl); repeat for a run and its continuations, in order")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled dsjax-tiny-py)")
    ap.add_argument("--max-sequences", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", default="benchmarks/results/tinypy_report.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = dsjax.load_model(*([args.model] if args.model else []), dtype="float32")
    load_s = time.perf_counter() - t0
    tok = dsjax.load_tokenizer(model)
    result = {"platform": platform.machine(), "jax": jax.__version__, "model": args.model or "dsjax-tiny-py (bundled)",
              "load_seconds": load_s, "params": int(sum(np.size(a) for a in jax.tree.leaves(model.params)))}
    ckpt_files = Path(dsjax.weights.resolve(args.model or dsjax.weights.DEFAULT_MODEL))
    result["checkpoint_mib"] = sum(f.stat().st_size for f in ckpt_files.glob("*.safetensors")) / 2**20
    if args.run:
        result["training"] = curve([Path(r) for r in args.run])
    result["held_out"] = held_out_loss(model, tok, args.max_sequences)
    print(f"held-out loss {result['held_out']['loss']:.3f} (ppl {result['held_out']['perplexity']:.1f}) "
          f"over {result['held_out']['tokens']} tokens")

    samples = []
    greedy = dsjax.generate(model, PROMPTS, args.new_tokens, token_healing=True)  # as `dsjax generate` does
    sampled = dsjax.generate(model, PROMPTS, args.new_tokens, temperature=0.7, top_p=0.95,
                             seed=list(range(len(PROMPTS))), token_healing=True)
    for prompt, g, s in zip(PROMPTS, greedy, sampled):
        samples.append({"prompt": prompt, "greedy": g, "greedy_parses": parses(prompt, g),
                        "sampled_t0.7_p0.95": s, "sampled_parses": parses(prompt, s)})
        print(f"--- {prompt!r}\n[greedy]\n{prompt}{g}\n[sampled]\n{prompt}{s}")
    result["continuations"] = samples
    result["token_healing"] = True
    result["parse_rate"] = {"greedy": float(np.mean([s["greedy_parses"] for s in samples])),
                            "sampled": float(np.mean([s["sampled_parses"] for s in samples]))}
    write_result(result, args.out)
    if args.run:
        plot(result["training"], Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
