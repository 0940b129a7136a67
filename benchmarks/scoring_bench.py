"""What scoring prompts costs: programs and compile time of the prefill's scoring variant
(`Engine.warmup(scoring=True)`), and the time to prefill a prompt scored (prompt_logprobs,
max_tokens 0) against the same prompt prefilled for one generated token.

    DSJAX_COMPILE_CACHE=off python benchmarks/scoring_bench.py [--prompt 1024] [--repeats 3]

Output: benchmarks/results/scoring_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dsjax  # noqa: E402
from dsjax.engine import Engine, SamplingParams  # noqa: E402
from dsjax.weights import DEFAULT_MODEL  # noqa: E402


def run_one(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    t = time.perf_counter()
    engine.add_request(prompt, params)
    for _ in engine.run():
        pass
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/scoring_cpu.json"))
    args = ap.parse_args()
    model = dsjax.load_model(args.model)
    engine = Engine(model, max_slots=8, capacity=4096, prefill_chunk=256, max_logprobs=5)
    t = time.perf_counter()
    plain = engine.warmup()
    plain_s = time.perf_counter() - t
    t = time.perf_counter()
    both = engine.warmup(scoring=True)  # the usual programs are compiled already: only the scoring ones compile
    scoring_s = time.perf_counter() - t
    prompt = np.random.default_rng(0).integers(2, 5000, args.prompt).tolist()
    runs = {"generate 1 token": SamplingParams(max_tokens=1),
            "score (prompt_logprobs=0, max_tokens 0)": SamplingParams(max_tokens=0, prompt_logprobs=0),
            "score top 5 (prompt_logprobs=5, max_tokens 0)": SamplingParams(max_tokens=0, prompt_logprobs=5)}
    times = {name: statistics.median(run_one(engine, prompt, p) for _ in range(args.repeats))
             for name, p in runs.items()}
    out = {"what": "prompt scoring: extra programs and their compile time, prefill time scored vs not",
           "model": model.config.name, "engine": {"max_slots": 8, "capacity": 4096, "prefill_chunk": 256},
           "programs_warmup": plain, "programs_scoring_extra": both - plain, "warmup_s": round(plain_s, 2),
           "scoring_warmup_s": round(scoring_s, 2), "prompt_tokens": args.prompt,
           "median_s": {k: round(v, 4) for k, v in times.items()}, "repeats": args.repeats,
           "compile_cache": os.environ.get("DSJAX_COMPILE_CACHE", "default"), "cpu_count": os.cpu_count()}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
