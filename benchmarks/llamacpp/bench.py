"""llama.cpp on engine_bench's model, beside dsjax, in one sitting (run.sh calls the steps).

    python benchmarks/llamacpp/bench.py prepare --work W --llama-src SRC --sdist SDIST --bin BIN
    python benchmarks/llamacpp/bench.py measure --work W --bin BIN --round before
    python benchmarks/llamacpp/bench.py combine --work W --engine-json E --out OUT

prepare: engine_bench's checkpoint (`bench_checkpoint`: HF's init under seed 0, the config
engine_bench runs) in W/checkpoint, converted to W/f32.gguf and W/bf16.gguf (convert.py), and
the agreement of each with dsjax (agree.py: fp32 weights against f32, dsjax's 16-bit weights
against bf16) in W/agreement.json.
measure: llama-bench's prefill (pp`--prompt-len`, empty context) and decode (tg`--new-tokens`,
after a `--prompt-len` context and from an empty one), and llama-batched-bench's decode of
`--batches` sequences after a `--prompt-len` prompt each (the engine_bench shape: batch 8 is
eight sequences decoding together), `--threads` threads, `--reps` repetitions (medians), the
load average beside each -> W/llama_<round>.json.
combine: one table, llama.cpp f32 / bf16 (medians of the rounds' pooled repetitions, each
round's medians kept, and the fastest repetition) beside
engine_bench's dsjax fp32 / 16-bit and HF rows from the same sitting, the ratios, the
agreement -> OUT (benchmarks/results/llamacpp_*.json, rendered by report.py).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from machine import cpu_info, load_average  # noqa: E402
from results_io import write_result  # noqa: E402

WEIGHTS = ("f32", "bf16")


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench -o json's array -> [{test, n_prompt, n_gen, n_depth, tokens_per_s, samples, type_k}]."""
    out = []
    for r in json.loads(text):
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out.append({"test": test + (f"@d{r['n_depth']}" if r.get("n_depth") else ""), "n_prompt": r["n_prompt"],
                    "n_gen": r["n_gen"], "n_depth": r.get("n_depth", 0), "tokens_per_s": float(r["avg_ts"]),
                    "samples": [float(x) for x in r["samples_ts"]], "type_k": r.get("type_k")})
    return out


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench --output-format jsonl's lines (other lines skipped) -> their records."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"speed_tg"' in line]


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def measure(args) -> dict:
    out = {"round": args.round, "threads": args.threads, "models": {}}
    for w in WEIGHTS:
        gguf = os.path.join(args.work, f"{w}.gguf")
        row = {"load_average_before": load_average()}
        bench = os.path.join(args.bin, "llama-bench")
        common = ["-m", gguf, "-t", str(args.threads), "-r", str(args.reps), "-o", "json"]
        tests = parse_llama_bench(_run([bench, *common, "-p", str(args.prompt_len), "-n", str(args.new_tokens)]))
        tests += parse_llama_bench(_run([bench, *common, "-p", "0", "-n", str(args.new_tokens),
                                         "-d", str(args.prompt_len)]))
        row["llama_bench"] = {t["test"]: t for t in tests}
        batches = [int(b) for b in args.batches.split(",")]
        ctx = max(batches) * (args.prompt_len + args.new_tokens)
        runs = []
        for _ in range(args.reps):
            runs += parse_batched_bench(_run([
                os.path.join(args.bin, "llama-batched-bench"), "-m", gguf, "-t", str(args.threads), "-tb",
                str(args.threads), "-c", str(ctx), "-npp", str(args.prompt_len), "-ntg", str(args.new_tokens),
                "-npl", args.batches, "--output-format", "jsonl"]))
        row["batched_bench"] = {}
        for b in batches:
            tg, pp = ([r[k] for r in runs if r["pl"] == b] for k in ("speed_tg", "speed_pp"))
            row["batched_bench"][str(b)] = {"decode_tokens_per_s": float(np.median(tg)), "decode_tokens_per_s_all": tg,
                                            "prefill_tokens_per_s": float(np.median(pp))}
        row["load_average_after"] = load_average()
        out["models"][w] = row
        pp = row["llama_bench"][f"pp{args.prompt_len}"]["tokens_per_s"]
        print(f"llama.cpp {w}: pp{args.prompt_len} {pp:.1f} tok/s; decode "
              + ", ".join(f"b{b} {r['decode_tokens_per_s']:.1f}" for b, r in row["batched_bench"].items())
              + f"; load {row['load_average_before']} -> {row['load_average_after']}", flush=True)
    write_result(out, os.path.join(args.work, f"llama_{args.round}.json"))
    return out


