"""What one `dsjax.generate` call costs beyond its tokens, on the built-in model: a 128-token
prompt's first token (max_new_tokens=1) and 64 new tokens, through

    generate_warm     `dsjax.generate` (the model's warm engine: `dsjax.engine.warm`)
    generate_fresh    a new engine per call (`plan(...).engine(model)`, what generate did before)
    engine            one Engine built once, `Engine.generate` (the floor)

the three taking turns round by round (a shared box drifts); best of `--rounds`, seconds.

    python benchmarks/generate_overhead.py [--rounds 7] [--out benchmarks/results/generate_overhead_cpu.json]
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import dsjax  # noqa: E402
from dsjax.engine import Engine, SamplingParams  # noqa: E402
from dsjax.generate import engine_capacity, plan  # noqa: E402
from results_io import write_result  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/generate_overhead_cpu.json")
    args = ap.parse_args(argv)
    model = dsjax.load_model()
    prompt = np.random.default_rng(0).integers(10, 1000, 128).tolist()
    rows = {}
    for new in (1, 64):
        sampling = SamplingParams(max_tokens=new, ignore_eos=True)
        engine = Engine(model, max_slots=1, capacity=engine_capacity(128 + new, model), decode_steps=4)

        def fresh():
            p = plan(model, [prompt], new, ignore_eos=True)
            return [c.ids for c in p.run(p.engine(model))]

        forms = {"generate_warm": lambda: dsjax.generate(model, [prompt], new, ignore_eos=True),
                 "generate_fresh": fresh, "engine": lambda: engine.generate([prompt], sampling)}
        outs = {name: f() for name, f in forms.items()}  # compiles; every form gives the same tokens
        assert outs["generate_warm"] == outs["generate_fresh"] == outs["engine"], outs
        times = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, f in forms.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        best = {name: min(ts) for name, ts in times.items()}
        rows[f"{new}_new_tokens"] = {**{f"{k}_s": v for k, v in best.items()},
                                    "warm_over_engine": best["generate_warm"] / best["engine"],
                                    "fresh_over_engine": best["generate_fresh"] / best["engine"]}
    write_result({"benchmark": "generate_overhead", "machine": cpu_name(), "cpus": len(os.sched_getaffinity(0)),
                  "model": model.config.name, "prompt_tokens": 128, "rounds": args.rounds, "rows": rows}, args.out)
    print(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
