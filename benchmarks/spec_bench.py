"""Speculative decoding against plain decoding on this machine, with the trained dsjax-tiny-py
and its MTP drafter (the checkpoint's reduced draft vocabulary): plain, `spec_policy="fixed"`
and `spec_policy="confidence"` at k drafts, one-slot and `--batches` engines, on two prompt
sets: held-out stdlib files (the model trained on the rest of the stdlib) and unseen
non-stdlib Python (dsjax's own sources, which the model never saw).

    python benchmarks/spec_bench.py --out benchmarks/results/spec_cpu_tinypy.json

Greedy, `--new-tokens` each, so every speculative run must reproduce the plain run's tokens
(`identical`). Batch 1 runs the prompts one after another through a one-slot engine, batch
8 all at once. Timing: the engines of a batch size take turns run by run in one process
(a shared machine's speed drifts; only ratios within a batch are compared), each round in
the next permutation of the engines, one untimed run each first; tok/s is the median of `--repeats` runs (and
the best), the speedup the median over rounds of plain's time over the engine's in the same
round (a best-of ratio swings with one lucky run: on the 2-core EPYC plain's batch-8 runs
spread 0.19-0.23 s). Per run: speedup against plain, tokens per target step (plain steps included), acceptance per draft position, and for the
confidence policy its step costs (`step_seconds`: a plain step, then a verify step over
k = 1..K drafts with its drafting, as measured at warm-up and refreshed from the observed
step times), how many of its steps were plain and how many prompts it prefilled with the
plain program (`plain_prefills`). The load average is recorded as each batch size starts a
prompt set (a shared machine: the absolute speeds are the load's).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
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
from dsjax.weights import resolve

SPEC_KEYS = ("acceptance_rate", "acceptance_by_position", "tokens_per_row_step", "tokens_per_target_step",
             "target_steps", "plain_steps", "plain_prefills", "verify_costs", "step_seconds")


def cut(docs: list, names: list[str], n: int, length: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """n prompts of `length` tokens, each cut at a random place from a different document."""
    rng = np.random.default_rng(seed)
    usable = [i for i, d in enumerate(docs) if len(d) > length + 64]
    prompts, sources = [], []
    for i in rng.choice(usable, n, replace=False):
        start = int(rng.integers(0, len(docs[i]) - length - 64))
        prompts.append([int(t) for t in docs[i][start: start + length]])
        sources.append(f"{names[i]}[{start}:{start + length}]")
    return prompts, sources


def held_out_prompts(tokenizer, n: int, length: int, seed: int):
    """Cuts of held-out stdlib files (dsjax.train.data: never trained on)."""
    root, listing = data.stdlib_root(), data.load_file_list()
    names = [f["path"] for f in listing["files"] if data.is_held_out(f["path"])]
    return cut(data.tokenize(data.read_documents(root, listing, held_out=True), tokenizer), names, n, length, seed)


def unseen_prompts(tokenizer, n: int, length: int, seed: int):
    """Cuts of dsjax's own Python sources: not the stdlib, so not in the model's corpus."""
    root = Path(dsjax.__file__).parent
    files = sorted(root.rglob("*.py"))
    names = [str(f.relative_to(root.parent)) for f in files]
    return cut([tokenizer.encode(f.read_text()) for f in files], names, n, length, seed)


def timed_runs(engines: dict, prompts, new_tokens: int, repeats: int) -> dict:
    """engine.generate for each engine in turn, an untimed run each and then `repeats` rounds,
    each in the next permutation of the engines (a verify-heavy engine leaves the caches cold
    for whichever runs next: in one fixed order that was always the same engine)
    -> per engine: tok/s at its median run and at its best, its times, its counters at its best
    run, every run's tokens."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, engine in engines.items():
        out[name] = {"seconds_all": [], "tokens": [engine.generate(prompts, params)]}
    orders = list(itertools.permutations(engines))  # round by round, so each engine follows each other as often
    for i in range(repeats):
        for name in orders[i % len(orders)]:
            engine = engines[name]
            engine.policy.reset()
            t = time.perf_counter()
            tokens = engine.generate(prompts, params)
            r = out[name]
            r["seconds_all"].append(time.perf_counter() - t)
            r["tokens"].append(tokens)
            if engine.num_draft_tokens and r["seconds_all"][-1] == min(r["seconds_all"]):
                m = engine.spec_metrics()
                r.update({k: m.get(k) for k in SPEC_KEYS})
    for r in out.values():
        tokens = sum(map(len, r["tokens"][0]))
        r["seconds"], r["seconds_best"] = statistics.median(r["seconds_all"]), min(r["seconds_all"])
        r["tokens_per_s"], r["tokens_per_s_best"] = tokens / r["seconds"], tokens / r["seconds_best"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dsjax-tiny-py", help="a checkpoint with its MTP layer (default: bundled)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=3, help="drafts of the fixed and confidence policies")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/spec_cpu_tinypy.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = dsjax.load_model(args.model, dtype="float32")
    if model.mtp is None:
        raise SystemExit(f"{args.model}: no MTP layer (mtp.0.*) to draft with")
    tokenizer = load_tokenizer()
    sets = {"held_out": held_out_prompts(tokenizer, args.prompts, args.prompt_len, args.seed),
            "unseen": unseen_prompts(tokenizer, args.prompts, args.prompt_len, args.seed)}
    checkpoint = Path(resolve(args.model)).resolve()
    draft = {"num_draft_tokens": args.k, "draft_vocab": model.draft_vocab}
    result = {
        "machine": _cpu_name(), "load_average_at_start": list(os.getloadavg()),
        "platform": platform.processor() or platform.machine(), "jax": jax.__version__,
        "devices": str(jax.devices()), "model": f"{args.model} (float32) from {checkpoint}",
        "prompts": {name: s[1] for name, s in sets.items()}, "new_tokens": args.new_tokens, "decoding": "greedy",
        "draft_vocab": None if model.draft_vocab is None else int(len(model.draft_vocab)), "k": args.k,
        "timing": f"engines of a batch size in turn, a permutation a round, {args.repeats} runs after an "
                  "untimed one; tok/s the median run (and the best), speedup the median over rounds",
        "runs": {}, "load_average_by_run": {},
    }
    for batch in map(int, args.batches.split(",")):
        kw = dict(max_slots=batch, capacity=256, prefill_chunk=64)
        engines = {"plain": Engine(model, **kw), "fixed": Engine(model, spec_policy="fixed", **draft, **kw),
                   "confidence": Engine(model, spec_policy="confidence", **draft, **kw)}
        for engine in engines.values():
            engine.warmup()
        for name, (prompts, _) in sets.items():
            load = [round(x, 2) for x in os.getloadavg()]
            runs = timed_runs(engines, prompts, args.new_tokens, args.repeats)
            base = runs["plain"]
            for r in runs.values():  # per round against plain's run of that round, the median
                r["speedup_vs_plain"] = statistics.median(p / s for p, s in zip(base["seconds_all"], r["seconds_all"]))
                r["speedup_best_vs_plain"] = r["tokens_per_s_best"] / base["tokens_per_s_best"]
            expected = base["tokens"][0]
            for r in runs.values():
                r["identical"] = all(t == expected for t in r.pop("tokens"))
            result["runs"][f"batch{batch}_{name}"] = runs
            result["load_average_by_run"][f"batch{batch}_{name}"] = load
            print(f"batch {batch} {name}: " + ", ".join(
                f"{n} {r['tokens_per_s']:.0f} tok/s ({r['speedup_vs_plain']:.2f}x)" for n, r in runs.items())
                + f"; confidence costs {runs['confidence'].get('verify_costs')}, "
                f"plain steps {runs['confidence'].get('plain_steps')} of {runs['confidence'].get('target_steps')}",
                flush=True)
    result["seconds_total"] = time.perf_counter() - t0
    result["load_average_at_end"] = list(os.getloadavg())
    write_result(result, args.out)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
        flags = open("/proc/cpuinfo").read()
        extras = [x for x in ("avx512_bf16", "amx_bf16") if x in flags]
        return f"{', '.join(sorted(names))} ({', '.join(extras) or 'no AVX512-BF16'})"
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    main()