def prepare(args) -> None:
    from engine_bench import bench_checkpoint
    from decode_profile import bench_config

    import dsjax

    ckpt = os.path.join(args.work, "checkpoint")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        cfg = bench_config() if args.config == "bench-78m" else dsjax.load_config(args.config)
        bench_checkpoint(cfg, ckpt)
    for w in WEIGHTS:
        gguf = os.path.join(args.work, f"{w}.gguf")
        if not os.path.exists(gguf):
            subprocess.run([sys.executable, os.path.join(HERE, "convert.py"), "--llama-src", args.llama_src,
                            "--checkpoint", ckpt, "--outtype", w, "--out", gguf,
                            "--staging", os.path.join(args.work, "staging")], check=True, capture_output=True)
    from agree import agreement, bindings

    ll = bindings(args.sdist, args.bin)
    quiet = ll.llama_log_callback(lambda level, text, data: None)  # kept alive while llama.cpp logs
    ll.llama_log_set(quiet, None)
    result = {w: agreement(ll, ckpt, os.path.join(args.work, f"{w}.gguf"), bf16_weights=w == "bf16")
              for w in WEIGHTS}
    print(json.dumps(result, indent=1), flush=True)
    write_result(result, os.path.join(args.work, "agreement.json"))


def combine(args) -> dict:
    with open(args.engine_json) as f:
        engine = json.load(f)
    rounds = []
    for path in sorted(glob.glob(os.path.join(args.work, "llama_*.json"))):
        with open(path) as f:
            rounds.append(json.load(f))
    with open(os.path.join(args.work, "agreement.json")) as f:
        agree = json.load(f)
    p, n = engine["prompt_len"], engine["new_tokens"]
    runs = {}
    for w in WEIGHTS:
        # every repetition of every round pooled: one round stalled by the shared box's bursts
        # moves a median of the pool less than a mean of the rounds
        per = {k: sum((r["models"][w]["batched_bench"][b]["decode_tokens_per_s_all"] for r in rounds), [])
               for k, b in (("decode_b1", "1"), ("decode_b8", "8"))}
        per[f"prefill_{p}"] = sum((r["models"][w]["llama_bench"][f"pp{p}"]["samples"] for r in rounds), [])
        row = {f"{k}_tokens_per_s": float(np.median(v)) for k, v in per.items()}
        row["decode_b1_best_tokens_per_s"], row["decode_b8_best_tokens_per_s"] = (
            max(max(r["models"][w]["batched_bench"][b]["decode_tokens_per_s_all"]) for r in rounds) for b in ("1", "8"))
        row[f"prefill_{p}_best_tokens_per_s"] = max(max(r["models"][w]["llama_bench"][f"pp{p}"]["samples"])
                                                    for r in rounds)
        for test in (f"tg{n}", f"tg{n}@d{p}"):
            row[f"llama_bench_{test}_tokens_per_s"] = float(np.median(
                sum((r["models"][w]["llama_bench"][test]["samples"] for r in rounds), [])))
        for r in rounds:
            m = r["models"][w]
            row[f"{r['round']}: b1, b8, prefill"] = [m["batched_bench"]["1"]["decode_tokens_per_s"],
                                                     m["batched_bench"]["8"]["decode_tokens_per_s"],
                                                     m["llama_bench"][f"pp{p}"]["tokens_per_s"]]
            row[f"{r['round']}: load before"] = m["load_average_before"]
        runs[f"llama.cpp {w}"] = row
    b = engine["batches"]
    pre = engine["prefill"]
    for name, key in (("dsjax fp32", "dsjax"), ("dsjax 16-bit weights", "dsjax_bf16_weights"),
                      ("HF transformers fp32", "hf")):
        if key not in b["1"]:
            continue
        row = {f"decode_b{k}_tokens_per_s": b[k][key]["decode_tokens_per_s"] for k in ("1", "8")}
        pkey = "hf_forward" if key == "hf" else key
        row[f"prefill_{p}_tokens_per_s"] = pre[pkey]["prefill_tokens_per_s"]
        row.update({f"decode_b{k}_best_tokens_per_s": max(b[k][key]["decode_tokens_per_s_all"]) for k in ("1", "8")})
        row[f"prefill_{p}_best_tokens_per_s"] = pre[pkey]["prefill_tokens_per_s_best"]
        if key != "hf":
            row.update({f"decode_b{k}_4_steps_tokens_per_s": b[k][key + "_decode_steps_4"]["decode_tokens_per_s"]
                        for k in ("1", "8")})
        row["engine_bench: load before prefill, b1, b8"] = [pre["load"]["load_average_before"][0]] + [
            b[k]["load"]["load_average_before"][0] for k in ("1", "8")]
        runs[name] = row
    ratios = {}
    for metric in ("decode_b1", "decode_b8", f"prefill_{p}", "decode_b1_best", "decode_b8_best", f"prefill_{p}_best"):
        k = f"{metric}_tokens_per_s"
        ratios[f"{metric}: dsjax fp32 / llama.cpp f32"] = runs["dsjax fp32"][k] / runs["llama.cpp f32"][k]
        ratios[f"{metric}: dsjax 16-bit / llama.cpp bf16"] = runs["dsjax 16-bit weights"][k] / runs["llama.cpp bf16"][k]
        ratios[f"{metric}: dsjax 16-bit / llama.cpp f32"] = runs["dsjax 16-bit weights"][k] / runs["llama.cpp f32"][k]
    result = {"config": engine["config"], "prompt_len": p, "new_tokens": n, "threads": rounds[0]["threads"],
              "cpus": os.cpu_count(), "cpu": cpu_info(), "engine_json": os.path.basename(args.engine_json),
              "llama_cpp": args.llama_version, "rounds": [r["round"] for r in rounds],
              "note": "llama.cpp decode: llama-batched-bench (b sequences after a prompt_len prompt each, "
                      "as engine_bench); prefill: llama-bench pp (empty context); dsjax prefill: the engine's "
                      "time to the first token; llama.cpp's KV cache f16 (its default). Figures: medians "
                      "(llama.cpp: of every repetition of its rounds); _best: the fastest repetition",
              "ratios": ratios, "agreement": {w: {k: v for k, v in a.items() if k != "dsjax_weights"}
                                              for w, a in agree.items()},
              "runs": runs}
    write_result(result, args.out)
    for name, r in runs.items():
        print(f"{name:24s} " + "  ".join(f"{k.replace('_tokens_per_s', '')} {r[f'{k}']:.1f}"
                                         for k in ("decode_b1_tokens_per_s", "decode_b8_tokens_per_s",
                                                   f"prefill_{p}_tokens_per_s")), flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    for name in ("prepare", "measure", "combine"):
        s = sub.add_parser(name)
        s.add_argument("--work", required=True)
        s.add_argument("--prompt-len", type=int, default=128)
        s.add_argument("--new-tokens", type=int, default=64)
    sub.choices["prepare"].add_argument("--llama-src", required=True)
    sub.choices["prepare"].add_argument("--sdist", required=True)
    sub.choices["prepare"].add_argument("--bin", required=True)
    sub.choices["prepare"].add_argument("--config", default="bench-78m")
    m = sub.choices["measure"]
    m.add_argument("--bin", required=True)
    m.add_argument("--round", default="before")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--batches", default="1,8")
    m.add_argument("--reps", type=int, default=5)
    c = sub.choices["combine"]
    c.add_argument("--engine-json", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--llama-version", default="llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, GGML_NATIVE=ON")
    args = ap.parse_args()
    {"prepare": prepare, "measure": measure, "combine": combine}[args.step](args)


if __name__ == "__main__":
    main()
